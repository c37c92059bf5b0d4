"""What a run reports: the floors of the kernels' rows, the text table, the JSON, and which
sources ran.

Each dispatch/combine row that carries ``hbm_bytes`` (kernels section and sweep points) gets its
**floor** from the ceilings of the same run: the larger of the HBM floor (``hbm_bytes`` / the HBM
copy's read+write rate) and the link floor (physical bytes / the peer copy's rate, every GPU
copying where measured); "floor %" is floor / time. Without the ceilings section there is no
floor.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

from .ceilings import HBM_COPY, PEER_COPY_ALL, PEER_COPY_ONE
from .sweeps import sweep_mode
from .team import OPS as TEAM_OPS
from .team import PROXY_NOTE

TABLE_MARKER = "== megatron_nccl_ep bench"
HOST_WALL = " (host wall)"  # the item suffix of cpu rows: the table's header says it instead

# The ceilings that the floors divide by, first found first.
FLOOR_CEILINGS = {
    "hbm": (HBM_COPY,),
    "link": (PEER_COPY_ALL, PEER_COPY_ONE),
}


def source_version() -> dict:
    """What code ran: ``git describe --dirty`` of the tree (a copy of the tree may carry an older
    .git: "-dirty" then says the files differ from that commit) and a SHA-256 over the library's
    sources (csrc/, the package's .py files), which names the code whatever the .git says."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(package)
    try:
        git = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device copy of the tree may have no .git
        git = None
    digest = hashlib.sha256()
    paths = [os.path.join(d, f) for top in (os.path.join(root, "csrc"), package)
             for d, _, files in os.walk(top) for f in files
             if f.endswith((".py", ".cu", ".cuh", ".cc", ".h"))]
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return {"git": git, "sources_sha256": digest.hexdigest()[:16]}


def fmt(value, spec: str) -> str:
    """``value`` formatted, or a dash of the same width when there is none."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return "-".rjust(int(spec.split(".")[0] or 1))


def floor_rates(result: dict) -> dict:
    """GB/s of the ceilings the floors divide by ({'hbm': .., 'link': ..}, None where absent)."""
    measured = result.get("ceilings") or {}
    rates = {}
    for kind, names in FLOOR_CEILINGS.items():
        found = [measured[n]["phys_GBps"] for n in names if measured.get(n, {}).get("phys_GBps")]
        rates[kind] = found[0] if found else None
    return rates


def add_floors(result: dict) -> None:
    """Sets ``floor_us`` and ``floor_pct`` on every kernels item (main section and sweep points)
    that carries ``hbm_bytes``, from the run's ceilings (module doc)."""
    rates = floor_rates(result)
    if rates["hbm"] is None:
        return
    groups = [result.get("kernels") or {}] + [point["items"] for point in result["sweeps"]]
    for row in (row for group in groups for row in group.values()):
        if not isinstance(row.get("hbm_bytes"), float) or not row.get("median_ms"):
            continue
        floor_us = row["hbm_bytes"] / rates["hbm"] / 1e3
        if rates["link"] and isinstance(row.get("phys_bytes"), float):
            floor_us = max(floor_us, row["phys_bytes"] / rates["link"] / 1e3)
        row["floor_us"] = floor_us
        row["floor_pct"] = 100.0 * floor_us / (row["median_ms"] * 1e3)


def cpu_note(args, sweep_count: int) -> str:
    """The line a CPU run prints under its header: how it timed, what that means, what it left
    out."""
    measured = [f"megatron ({', '.join(args.megatron_dispatchers)})" if s == "megatron" else s
                for s in args.sections]
    if sweep_count:
        measured.append(f"a kernels sweep of {sweep_count} points")
    skipped = ["ceilings and team (GPU hardware)"]
    others = [d for d in ("alltoall", "allgather") if d not in args.megatron_dispatchers]
    if "megatron" in args.sections and others:
        skipped.append(f"Megatron's {'/'.join(others)} (GPU comparisons; alltoall needs CUDA "
                       f"streams)")
    return (f"host wall time, reference backend ({args.backend}) over gloo, {args.nproc} "
            f"processes: these times show that the code runs, not GPU speed. Measured "
            f"{', '.join(measured) or 'nothing'}; skipped {'; '.join(skipped)}.")


def header_lines(result: dict) -> list:
    meta, shape = result["meta"], result["shape"]
    source = meta.get("source") or {}
    if meta["device"] == "cuda":
        machine = (f"{meta.get('gpu_count', '?')} x {meta.get('device_name', '?')}, torch "
                   f"{meta.get('torch')}, NCCL {meta.get('nccl')}")
        budget = f", {shape['num_sms']} SMs"
    else:
        machine = (f"cpu ({meta.get('cpu_model', '?')}, {meta.get('cpu_count', '?')} cores), "
                   f"torch {meta.get('torch')}")
        budget = ""
    return [
        f"{TABLE_MARKER}: {machine}, backend {shape['backend']}, {shape['recv_mode']} mode, "
        f"sources {source.get('sources_sha256')}",
        f"shape: {shape['tokens']} tokens/rank x {shape['hidden']} hidden x top-{shape['topk']}"
        f" x {shape['experts']} experts, {shape['dtype']}{budget}, {shape['ranks']} ranks"
        + (f", staging chunks of {shape['staging_chunk_tokens']} tokens"
           if shape.get("staging_chunk_tokens") else "")
        + (f", staging depth {shape['staging_depth']}" if shape.get("staging_depth") else "")
        + (f", emulated nodes of {shape['ranks_per_node']} rank(s) (rail: NCCL send/receive)"
           if shape.get("ranks_per_node") else "")
        + "; medians of per-iteration slowest rank",
    ]


def _gpu_sections(result: dict, lines: list) -> None:
    shape = result["shape"]
    ceil = result.get("ceilings") or {}
    if ceil:
        lines.append(f"{'ceiling':38s} {'time_us':>9s} {'GB/s':>9s}")
        for name, row in ceil.items():
            lines.append(f"{name:38s} {fmt(row['median_ms'] * 1e3, '9.1f')} "
                         f"{fmt(row.get('phys_GBps'), '9.1f')}")
    kern = result.get("kernels") or {}
    if kern:
        lines.append(f"{'ours (' + shape['backend'] + ')':38s} {'time_us':>9s} {'phys GB/s':>9s} "
                     f"{'logic GB/s':>10s} {'floor_us':>9s} {'floor %':>7s}")
        for name, row in kern.items():
            lines.append(f"{name:38s} {fmt(row['median_ms'] * 1e3, '9.1f')} "
                         f"{fmt(row.get('phys_GBps'), '9.1f')} "
                         f"{fmt(row.get('logical_GBps'), '10.1f')} "
                         f"{fmt(row.get('floor_us'), '9.1f')} {fmt(row.get('floor_pct'), '7.0f')}")


def _cpu_kernels(result: dict, lines: list) -> None:
    kern = result.get("kernels") or {}
    if kern:
        lines.append(f"{'ours (' + result['shape']['backend'] + '), host wall':38s} "
                     f"{'time_ms':>9s}")
        for name, row in kern.items():
            lines.append(f"{name.replace(HOST_WALL, ''):38s} {fmt(row['median_ms'], '9.2f')}")


def _megatron(result: dict, lines: list, cuda: bool) -> None:
    meg = result.get("megatron") or {}
    if not meg:
        return
    # GPUs: dispatch and combine in us; cpu: everything in ms (host wall times are that long).
    small, small_unit = (1e3, "us") if cuda else (1.0, "ms")
    lines.append(f"{'megatron dispatcher' + ('' if cuda else ', host wall'):30s} "
                 f"{'dispatch_' + small_unit:>12s} {'combine_' + small_unit:>12s} "
                 f"{'fwd+bwd_ms':>12s} {'expert_ms':>10s}")
    for disp in dict.fromkeys(name.split(".")[0] for name in meg):
        def cell(op, scale, spec):
            row = meg.get(f"{disp}.{op}")
            return fmt(row["median_ms"] * scale if row else None, spec)
        lines.append(f"{disp:30s} {cell('dispatch', small, '12.0f' if cuda else '12.2f')} "
                     f"{cell('combine', small, '12.0f' if cuda else '12.2f')} "
                     f"{cell('fwd_bwd', 1.0, '12.2f')} {cell('expert_fwd_bwd', 1.0, '10.2f')}")


def _team(result: dict, lines: list) -> None:
    points = result.get("team") or []
    if not points:
        return
    lines.append(f"team: EP>1 as a local team on GPU 0, {PROXY_NOTE}; "
                 f"{points[0]['num_sms']} SMs per rank")
    lines.append(f"{'EP':>4s} {'op':24s} {'collective_us':>13s} {'busy_us/rank':>12s} "
                 f"{'fastest_us':>10s}")
    for point in points:
        if "skipped" in point:
            lines.append(f"{point['world']:4d} skipped: {point['skipped']}")
            continue
        for op in TEAM_OPS:
            row = point["items"].get(op)
            lines.append(f"{point['world']:4d} {op:24s} "
                         f"{fmt(row['median_ms'] * 1e3 if row else None, '13.1f')} "
                         f"{fmt(row['busy_ms'] * 1e3 if row else None, '12.1f')} "
                         f"{fmt(row['min_ms'] * 1e3 if row else None, '10.1f')}")


def _sweeps(result: dict, lines: list, cuda: bool) -> None:
    points = result.get("sweeps") or []
    if not points:
        return
    mode = sweep_mode(result)
    if cuda:
        lines.append(f"{'sweep, kernel mode: tokens':>26s} {'SMs':>4s} {'dispatch_us':>11s} "
                     f"{'phys GB/s':>9s} {'logic GB/s':>10s} {'floor %':>7s} {'combine_us':>11s} "
                     f"{'phys GB/s':>9s} {'logic GB/s':>10s} {'floor %':>7s}")
    else:
        lines.append(f"{'sweep, host wall: tokens':>26s} {'dispatch_ms':>11s} {'combine_ms':>11s}")
    for point in points:
        cells = []
        for op in ("dispatch", "combine"):
            row = point["items"].get(f"{op} ({mode})", {})
            if cuda:
                cells += [fmt(row["median_ms"] * 1e3 if row else None, "11.1f"),
                          fmt(row.get("phys_GBps"), "9.1f"), fmt(row.get("logical_GBps"), "10.1f"),
                          fmt(row.get("floor_pct"), "7.0f")]
            else:
                cells.append(fmt(row["median_ms"] if row else None, "11.2f"))
        # The sanity checks of every point are in the JSON; a failed one is flagged here.
        bad = any("MISMATCH" in str(value) for per_rank in point["checks"].values()
                  for value in per_rank.values())
        sms = f" {point['num_sms']:4d}" if cuda else ""
        lines.append(f"{point['tokens']:26d}{sms} {' '.join(cells)}"
                     + ("  check MISMATCH" if bad else ""))


def format_table(result: dict) -> str:
    """The short table printed last (the GPU script's summary takes it from TABLE_MARKER on)."""
    cuda = result["meta"]["device"] == "cuda"
    lines = header_lines(result)
    if result.get("note"):
        lines.append(result["note"])
    if cuda:
        _gpu_sections(result, lines)
    else:
        _cpu_kernels(result, lines)
    for name, per_rank in result.get("checks", {}).items():
        values = ", ".join(f"r{rank} {value}" for rank, value in sorted(per_rank.items()))
        lines.append(f"check {name}: {values}")
    _megatron(result, lines, cuda)
    _team(result, lines)
    for point in result.get("team") or []:
        for name, per_rank in point.get("checks", {}).items():
            lines.append(f"check team EP={point['world']} {name}: "
                         + ", ".join(str(v) for _, v in sorted(per_rank.items())))
    _sweeps(result, lines, cuda)
    for err in result.get("errors", []):
        first_line = (err["error"] or "").strip().splitlines()[:1] or [""]
        lines.append(f"ERROR {err['section']}/{err['item']} rank {err['rank']}: "
                     f"{first_line[0][:160]}")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
