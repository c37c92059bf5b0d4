"""Checks training with the nccl_ep dispatcher end to end on GPUs, through Megatron's pretrain()
(examples/pretrain_gpt_moe.py), every run with --deterministic-mode and --train-iters 100:

  (a) determinism: two nccl_ep runs give the same loss and gradient norm bits at every iteration;
  (b) against Megatron's alltoall dispatcher: one run with it; the largest absolute loss
      difference from the nccl_ep run over the iterations is reported, and fails the check above
      --alltoall-tolerance;
  (c) resumption: a run that saves a checkpoint at iteration 50 and stops, then a run resumed from
      it, give the bits of the uninterrupted nccl_ep run at iterations 1-50 and 51-100;
  (d) shared-expert overlap: a model with shared experts and --moe-shared-expert-overlap trains
      with the bits of Megatron's alltoall dispatcher under the same flags (not against the same
      model without the overlap: the overlap changes Megatron's own sums, alltoall's bits too);
  (e) CUDA graphs: --cuda-graph-impl local of the moe_router and moe_preprocess scopes trains
      with the bits of the nccl_ep run without graphs.

Whole MoE layers in CUDA graphs, on a larger model (GRAPH_MODEL: 4 layers, hidden 1024, 32
experts top-4, sequence 1024, micro-batch 4, global batch 16, bf16), GRAPH_ITERATIONS iterations:

  (f) drop-and-pad with --cuda-graph-impl local --cuda-graph-modules moe, bitwise the same run
      without graphs;
  (g) drop-and-pad with --cuda-graph-impl full_iteration, bitwise the same run without graphs;
  (h) capacity mode with SequentialMLP (the fixed layout) with --cuda-graph-impl
      full_iteration, bitwise the same run without graphs (routing balanced by Megatron's
      benchmarking switch: see CAPACITY_MODE);
  (i) dropless on the model's own routing (no forced balancing, the aux loss on): capacity mode
      with nccl_ep's grouped experts (--moe-grouped-gemm: the packed layout, only the routed rows
      computed) and --cuda-graph-impl full_iteration, DROPLESS_ITERATIONS iterations, bitwise
      the same run without graphs; no step overflowed (no redo line) and the budget's
      high-water mark is printed;
  (j) eager steps: the grouped experts' step faster than SequentialMLP's, in exact mode and in
      capacity mode (SequentialMLP: the fixed layout, at a factor that holds the routing);
  (k) an overflow redone: the grouped experts at a budget below what the first step needs
      (factor 0.9) with the full-iteration graph: the first step is redone (one log line), its
      loss and grad norm bits those of exact mode's eager first step, and training goes on with
      the grown budget (the graph captured after it);
  (t) step times against Megatron's alltoall with the same settings: (g) within 1.05x of
      alltoall's full-iteration drop-and-pad step, (f) no slower than alltoall's moe module
      graphs;
  (u) (i)'s graphed step within 1.10x of alltoall's full-iteration drop-and-pad step (which
      drops tokens, at capacity factor 1.0; ours drops none).

Every run compared bit for bit must have logged finite losses that went down (its last tenth of
iterations below its first): two runs of NaN losses, or of no training, would be equal trivially.

    python examples/check_training.py [--gpus 2] [--checks abcde] [--workdir DIR]
                                      [--megatron-lm-script PRETRAIN_GPT] [-- FLAGS]

``--megatron-lm-script`` runs Megatron-LM's own pretrain_gpt.py (from its repository, unchanged)
through ``megatron_nccl_ep.launch`` in place of the example (examples/run_megatron_lm.py: the
example's default flags, its step lines), every run alike.

``--json PATH`` writes the checks and each run's step time with the machine, the sources hash and
the command (``python -m benchmarks.readme --training PATH`` puts them into RESULTS.md).

e.g. ``-- --nccl-ep-backend cuda`` to fail rather than fall back when the CUDA kernels are not
built. Runs only what the chosen checks need; prints one PASS/FAIL line per check, then a SPEED
line per dispatcher that ran without extras (nccl_ep, alltoall: Megatron's iteration time and the
tokens per second it gives), and exits 1 when a check failed. Each run's output stays in
WORKDIR/<run>.log (WORKDIR: a new temporary folder unless given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Optional

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrain_gpt_moe.py")
# Runs a Megatron-LM script through the launcher with the example's defaults and step lines.
MEGATRON_LM_RUNNER = os.path.join(os.path.dirname(EXAMPLE), "run_megatron_lm.py")
ITERATIONS = 100
SAVE_AT = 50
# The line examples/pretrain_gpt_moe.py prints after every iteration (its step_line).
STEP = re.compile(r"^exact_step iteration=(\d+) loss=(\S+) grad_norm=(\S+)$", re.MULTILINE)
# NVLink multicast stays off on shared GPU hosts.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
# How many problems a FAIL line lists before it just counts the rest.
SHOWN = 5
SHARED_EXPERTS = ["--moe-shared-expert-intermediate-size", "512"]
ROUTER_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe_router",
                 "moe_preprocess"]
GRAPH_ITERATIONS = 40
GRAPH_MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "1024",
               "--num-attention-heads", "16", "--seq-length", "1024",
               "--max-position-embeddings", "1024", "--num-experts", "32", "--moe-router-topk", "4",
               "--micro-batch-size", "4", "--global-batch-size", "16", "--bf16",
               "--deterministic-mode", "--train-iters", str(GRAPH_ITERATIONS),
               "--no-check-for-nan-in-loss-and-grad"]
DROP_AND_PAD = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
# Check h (SequentialMLP, the fixed layout) routes with Megatron's
# --moe-router-force-load-balancing (random logits, its benchmarking switch) at a budget of 1.25
# x the even share per (expert, source rank): GRAPH_MODEL's own routing at initialization sends
# several times the share to a few experts, and SequentialMLP computes every budget row.
# Balanced, a step's largest expert load stays near the share, inside the budget. The model's
# own routing is check i's, with the grouped experts (the packed layout).
BALANCED = ["--moe-router-force-load-balancing"]
CAPACITY_MODE = [*BALANCED, "--nccl-ep-recv-mode", "capacity", "--nccl-ep-capacity-factor",
                 "1.25"]
MOE_GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"]
FULL_ITERATION = ["--cuda-graph-impl", "full_iteration"]
# Dropless on the model's own routing: nccl_ep's grouped experts (the packed layout), capacity
# mode at 1.25 x the balanced share of rows per rank (at EP 1 every step needs exactly the
# share: tokens x top-k), DROPLESS_ITERATIONS iterations.
DROPLESS_ITERATIONS = 100
GROUPED = ["--moe-grouped-gemm"]
DROPLESS = [*GROUPED, "--nccl-ep-recv-mode", "capacity", "--nccl-ep-capacity-factor", "1.25"]
# Eager steps, timed (check j): EAGER_ITERATIONS iterations each; SequentialMLP's capacity mode
# (the fixed layout, per expert and source rank) at a factor that holds the model's routing.
EAGER_ITERATIONS = 20
EAGER = ["--train-iters", str(EAGER_ITERATIONS)]
SEQUENTIAL_CAPACITY = ["--nccl-ep-recv-mode", "capacity", "--nccl-ep-capacity-factor", "6"]
# Check k: a budget below what the first step needs (0.9 x tokens x top-k rows at EP 1).
REDO = [*GROUPED, "--nccl-ep-recv-mode", "capacity", "--nccl-ep-capacity-factor", "0.9",
        "--train-iters", str(DROPLESS_ITERATIONS)]
REDO_LINE = "nccl_ep capacity overflow in iteration"  # megatron_nccl_ep/overflow.py's
HIGH_WATER_LINE = "nccl_ep budget high-water mark:"  # examples/pretrain_gpt_moe.py's
# The runs that must capture CUDA graphs (examples/pretrain_gpt_moe.py prints GRAPHS_LINE then).
GRAPHED = {"router_graphs", "drop_and_pad_moe_graphs", "drop_and_pad_full_iteration",
           "capacity_full_iteration", "alltoall_drop_and_pad_moe_graphs",
           "alltoall_drop_and_pad_full_iteration", "dropless_full_iteration",
           "redo_full_iteration"}
GRAPHS_LINE = "cuda_graphs captured:"  # examples/pretrain_gpt_moe.py's
# The step-time targets of check (t): run -> (alltoall's run, largest ratio to its time).
TIME_TARGETS = {"drop_and_pad_moe_graphs": ("alltoall_drop_and_pad_moe_graphs", 1.0),
                "drop_and_pad_full_iteration": ("alltoall_drop_and_pad_full_iteration", 1.05)}
# Check u: the dropless step (check i's graphed run) against alltoall's full-iteration
# drop-and-pad step, which drops tokens (capacity factor 1.0).
DROPLESS_TARGET = {"dropless_full_iteration": ("alltoall_drop_and_pad_full_iteration", 1.10)}
# Check j: run -> the run it must be faster than.
EAGER_TARGETS = {"eager_exact_grouped": "eager_exact_sequential",
                 "eager_capacity_grouped": "eager_capacity_sequential"}
# Each check and the runs it compares (the first is its reference).
CHECK_RUNS = {"a": ("nccl_ep", "nccl_ep_again"), "b": ("nccl_ep", "alltoall"),
              "c": ("nccl_ep", "until_save", "resumed"),
              "d": ("shared_expert_overlap_alltoall", "shared_expert_overlap"),
              "e": ("nccl_ep", "router_graphs"),
              "f": ("drop_and_pad", "drop_and_pad_moe_graphs"),
              "g": ("drop_and_pad", "drop_and_pad_full_iteration"),
              "h": ("capacity", "capacity_full_iteration"),
              "i": ("dropless", "dropless_full_iteration"),
              "j": (*EAGER_TARGETS, *EAGER_TARGETS.values()),
              "k": ("eager_exact_grouped", "redo_full_iteration"),
              "t": (*TIME_TARGETS, *sorted({run for run, _ in TIME_TARGETS.values()})),
              "u": (*DROPLESS_TARGET, *{run for run, _ in DROPLESS_TARGET.values()})}
# Megatron's log: its arguments at start-up, the iteration time every --log-interval.
ARGUMENT = re.compile(r"^\s*(global_batch_size|seq_length) \.+ (\d+)\s*$", re.MULTILINE)
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def run_arguments(checkpoint_dir: str) -> dict:
    """Each run's flags, which follow the example's defaults (later flags win)."""
    common = ["--deterministic-mode", "--train-iters", str(ITERATIONS)]
    return {
        "nccl_ep": common,
        "nccl_ep_again": common,
        "alltoall": [*common, "--moe-token-dispatcher-type", "alltoall"],
        "until_save": [*common, "--save", checkpoint_dir, "--save-interval", str(SAVE_AT),
                       "--exit-interval", str(SAVE_AT)],
        "resumed": [*common, "--load", checkpoint_dir],
        "shared_expert_overlap": [*common, *SHARED_EXPERTS, "--moe-shared-expert-overlap"],
        "shared_expert_overlap_alltoall": [*common, *SHARED_EXPERTS, "--moe-shared-expert-overlap",
                                           "--moe-token-dispatcher-type", "alltoall"],
        "router_graphs": [*common, *ROUTER_GRAPHS],
        "drop_and_pad": [*GRAPH_MODEL, *DROP_AND_PAD],
        "drop_and_pad_moe_graphs": [*GRAPH_MODEL, *DROP_AND_PAD, *MOE_GRAPHS],
        "drop_and_pad_full_iteration": [*GRAPH_MODEL, *DROP_AND_PAD, *FULL_ITERATION],
        "capacity": [*GRAPH_MODEL, *CAPACITY_MODE],
        "capacity_full_iteration": [*GRAPH_MODEL, *CAPACITY_MODE, *FULL_ITERATION],
        "dropless": [*GRAPH_MODEL, *DROPLESS, "--train-iters", str(DROPLESS_ITERATIONS)],
        "dropless_full_iteration": [*GRAPH_MODEL, *DROPLESS, *FULL_ITERATION,
                                    "--train-iters", str(DROPLESS_ITERATIONS)],
        "eager_exact_sequential": [*GRAPH_MODEL, *EAGER],
        "eager_exact_grouped": [*GRAPH_MODEL, *EAGER, *GROUPED],
        "eager_capacity_sequential": [*GRAPH_MODEL, *EAGER, *SEQUENTIAL_CAPACITY],
        "eager_capacity_grouped": [*GRAPH_MODEL, *EAGER, *DROPLESS],
        "redo_full_iteration": [*GRAPH_MODEL, *REDO, *FULL_ITERATION],
        "alltoall_drop_and_pad_moe_graphs": [*GRAPH_MODEL, *DROP_AND_PAD, *MOE_GRAPHS,
                                             "--moe-token-dispatcher-type", "alltoall"],
        "alltoall_drop_and_pad_full_iteration": [*GRAPH_MODEL, *DROP_AND_PAD, *FULL_ITERATION,
                                                 "--moe-token-dispatcher-type", "alltoall"],
    }


def read_steps(log: str) -> dict:
    """iteration -> (loss, gradient norm), each as its float.hex() string."""
    return {int(iteration): (loss, grad_norm) for iteration, loss, grad_norm in STEP.findall(log)}


def span(iterations) -> str:
    found = sorted(iterations)
    return f"{found[0]}-{found[-1]} ({len(found)})" if found else "none"


def coverage_problems(reference: dict, run: dict, iterations: range) -> list:
    """Whether ``run`` logged exactly ``iterations`` and ``reference`` all of them."""
    problems = []
    if not set(iterations) <= reference.keys():
        problems.append(f"the reference logged iterations {span(reference)}, "
                        f"not all of {span(iterations)}")
    if run.keys() != set(iterations):
        problems.append(f"logged iterations {span(run)}, expected {span(iterations)}")
    return problems


def bitwise_differences(reference: dict, run: dict, iterations: range) -> list:
    """Why ``run``, which should have logged exactly ``iterations``, does not match ``reference``
    bit for bit there: one line per problem, none when it does."""
    problems = coverage_problems(reference, run, iterations)
    for iteration in iterations:
        if iteration in reference and iteration in run:
            for name, expected, got in zip(("loss", "grad norm"), reference[iteration],
                                           run[iteration]):
                if got != expected:
                    problems.append(f"iteration {iteration}: {name} {got} != {expected}")
    return problems


def training_problems(name: str, steps: dict) -> list:
    """Why a run's losses do not show training: a loss that is not finite, or the mean loss of
    its last tenth of iterations not below that of its first tenth."""
    losses = [float.fromhex(steps[it][0]) for it in sorted(steps)]
    if not losses:
        return [f"run {name} logged no loss"]
    bad = [it for it in sorted(steps) if not math.isfinite(float.fromhex(steps[it][0]))]
    if bad:
        return [f"run {name}: loss not finite at iterations {span(bad)}"]
    tenth = max(1, len(losses) // 10)
    first, last = (statistics.fmean(losses[:tenth]), statistics.fmean(losses[-tenth:]))
    if not last < first:
        return [f"run {name}: the loss did not go down (first {tenth} iterations {first:.4f}, "
                f"last {tenth} {last:.4f})"]
    return []


def loss_differences(reference: dict, run: dict) -> dict:
    """iteration -> absolute loss difference, at the iterations both runs logged."""
    return {it: abs(float.fromhex(run[it][0]) - float.fromhex(reference[it][0]))
            for it in sorted(reference.keys() & run.keys())}


def summary(problems: list) -> str:
    shown = "; ".join(problems[:SHOWN])
    return shown + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")


def speed(log: str) -> Optional[dict]:
    """Megatron's iteration time in a run's log (the median over its log intervals after the
    first, which holds the warm-up) and the tokens per second it gives; None without both."""
    times = [float(ms) for ms in ITERATION_MS.findall(log)][1:]
    sizes = dict(ARGUMENT.findall(log))
    if not times or sizes.keys() != {"global_batch_size", "seq_length"}:
        return None
    ms = statistics.median(times)
    tokens = int(sizes["global_batch_size"]) * int(sizes["seq_length"])
    return {"ms": ms, "tokens": tokens, "tokens_per_s": tokens / ms * 1000.0}


def time_problems(times: dict, targets: dict = TIME_TARGETS) -> tuple:
    """Checks t and u: (problems, detail) from each run's step time in ms (None: not measured)
    against ``targets`` (run -> (baseline run, largest ratio))."""
    problems, parts = [], []
    for run, (baseline, most) in targets.items():
        ours, theirs = times.get(run), times.get(baseline)
        if ours is None or theirs is None:
            problems.append(f"no step time for {run if ours is None else baseline}")
            continue
        ratio = ours / theirs
        parts.append(f"{run} {ours:.1f} ms = {ratio:.3f}x {baseline} {theirs:.1f} ms "
                     f"(target <= {most:g}x)")
        if ratio > most:
            problems.append(parts[-1])
    return problems, "; ".join(parts)


def checks(runs: dict, tolerance: float, times: Optional[dict] = None,
           captured: Optional[set] = None, logs: Optional[dict] = None) -> list:
    """(label, passed, detail) for each check whose runs are all in ``runs``: name -> (exit
    status, steps); ``times``: name -> step time in ms (check t); ``captured``: the runs whose
    log says Megatron captured CUDA graphs (None: not looked at); ``logs``: name -> the run's
    output (checks i and k read its redo and high-water lines). A run of GRAPHED that captured
    nothing fails its check: its bits would equal the reference's trivially; so does a run of a
    bitwise check whose losses show no training (``training_problems``)."""
    steps = {name: found for name, (_, found) in runs.items()}
    reference = steps.get("nccl_ep")
    logs = logs or {}
    results = []
    wanted = [check for check, names in CHECK_RUNS.items() if set(names) <= runs.keys()]

    def add(label: str, names: tuple, problems: list, detail: str,
            trained: bool = True) -> None:
        crashed = [f"run {name} exited with status {runs[name][0]}" for name in names
                   if runs[name][0] != 0]
        if captured is not None:
            crashed += [f"run {name} captured no CUDA graph (no '{GRAPHS_LINE}' line)"
                        for name in names if name in GRAPHED and name not in captured]
        if trained:
            crashed += [p for name in names for p in training_problems(name, steps[name])]
        problems = crashed + problems
        results.append((label, not problems, summary(problems) if problems else detail))

    def redone(name: str) -> list:
        """The iterations a run redid (its overflow lines)."""
        return [int(m) for m in re.findall(rf"^{REDO_LINE} (\d+):", logs.get(name, ""),
                                           re.MULTILINE)]

    every = range(1, ITERATIONS + 1)
    same_bits = f"loss and grad norm bits equal at all {ITERATIONS} iterations"
    if "a" in wanted:
        add("(a) nccl_ep twice, bitwise", CHECK_RUNS["a"],
            bitwise_differences(reference, steps["nccl_ep_again"], every), same_bits)

    if "b" in wanted:
        differences = loss_differences(reference, steps["alltoall"])
        # NaN counts as the largest difference, and as over any tolerance.
        worst = max(differences, default=None,
                    key=lambda it: math.inf if math.isnan(differences[it]) else differences[it])
        measured = ("no iteration to compare" if worst is None else
                    f"largest |loss difference| {differences[worst]:.3e} at iteration {worst} "
                    f"(tolerance {tolerance:g})")
        over = [iteration for iteration, d in differences.items() if not d <= tolerance]
        add("(b) nccl_ep against alltoall", CHECK_RUNS["b"],
            coverage_problems(reference, steps["alltoall"], every)
            + ([f"{measured}: over it at {len(over)} iterations"] if over else []),
            measured)

    if "c" in wanted:
        add(f"(c) save at {SAVE_AT}, resume to {ITERATIONS}, bitwise", CHECK_RUNS["c"],
            [f"until_save: {p}" for p in bitwise_differences(
                reference, steps["until_save"], range(1, SAVE_AT + 1))]
            + [f"resumed: {p}" for p in bitwise_differences(
                reference, steps["resumed"], range(SAVE_AT + 1, ITERATIONS + 1))],
            f"iterations 1-{SAVE_AT}, and {SAVE_AT + 1}-{ITERATIONS} after the restart, carry "
            "the uninterrupted run's bits")

    if "d" in wanted:
        add("(d) shared-expert overlap against alltoall with it, bitwise", CHECK_RUNS["d"],
            bitwise_differences(steps["shared_expert_overlap_alltoall"],
                                steps["shared_expert_overlap"], every),
            same_bits)

    if "e" in wanted:
        add("(e) moe_router + moe_preprocess CUDA graphs against none, bitwise", CHECK_RUNS["e"],
            bitwise_differences(reference, steps["router_graphs"], every), same_bits)

    graph_iterations = range(1, GRAPH_ITERATIONS + 1)
    graph_bits = f"loss and grad norm bits equal at all {GRAPH_ITERATIONS} iterations"
    for check, label in (("f", "(f) drop-and-pad, moe module CUDA graphs against none"),
                         ("g", "(g) drop-and-pad, full-iteration CUDA graph against none"),
                         ("h", "(h) capacity mode, full-iteration CUDA graph against none")):
        if check in wanted:
            reference_run, graphed = CHECK_RUNS[check]
            add(f"{label}, bitwise", CHECK_RUNS[check],
                bitwise_differences(steps[reference_run], steps[graphed], graph_iterations),
                graph_bits)
    if "i" in wanted:
        dropless_its = range(1, DROPLESS_ITERATIONS + 1)
        problems = bitwise_differences(steps["dropless"], steps["dropless_full_iteration"],
                                       dropless_its)
        problems += [f"run {name} redid iterations {redone(name)} (a budget overflowed)"
                     for name in CHECK_RUNS["i"] if redone(name)]
        marks = [line for line in logs.get("dropless_full_iteration", "").splitlines()
                 if line.startswith(HIGH_WATER_LINE)]
        if not marks:
            problems.append(f"run dropless_full_iteration printed no '{HIGH_WATER_LINE}' line")
        add("(i) grouped experts, capacity mode on the model's own routing, full-iteration CUDA "
            "graph against none, bitwise, no token dropped", CHECK_RUNS["i"], problems,
            f"loss and grad norm bits equal at all {DROPLESS_ITERATIONS} iterations, no step "
            f"redone; {marks[-1] if marks else ''}")
    if "j" in wanted:
        problems, parts = [], []
        for run, slower in EAGER_TARGETS.items():
            ours, theirs = (times or {}).get(run), (times or {}).get(slower)
            if ours is None or theirs is None:
                problems.append(f"no step time for {run if ours is None else slower}")
                continue
            parts.append(f"{run} {ours:.1f} ms = {ours / theirs:.3f}x {slower} {theirs:.1f} ms")
            if not ours < theirs:
                problems.append(parts[-1] + " (not faster)")
        add("(j) eager steps: grouped experts against SequentialMLP", CHECK_RUNS["j"], problems,
            "; ".join(parts))
    if "k" in wanted:
        problems = []
        if redone("redo_full_iteration") != [1]:
            problems.append(f"run redo_full_iteration redid iterations "
                            f"{redone('redo_full_iteration')}, expected [1]")
        redo = steps["redo_full_iteration"]
        problems += bitwise_differences(steps["eager_exact_grouped"],
                                        {it: redo[it] for it in redo if it == 1}, range(1, 2))
        if set(redo) != set(range(1, DROPLESS_ITERATIONS + 1)):
            problems.append(f"run redo_full_iteration logged iterations {span(redo)}, expected "
                            f"1-{DROPLESS_ITERATIONS}")
        add("(k) an overflowed step redone in exact mode, training going on", CHECK_RUNS["k"],
            problems, "iteration 1 redone: its loss and grad norm bits exact mode's; "
            f"{DROPLESS_ITERATIONS} iterations trained with the grown budget")
    if "t" in wanted:
        problems, detail = time_problems(times or {})
        add("(t) step times against alltoall with the same graphs", CHECK_RUNS["t"], problems,
            detail, trained=False)
    if "u" in wanted:
        problems, detail = time_problems(times or {}, DROPLESS_TARGET)
        add("(u) the dropless full-iteration step against alltoall's dropping one",
            CHECK_RUNS["u"], problems, detail, trained=False)
    return results


def train_command(arguments: list, gpus: int, megatron_lm_script: Optional[str] = None) -> list:
    """The command of one run: the example, or ``megatron_lm_script`` through
    examples/run_megatron_lm.py, under torchrun with ``gpus`` processes."""
    program = [EXAMPLE] if megatron_lm_script is None else [MEGATRON_LM_RUNNER,
                                                            megatron_lm_script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(gpus), *program, *arguments]


def train(name: str, arguments: list, gpus: int, workdir: str, timeout: float,
          megatron_lm_script: Optional[str] = None) -> tuple:
    """Runs the example (or ``megatron_lm_script``) under torchrun; returns (exit status, steps);
    the output goes to WORKDIR/<name>.log. A run past ``timeout`` seconds is killed with all its
    processes."""
    log_path = os.path.join(workdir, f"{name}.log")
    command = train_command(arguments, gpus, megatron_lm_script)
    with open(log_path, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        # A session of its own: on a timeout, torchrun and its workers go together.
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **GPU_ENV}, start_new_session=True)
        try:
            status = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            status = process.wait()
            log.write(f"\nkilled after {timeout:g} s\n")
    with open(log_path) as log:
        text = log.read()
    steps = read_steps(text)
    print(f"run {name}: exit status {status}, iterations logged {span(steps)}; {log_path}",
          flush=True)
    return status, steps, speed(text), GRAPHS_LINE in text, text


def device_name() -> Optional[str]:
    """The first GPU's name, as nvidia-smi gives it (None without one)."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return None
    return found.strip() or None


