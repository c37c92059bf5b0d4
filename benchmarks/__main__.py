"""``python -m benchmarks`` (from the repository root): runs the sections, then the sweeps, and
reports.

Each section (``ceilings``, ``kernels``, ``megatron``, ``host``), each team world size, each LL
point, each nodes point and each sweep point runs in its own fresh set of processes with its own
deadline within ``--time-budget``; the table is printed last, after the JSON is written, then the
plot and the markdown.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
import time

from . import (ceilings, dispatchers, experts, host, kernels, ll, markdown, nodes, plot, report,
               sweeps, team)
from .cli import parse_args, sweep_points
from .machine import machine_info
from .runner import run_into

SECTION_FUNCTIONS = {"ceilings": ceilings.section, "kernels": kernels.section,
                     "megatron": dispatchers.section, "experts": experts.section}
# Read and recorded, never set: the GPU script exports what its machines need.
RECORDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING")


def new_result(args, argv: list) -> dict:
    import torch

    env = {k: os.environ.get(k) for k in RECORDED_ENV}
    shape = {"tokens": args.tokens, "hidden": args.hidden, "topk": args.topk,
             "experts": args.experts, "dtype": args.dtype, "num_sms": args.num_sms,
             "ranks": args.nproc, "backend": args.backend, "recv_mode": args.recv_mode,
             "capacity_factor": args.capacity_factor,
             "staging_chunk_tokens": args.staging_chunk_tokens,
             "staging_depth": args.staging_depth, "ranks_per_node": args.ranks_per_node}
    command = shlex.join([os.path.basename(sys.executable), "-m", "benchmarks", *argv])
    result = {
        "meta": {"torch": torch.__version__, "python": sys.version.split()[0],
                 "source": report.source_version(), "device": args.device, "command": command,
                 "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "env": env},
        "shape": shape, "args": dict(vars(args)),
        "sections": {}, "errors": [], "checks": {}, "sweeps": [], "team": [],
    }
    # The machine, read once for every section (a dry run on GPUs touches no GPU).
    if args.device == "cpu" or not args.dry_run:
        result["meta"].update(machine_info(args.device))
    if args.device == "cpu":
        result["note"] = report.cpu_note(args, len(sweep_points(args)))
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    result = new_result(args, argv)
    if args.dry_run:
        print(f"plan: sections {args.sections} on {args.nproc} {args.device} processes, "
              f"{args.warmup} warm-up + {args.iters} timed iterations over {args.rotate} input "
              f"sets; megatron dispatchers {args.megatron_dispatchers}; team sizes "
              f"{args.team_sizes if 'team' in args.sections else []}; nodes shapes "
              f"{args.nodes_shapes if 'nodes' in args.sections else []}; sweep points "
              f"{[sweeps.point_label(*point) for point in sweep_points(args)]}")
        print(report.format_table(result))
        return 0

    budget_end = time.monotonic() + args.time_budget
    for section in args.sections:
        if section == "team":
            team.run(result, args, budget_end)
            continue
        if section == "ll":
            ll.run(result, args, budget_end)
            continue
        if section == "host":
            host.run(result, args, budget_end)
            continue
        if section == "nodes":
            nodes.run(result, args, budget_end)
            continue
        result[section], checks, _ = run_into(result, section, SECTION_FUNCTIONS[section],
                                              args, budget_end)
        result["checks"].update(checks)
    sweeps.run(result, args, budget_end)
    report.add_floors(result)
    table = report.format_table(result)
    result["table"] = table
    if args.json:
        report.write_json(result, args.json)
    print(table, flush=True)
    if args.plot:  # after the table and the JSON: they are out whatever the plot does
        try:
            line = plot.write(result, args.plot)
        except Exception as exc:  # noqa: BLE001 - a plot failure must not lose the markdown
            line = f"no plot: {type(exc).__name__}: {exc}"
        if line.startswith("plot: "):
            result["plot"] = args.plot
        print(line, flush=True)
    if args.markdown:
        markdown.write(result, args.markdown)
        print(f"markdown: {args.markdown}", flush=True)
    measured = (any(result.get(s) for s in (*SECTION_FUNCTIONS, "host"))
                or any(p.get("items") for p in result["sweeps"] + result["team"]
                       + ll.points(result) + nodes.points(result)))
    return 0 if measured and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
