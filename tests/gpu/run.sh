#!/usr/bin/env bash
# The GPU script: on a bare GPU machine, from the repository root,
#   bash tests/gpu/run.sh [build] [tests] [bench] [micro] [example] [faults] [pretrain]
#                                                        (no argument: build tests bench)
# builds the extension, runs the GPU tests, runs the benchmark, and leaves under $OUT:
#   env.txt  build.log  gpu_tests.log (the three test runs)  bench.log  bench.json  example.log
#   faults.log  summary.md  (pretrain: pretrain.log in place of example.log; MICRO_NCU: ncu.txt)
# (keep it to 8 files: what a remote runner may copy back). Each stage has its own time limit
# (choose stages and limits so that a call stays inside 10 minutes): BUILD_TIMEOUT (150 s),
# TESTS_TIMEOUT (180 s), NODES_TESTS_TIMEOUT (180 s, groups that span nodes, emulated),
# MEGATRON_TESTS_TIMEOUT (150 s, Megatron's EP overlap and drop-and-pad on GPUs) and
# TEAM_TIMEOUT (210 s, the local-team tests), BENCH_TIMEOUT (180 s), MICRO_TIMEOUT (90 s per
# microbenchmark; MICRO_SMS: sm_budget's SM count, 24; MICRO_BASELINES=0: not the baselines'
# sm_budget (each takes ~40 s); MICRO_HBM="16384 24 66 132": also hbm_patterns at those tokens
# and CTA counts (~25 s per count at 16384 tokens); MICRO_NCU="combine_library": Nsight
# Compute's SpeedOfLight, memory, warp-state, scheduler and occupancy sections of the first
# MICRO_NCU_COUNT (4) launches of sm_budget's kernels matching that regex, into ncu.txt;
# BENCH_NCU="CombineOp": the same sections plus the source lines and SASS instructions with the
# most warp-stall samples for the first BENCH_NCU_COUNT (2) launches of our kernels matching that
# regex in a one-rank bench, into ncu.txt, after the bench stage, under BENCH_NCU_TIMEOUT (150 s)).
# The bench stage also runs benchmarks/handle_timeline.py (handle creation kernel by kernel),
# and with BENCH_TEAM="2 4" benchmarks/team_bench.py (EP=2, 4 as local teams on one GPU;
# TEAM_BENCH_TIMEOUT, 90 s each; TEAM_BENCH_ARGS adds its flags, e.g. "--staging-chunk-tokens 128").
# BENCH_ARGS adds benchmark flags, e.g. BENCH_ARGS="--sections kernels"; BENCH_CHUNKS="24 48"
# reruns the kernels section per staging chunk size, BENCH_DEPTHS="3 4" per staging ring depth,
# BENCH_NODES="1" per emulated node size (ranks per node). BENCH_BASELINE="DIR ...":
# an A/B against other versions of the package (patches that apply to this tree with patch -p1,
# e.g. benchmarks/ab/*.patch, or trees with setup.py, csrc/, megatron_nccl_ep/ and tests/, carried
# as ignored paths, e.g. made with `git archive REF | tar -x -C scratch/baseline`):
# each built in /tmp/baseline_i alongside the other stages, its kernels section (the sections
# BASELINE_SECTIONS names, e.g. "kernels,megatron" for a change of the Python path) runs after ours
# in the bench stage and its sm_budget in the micro stage, so every version is timed on the same
# machine in the same call; BASELINE_TESTS="tests/gpu/test_cuda_local_team.py -k wrap" also runs
# those pytest arguments in each baseline tree after its bench (BASELINE_TESTS_TIMEOUT, 120 s
# each, into gpu_tests.log).
# faults (issue 8; not in the default stages; `build faults` fits one 10-minute call): ranks
# that never call or are killed mid-op, a handle-destroying thread, live handles used out of order,
# 10,000 handle cycles with memory before/after, all tokens to one expert at 16384 tokens, then the
# random soak bitwise against the reference (tests/gpu/test_cuda_{faults,stress,soak}.py) into
# faults.log, under FAULTS_TIMEOUT (480 s); the soak runs SOAK_SECONDS (300), shortened if needed
# so that the stage ends inside its limit (SOAK_DEADLINE). FAULTS_SELECT adds pytest arguments,
# shell-quoted, e.g. FAULTS_SELECT='-k "node_per_rank or soak"'.
# pretrain (issue 10; not in the default stages): examples/check_training.py, runs of Megatron's
# pretrain() through examples/pretrain_gpt_moe.py on every GPU for the checks PRETRAIN_CHECKS
# (abcde: determinism, alltoall, save/resume, shared-expert overlap, router CUDA graphs; 8 runs of
# ~50 s), PRETRAIN_RUN_TIMEOUT (150 s) per run, every run's log into pretrain.log.
# Carried wheels in .whl/ (megatron-core, which the image lacks) are installed first.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"