def record(argv: list, options, results: list, runs: dict) -> dict:
    """What ``--json`` writes: the machine, the sources (the bench's hash of them), the command,
    each check's outcome and each run's step time."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.report import source_version

    script = options.megatron_lm_script
    return {
        "device": device_name(), "gpus": options.gpus, "source": source_version(),
        "command": " ".join(["python", "examples/check_training.py", *argv]),
        "script": ("Megatron-LM's " + os.path.basename(script) if script
                   else "examples/pretrain_gpt_moe.py"),
        "checks": [{"label": label, "passed": passed, "detail": detail}
                   for label, passed, detail in results],
        "runs": {name: {"exit_status": status, "iterations": len(steps), "graphs": graphs,
                        **(measured or {})}
                 for name, (status, steps, measured, graphs, _) in runs.items()},
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="processes, one per GPU (EP size)")
    parser.add_argument("--workdir", help="where the logs and the checkpoint go")
    parser.add_argument("--alltoall-tolerance", type=float, default=1e-2,
                        help="largest absolute loss difference (b) passes with")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--checks", default="".join(CHECK_RUNS),
                        help=f"which checks to run, e.g. ab (default: {''.join(CHECK_RUNS)})")
    parser.add_argument("--megatron-lm-script", metavar="PRETRAIN_GPT",
                        help="Megatron-LM's pretrain_gpt.py, run through megatron_nccl_ep.launch "
                             "instead of the example")
    parser.add_argument("--json", metavar="PATH",
                        help="write the checks and the runs' step times here (with the machine, "
                             "the sources hash and the command)")
    parser.add_argument("flags", nargs="*", help="after --: flags for every run of the example")
    options = parser.parse_args(argv)
    unknown = set(options.checks) - CHECK_RUNS.keys()
    if unknown or not options.checks:
        parser.error(f"--checks: choose letters from {''.join(CHECK_RUNS)}, "
                     f"got {options.checks!r}")
    script = options.megatron_lm_script
    if script is not None and not os.path.isfile(script):
        parser.error(f"--megatron-lm-script: no such file: {script}")
    if options.workdir:
        os.makedirs(options.workdir, exist_ok=True)
    workdir = options.workdir or tempfile.mkdtemp(prefix="check_training_")
    checkpoint_dir = tempfile.mkdtemp(prefix="checkpoint_", dir=workdir)
    needed = {name for check in options.checks for name in CHECK_RUNS[check]}
    runs = {name: train(name, [*arguments, *options.flags], options.gpus, workdir,
                        options.run_timeout, script and os.path.abspath(script))
            for name, arguments in run_arguments(checkpoint_dir).items() if name in needed}
    results = checks({name: (status, steps) for name, (status, steps, *_) in runs.items()},
                     options.alltoall_tolerance,
                     {name: measured["ms"] for name, (_, _, measured, *_) in runs.items()
                      if measured is not None},
                     {name for name, (_, _, _, graphs, _) in runs.items() if graphs},
                     {name: text for name, (*_, text) in runs.items()})
    for label, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'} {label}: {detail}", flush=True)
    for name in ("nccl_ep", "alltoall", "drop_and_pad", "capacity", "dropless",
                 *CHECK_RUNS["j"], *CHECK_RUNS["t"]):
        measured = runs[name][2] if name in runs else None
        if measured is not None:
            print(f"SPEED {name}: {measured['ms']:.1f} ms per iteration, "
                  f"{measured['tokens_per_s']:,.0f} tokens/s ({measured['tokens']} tokens per "
                  f"iteration; median of Megatron's log intervals after the first)", flush=True)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(record(argv, options, results, runs), f, indent=1)
    return 0 if all(passed for _, passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
