#!/usr/bin/env bash
# The GPU script (docs/gpu_tests.md: stages, outputs, time limits, environment). From the
# repository root of a GPU machine:
#   bash tests/gpu/run.sh [build] [tests] [bench] [stress] [example] [faults] [pretrain] [micro]
#                                                   (no argument: build tests)
# It builds the library, runs the GPU tests bitwise against the reference and runs the benchmark,
# leaving its logs and results under $OUT (default ./out). Every stage's limit is clamped to what
# is left of RUN_BUDGET (580 s) from the start, so a call ends within ten minutes: `build tests`
# fills one; `build bench stress` another.
# megatron-core's wheel in .whl/, where the machine's python3 lacks it, is installed first.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STARTED=$SECONDS

# NVLink multicast stays off in every process started from here: on shared GPU hosts a program
# that uses it can take the host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# CUDA's default (lazy) module loading in every stage, as users run: nothing may depend on EAGER.
unset CUDA_MODULE_LOADING
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}  # the machine's python3, with PyTorch and CUDA
RUN_BUDGET=${RUN_BUDGET:-580}
BENCH_ARGS=${BENCH_ARGS:-}
JOBS=$(nproc)

STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build tests)
for stage in "${STAGES[@]}"; do
    case "$stage" in
        build|tests|bench|stress|example|faults|pretrain|micro) ;;
        *) echo "unknown stage '$stage' (choose from: build tests bench stress example faults" \
               "pretrain micro)" >&2
           exit 2 ;;
    esac
done
wants() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }
# A stage's limit: its own, or what is left of RUN_BUDGET if that is less (at least 10 s).
limit() {
    local left=$((RUN_BUDGET - (SECONDS - STARTED)))
    [ "$left" -lt 10 ] && left=10
    echo $(($1 < left ? $1 : left))
}

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
    "$PY" -c 'from benchmarks import source_version; print("source", source_version())'
    echo "## CUDA / NCCL environment"; env | grep -E '^(CUDA|NCCL|TORCH)_' | sort
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
{
    echo "- machine: $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s): $(nvidia-smi -L 2>/dev/null | head -n 1 | cut -d'(' -f1)"
    grep -E '^(torch|source) ' "$OUT/env.txt" | sed 's/^/- /'
} >>"$SUMMARY"

# -- wheels in .whl/ ----------------------------------------------------------------------------
# --no-deps into a separate folder: the machine's torch, numpy and packaging stay in charge.
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
    note "- wheels: none in .whl/: the Megatron tests skip where megatron-core is missing"
fi

# -- stages ----------------------------------------------------------------------------------------
STATUS=0

# Builds the package tree DIR in place (NCCL_EP_BUILD_EXT=1: a library that cannot be built fails
# the build), its log into LOG.
#   build_tree DIR LOG LIMIT
build_tree() {
    (cd "$1" && NCCL_EP_BUILD_EXT=1 MAX_JOBS=$JOBS timeout -k 10 "$3" \
        "$PY" setup.py build_ext --inplace -j "$JOBS") >"$2" 2>&1
}

if wants build; then
    start=$SECONDS
    build_tree "$PWD" "$OUT/build.log" "$(limit "${BUILD_TIMEOUT:-120}")"
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