# NVLink multicast stays off in every process started from here (shared GPU hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}  # the image's python3 (the one that holds torch)
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-180}
TEAM_TIMEOUT=${TEAM_TIMEOUT:-210}
MEGATRON_TESTS_TIMEOUT=${MEGATRON_TESTS_TIMEOUT:-150}
NODES_TESTS_TIMEOUT=${NODES_TESTS_TIMEOUT:-180}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
BENCH_ARGS=${BENCH_ARGS:-}
FAULTS_TIMEOUT=${FAULTS_TIMEOUT:-480}
SOAK_SECONDS=${SOAK_SECONDS:-300}
JOBS=$(nproc)

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build tests bench)
for stage in "${STAGES[@]}"; do
    case "$stage" in
        build|tests|bench|micro|example|faults|pretrain) ;;
        *) echo "unknown stage '$stage' (choose from: build tests bench micro example faults" \
               "pretrain)" >&2
           exit 2 ;;
    esac
done
wants() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

SUMMARY="$OUT/summary.md"
{
    echo "# GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ): stages ${STAGES[*]}"
    echo
} >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# -- what this machine is ---------------------------------------------------------------------
{
    echo "## nvidia-smi -L"; nvidia-smi -L
    echo "## nvidia-smi topo -m"; nvidia-smi topo -m
    echo "## versions"
    "$PY" --version
    nvcc --version | tail -n 2
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count())'
    # The copy's .git may be older than its files: the sources' digest names the code that ran.
    "$PY" -c 'from megatron_nccl_ep.bench import source_version; print("source", source_version())'
    echo "## CUDA / NCCL environment"; env | grep -E '^(CUDA|NCCL|TORCH)_' | sort
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
{
    echo "- machine: $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s): $(nvidia-smi -L 2>/dev/null | head -n 1 | cut -d'(' -f1)"
    grep -E '^(torch|source) ' "$OUT/env.txt" | sed 's/^/- /'
} >>"$SUMMARY"

# -- carried wheels ------------------------------------------------------------------------------
# --no-deps into a separate folder: the image's torch, numpy and packaging stay in charge.
if compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
        note "- wheels: $(printf '%s ' .whl/*.whl)"
        "$PY" -c 'import megatron.core, torch; print("megatron-core", megatron.core.__version__,
"from", megatron.core.__file__, "| torch from", torch.__file__)' 2>&1 | tee -a "$OUT/env.txt"
    else
        note "- wheels: pip install FAILED"
    fi
else
    note "- wheels: none carried (.whl/ absent): the Megatron section of the bench will be skipped"
fi

# -- stages ----------------------------------------------------------------------------------------
STATUS=0

if wants build; then
    start=$SECONDS
    # NCCL_EP_BUILD_EXT=1: compile even where no GPU device node is visible (the default skips).
    NCCL_EP_BUILD_EXT=1 MAX_JOBS=$JOBS timeout -k 10 "$BUILD_TIMEOUT" \
        "$PY" setup.py build_ext --inplace -j "$JOBS" >"$OUT/build.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && "$PY" -c 'import megatron_nccl_ep._C' >>"$OUT/build.log" 2>&1; then
        note "- build: ok ($((SECONDS - start)) s)"
    else
        STATUS=1
        note "- build: FAILED (rc $rc, $((SECONDS - start)) s; 124 = timed out); first errors, then the tail of build.log:"
        {
            echo '```'
            grep -iE 'error|undefined reference' "$OUT/build.log" | head -n 20
            echo '...'
            tail -n 12 "$OUT/build.log"
            echo '```'
        } | tee -a "$SUMMARY"
    fi
