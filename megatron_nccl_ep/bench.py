"""Benchmark: link and memory ceilings, our dispatch/combine, and Megatron's dispatcher interface.

    python -m megatron_nccl_ep.bench [--tokens 4096 --hidden 7168 --topk 8 --experts 256]
                                     [--backend cuda|torch] [--json PATH] [--sections ...]
                                     [--sweep-tokens 1024,2048,...] [--sweep-sms 16,...,all]

One process per GPU, started here (no torchrun); without a GPU, 2 gloo processes run the
reference backend at a small shape and skip what only GPUs can measure (DEVICE_DEFAULTS). Each
section (``ceilings``, ``kernels``, ``megatron``) and each sweep point (the kernels section at
another tokens-per-rank or SM budget) runs in its own fresh set of processes with its own
deadline, and every measured item inside is guarded on its own: a failing or hanging item costs
its section's remaining items, never the others. The parent process collects per-iteration
times from every rank as they arrive, so whatever finished before a crash or a kill still
reaches the table and the JSON.

How things are timed:
* warm-up iterations first, then ``--iters`` timed ones, rotating over ``--rotate`` input sets,
  each with its own fresh random routing (never zeros);
* CUDA events on the current stream; per iteration the time of the slowest rank is kept, and
  the median over iterations is reported;
* ``kernel`` mode: the GPUs are held by a short sleep kernel while the host enqueues, then lined
  up by a one-element all-reduce, so the events bracket device work only (no host gaps);
* ``e2e`` mode: every GPU idle and the hosts lined up by a gloo barrier before the call, so host
  launch overhead and any host synchronization inside the call are included.

Bandwidth is reported two ways (docs/design.md §8): **physical** = bytes that cross the link,
unique (token, destination rank != source rank) pairs x hidden x element size, per rank;
**logical** (DeepEP's convention) = unique (token, rank) pairs received including the rank's own
x hidden x element size, per rank. Routing probabilities are left out of both (under 0.1%).

Each dispatch/combine row (and sweep point) also gets its **floor**, from the ceilings of the same
run: the larger of the HBM floor (this rank's tokens once plus its expert-major rows once, i.e.
what the op must read and write at the least, / the HBM copy's read+write rate) and the link floor
(physical bytes / the peer copy's rate, both GPUs copying where measured); "floor %" is floor /
time. Without the ceilings section there is no floor.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import math
import os
import queue as queue_module
import socket
import statistics
import subprocess
import sys
import time
import traceback
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:  # torch is imported where used: after main() has set the environment
    import torch

# NVLink multicast stays off on shared GPU hosts (it can take a host's GPUs out of
# service); every process started here inherits these.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

SECTIONS = ("ceilings", "kernels", "megatron")
# How long a section's workers get to exit (destroy their groups and process group) once they
# reported done, before they are killed and the section reports them.
EXIT_GRACE_S = 20.0
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TABLE_MARKER = "== megatron_nccl_ep bench"

# Flags left out take their device's value. On CPU the reference backend runs over gloo, so the
# shape is one that takes seconds there, and what measures GPU hardware is left out (_cpu_note).
DEVICE_DEFAULTS = {
    "cuda": {"tokens": 4096, "hidden": 7168, "topk": 8, "experts": 256, "warmup": 5,
             "iters": 40, "rotate": 4, "copy_mib": 1024, "sections": ",".join(SECTIONS),
             "megatron_dispatchers": "nccl_ep,alltoall"},
    "cpu": {"tokens": 256, "hidden": 256, "topk": 2, "experts": 16, "warmup": 2, "iters": 10,
            "rotate": 2, "copy_mib": 64, "sections": "kernels,megatron",
            "megatron_dispatchers": "nccl_ep"},
}

# Cycles of torch.cuda._sleep that keep the GPU busy while the host enqueues a kernel-mode
# iteration (~100 us at H200 clocks): longer than the Python overhead of one call.
HEAD_START_CYCLES = 200_000


# ------------------------------------------------------------------------------------------------
# arguments


def _by_device(key: str) -> str:
    return (f"default {DEVICE_DEFAULTS['cuda'][key]} on GPUs, "
            f"{DEVICE_DEFAULTS['cpu'][key]} on cpu")


def _sweep_values(text: str) -> list:
    """'16,24,all' -> [16, 24, 'all']."""
    words = [word for word in text.split(",") if word]
    if not words or not all(w == "all" or (w.isdigit() and int(w) >= 1) for w in words):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1: {text!r}")
    return [w if w == "all" else int(w) for w in words]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_nccl_ep.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (one per GPU); default: all GPUs, or 2 with --device cpu")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when a GPU is visible; cpu runs the reference backend over "
                        "gloo at a small shape (a check that the code runs, not a measurement)")
    p.add_argument("--tokens", type=int, help=f"tokens per rank; {_by_device('tokens')}")
    p.add_argument("--hidden", type=int, help=_by_device("hidden"))
    p.add_argument("--topk", type=int, help=_by_device("topk"))
    p.add_argument("--experts", type=int, help=_by_device("experts"))
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--num-sms", type=int, default=24, help="SM budget of our kernels")
    p.add_argument("--staging-chunk-tokens", type=int, default=0,
                   help="tokens per staging-ring chunk of our kernels (0: the library's choice)")
    p.add_argument("--staging-depth", type=int, default=0,
                   help="ring slots per (channel, peer) of our kernels (0: the library's choice)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks per node of our groups (0: one NVLink domain; smaller: emulated "
                        "nodes, tokens between them over NCCL send/receive)")
    p.add_argument("--backend", choices=("cuda", "torch", "auto"), default=None,
                   help="our Group's backend; default: cuda on GPUs, torch on cpu")
    p.add_argument("--recv-mode", choices=("exact", "capacity"), default="exact")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="capacity mode: rows = factor x tokens x top-k (default 1.5 x world)")
    p.add_argument("--warmup", type=int, help=_by_device("warmup"))
    p.add_argument("--iters", type=int, help=_by_device("iters"))
    p.add_argument("--rotate", type=int, help=f"input sets rotated through; {_by_device('rotate')}")
    p.add_argument("--copy-mib", type=int,
                   help=f"size of the ceiling copies; {_by_device('copy_mib')}")
    p.add_argument("--sections",
                   help=f"comma-separated subset of {','.join(SECTIONS)}; {_by_device('sections')}")
    p.add_argument("--megatron-dispatchers",
                   help="Megatron dispatchers to drive: nccl_ep, alltoall, allgather; "
                        + _by_device("megatron_dispatchers"))
    p.add_argument("--sweep-sms", type=_sweep_values, default=[], metavar="16,24,...,all",
                   help="after the sections, the kernels section once per SM budget (at --tokens;"
                        " all: the GPU's SM count)")
    p.add_argument("--sweep-tokens", type=_sweep_values, default=[], metavar="1024,2048,...",
                   help="after the sections, the kernels section once per tokens-per-rank value "
                        "(at --num-sms)")
    p.add_argument("--device-timeout", type=float, default=20.0,
                   help="timeout_s of our Group: a device-side wait fails after this long")
    p.add_argument("--section-timeout", type=float, default=75.0,
                   help="seconds one section (or sweep point) may take before its processes are "
                        "killed")
    p.add_argument("--time-budget", type=float, default=170.0,
                   help="seconds for the whole bench; later sections and sweep points get what "
                        "is left")
    p.add_argument("--json", default=None, help="write all results here")
    p.add_argument("--plot", default=None,
                   help="PNG of the sweeps (needs matplotlib); default: the --json path with .png")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and an empty table, start no process")
    args = p.parse_args(argv)

    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backend is None:
        args.backend = "cuda" if args.device == "cuda" else "torch"
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    args.sections = [s for s in args.sections.split(",") if s]
    args.megatron_dispatchers = [d for d in args.megatron_dispatchers.split(",") if d]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {SECTIONS}")
    if args.nproc < 1:
        p.error("--nproc must be >= 1")
    if args.experts % args.nproc:
        p.error(f"--experts ({args.experts}) must be a multiple of the process count "
                f"({args.nproc})")
    if not 1 <= args.topk <= args.experts:
        p.error("--topk must be in [1, --experts]")
    if min(args.iters, args.rotate, args.tokens, args.hidden) < 1 or args.warmup < 0:
        p.error("--iters, --rotate, --tokens, --hidden must be >= 1 and --warmup >= 0")
    if args.staging_chunk_tokens < 0:
        p.error("--staging-chunk-tokens must be >= 0 (0: the library's choice)")
    if args.staging_depth < 0 or args.staging_depth == 1:
        p.error("--staging-depth must be 0 (the library's choice) or >= 2")
    if args.ranks_per_node < 0 or (args.ranks_per_node and args.nproc % args.ranks_per_node):
        p.error(f"--ranks-per-node must be 0 or a divisor of the process count ({args.nproc})")
    if "all" in args.sweep_tokens:
        p.error("--sweep-tokens takes numbers only")
    if "all" in args.sweep_sms:
        # The reference backend has no SM budget: on cpu, 'all' stands for the cores.
        every = (torch.cuda.get_device_properties(0).multi_processor_count
                 if args.device == "cuda" else os.cpu_count())
        args.sweep_sms = [every if v == "all" else v for v in args.sweep_sms]
    sweeping = bool(args.sweep_sms or args.sweep_tokens)
    if args.plot and not sweeping:
        p.error("--plot needs --sweep-tokens or --sweep-sms")
    if args.plot is None and args.json and sweeping:
        args.plot = os.path.splitext(args.json)[0] + ".png"
    if args.recv_mode == "capacity" and args.capacity_factor is None:
        # Random routing is balanced in expectation; this leaves room for its spread.
        args.capacity_factor = 1.5
    return args


# ------------------------------------------------------------------------------------------------
# parent: start one set of processes per section, collect, summarize


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_section(section: str, args: argparse.Namespace, deadline_s: float) -> dict:
    """Starts ``args.nproc`` workers for one section; returns their messages and exit status."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, name=f"bench-{section}-{rank}",
                         args=(rank, args.nproc, section, vars(args), port, messages))
             for rank in range(args.nproc)]
    started = time.monotonic()
    for proc in procs:
        proc.start()
    records, done, timed_out = [], set(), False
    first_exit = None  # when the first worker died without finishing
    while len(done) < len(procs):
        try:
            msg = messages.get(timeout=0.5)
        except queue_module.Empty:
            msg = None
        if msg is not None:
            if msg.get("kind") == "done":
                done.add(msg["rank"])
            else:
                records.append(msg)
            continue
        now = time.monotonic()
        if now - started > deadline_s:
            timed_out = True
            break
        crashed = [p for i, p in enumerate(procs) if i not in done and p.exitcode is not None]
        if crashed and first_exit is None:
            first_exit = now
        # Peers of a dead rank wait in a collective that never completes: give them a moment
        # to report on their own, then stop waiting.
        if first_exit is not None and now - first_exit > 10.0:
            break
    exit_by = time.monotonic() + EXIT_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, exit_by - time.monotonic()))
    killed = []
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
            killed.append(rank)
    while True:  # messages sent just before the end
        try:
            msg = messages.get(timeout=0.2)
        except queue_module.Empty:
            break
        if msg.get("kind") != "done":
            records.append(msg)
    return {"records": records, "exit_codes": [p.exitcode for p in procs], "killed": killed,
            "timed_out": timed_out, "wall_s": round(time.monotonic() - started, 1)}