# The baselines (BENCH_BASELINE) build in the background while the tests run, tree i in
# /tmp/baseline_i: its library, and its bench where that is a tool of the tree (benchmarks/; older
# trees have it inside the package, megatron_nccl_ep/bench/).
read -r -a BASELINES <<<"${BENCH_BASELINE:-}"
BASELINE_PIDS=()
if wants bench; then
    for i in "${!BASELINES[@]}"; do
        tree=${BASELINES[$i]} dir=/tmp/baseline_$i
        if [ -f "$tree/setup.py" ]; then
            rm -rf "$dir" && mkdir -p "$dir" &&
                cp -r "$tree/setup.py" "$tree/csrc" "$tree/megatron_nccl_ep" "$dir/" &&
                if [ -f "$tree/benchmarks/__main__.py" ]; then
                    mkdir "$dir/benchmarks" && cp "$tree"/benchmarks/*.py "$dir/benchmarks/"
                fi
            build_tree "$dir" "$dir/build.log" "${BUILD_TIMEOUT:-120}" &
            BASELINE_PIDS[$i]=$!
        else
            STATUS=1
            note "- baseline: $tree (BENCH_BASELINE) holds no setup.py"
        fi
    done
fi

# One pytest run under a time limit, appended to LOG after a header line, its counts into the
# summary (and its failures with the tail of its output).
#   run_pytest LABEL LIMIT_S LOG [pytest args...]
run_pytest() {
    local label=$1 limit=$2 log=$3 start=$SECONDS per_test=() first section counts
    shift 3
    # pytest-timeout, where installed, turns a hung test into a traceback instead of a silent kill.
    "$PY" -c 'import pytest_timeout' 2>/dev/null &&
        per_test=(--timeout="${PER_TEST_TIMEOUT:-$((limit > 40 ? limit - 20 : limit))}")
    echo "==== $label ====" >>"$log"
    first=$(($(wc -l <"$log") + 1))
    timeout -k 10 "$limit" "$PY" -m pytest -q --tb=short -rfEP "${per_test[@]}" "$@" >>"$log" 2>&1
    local rc=$?
    section=$(tail -n "+$first" "$log")
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
MEGATRON_TESTS=(tests/gpu/test_megatron_overlap.py tests/gpu/test_megatron_fixed_capacity.py
                tests/gpu/test_megatron_inference_gpu.py tests/gpu/test_megatron_graphs.py
                tests/gpu/test_megatron_grouped_experts_gpu.py
                tests/gpu/test_megatron_overflow_redo.py)
# Groups that span nodes (emulated: the group option and NCCL_HOSTID): a run of their own too.
NODES_TESTS=(tests/gpu/test_cuda_nodes.py)
# LL mode (EP=1 and local teams): with the team tests' environment.
LL_TESTS=(tests/gpu/test_cuda_ll.py)
# LL over NVLink, one process per GPU (skips below 2 GPUs): a run of its own.
LL_NVLINK_TESTS=(tests/gpu/test_cuda_ll_nvlink.py)

if wants tests; then
    : >"$OUT/gpu_tests.log"
    # Local teams (the C example's, the team tests') put every rank's stream in one process:
    # each needs its own hardware queue (nccl_ep.h, ncclEpCreateLocalTeam).
    CUDA_DEVICE_MAX_CONNECTIONS=32 run_pytest "tests (one rank per GPU, C example)" \
        "$(limit "${TESTS_TIMEOUT:-120}")" "$OUT/gpu_tests.log" tests/gpu \
        --ignore=tests/gpu/test_cuda_local_team.py "${FAULT_TESTS[@]/#/--ignore=}" \
        "${MEGATRON_TESTS[@]/#/--ignore=}" "${NODES_TESTS[@]/#/--ignore=}" \
        "${LL_TESTS[@]/#/--ignore=}" "${LL_NVLINK_TESTS[@]/#/--ignore=}"
    run_pytest "tests (groups that span nodes: emulated nodes, the rail)" \
        "$(limit "${NODES_TESTS_TIMEOUT:-90}")" "$OUT/gpu_tests.log" "${NODES_TESTS[@]}"
    # Megatron asks the 1F1B EP overlap for more than one hardware queue, as the runs above have.
    CUDA_DEVICE_MAX_CONNECTIONS=32 PER_TEST_TIMEOUT=90 \
        run_pytest "tests (Megatron on GPUs: 1F1B EP overlap, drop-and-pad, graphs, grouped experts, overflow redo)" \
        "$(limit "${MEGATRON_TESTS_TIMEOUT:-150}")" "$OUT/gpu_tests.log" "${MEGATRON_TESTS[@]}"
    # Local teams: every rank's stream in one process, under CUDA's default module loading.
    CUDA_DEVICE_MAX_CONNECTIONS=32 PER_TEST_TIMEOUT=90 \
        run_pytest "tests (local teams: EP 2/4/8 on one GPU)" \
        "$(limit "${TEAM_TIMEOUT:-240}")" "$OUT/gpu_tests.log" tests/gpu/test_cuda_local_team.py
    CUDA_DEVICE_MAX_CONNECTIONS=32 PER_TEST_TIMEOUT=90 \
        run_pytest "tests (LL: EP=1 and local teams EP 2/4/8 on one GPU)" \
        "$(limit "${LL_TIMEOUT:-150}")" "$OUT/gpu_tests.log" "${LL_TESTS[@]}"
    run_pytest "tests (LL over NVLink: one process per GPU, EP 2/4/8)" \
        "$(limit "${LL_NVLINK_TIMEOUT:-150}")" "$OUT/gpu_tests.log" "${LL_NVLINK_TESTS[@]}"
fi

# A bench output's table (from its marker line on; else its last 30 lines) as a code block.
bench_table() {
    local log table
    log=$(cat)
    table=$(sed -n '/^== megatron_nccl_ep bench/,$p' <<<"$log")
    echo '```'; echo "${table:-$(tail -n 30 <<<"$log")}"; echo '```'
}

if wants bench; then
    # The baselines' builds end first, so that none runs beside a timed bench.
    READY=()
    for i in "${!BASELINES[@]}"; do
        [ -n "${BASELINE_PIDS[$i]:-}" ] || continue
        if wait "${BASELINE_PIDS[$i]}"; then
            READY+=("$i")
        else
            STATUS=1
            note "- baseline ${BASELINES[$i]} build: FAILED; the tail of its log:"
            { echo '```'; tail -n 12 "/tmp/baseline_$i/build.log"; echo '```'; } | tee -a "$SUMMARY"
        fi
    done
    # BENCH_ROUNDS > 1 alternates this tree's bench and the baselines' that many times (two
    # processes of one tree may differ more than two trees do): round 1 of this tree writes the
    # results files, every round's log goes into bench.log and its table into the summary.
    ROUNDS=${BENCH_ROUNDS:-1}
    for ((round = 1; round <= ROUNDS; round++)); do
        of=""
        [ "$ROUNDS" -gt 1 ] && of=", round $round of $ROUNDS"
        start=$SECONDS
        budget=$(limit "${BENCH_TIMEOUT:-170}")
        files=()
        [ "$round" -eq 1 ] && files=(--json "$OUT/results.json" --markdown "$OUT/RESULTS.md"
                                     --plot "$OUT/results.png")
        # Local teams (the team section) need a hardware queue per rank, as in the tests.
        # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
        log=$(CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 10 "$budget" "$PY" -m benchmarks \
            "${files[@]}" --time-budget $((budget - 15)) $BENCH_ARGS 2>&1)
        rc=$?
        [ $rc -eq 0 ] || STATUS=1
        if [ "$round" -eq 1 ]; then
            echo "$log" >"$OUT/bench.log"
        else
            { echo "==== this tree$of"; echo "$log"; } >>"$OUT/bench.log"
        fi
        note "- bench$of: rc $rc ($((SECONDS - start)) s; 1 = some item failed, 124 = timed out)"
        { echo; bench_table <<<"$log"; } >>"$SUMMARY"
        for i in "${READY[@]}"; do
            dir=/tmp/baseline_$i
            start=$SECONDS
            budget=$(limit "${BENCH_TIMEOUT:-170}")
            # The baseline's own bench: benchmarks/ where the tree has it, else the package's.
            bench=megatron_nccl_ep.bench
            [ -f "$dir/benchmarks/__main__.py" ] && bench=benchmarks
            # shellcheck disable=SC2086 # BENCH_ARGS is a list of flags
            log=$(cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" CUDA_DEVICE_MAX_CONNECTIONS=32 \
                timeout -k 10 "$budget" "$PY" -m "$bench" $BENCH_ARGS \
                --sections "${BASELINE_SECTIONS:-kernels}" --time-budget $((budget - 15)) 2>&1)
            rc=$?
            [ $rc -eq 0 ] || STATUS=1
            { echo "==== baseline ${BASELINES[$i]}$of"; echo "$log"; } >>"$OUT/bench.log"
            note "- bench, baseline ${BASELINES[$i]}$of: rc $rc ($((SECONDS - start)) s)"
            bench_table <<<"$log" >>"$SUMMARY"
        done
    done
fi

if wants stress; then
    # Local teams under fresh-process stress (tests/gpu/stress_teams.py: each configuration first
    # in a fresh process, then repeated), under CUDA's default (lazy) module loading.
    start=$SECONDS
    # shellcheck disable=SC2086 # STRESS_ARGS is a list of flags
    CUDA_DEVICE_MAX_CONNECTIONS=32 timeout -k 10 \
        "$(limit "${STRESS_TIMEOUT:-480}")" "$PY" tests/gpu/stress_teams.py ${STRESS_ARGS:-} \
        --json "$OUT/stress.json" >"$OUT/stress.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || STATUS=1
    note "- stress (local teams, fresh processes): rc $rc ($((SECONDS - start)) s; 124 = timed out)"
    sed -n '/^== stress: configuration/,$p' "$OUT/stress.log" | sed 's/^/  /' | tee -a "$SUMMARY"
    [ $rc -eq 0 ] || { echo '```'; tail -n 20 "$OUT/stress.log"; echo '```'; } | tee -a "$SUMMARY"
fi

if wants example; then
    # The main job on the GPUs (NCCL, cuda backend), one process per GPU, twice: the loss must go
    # down (the example checks) and the final loss bits must be identical across the two runs.
    start=$SECONDS
    gpus=$(nvidia-smi -L | wc -l)
    : >"$OUT/example.log"
    for run in 1 2; do
        timeout -k 10 "$(limit "${EXAMPLE_TIMEOUT:-120}")" "$PY" -m torch.distributed.run \
            --standalone --nproc-per-node "$gpus" examples/train_moe.py --backend cuda --steps 30 \
            >>"$OUT/example.log" 2>&1 || { STATUS=1; note "- example run $run: FAILED"; }
    done
    bits=$(grep -o 'final loss.*' "$OUT/example.log" | sort -u)
    note "- example (EP=$gpus, cuda backend, 2 runs, $((SECONDS - start)) s): $(echo "$bits" | wc -l) distinct final-loss line(s): $bits"
fi

if wants faults; then
    # Every GPU one rank: the summary lines ("[test] ...") in faults.log hold each fault's
    # per-rank outcome and time to error, the memory of the 10,000 cycles, the soak's calls and
    # mismatches. The soak (last) ends 20 s before SOAK_DEADLINE at the latest, so that slow
    # earlier tests shorten it instead of the stage being killed.
    : >"$OUT/faults.log"
    faults_limit=$(limit "${FAULTS_TIMEOUT:-480}")
    # FAULTS_SELECT is a list of pytest arguments, shell-quoted (-k "a or b").
    eval "faults_select=(${FAULTS_SELECT:-})"
    SOAK_DEADLINE=$(($(date +%s) + faults_limit - 20)) SOAK_SECONDS=${SOAK_SECONDS:-300} \
        run_pytest "faults (fault injection, stress, soak of ${SOAK_SECONDS:-300} s)" \
        "$faults_limit" "$OUT/faults.log" -rfEPxX "${faults_select[@]}" "${FAULT_TESTS[@]}"
fi

if wants pretrain; then
    start=$SECONDS
    # PRETRAIN_WORKDIR under $OUT keeps each run's log where a killed call still returns it.
    workdir=${PRETRAIN_WORKDIR:-$(mktemp -d /tmp/check_training_XXXX)}
    mkdir -p "$workdir"
    gpus=$(nvidia-smi -L | wc -l)
    # MEGATRON_LM_SCRIPT: Megatron-LM's pretrain_gpt.py, run through the launcher instead of
    # examples/pretrain_gpt_moe.py. training.json: python -m benchmarks.readme --training reads it.
    script=()
    [ -n "${MEGATRON_LM_SCRIPT:-}" ] && script=(--megatron-lm-script "$MEGATRON_LM_SCRIPT")
    "$PY" examples/check_training.py --gpus "$gpus" --workdir "$workdir" \
        --checks "${PRETRAIN_CHECKS:-abcdefghijktu}" --run-timeout "${PRETRAIN_RUN_TIMEOUT:-150}" \
        --json "$OUT/training.json" "${script[@]}" -- --nccl-ep-backend cuda \
        >"$workdir/checks.txt" 2>&1 || STATUS=1
    for log in "$workdir"/checks.txt "$workdir"/*.log; do
        echo "==== $(basename "$log")"; cat "$log"
    done >"$OUT/pretrain.log"
    note "- pretrain (EP=$gpus, Megatron's pretrain() via ${MEGATRON_LM_SCRIPT:-examples/pretrain_gpt_moe.py}, cuda backend, $((SECONDS - start)) s):"
    grep -E '^(PASS|FAIL|SPEED) ' "$workdir/checks.txt" | sed 's/^/  - /' | tee -a "$SUMMARY"
fi

if wants micro; then
    start=$SECONDS
    rc=0  # 1 when either tool fails
    {
        echo "== benchmarks/micro/peer_ceilings.cu"
        if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
            echo "skipped: one GPU on this machine (it times copies between two)"
        else
            nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/peer_ceilings \
                benchmarks/micro/peer_ceilings.cu &&
                timeout -k 5 "$(limit "${MICRO_TIMEOUT:-90}")" /tmp/peer_ceilings || rc=1
        fi
        echo "== benchmarks/micro/host_floor.cu"
        nccl=$("$PY" -c 'import glob, os, nvidia
print(next(p for b in nvidia.__path__ for p in glob.glob(os.path.join(b, "nccl"))
           if os.path.exists(os.path.join(p, "include", "nccl.h"))))') &&
            nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/host_floor benchmarks/micro/host_floor.cu \
                -Icsrc/include -I"$nccl/include" -Lmegatron_nccl_ep -l:libmegatron_nccl_ep.so \
                -L"$nccl/lib" -l:libnccl.so.2 -Xlinker -rpath,"$PWD/megatron_nccl_ep:$nccl/lib" &&
            timeout -k 5 "$(limit "${MICRO_TIMEOUT:-90}")" /tmp/host_floor || rc=1
    } >"$OUT/micro.log" 2>&1
    [ $rc -eq 0 ] || STATUS=1
    note "- micro: rc $rc ($((SECONDS - start)) s; micro.log)"
fi

echo
echo "================ summary ($OUT/summary.md, $((SECONDS - STARTED)) s) ================"
cat "$SUMMARY"
exit $STATUS