fi

# Applies a patch (-p1) to the current directory, with patch(1) or, where the image lacks it, git.
apply_patch() {
    if command -v patch >/dev/null; then patch -p1 -s <"$1"
    elif command -v git >/dev/null; then git apply "$1"
    else echo "neither patch nor git on this machine: cannot apply $1"; return 1
    fi
}

# The A/B baselines (BENCH_BASELINE, one or more trees) build in the background while the other
# stages run, baseline i in /tmp/baseline_i.
read -r -a BASELINES <<<"${BENCH_BASELINE:-}"
BASELINE_PIDS=()
if [ ${#BASELINES[@]} -gt 0 ] && (wants bench || wants micro); then
    for i in "${!BASELINES[@]}"; do
        src=${BASELINES[$i]} dir=/tmp/baseline_$i tree=${BASELINES[$i]}
        BASELINE_PIDS[$i]=
        # A patch (benchmarks/ab/*.patch) is applied to a copy of this tree.
        case "$src" in *.patch) tree=$PWD src=$(realpath "$src") ;; esac
        if [ -f "$tree/setup.py" ]; then
            rm -rf "$dir" && mkdir -p "$dir" &&
                cp -r "$tree/setup.py" "$tree/csrc" "$tree/megatron_nccl_ep" "$tree/benchmarks" \
                    "$tree/tests" "$tree/pytest.ini" "$dir/"
            (cd "$dir" && case "$src" in *.patch) apply_patch "$src" || exit 1 ;; esac &&
                NCCL_EP_BUILD_EXT=1 MAX_JOBS=$JOBS timeout -k 10 "$BUILD_TIMEOUT" \
                "$PY" setup.py build_ext --inplace -j "$JOBS") >"$dir/build.log" 2>&1 &
            BASELINE_PIDS[$i]=$!
        else
            STATUS=1
            note "- baseline: $src (BENCH_BASELINE) holds no setup.py (carry it)"
        fi
    done
fi
# Waits for baseline i's build: 0 when it is usable.
baseline_ready() {
    local i=$1 dir=/tmp/baseline_$1
    [ -n "${BASELINE_PIDS[$i]:-}" ] || return 1
    if [ "${BASELINE_PIDS[$i]}" != done ]; then
        wait "${BASELINE_PIDS[$i]}"
        local rc=$?
        BASELINE_PIDS[$i]=done
        if [ $rc -ne 0 ]; then
            STATUS=1
            note "- baseline ${BASELINES[$i]} build: FAILED (rc $rc); the tail of its log:"
            { echo '```'; tail -n 12 "$dir/build.log"; echo '```'; } | tee -a "$SUMMARY"
            rm -rf "$dir/megatron_nccl_ep"
        fi
    fi
    [ -d "$dir/megatron_nccl_ep" ]
}

# One pytest run under a time limit, appended to LOG after a header line (a stage truncates its
# log first), its summary into the summary file.
#   run_pytest LABEL LIMIT_S LOG [pytest args...]
run_pytest() {
    local label=$1 limit=$2 log=$3 start=$SECONDS per_test=() first section
    shift 3
    # pytest-timeout (in the image) turns a hung test into a traceback instead of a silent kill.
    "$PY" -c 'import pytest_timeout' 2>/dev/null &&
        per_test=(--timeout="${PER_TEST_TIMEOUT:-$((limit - 20))}")
    echo "==== $label ====" >>"$log"
    first=$(($(wc -l <"$log") + 1))
    timeout -k 10 "$limit" "$PY" -m pytest -q --tb=short -rfEP "${per_test[@]}" "$@" >>"$log" 2>&1
    local rc=$?
    section=$(tail -n "+$first" "$log")
    local counts
    counts=$(grep -E '[0-9]+ (passed|failed|error|errors|skipped|xfailed|xpassed)' <<<"$section" |
        tail -n 1)
    [ $rc -eq 0 ] || STATUS=1
    note "- $label: rc $rc ($((SECONDS - start)) s; 124 = timed out): ${counts:-no pytest summary line}"
    grep -E '^(FAILED|ERROR|XPASS) ' <<<"$section" | head -n 20 | sed 's/^/  - /' |
        tee -a "$SUMMARY"
    if [ $rc -ne 0 ]; then
        { echo '```'; tail -n 30 <<<"$section"; echo '```'; } | tee -a "$SUMMARY"
    fi
    return $rc
}