def _summarize_times(per_rank: dict[int, list[float]]) -> dict:
    """Per iteration the slowest rank counts (a collective is done when its last rank is)."""
    ranks = sorted(per_rank)
    n = min(len(per_rank[r]) for r in ranks)
    slowest = [max(per_rank[r][i] for r in ranks) for i in range(n)]
    return {
        "median_ms": statistics.median(slowest),
        "min_ms": min(slowest),
        "p90_ms": sorted(slowest)[min(n - 1, math.ceil(0.9 * n) - 1)],
        "iters": n,
        "per_rank_median_ms": {str(r): statistics.median(per_rank[r]) for r in ranks},
    }


def _collect(records: list[dict]) -> tuple[dict, list, dict, dict]:
    """Groups the workers' records by item: times of all ranks side by side, byte counts
    averaged over ranks, bandwidth = bytes per rank / median time."""
    items: dict[str, dict] = {}
    errors, info, checks = [], {}, {}
    for rec in records:
        if rec["kind"] == "error":
            errors.append({k: rec[k] for k in ("section", "item", "rank", "error")})
        elif rec["kind"] == "info":
            info.setdefault(rec["section"], {})[str(rec["rank"])] = rec["data"]
        elif rec["kind"] == "check":
            checks.setdefault(rec["item"], {})[str(rec["rank"])] = rec["value"]
        elif rec["kind"] == "times":
            entry = items.setdefault(rec["item"], {"times": {}, "extra": {}})
            entry["times"][rec["rank"]] = rec["times_ms"]
            for key, value in rec.get("extra", {}).items():
                entry["extra"].setdefault(key, {})[rec["rank"]] = value
    out = {}
    for name, entry in items.items():
        summary = _summarize_times(entry["times"])
        for key, per_rank in entry["extra"].items():
            values = list(per_rank.values())
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                summary[key] = sum(values) / len(values)
            else:
                summary[key] = {str(r): v for r, v in per_rank.items()}
        seconds = summary["median_ms"] * 1e-3
        for key, label in (("phys_bytes", "phys_GBps"), ("logical_bytes", "logical_GBps"),
                           ("hbm_bytes", "hbm_GBps")):
            if isinstance(summary.get(key), float) and seconds > 0:
                summary[label] = summary[key] / seconds / 1e9
        out[name] = summary
    return out, errors, info, checks


def source_version() -> dict:
    """What code ran: ``git describe --dirty`` of the tree (a copy of the tree may carry an older
    .git: "-dirty" then says the files differ from that commit) and a SHA-256 over the library's
    sources (csrc/, the package's .py files), which names the code whatever the .git says."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    try:
        git = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device copy of the tree may have no .git
        git = None
    digest = hashlib.sha256()
    paths = [os.path.join(d, f) for top in (os.path.join(root, "csrc"), here)
             for d, _, files in os.walk(top) for f in files
             if f.endswith((".py", ".cu", ".cuh", ".cc", ".h"))]
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return {"git": git, "sources_sha256": digest.hexdigest()[:16]}


def _fmt(value, spec: str) -> str:
    """``value`` formatted, or a dash of the same width when there is none."""
    if isinstance(value, (int, float)):
        return format(value, spec)
    return "-".rjust(int(spec.split(".")[0]))


# The ceilings that the floors divide by (module doc), first found first.
FLOOR_CEILINGS = {
    "hbm": ("HBM copy, read+write (per GPU)",),
    "link": ("peer copy, all GPUs at once (per GPU)", "peer copy GPU0->GPU1 (copy engine)"),
}


def add_floors(result: dict) -> None:
    """Sets ``floor_us`` and ``floor_pct`` on every kernels item (main section and sweep points)
    that carries ``hbm_bytes``, from the run's ceilings (module doc)."""
    ceilings = result.get("ceilings") or {}
    rates = {}
    for kind, names in FLOOR_CEILINGS.items():
        found = [ceilings[n]["phys_GBps"] for n in names if ceilings.get(n, {}).get("phys_GBps")]
        rates[kind] = found[0] if found else None
    if rates["hbm"] is None:
        return
    items = [result.get("kernels") or {}] + [point["items"] for point in result["sweeps"]]
    for row in (row for group in items for row in group.values()):
        if not isinstance(row.get("hbm_bytes"), float) or not row.get("median_ms"):
            continue
        floor_us = row["hbm_bytes"] / rates["hbm"] / 1e3
        if rates["link"] and isinstance(row.get("phys_bytes"), float):
            floor_us = max(floor_us, row["phys_bytes"] / rates["link"] / 1e3)
        row["floor_us"] = floor_us
        row["floor_pct"] = 100.0 * floor_us / (row["median_ms"] * 1e3)


def format_table(result: dict) -> str:
    """The short table printed last (the device reply carries only the tail)."""
    meta, shape = result["meta"], result["shape"]
    lines = [
        f"{TABLE_MARKER}: {meta.get('gpu_count', '?')} x {meta.get('device_name', '?')}, "
        f"torch {meta.get('torch')}, NCCL {meta.get('nccl')}, backend {shape['backend']}, "
        f"{shape['recv_mode']} mode",
        f"shape: {shape['tokens']} tokens/rank x {shape['hidden']} hidden x top-{shape['topk']}"
        f" x {shape['experts']} experts, {shape['dtype']}, {shape['num_sms']} SMs, "
        f"{shape['ranks']} ranks"
        + (f", staging chunks of {shape['staging_chunk_tokens']} tokens"
           if shape.get("staging_chunk_tokens") else "")
        + (f", staging depth {shape['staging_depth']}" if shape.get("staging_depth") else "")
        + (f", emulated nodes of {shape['ranks_per_node']} rank(s) (rail: NCCL send/receive)"
           if shape.get("ranks_per_node") else "")
        + "; medians of per-iteration slowest rank",
    ]
    if result.get("note"):
        lines.append(result["note"])
    ceil = result.get("ceilings", {})
    if ceil:
        lines.append(f"{'ceiling':38s} {'time_us':>9s} {'GB/s':>9s}")
        for name, row in ceil.items():
            lines.append(f"{name:38s} {_fmt(row['median_ms'] * 1e3, '9.1f')} "
                         f"{_fmt(row.get('phys_GBps'), '9.1f')}")
    kern = result.get("kernels", {})
    if kern:
        lines.append(f"{'ours (' + shape['backend'] + ')':38s} {'time_us':>9s} {'phys GB/s':>9s} "
                     f"{'logic GB/s':>10s} {'floor_us':>9s} {'floor %':>7s}")
        for name, row in kern.items():
            lines.append(f"{name:38s} {_fmt(row['median_ms'] * 1e3, '9.1f')} "
                         f"{_fmt(row.get('phys_GBps'), '9.1f')} "
                         f"{_fmt(row.get('logical_GBps'), '10.1f')} "
                         f"{_fmt(row.get('floor_us'), '9.1f')} {_fmt(row.get('floor_pct'), '7.0f')}")
    for name, per_rank in result.get("checks", {}).items():
        values = ", ".join(f"r{rank} {value}" for rank, value in sorted(per_rank.items()))
        lines.append(f"check {name}: {values}")
    meg = result.get("megatron", {})
    if meg:
        lines.append(f"{'megatron dispatcher':24s} {'dispatch_us':>12s} {'combine_us':>12s} "
                     f"{'fwd+bwd_ms':>12s} {'expert_ms':>10s}")
        for disp in sorted({name.split(".")[0] for name in meg}):
            def cell(op, scale, spec):
                row = meg.get(f"{disp}.{op}")
                return _fmt(row["median_ms"] * scale, spec) if row else "-"
            lines.append(f"{disp:24s} {cell('dispatch', 1e3, '12.0f')} "
                         f"{cell('combine', 1e3, '12.0f')} {cell('fwd_bwd', 1.0, '12.2f')} "
                         f"{cell('expert_fwd_bwd', 1.0, '10.2f')}")
    if result.get("sweeps"):
        lines.append(f"{'sweep, kernel mode: tokens':>26s} {'SMs':>4s} {'dispatch_us':>11s} "
                     f"{'phys GB/s':>9s} {'logic GB/s':>10s} {'floor %':>7s} {'combine_us':>11s} "
                     f"{'phys GB/s':>9s} {'logic GB/s':>10s} {'floor %':>7s}")
    for point in result.get("sweeps", []):
        cells = []
        for op in ("dispatch", "combine"):
            row = point["items"].get(f"{op} (kernel)", {})
            cells += [_fmt(row["median_ms"] * 1e3 if row else None, "11.1f"),
                      _fmt(row.get("phys_GBps"), "9.1f"), _fmt(row.get("logical_GBps"), "10.1f"),
                      _fmt(row.get("floor_pct"), "7.0f")]
        # The sanity checks of every point are in the JSON; a failed one is flagged here.
        bad = any("MISMATCH" in str(value) for per_rank in point["checks"].values()
                  for value in per_rank.values())
        lines.append(f"{point['tokens']:26d} {point['num_sms']:4d} {' '.join(cells)}"
                     + ("  check MISMATCH" if bad else ""))
    for err in result.get("errors", []):
        first_line = (err["error"] or "").strip().splitlines()[:1] or [""]
        lines.append(f"ERROR {err['section']}/{err['item']} rank {err['rank']}: "
                     f"{first_line[0][:160]}")
    return "\n".join(lines)