# The faults stage's test modules (the tests stage leaves them out).
FAULT_TESTS=(tests/gpu/test_cuda_faults.py tests/gpu/test_cuda_stress.py
             tests/gpu/test_cuda_soak.py)
# Megatron on GPUs: a run of their own, so that one stuck there leaves the other summaries whole.
MEGATRON_TESTS=(tests/gpu/test_megatron_overlap.py tests/gpu/test_megatron_fixed_capacity.py)
# Groups that span nodes (emulated: the group option and NCCL_HOSTID): a run of their own too.
NODES_TESTS=(tests/gpu/test_cuda_nodes.py)

if wants tests; then
    : >"$OUT/gpu_tests.log"
    # Local teams (the C example's, the team tests') put every rank's stream in one process:
    # each needs its own hardware queue (nccl_ep.h, ncclEpCreateLocalTeam).
    CUDA_DEVICE_MAX_CONNECTIONS=32 run_pytest "tests (one rank per GPU, C example)" \
        "$TESTS_TIMEOUT" "$OUT/gpu_tests.log" tests/gpu --ignore=tests/gpu/test_cuda_local_team.py \
        "${FAULT_TESTS[@]/#/--ignore=}" "${MEGATRON_TESTS[@]/#/--ignore=}" \
        "${NODES_TESTS[@]/#/--ignore=}"
    run_pytest "tests (groups that span nodes: emulated nodes, the rail)" \
        "$NODES_TESTS_TIMEOUT" "$OUT/gpu_tests.log" "${NODES_TESTS[@]}"
    # Megatron asks the 1F1B EP overlap for more than one hardware queue, as the runs above have.
    CUDA_DEVICE_MAX_CONNECTIONS=32 PER_TEST_TIMEOUT=130 \
        run_pytest "tests (Megatron on GPUs: 1F1B EP overlap, drop-and-pad)" \
        "$MEGATRON_TESTS_TIMEOUT" "$OUT/gpu_tests.log" "${MEGATRON_TESTS[@]}"
    # Local teams run every rank's kernels in one process, where they wait for each other: no
    # kernel may be loaded lazily while another spins (a lazy load may wait for the device).
    CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER PER_TEST_TIMEOUT=90 \
        run_pytest "tests (local teams: EP 2/4/8 on one GPU)" \
        "$TEAM_TIMEOUT" "$OUT/gpu_tests.log" tests/gpu/test_cuda_local_team.py
fi

# A bench output's table (from its marker line on; else its last 30 lines) as a code block.
bench_table() {
    local log table
    log=$(cat)
    table=$(sed -n '/^== megatron_nccl_ep bench/,$p' <<<"$log")
    echo '```'; echo "${table:-$(tail -n 30 <<<"$log")}"; echo '```'
}