def _cpu_note(args: argparse.Namespace) -> str:
    """One line for a CPU run: what it measured, what it left out and why."""
    measured = [f"megatron ({', '.join(args.megatron_dispatchers)})" if s == "megatron" else s
                for s in args.sections]
    if args.sweep_tokens or args.sweep_sms:
        measured.append(f"a kernels sweep of {len(_sweep_points(args))} points")
    skipped = []
    if "ceilings" not in args.sections:
        skipped.append("ceilings (HBM/peer copies and NCCL all_to_all: GPU hardware)")
    others = [d for d in ("alltoall", "allgather") if d not in args.megatron_dispatchers]
    if "megatron" in args.sections and others:
        skipped.append(f"Megatron's {'/'.join(others)} (GPU comparisons; alltoall needs CUDA "
                       f"streams)")
    return (f"cpu: measured {', '.join(measured) or 'nothing'} with the {args.backend} backend "
            f"on {args.nproc} gloo processes; skipped {' and '.join(skipped) or 'nothing'}; "
            f"CPU times check that the code runs, not GPU speed")


def _sweep_points(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(tokens, SMs) of every sweep point: the tokens sweep at --num-sms, the SM sweep at
    --tokens; a point of both runs once."""
    points = [(tokens, args.num_sms) for tokens in args.sweep_tokens]
    points += [(args.tokens, num_sms) for num_sms in args.sweep_sms]
    return list(dict.fromkeys(points))


def _run_into(result: dict, label: str, section: str, args: argparse.Namespace,
              budget_end: float) -> tuple[dict, dict]:
    """Runs ``section`` within what is left of the budget, records its run, errors and device
    info in ``result`` under ``label``, and returns its items and checks (empty if skipped)."""
    left = budget_end - time.monotonic()
    if left < 10:
        result["errors"].append({"section": label, "item": "-", "rank": "-",
                                 "error": "skipped: --time-budget spent"})
        return {}, {}
    run = _run_section(section, args, min(args.section_timeout, left))
    items, errors, info, checks = _collect(run.pop("records"))
    result["sections"][label] = run
    for err in errors:  # a sweep point's errors name the point
        err["section"] = label
    result["errors"].extend(errors)
    for rank_info in info.get(section, {}).values():
        for key, value in rank_info.items():
            result["meta"].setdefault(key, value)
    died = [rank for rank, code in enumerate(run["exit_codes"]) if code != 0]
    if run["timed_out"] or died:
        result["errors"].append({
            "section": label, "item": "-", "rank": "-",
            "error": f"section ended after {run['wall_s']} s: timed out {run['timed_out']}, "
                     f"ranks killed {run['killed']}, exit codes {run['exit_codes']}"})
    return items, checks


def sweep_series(result: dict) -> "list[tuple[str, list]]":
    """The plot's panels: (x label, [(x, kernels items)] in x order) for the tokens sweep and/or
    the SMs sweep. The kernels section, when it ran, is the point (--tokens, --num-sms) of both."""
    shape, args = result["shape"], result["args"]
    base = [(shape["tokens"], shape["num_sms"], result["kernels"])] if result.get("kernels") else []
    points = base + [(p["tokens"], p["num_sms"], p["items"]) for p in result["sweeps"]]
    panels = []
    if args["sweep_tokens"]:
        by_tokens = {t: items for t, sms, items in points if sms == shape["num_sms"]}
        panels.append(("tokens per rank", sorted(by_tokens.items())))
    if args["sweep_sms"]:
        by_sms = {sms: items for t, sms, items in points if t == shape["tokens"]}
        panels.append(("SMs", sorted(by_sms.items())))
    return panels


def write_plot(result: dict, path: str) -> str:
    """PNG of the sweeps: kernel-mode time and the physical and HBM bandwidth of dispatch and
    combine against tokens per rank and/or SMs, with the ceilings of the same run as horizontal
    lines.
    Returns a line saying what was written, or why nothing was."""
    try:
        import matplotlib
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib); {path} not written"
    matplotlib.use("Agg")  # benchmark hosts have no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    shape = result["shape"]
    panels = sweep_series(result)
    ceilings = {name: row["phys_GBps"] for name, row in result.get("ceilings", {}).items()
                if row.get("phys_GBps")}
    fig, axes = plt.subplots(2, len(panels), figsize=(7 * len(panels), 8), squeeze=False)
    for col, (xlabel, points) in enumerate(panels):
        time_ax, bw_ax = axes[0][col], axes[1][col]
        xs = sorted(x for x, _ in points)
        for op in ("dispatch", "combine"):
            rows = sorted((x, items[f"{op} (kernel)"]) for x, items in points
                          if f"{op} (kernel)" in items)
            time_ax.plot([x for x, _ in rows], [row["median_ms"] * 1e3 for _, row in rows],
                         marker="o", label=op)
            line, = bw_ax.plot([x for x, _ in rows],
                               [row.get("phys_GBps") or math.nan for _, row in rows],
                               marker="o", label=f"{op}, physical")
            bw_ax.plot([x for x, _ in rows], [row.get("hbm_GBps", math.nan) for _, row in rows],
                       marker="s", linestyle=":", color=line.get_color(),
                       label=f"{op}, HBM (tokens + rows once)")
        for i, (name, gbps) in enumerate(ceilings.items()):
            bw_ax.axhline(gbps, color=f"C{2 + i}", linestyle="--", linewidth=1,
                          label=f"{name}: {gbps:.0f}")
        time_ax.set_ylabel("kernel time (us)")
        bw_ax.set_ylabel("GB/s per rank")
        # The ceilings span HBM (TB/s) to one link (tens of GB/s).
        bw_ax.set_yscale("log")
        for ax in (time_ax, bw_ax):
            if xlabel == "tokens per rank":
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])  # the swept values, not powers of 2
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    meta = result["meta"]
    fig.suptitle(f"{shape['ranks']} x {meta.get('device_name', '?')}, backend {shape['backend']}, "
                 f"kernel mode\n{shape['hidden']} hidden, top-{shape['topk']} of "
                 f"{shape['experts']} experts, {shape['dtype']}; {shape['tokens']} tokens/rank "
                 f"and {shape['num_sms']} SMs where not swept", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def main(argv=None) -> int:
    os.environ.update(MULTICAST_OFF_ENV)
    args = parse_args(argv)
    shape = {"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk,
             "experts": args.experts, "dtype": args.dtype, "num_sms": args.num_sms,
             "ranks": args.nproc, "backend": args.backend, "recv_mode": args.recv_mode,
             "capacity_factor": args.capacity_factor,
             "staging_chunk_tokens": args.staging_chunk_tokens,
             "staging_depth": args.staging_depth,
             "ranks_per_node": args.ranks_per_node}
    import torch

    result = {
        "meta": {"torch": torch.__version__, "python": sys.version.split()[0],
                 "source": source_version(), "device": args.device,
                 "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "env": {k: os.environ.get(k) for k in MULTICAST_OFF_ENV}},
        "shape": shape, "args": {k: v for k, v in vars(args).items()},
        "sections": {}, "errors": [], "checks": {}, "sweeps": [],
    }
    if args.device == "cpu":
        result["note"] = _cpu_note(args)
    if args.dry_run:
        print(f"plan: sections {args.sections} on {args.nproc} {args.device} processes, "
              f"{args.warmup} warm-up + {args.iters} timed iterations over {args.rotate} input "
              f"sets; megatron dispatchers {args.megatron_dispatchers}; sweep points "
              f"(tokens, SMs) {_sweep_points(args)}")
        print(format_table(result))
        return 0

    budget_end = time.monotonic() + args.time_budget
    for section in args.sections:
        result[section], checks = _run_into(result, section, section, args, budget_end)
        result["checks"].update(checks)
    # Each point is a fresh run of the kernels section, so one that fails costs only itself.
    for tokens, num_sms in _sweep_points(args):
        point = argparse.Namespace(**{**vars(args), "tokens": tokens, "num_sms": num_sms})
        items, checks = _run_into(result, f"kernels({tokens} tokens, {num_sms} SMs)", "kernels",
                                  point, budget_end)
        result["sweeps"].append({"tokens": tokens, "num_sms": num_sms, "items": items,
                                 "checks": checks})
    add_floors(result)
    table = format_table(result)
    result["table"] = table
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(table, flush=True)
    if args.plot:  # last: the table and the JSON are out whatever the plot does
        print(write_plot(result, args.plot), flush=True)
    measured = any(result.get(s) for s in SECTIONS) or any(p["items"] for p in result["sweeps"])
    return 0 if measured and not result["errors"] else 1


# ------------------------------------------------------------------------------------------------
# workers


class _Rank:
    """What one worker knows: its rank, device, process groups, and how to report and time."""

    def __init__(self, rank: int, world: int, section: str, args: argparse.Namespace,
                 messages):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world, self.section, self.args = rank, world, section, args
        self.messages = messages
        self.cuda = args.device == "cuda"
        self.dtype = getattr(torch, DTYPES[args.dtype])
        self.elt = torch.empty((), dtype=self.dtype).element_size()
        if self.cuda:
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
        timeout = datetime.timedelta(seconds=max(30.0, args.section_timeout))
        dist.init_process_group("nccl" if self.cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=self.device if self.cuda else None)
        # Host-side agreement (barriers, small metadata) goes over gloo so it never queues
        # behind device work.
        self.host_group = dist.new_group(backend="gloo", timeout=timeout)
        self._align_buf = torch.ones(1, device=self.device)

    # -- reporting --------------------------------------------------------------------------------
    def emit(self, kind: str, item: str = "-", **fields) -> None:
        self.messages.put({"kind": kind, "section": self.section, "item": item,
                           "rank": self.rank, **fields})

    def attempt(self, item: str, fn: Callable[[], None]) -> bool:
        """Runs one measured item; an exception is reported and the section goes on."""
        try:
            fn()
            return True
        except Exception as exc:  # noqa: BLE001 - one item's failure must not lose the others
            tb = traceback.format_exc()
            print(f"[bench rank {self.rank}] {self.section}/{item} failed:\n{tb}",
                  file=sys.stderr, flush=True)
            self.emit("error", item, error=f"{type(exc).__name__}: {exc}"[:2000])
            return False

    # -- timing -----------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def host_barrier(self) -> None:
        self.dist.barrier(group=self.host_group)

    def _align_devices(self) -> None:
        """Lines the GPUs up in stream order: the next op starts when the slowest rank arrives."""
        if self.world > 1:
            self.dist.all_reduce(self._align_buf)

    def measure(self, item: str, fn: Callable[[int], object], *, mode: str,
                setup: Optional[Callable[[int], None]] = None,
                after: Optional[Callable[[int, object], None]] = None,
                collective: bool = True, extra: Optional[dict] = None) -> None:
        """Times ``fn(i)`` (i = iteration; inputs rotate on i) and reports per-iteration ms.

        ``mode='kernel'``: device time only (see the module doc); ``mode='e2e'``: from an idle
        GPU and lined-up hosts to the end of the device work. ``setup``/``after`` run outside
        the timed region. ``collective=False`` for single-GPU work (no cross-rank alignment).
        """
        args, torch = self.args, self.torch
        times = []
        pending = []  # kernel mode: events read once at the end, so the host never stalls
        for i in range(args.warmup + args.iters):
            if setup is not None:
                setup(i)
            if mode == "e2e" or not self.cuda:
                self.sync()
                if collective:
                    self.host_barrier()
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                if mode == "kernel":
                    torch.cuda._sleep(HEAD_START_CYCLES)
                    if collective:
                        self._align_devices()
                start.record()
                out = fn(i)
                end.record()
                if i >= args.warmup:
                    pending.append((start, end))
                if mode == "e2e":
                    end.synchronize()
            else:
                t0 = time.perf_counter()
                out = fn(i)
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            if after is not None:
                after(i, out)
            del out
        self.sync()
        times.extend(start.elapsed_time(end) for start, end in pending)
        self.emit("times", item, times_ms=times, extra=extra or {})

    def check(self, name: str, value) -> None:
        """A correctness note next to the numbers (not a test: tests/gpu is the test)."""
        self.emit("check", name, value=value)


def _worker(rank: int, world: int, section: str, args_dict: dict, port: int, messages) -> None:
    os.environ.update(MULTICAST_OFF_ENV)  # also when a caller's environment lacked them
    args = argparse.Namespace(**args_dict, port=port)
    me = None
    try:
        me = _Rank(rank, world, section, args, messages)
        me.emit("info", data=_device_info(me))
        {"ceilings": _section_ceilings, "kernels": _section_kernels,
         "megatron": _section_megatron}[section](me)
    except Exception as exc:  # noqa: BLE001 - set-up failures are reported like item failures
        traceback.print_exc()
        messages.put({"kind": "error", "section": section, "item": "setup", "rank": rank,
                      "error": f"{type(exc).__name__}: {exc}"[:2000]})
    finally:
        messages.put({"kind": "done", "section": section, "rank": rank})
        # The parent kills a rank still running EXIT_GRACE_S after the section ended: say where
        # it was stuck first (every thread's stack on stderr, in the bench log).
        faulthandler.dump_traceback_later(EXIT_GRACE_S / 2, exit=False)
        if me is not None:
            try:
                me.sync()
                me.dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken communicator at exit changes nothing
                pass
        messages.close()
        messages.join_thread()
        # Past the cleanup: interpreter and CUDA teardown may outlast the timer (the Megatron
        # section's did: a dump of "<no Python frame>"), and a stack of it says nothing.
        faulthandler.cancel_dump_traceback_later()


def _device_info(me: _Rank) -> dict:
    torch = me.torch
    info = {"torch": torch.__version__}
    try:
        version = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    except Exception:  # noqa: BLE001 - a CPU-only torch has no NCCL
        info["nccl"] = None
    if me.cuda:
        props = torch.cuda.get_device_properties(me.device)
        info.update(device_name=torch.cuda.get_device_name(me.device),
                    gpu_count=torch.cuda.device_count(), sm_count=props.multi_processor_count,
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda_runtime=torch.version.cuda)
    else:
        info.update(device_name="cpu", gpu_count=0)
    return info


# ------------------------------------------------------------------------------------------------
# section: ceilings


_copy_kernel = None


def _persistent_copy_kernel():
    """A Triton copy whose programs loop over 16 KB blocks, so the grid size is the SM count."""
    global _copy_kernel
    if _copy_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def persistent_copy(src, dst, n_blocks, BLOCK: tl.constexpr):
            for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
                offs = b * BLOCK + tl.arange(0, BLOCK)
                tl.store(dst + offs, tl.load(src + offs))

        _copy_kernel = persistent_copy
    return _copy_kernel


def _section_ceilings(me: _Rank) -> None:
    torch, args = me.torch, me.args
    nbytes = args.copy_mib * 2**20

    def random_bytes(device) -> "torch.Tensor":
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)

    def hbm_copy():
        src, dst = random_bytes(me.device), torch.empty(nbytes, dtype=torch.uint8,
                                                        device=me.device)
        me.measure("HBM copy, read+write (per GPU)", lambda i: dst.copy_(src), mode="kernel",
                   collective=False, extra={"phys_bytes": 2.0 * nbytes})

    me.attempt("hbm_copy", hbm_copy)

    def hbm_copy_sm_budget():
        # The same copy from only num_sms SMs (one persistent program per SM): the HBM rate our
        # kernels can reach inside their SM budget.
        src = random_bytes(me.device).view(torch.int32)
        dst = torch.empty_like(src)
        copy = _persistent_copy_kernel()
        block = 4096  # int32 elements: 16 KB per program step
        grid = (args.num_sms,)
        me.measure(f"HBM copy, read+write, {args.num_sms} SMs (per GPU)",
                   lambda i: copy[grid](src, dst, src.numel() // block, BLOCK=block, num_warps=16),
                   mode="kernel", collective=False, extra={"phys_bytes": 2.0 * nbytes})

    if me.cuda:
        me.attempt("hbm_copy_sm_budget", hbm_copy_sm_budget)

    def peer_copy(all_ranks: bool):
        # The copy engine between two GPUs (cross-device copy_ is a peer memcpy in torch).
        peer = torch.device("cuda", (me.rank + 1) % me.world)
        active = all_ranks or me.rank == 0
        if active:
            src, dst = random_bytes(me.device), torch.empty(nbytes, dtype=torch.uint8, device=peer)
        name = ("peer copy, all GPUs at once (per GPU)" if all_ranks
                else "peer copy GPU0->GPU1 (copy engine)")
        if active:
            me.measure(name, lambda i: dst.copy_(src), mode="kernel", collective=all_ranks,
                       extra={"phys_bytes": float(nbytes)})
        me.host_barrier()

    if me.cuda and me.world > 1 and torch.cuda.device_count() >= 2:
        me.attempt("peer_copy_0to1", lambda: peer_copy(False))
        me.attempt("peer_copy_all", lambda: peer_copy(True))

    def all_to_all(rows_per_peer: int, label: str):
        total = rows_per_peer * me.world
        send = torch.randn(total, args.hidden, device=me.device).to(me.dtype)
        recv = torch.empty_like(send)
        remote = rows_per_peer * (me.world - 1) * args.hidden * me.elt
        me.measure(f"all_to_all_single {total} rows ({label})",
                   lambda i: me.dist.all_to_all_single(recv, send), mode="kernel",
                   extra={"phys_bytes": float(remote)})

    if me.world > 1:
        # T*K rows in all: the anchor's size; T rows per peer: the bytes a dispatch moves.
        me.attempt("a2a_TK", lambda: all_to_all(
            max(1, args.tokens * args.topk // me.world), "T*K"))
        me.attempt("a2a_T", lambda: all_to_all(args.tokens, "T per peer"))


# ------------------------------------------------------------------------------------------------
# section: our kernels through Group / Handle


def _random_topk(me: _Rank, set_index: int) -> "torch.Tensor":
    """Uniform random distinct experts per token; a fresh draw per (input set, rank)."""
    torch, args = me.torch, me.args
    gen = torch.Generator(device=me.device)
    gen.manual_seed(1_000_003 * (set_index + 1) + me.rank)
    scores = torch.rand(args.tokens, args.experts, generator=gen, device=me.device)
    return scores.topk(args.topk, dim=1).indices


def _random_tokens(me: _Rank, rows: int, seed: int) -> "torch.Tensor":
    torch = me.torch
    gen = torch.Generator(device=me.device)
    gen.manual_seed(seed)
    return torch.randn(rows, me.args.hidden, generator=gen, device=me.device).to(me.dtype)


def _pair_counts(me: _Rank, topk: "torch.Tensor") -> list[list[int]]:
    """M[s][d]: tokens of rank s with at least one expert on rank d, for every (s, d)."""
    torch = me.torch
    per_rank = me.args.experts // me.world
    hits = torch.zeros(topk.shape[0], me.world, dtype=torch.bool, device=topk.device)
    valid = topk >= 0
    hits.scatter_(1, torch.where(valid, topk // per_rank, 0), valid)
    mine = hits.sum(0).tolist()
    everyone = [None] * me.world
    me.dist.all_gather_object(everyone, mine, group=me.host_group)
    return everyone


def _traffic_bytes(me: _Rank, counts: list[list[int]], rows: int) -> dict:
    """Per-rank bytes of one dispatch/combine under both conventions, and what HBM must move at
    the least: this rank's tokens once and its ``rows`` expert-major rows once (module doc)."""
    row = me.args.hidden * me.elt
    r = me.rank
    return {
        "dispatch_phys": sum(counts[r][d] for d in range(me.world) if d != r) * row,
        "combine_phys": sum(counts[s][r] for s in range(me.world) if s != r) * row,
        "logical": sum(counts[s][r] for s in range(me.world)) * row,
        "hbm": (me.args.tokens + rows) * row,
    }


def _section_kernels(me: _Rank) -> None:
    torch, args = me.torch, me.args
    from .api import Group

    group = Group(num_experts=args.experts, hidden=args.hidden, max_tokens_per_rank=args.tokens,
                  max_topk=args.topk, dtype=me.dtype, backend=args.backend, device=me.device,
                  recv_mode=args.recv_mode, capacity_factor=args.capacity_factor,
                  num_sms=args.num_sms, timeout_s=args.device_timeout,
                  staging_chunk_tokens=args.staging_chunk_tokens,
                  staging_depth=args.staging_depth,
                  ranks_per_node=args.ranks_per_node)
    me.emit("info", data={"backend_resolved": group.backend_name})
    sets = []
    for s in range(args.rotate):
        topk = _random_topk(me, s)
        gen = torch.Generator(device=me.device)
        gen.manual_seed(7 * s + me.rank)
        probs = torch.rand(args.tokens, args.topk, generator=gen, device=me.device).softmax(-1)
        x = _random_tokens(me, args.tokens, seed=100 + 10 * s + me.rank)
        sets.append({"topk": topk, "probs": probs, "x": x,
                     "bytes": _traffic_bytes(me, _pair_counts(me, topk),
                                             _expected_rows(me, topk))})
    mean = lambda key: sum(st["bytes"][key] for st in sets) / len(sets)  # noqa: E731
    dispatch_bytes = {"phys_bytes": mean("dispatch_phys"), "logical_bytes": mean("logical")}
    combine_bytes = {"phys_bytes": mean("combine_phys"), "logical_bytes": mean("logical")}
    # The expert-major ops' floors (module doc); the rank-major lower bound moves fewer rows.
    floor_bytes = {"hbm_bytes": mean("hbm")}
    pick = lambda i: sets[i % len(sets)]  # noqa: E731

    def handles_and_outputs():
        for s, st in enumerate(sets):
            st["handle"] = group.create_handle(st["topk"])
            rows = st["handle"].num_recv_tokens
            st["expert_out"] = _random_tokens(me, rows, seed=500 + 10 * s + me.rank)

    if not me.attempt("create_handles", handles_and_outputs):
        return

    def check_roundtrip():
        # combine(dispatch(x)) is the unweighted sum over the token's K routed rows: K * x
        # (up to rounding of the per-rank partials). Also the counts against the routing.
        st = sets[0]
        handle = st["handle"]
        recv_x, recv_probs = handle.dispatch(st["x"], st["probs"])
        y = handle.combine(recv_x)
        ref = st["x"].double() * args.topk
        err = ((y.double() - ref).norm() / ref.norm()).item()
        me.check("combine(dispatch(x)) vs K*x, rel err", f"{err:.2e}")
        counts = handle.tokens_per_expert.sum().item()
        expected = _expected_rows(me, st["topk"])
        ok = (args.recv_mode == "capacity" or handle.num_recv_tokens == expected) and \
            counts == expected and recv_probs is not None
        me.check("rows / sum(tokens_per_expert) / expected",
                 f"{'ok' if ok else 'MISMATCH'} {handle.num_recv_tokens}/{counts}/{expected}")

    me.attempt("check", check_roundtrip)

    def new_handle(i):
        # Creation plus the exact-mode count read (what a dispatch needs first).
        handle = group.create_handle(pick(i)["topk"])
        handle.num_recv_tokens
        return handle

    def layout():
        for mode in ("kernel", "e2e"):
            me.measure(f"handle: create + count read ({mode})", new_handle, mode=mode,
                       after=lambda i, handle: handle.destroy())

    me.attempt("layout", layout)

    for mode in ("kernel", "e2e"):
        me.attempt(f"dispatch.{mode}", lambda: me.measure(
            f"dispatch ({mode})",
            lambda i: pick(i)["handle"].dispatch(pick(i)["x"], pick(i)["probs"]),
            mode=mode, extra={**dispatch_bytes, **floor_bytes}))
    for mode in ("kernel", "e2e"):
        me.attempt(f"combine.{mode}", lambda: me.measure(
            f"combine ({mode})",
            lambda i: pick(i)["handle"].combine(pick(i)["expert_out"]),
            mode=mode, extra={**combine_bytes, **floor_bytes}))

    def rank_major():
        # DeepEP's layout, as our own lower bound: the same tokens and link bytes, but one row
        # per (token, destination rank) instead of per (token, expert), i.e. a group with one
        # "expert" per rank routed by each token's destination ranks (a K-th of the rows to
        # write and to sum at top-K).
        per_rank = args.experts // me.world
        rm_group = Group(num_experts=me.world, hidden=args.hidden,
                         max_tokens_per_rank=args.tokens, max_topk=min(args.topk, me.world),
                         dtype=me.dtype, backend=args.backend, device=me.device,
                         num_sms=args.num_sms, timeout_s=args.device_timeout,
                         staging_chunk_tokens=args.staging_chunk_tokens,
                         staging_depth=args.staging_depth,
                         ranks_per_node=args.ranks_per_node)
        for s, st in enumerate(sets):
            dest = torch.zeros(args.tokens, me.world, dtype=torch.bool, device=me.device)
            dest.scatter_(1, st["topk"] // per_rank, True)
            st["rm_handle"] = rm_group.create_handle(routing_map=dest)
            st["rm_rows"] = _random_tokens(me, st["rm_handle"].num_recv_tokens,
                                           seed=900 + 10 * s + me.rank)
        try:
            me.measure("dispatch, rank-major (kernel)",
                       lambda i: pick(i)["rm_handle"].dispatch(pick(i)["x"]), mode="kernel",
                       extra=dispatch_bytes)
            me.measure("combine, rank-major (kernel)",
                       lambda i: pick(i)["rm_handle"].combine(pick(i)["rm_rows"]),
                       mode="kernel", extra=combine_bytes)
        finally:
            for st in sets:
                st.pop("rm_handle").destroy()
            rm_group.destroy()

    me.attempt("rank_major", rank_major)
    for st in sets:
        st["handle"].destroy()
    group.destroy()


def _expected_rows(me: _Rank, topk: "torch.Tensor") -> int:
    """Rows this rank receives (docs/design.md §3: one per routed (token, slot) it owns), without
    alignment padding."""
    per_rank = me.args.experts // me.world
    mine = [int(((topk >= 0) & (topk // per_rank == d)).sum()) for d in range(me.world)]
    everyone = [None] * me.world
    me.dist.all_gather_object(everyone, mine, group=me.host_group)
    return sum(counts[me.rank] for counts in everyone)


# ------------------------------------------------------------------------------------------------
# section: Megatron's dispatcher interface, driven as MoELayer drives it


def _megatron_dispatcher(me: _Rank, name: str, pg_collection):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = me.args
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1,
        ffn_hidden_size=args.hidden, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type=name, expert_model_parallel_size=me.world,
        bf16=me.dtype == torch.bfloat16, fp16=me.dtype == torch.float16, params_dtype=me.dtype,
        # Fused permutes need transformer-engine: without it, Megatron's unfused permutes.
        moe_permute_fusion=False, add_bias_linear=False, use_cpu_initialization=not me.cuda)
    local = args.experts // me.world
    indices = list(range(me.rank * local, (me.rank + 1) * local))
    if name == "nccl_ep":
        import megatron_nccl_ep

        megatron_nccl_ep.register()
        from .options import NcclEpOptions

        options = {"backend": args.backend, "recv_mode": args.recv_mode,
                   "num_sms": args.num_sms, "max_tokens_per_rank": args.tokens}
        if args.capacity_factor is not None:
            options["capacity_factor"] = args.capacity_factor
        # The dispatcher reads its plugin options from the config it is built with.
        config.nccl_ep_options = NcclEpOptions(**options)
        cls = megatron_nccl_ep.NcclEpTokenDispatcher
    else:
        from megatron.core.transformer.moe import token_dispatcher as td

        cls = {"alltoall": td.MoEAlltoAllTokenDispatcher,
               "allgather": td.MoEAllGatherTokenDispatcher}[name]
    return cls(local, indices, config, pg_collection=pg_collection)


def _section_megatron(me: _Rank) -> None:
    torch, args = me.torch, me.args
    try:
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection
    except Exception as exc:  # noqa: BLE001
        me.emit("error", "import", error=f"megatron-core does not import: {exc}")
        return
    parallel_state.initialize_model_parallel(expert_model_parallel_size=me.world)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()

    sets = []
    for s in range(args.rotate):
        topk = _random_topk(me, s)
        gen = torch.Generator(device=me.device)
        gen.manual_seed(7 * s + me.rank)
        weights = torch.rand(args.tokens, args.topk, generator=gen, device=me.device).softmax(-1)
        routing_map = torch.zeros(args.tokens, args.experts, dtype=torch.bool, device=me.device)
        routing_map.scatter_(1, topk, True)
        probs = torch.zeros(args.tokens, args.experts, device=me.device).scatter_(1, topk, weights)
        # [sequence, batch, hidden], as MoELayer hands it over
        hidden = _random_tokens(me, args.tokens, 100 + 10 * s + me.rank).unsqueeze(1)
        grad_out = _random_tokens(me, args.tokens, 900 + 10 * s + me.rank).unsqueeze(1)
        sets.append({"routing_map": routing_map, "probs": probs, "hidden": hidden,
                     "grad_out": grad_out})
    pick = lambda i: sets[i % len(sets)]  # noqa: E731

    for name in args.megatron_dispatchers:
        dispatcher = None

        def build():
            nonlocal dispatcher
            dispatcher = _megatron_dispatcher(me, name, pg_collection)

        if not me.attempt(f"{name}.build", build):
            continue
        state = {}

        def leaf_inputs(i):
            st = pick(i)
            state["hidden"] = st["hidden"].detach().requires_grad_(True)
            state["probs"] = st["probs"].detach().requires_grad_(True)

        def dispatch(i):
            st = pick(i)
            h, p = dispatcher.dispatch_preprocess(state["hidden"], st["routing_map"],
                                                  state["probs"])
            h, p = dispatcher.token_dispatch(h, p)
            rows, tokens_per_expert, rows_probs = dispatcher.dispatch_postprocess(h, p)
            return rows, rows_probs

        def expert_stand_in(rows, rows_probs):
            # What the experts would do to the rows at the least: weight them by their prob.
            return rows * rows_probs.unsqueeze(-1).to(rows.dtype)

        def combine(expert_out):
            out = dispatcher.combine_preprocess(expert_out)
            out = dispatcher.token_combine(out)
            return dispatcher.combine_postprocess(out)

        def dispatched_rows(i):
            leaf_inputs(i)
            state["expert_out"] = expert_stand_in(*dispatch(i))

        def fwd_bwd(i):
            out = combine(expert_stand_in(*dispatch(i)))
            out.backward(pick(i)["grad_out"])
            return None

        me.attempt(f"{name}.dispatch", lambda: me.measure(
            f"{name}.dispatch", dispatch, mode="e2e", setup=leaf_inputs))
        me.attempt(f"{name}.combine", lambda: me.measure(
            f"{name}.combine", lambda i: combine(state["expert_out"]), mode="e2e",
            setup=dispatched_rows))
        me.attempt(f"{name}.fwd_bwd", lambda: me.measure(
            f"{name}.fwd_bwd", fwd_bwd, mode="e2e", setup=leaf_inputs))

        # The stand-in expert alone, forward and backward on this dispatcher's rows: the share
        # of fwd+bwd that is torch's work on the rows, the same whichever dispatcher moved them.
        def expert_leaves(i):
            leaf_inputs(i)
            rows, rows_probs = dispatch(i)
            state["rows"] = rows.detach().requires_grad_(True)
            state["rows_probs"] = rows_probs.detach().requires_grad_(True)
            state["grad_rows"] = torch.randn_like(rows)

        def expert_fwd_bwd(i):
            expert_stand_in(state["rows"], state["rows_probs"]).backward(state["grad_rows"])

        me.attempt(f"{name}.expert_fwd_bwd", lambda: me.measure(
            f"{name}.expert_fwd_bwd", expert_fwd_bwd, mode="e2e", setup=expert_leaves))
        state.clear()
        dispatcher = None  # noqa: F841 - drop it (and its handles) before the next one
    if "nccl_ep" in args.megatron_dispatchers:
        from .dispatcher import destroy_groups

        destroy_groups()  # collective, while every rank is still here
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main())