# The bench once more (its kernels section, or the sections SECTIONS names), from the package
# tree TREE with FLAGS: its output appended to bench.log under a header line, its table to the
# summary.
#   bench_kernels LABEL TREE SECTIONS [FLAGS...]
bench_kernels() {
    local label=$1 tree=$2 sections=$3 start=$SECONDS log rc
    shift 3
    log=$(cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" timeout -k 10 "$BENCH_TIMEOUT" \
        "$PY" -m megatron_nccl_ep.bench "$@" --sections "$sections" \
        --time-budget $((BENCH_TIMEOUT - 20)) 2>&1)
    rc=$?
    [ $rc -eq 0 ] || STATUS=1
    { echo "==== $label"; echo "$log"; } >>"$OUT/bench.log"
    note "- bench, $label ($sections): rc $rc ($((SECONDS - start)) s)"
    bench_table <<<"$log" >>"$SUMMARY"
}

if wants bench; then
    start=$SECONDS
    # The bench stops its own sections before the stage limit so that it still writes its JSON.
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
    timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m megatron_nccl_ep.bench --json "$OUT/bench.json" \
        --time-budget $((BENCH_TIMEOUT - 20)) $BENCH_ARGS >"$OUT/bench.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || STATUS=1
    note "- bench: rc $rc ($((SECONDS - start)) s; 1 = some item failed, 124 = timed out)"
    { echo; bench_table <"$OUT/bench.log"; } >>"$SUMMARY"
    # Handle creation's kernels one by one (CUPTI), appended to bench.log (also per baseline).
    #   handle_timeline LABEL TREE
    handle_timeline() {
        local start=$SECONDS rc
        { echo "==== $1: benchmarks/handle_timeline.py"
          (cd "$2" && PYTHONPATH="$2:$PYTHONPATH" timeout -k 5 60 "$PY" \
              benchmarks/handle_timeline.py 2>&1); } >>"$OUT/bench.log"
        rc=$?
        note "- handle timeline, $1: rc $rc ($((SECONDS - start)) s; in bench.log)"
    }
    # BENCH_TEAM="2 4": benchmarks/team_bench.py per world size, a local team on one GPU (the
    # EP >= 2 proxy when one GPU is lent), appended to bench.log (also per baseline).
    #   team_bench LABEL TREE
    team_bench() {
        local start world rc
        for world in ${BENCH_TEAM:-}; do
            start=$SECONDS
            # shellcheck disable=SC2086 # TEAM_BENCH_ARGS is a list of flags
            { echo "==== $1: benchmarks/team_bench.py --world $world ${TEAM_BENCH_ARGS:-}"
              (cd "$2" && PYTHONPATH="$2:$PYTHONPATH" timeout -k 5 "${TEAM_BENCH_TIMEOUT:-90}" \
                  "$PY" benchmarks/team_bench.py --world "$world" ${TEAM_BENCH_ARGS:-} 2>&1); } \
                >>"$OUT/bench.log"
            rc=$?
            note "- team bench EP=$world, $1: rc $rc ($((SECONDS - start)) s; in bench.log)"
        done
    }
    handle_timeline "this tree" "$PWD"
    team_bench "this tree" "$PWD"
    # The kernels again per staging chunk size in BENCH_CHUNKS (e.g. "24 48": an A/B of the
    # chunk against the warps that share it, without a rebuild), per ring depth in BENCH_DEPTHS,
    # and per emulated node size in BENCH_NODES (e.g. "1": the rail next to NVLink), appended to
    # bench.log.
    variants=()
    for chunk in ${BENCH_CHUNKS:-}; do variants+=("staging chunks of $chunk tokens|--staging-chunk-tokens $chunk"); done
    for depth in ${BENCH_DEPTHS:-}; do variants+=("staging depth $depth|--staging-depth $depth"); done
    for g in ${BENCH_NODES:-}; do variants+=("nodes of $g rank(s)|--ranks-per-node $g"); done
    for variant in "${variants[@]}"; do
        # shellcheck disable=SC2086 # the variant's flags are a list
        bench_kernels "${variant%%|*}" "$PWD" kernels ${variant#*|}
    done
    # Each baseline's kernels section (BENCH_BASELINE), appended to bench.log likewise.
    for i in "${!BASELINES[@]}"; do
        baseline_ready "$i" || continue
        # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
        bench_kernels "baseline ${BASELINES[$i]}" "/tmp/baseline_$i" \
            "${BASELINE_SECTIONS:-kernels}" $BENCH_ARGS
        handle_timeline "baseline ${BASELINES[$i]}" "/tmp/baseline_$i"
        team_bench "baseline ${BASELINES[$i]}" "/tmp/baseline_$i"
        if [ -n "${BASELINE_TESTS:-}" ]; then
            # The baseline's own tests (its tests/ import its package), into gpu_tests.log.
            # shellcheck disable=SC2086 # BASELINE_TESTS is a list of pytest arguments
            (cd "/tmp/baseline_$i" && CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER \
                run_pytest "baseline ${BASELINES[$i]} tests" "${BASELINE_TESTS_TIMEOUT:-120}" \
                "$OUT/gpu_tests.log" $BASELINE_TESTS) || STATUS=1
        fi
    done
    if [ -n "${BENCH_NCU:-}" ]; then
        # Nsight Compute on our kernels whose demangled names match BENCH_NCU, in a one-rank
        # bench (a kernel replayed alone has no peer to wait for): sections, then the source
        # lines with the most warp-stall samples (the build has -lineinfo), into ncu.txt.
        start=$SECONDS
        ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
        (
            echo "== ncu ($ncu_bin), one-rank bench, kernels matching '$BENCH_NCU'"
            [ -n "$ncu_bin" ] || { echo "no ncu on this machine"; exit 1; }
            timeout -k 5 "${BENCH_NCU_TIMEOUT:-150}" "$ncu_bin" --clock-control none \
                --target-processes all --kernel-name-base demangled -k "regex:$BENCH_NCU" \
                --launch-count "${BENCH_NCU_COUNT:-2}" --import-source yes \
                --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                --section SchedulerStats --section Occupancy --section SourceCounters \
                -f -o /tmp/bench_ncu "$PY" -m megatron_nccl_ep.bench --nproc 1 --sections kernels \
                --warmup 1 --iters 1 --rotate 1 >/tmp/bench_ncu.log 2>&1 || {
                tail -n 20 /tmp/bench_ncu.log; exit 1; }
            "$ncu_bin" --import /tmp/bench_ncu.ncu-rep --page details || exit 1
            "$ncu_bin" --import /tmp/bench_ncu.ncu-rep --page source --csv --print-source cuda \
                >/tmp/bench_ncu_source.csv && "$PY" tests/gpu/ncu_hot_lines.py /tmp/bench_ncu_source.csv
            echo "== the same, per SASS instruction"
            "$ncu_bin" --import /tmp/bench_ncu.ncu-rep --page source --csv --print-source sass \
                >/tmp/bench_ncu_sass.csv && "$PY" tests/gpu/ncu_hot_lines.py /tmp/bench_ncu_sass.csv 60
        ) >>"$OUT/ncu.txt" 2>&1
        note "- ncu on the bench's kernels: rc $? ($((SECONDS - start)) s; ncu.txt)"
    fi
fi

if wants micro; then
    # The standalone hardware ceilings (benchmarks/micro), appended to bench.log:
    # what N SMs move locally and over NVLink, and the expansion / summation under an SM budget
    # (sm_budget also times the library's own per-token sum, csrc/kernels/token_sum.cuh).
    start=$SECONDS
    rc=0
    ready=()
    if [ "${MICRO_BASELINES:-1}" = 1 ]; then
        for i in "${!BASELINES[@]}"; do baseline_ready "$i" && ready+=("$i"); done
    fi
    (  # a subshell: a failing step ends this stage, not the script
        # sm_budget includes the library's kernel headers, which include nccl.h: the headers of
        # the nvidia-nccl wheel next to torch (as setup.py finds them), or NCCL_INCLUDE_DIR.
        nccl_inc=${NCCL_INCLUDE_DIR:-$("$PY" -c 'import glob, nvidia
print(([d for p in nvidia.__path__ for d in glob.glob(p + "/nccl/include")] + [""])[0])' 2>/dev/null)}
        for bench in peer_ceilings sm_budget hbm_patterns; do
            echo "== benchmarks/micro/$bench.cu"
            nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a ${nccl_inc:+-I "$nccl_inc"} \
                -o "/tmp/$bench" "benchmarks/micro/$bench.cu" || exit 1
        done
        # peer_ceilings needs two GPUs (their NVLink); sm_budget runs on one.
        if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
            timeout -k 5 "${MICRO_TIMEOUT:-90}" /tmp/peer_ceilings || exit 1
        else
            echo "peer_ceilings: skipped, one GPU on this machine (it times copies between two)"
        fi
        timeout -k 5 "${MICRO_TIMEOUT:-90}" /tmp/sm_budget "${MICRO_SMS:-24}" || exit 1
        if [ -n "${MICRO_HBM:-}" ]; then  # tokens, then CTA counts, e.g. "16384 24 66 132"
            # shellcheck disable=SC2086 # MICRO_HBM is a list of arguments
            timeout -k 5 "${MICRO_TIMEOUT:-90}" /tmp/hbm_patterns $MICRO_HBM || exit 1
        fi
        if [ -n "${MICRO_NCU:-}" ]; then  # Nsight Compute on the micro's kernels of that name
            ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
            echo "== ncu ($ncu_bin) on kernels matching '$MICRO_NCU': ncu.txt"
            timeout -k 5 "${MICRO_TIMEOUT:-90}" "$ncu_bin" --clock-control none \
                -k "regex:$MICRO_NCU" --launch-count "${MICRO_NCU_COUNT:-4}" \
                --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                --section SchedulerStats --section Occupancy \
                /tmp/sm_budget "${MICRO_SMS:-24}" >"$OUT/ncu.txt" 2>&1 || exit 1
        fi
        for i in "${ready[@]}"; do  # each baseline's library code, same microbenchmark
            echo "== baseline (${BASELINES[$i]}): benchmarks/micro/sm_budget.cu"
            nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a ${nccl_inc:+-I "$nccl_inc"} \
                -o "/tmp/sm_budget_baseline_$i" "/tmp/baseline_$i/benchmarks/micro/sm_budget.cu" ||
                exit 1
            timeout -k 5 "${MICRO_TIMEOUT:-90}" "/tmp/sm_budget_baseline_$i" "${MICRO_SMS:-24}" ||
                exit 1
        done
    ) >>"$OUT/bench.log" 2>&1 || rc=$?
    [ $rc -eq 0 ] || STATUS=1
    note "- micro: rc $rc ($((SECONDS - start)) s; output at the end of bench.log)"
fi

if wants example; then
    # The main job on the GPUs (NCCL, cuda backend), one process per GPU, twice: the loss must go
    # down (the example checks) and the final loss bits must be identical across the two runs.
    start=$SECONDS
    gpus=$(nvidia-smi -L | wc -l)
    : >"$OUT/example.log"
    for run in 1 2; do
        timeout -k 10 "${EXAMPLE_TIMEOUT:-120}" "$PY" -m torch.distributed.run --standalone \
            --nproc-per-node "$gpus" examples/train_moe.py --backend cuda --steps 30 \
            >>"$OUT/example.log" 2>&1 || { STATUS=1; note "- example run $run: FAILED"; }
    done
    bits=$(grep -o 'final loss.*' "$OUT/example.log" | sort -u)
    note "- example (EP=$gpus, cuda backend, 2 runs, $((SECONDS - start)) s): $(echo "$bits" | wc -l) distinct final-loss line(s): $bits"
fi

if wants faults; then
    # Faults and stress (issue 8), every GPU one rank: the summary lines ("[test] ...") in
    # faults.log hold each fault's per-rank outcome and time to error, the memory of the 10,000
    # cycles, the soak's calls and mismatches. The soak (last) ends 20 s before SOAK_DEADLINE at
    # the latest, so that slow earlier tests shorten it instead of the stage being killed.
    : >"$OUT/faults.log"
    # FAULTS_SELECT is a list of pytest arguments, shell-quoted (-k "a or b").
    eval "faults_select=(${FAULTS_SELECT:-})"
    SOAK_DEADLINE=$(($(date +%s) + FAULTS_TIMEOUT - 20)) SOAK_SECONDS=$SOAK_SECONDS \
        run_pytest "faults (fault injection, stress, soak of ${SOAK_SECONDS} s)" \
        "$FAULTS_TIMEOUT" "$OUT/faults.log" -rfEPxX "${faults_select[@]}" "${FAULT_TESTS[@]}"
fi

if wants pretrain; then
    start=$SECONDS
    workdir=$(mktemp -d /tmp/check_training_XXXX)
    gpus=$(nvidia-smi -L | wc -l)
    "$PY" examples/check_training.py --gpus "$gpus" --workdir "$workdir" \
        --checks "${PRETRAIN_CHECKS:-abcde}" --run-timeout "${PRETRAIN_RUN_TIMEOUT:-150}" \
        -- --nccl-ep-backend cuda \
        >"$workdir/checks.txt" 2>&1 || STATUS=1
    for log in "$workdir"/checks.txt "$workdir"/*.log; do
        echo "==== $(basename "$log")"; cat "$log"
    done >"$OUT/pretrain.log"
    note "- pretrain (EP=$gpus, Megatron's pretrain(), cuda backend, $((SECONDS - start)) s):"
    grep -E '^(PASS|FAIL|SPEED) ' "$workdir/checks.txt" | sed 's/^/  - /' | tee -a "$SUMMARY"
fi

echo
echo "================ summary ($OUT/summary.md) ================"
cat "$SUMMARY"
exit $STATUS
