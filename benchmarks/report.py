"""What a run reports: the floors of the kernels' rows, the text table, the JSON, and which
sources ran.

Each dispatch/combine row that carries ``hbm_bytes`` (kernels section and sweep points) gets its
**floor** from the ceilings of the same run: the larger of the HBM floor (``hbm_bytes`` / the HBM
copy's read+write rate) and the link floor (physical bytes / the peer copy's rate, every GPU
copying where measured); "floor %" is floor / time. The LL section's items get their HBM floor
(benchmarks/ll.py's add_floors). Without the ceilings section there is no floor.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from typing import Optional

from megatron_nccl_ep.build_info import PACKAGE_DIR
from .ceilings import HBM_COPY, PEER_COPY_ALL, PEER_COPY_ONE
from .host import FLOOR, FLOOR_OP, HOST_KINDS, HOST_OPS, ht_prefix, megatron_prefix
from .ll import LL_OPS, ht_item, ll_item
from .ll import add_floors as ll_add_floors
from .ll import points as ll_points
from .nodes import OPS as NODES_OPS
from .nodes import item as nodes_item
from .nodes import points as nodes_points
from .nodes import shape_label as nodes_shape
from .runner import e2e_mode, item_name, kernel_mode
from .sweeps import sweep_mode
from .team import OPS as TEAM_OPS
from .team import PROXY_NOTE

TABLE_MARKER = "== megatron_nccl_ep bench"

# The ceilings that the floors divide by, first found first.
FLOOR_CEILINGS = {
    "hbm": (HBM_COPY,),
    "link": (PEER_COPY_ALL, PEER_COPY_ONE),
}


# The bench's modules that only render a results file (RESULTS.md, the README's numbers, the
# plot): left out of the sources hash, so that a rendering change keeps the committed run current.
RENDERERS = ("markdown.py", "plot.py", "readme.py")


def source_version() -> dict:
    """What code ran: ``git describe --dirty`` of the tree (a copy of the tree may carry an older
    .git: "-dirty" then says the files differ from that commit) and a SHA-256 over the library's
    sources (csrc/, the package's .py files) and the bench's own .py files but its renderers
    (``RENDERERS``: they turn a results file into text and a picture, and the numbers do not
    depend on them), which names the code whatever the .git says."""
    package = PACKAGE_DIR
    root = os.path.dirname(package)
    bench = os.path.dirname(os.path.abspath(__file__))
    try:
        git = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 - the device copy of the tree may have no .git
        git = None
    digest = hashlib.sha256()
    paths = [os.path.join(d, f) for top in (os.path.join(root, "csrc"), package)
             for d, _, files in os.walk(top) for f in files
             if f.endswith((".py", ".cu", ".cuh", ".cc", ".h"))]
    paths += [os.path.join(bench, f) for f in os.listdir(bench)
              if f.endswith(".py") and f not in RENDERERS]
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return {"git": git, "sources_sha256": digest.hexdigest()[:16]}


def fmt(value, spec: str) -> str:
    """``value`` formatted, or a dash of the same width when there is none (no width: '-')."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return "-".rjust(int(spec.split(".")[0] or 1))


def cells(values, specs) -> list:
    """Each value formatted by its spec (``fmt``)."""
    return list(map(fmt, values, specs))


def first_line(text) -> str:
    """The first line of an error's text ('' where there is none)."""
    return ((text or "").strip().splitlines() or [""])[0]


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
    ll_add_floors(result, rates["hbm"])
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
    skipped = ["ceilings and team (they need a GPU)"]
    if "ll" in args.sections:
        skipped.append("the ll section's CUDA graphs and local teams (GPU)")
    others = [d for d in ("alltoall", "allgather") if d not in args.megatron_dispatchers]
    if "megatron" in args.sections and others:
        skipped.append(f"Megatron's {' and '.join(others)} dispatchers (GPU comparisons; "
                       "alltoall needs CUDA streams)")
    return (f"host wall time of the reference backend ({args.backend}) over gloo, {args.nproc} "
            f"processes: it shows that the code runs, not GPU speed. Ran: "
            f"{', '.join(measured) or 'nothing'}. Not run on a CPU: {'; '.join(skipped)}.")


# ------------------------------------------------------------------------------------------------
# Each section's rows as numbers (None where not measured): both the text table (below) and the
# markdown (markdown.py) render these.


def shape_extras(shape: dict, *, rail: bool = False) -> list:
    """The shape's settings that only some runs have, as words."""
    words = {"staging_chunk_tokens": "staging chunks of {} tokens",
             "staging_depth": "staging depth {}",
             "ranks_per_node": "emulated nodes of {} rank(s)"
                               + (" (rail: NCCL send/receive)" if rail else "")}
    return [text.format(shape[key]) for key, text in words.items() if shape.get(key)]


def times_us(row, *keys) -> list:
    """An item's times (ms) ``keys`` in us."""
    return [row[key] * 1e3 if row else None for key in keys]


def kernel_cells(row, keys=("phys_GBps", "logical_GBps", "floor_us", "floor_pct")) -> list:
    """A kernels item's time_us, then its ``keys``."""
    return times_us(row, "median_ms") + [(row or {}).get(key) for key in keys]


def ceiling_rows(result: dict) -> list:
    """(name, time_us, GB/s) of every ceiling."""
    return [(name, *kernel_cells(row, ("phys_GBps",)))
            for name, row in (result.get("ceilings") or {}).items()]


def megatron_rows(result: dict) -> tuple:
    """(unit, [(dispatcher, dispatch, combine, fwd_bwd_ms, expert_fwd_bwd_ms)]): dispatch and
    combine in the unit, us on GPUs and ms on cpu (host wall times are that long)."""
    meg = result.get("megatron") or {}
    scale, unit = (1e3, "us") if result["meta"]["device"] == "cuda" else (1.0, "ms")
    ops = (("dispatch", scale), ("combine", scale), ("fwd_bwd", 1.0), ("expert_fwd_bwd", 1.0))
    return unit, [(disp, *(meg[f"{disp}.{op}"]["median_ms"] * s if f"{disp}.{op}" in meg
                           else None for op, s in ops))
                  for disp in dict.fromkeys(name.split(".")[0] for name in meg)]


def experts_rows(result: dict) -> tuple:
    """The experts section: ``(factor_rows, layer_rows)``. factor_rows: (budget factor, grouped
    ms, grouped peak MiB, sequential ms, sequential peak MiB); layer_rows: (configuration, eager
    ms, eager peak MiB, graph ms, graph peak MiB); None where not measured."""
    items = result.get("experts") or {}

    def get(name: str):
        row = items.get(name)
        return (None, None) if row is None else (row["median_ms"], row.get("peak_mib"))

    factors = sorted({int(name.split(" f")[1]) for name in items
                      if name.startswith(("grouped f", "sequential f"))})
    factor_rows = [(f, *get(f"grouped f{f}"), *get(f"sequential f{f}")) for f in factors]
    configs = list(dict.fromkeys(name[len("layer "):].rsplit(" (", 1)[0] for name in items
                                 if name.startswith("layer ")))
    layer_rows = [(c, *get(f"layer {c} (eager)"), *get(f"layer {c} (graph)")) for c in configs]
    return factor_rows, layer_rows


def host_rows(result: dict) -> tuple:
    """The host section (us): ``(op_rows, step_rows, megatron_rows)``. op_rows: (configuration,
    one of HOST_KINDS, one time per HOST_OPS, None where not measured); step_rows: (configuration,
    eager step, graph step, graph kernel, eager step / graph kernel); megatron_rows: (T, the
    methods' dispatch, the HT handle + dispatch kernels at that T in the run's receive mode, the
    difference, the methods' combine, the combine kernel, the difference)."""
    items = result.get("host") or {}
    us = {name: row["median_ms"] * 1e3 for name, row in items.items()}
    configs = list(dict.fromkeys(name.split(": ")[0] for name in us))
    op_rows, step_rows, meg_rows = [], [], []
    for config in configs:
        if config.startswith("megatron"):
            continue
        for kind in HOST_KINDS:
            values = [us.get(f"{config}: {op} ({kind})") for op in HOST_OPS]
            if any(v is not None for v in values):
                op_rows.append((config, kind, *values))
        eager, graph, device = (us.get(f"{config}: {item}") for item in
                                ("step (eager)", "step (graph)", "graph (kernel)"))
        if eager is not None:
            step_rows.append((config, eager, graph, device,
                              eager / device if device else None))
    mode = (result.get("args") or {}).get("recv_mode", "exact")
    for config in configs:
        if not config.startswith("megatron"):
            continue
        tokens = int(config.split("T=")[1])
        if config != megatron_prefix(tokens):
            continue
        ht = ht_prefix(tokens, mode)
        dispatch, combine = us.get(f"{config}: dispatch"), us.get(f"{config}: combine")
        handle_k, dispatch_k, combine_k = (us.get(f"{ht}: {op} (kernel)")
                                           for op in ("handle", "dispatch", "combine"))
        kernels = (handle_k + dispatch_k
                   if handle_k is not None and dispatch_k is not None else None)
        meg_rows.append((tokens, dispatch, kernels,
                         dispatch - kernels if None not in (dispatch, kernels) else None,
                         combine, combine_k,
                         combine - combine_k if None not in (combine, combine_k) else None))
    return op_rows, step_rows, meg_rows


def host_floor_us(result: dict) -> Optional[float]:
    """The host section's floor (us): one kernel launched through torch, enqueued as the calls
    are; None when not measured."""
    row = (result.get("host") or {}).get(f"{FLOOR}: {FLOOR_OP} (host)")
    return None if row is None else row["median_ms"] * 1e3


def team_rows(result: dict) -> list:
    """(EP, why it was skipped or None, [(op, collective_us, busy_us per rank, fastest_us)]) of
    every team point."""
    return [(point["world"], point.get("skipped"),
             [(op, *times_us(point["items"].get(op), "median_ms", "busy_ms", "min_ms"))
              for op in TEAM_OPS if not point.get("skipped")])
            for point in result.get("team") or []]


def sweep_rows(result: dict) -> list:
    """(tokens, SMs, values, a check failed) of every sweep point; values: per op (dispatch, then
    combine) its kernel-mode time_us, phys GB/s, logical GB/s and floor % on GPUs, its host wall
    time_ms on cpu."""
    mode = sweep_mode(result)
    rows = []
    for point in result.get("sweeps") or []:
        values = []
        for op in ("dispatch", "combine"):
            row = point["items"].get(item_name(op, mode))
            values += (kernel_cells(row, ("phys_GBps", "logical_GBps", "floor_pct"))
                       if mode == "kernel" else [(row or {}).get("median_ms")])
        # The sanity checks of every point are in the JSON; the table flags a failed one.
        bad = any("MISMATCH" in str(value) for per_rank in point["checks"].values()
                  for value in per_rank.values())
        rows.append((point["tokens"], point["num_sms"], values, bad))
    return rows


def check_rows(result: dict) -> tuple:
    """The checks: [(name, [(rank, value)] in rank order)] of the sections, and [(EP, name,
    [value] in rank order)] of the team points."""
    own = [(name, sorted(per_rank.items())) for name, per_rank in result.get("checks", {}).items()]
    team = [(point["world"], name, [value for _, value in sorted(per_rank.items())])
            for point in result.get("team") or []
            for name, per_rank in point.get("checks", {}).items()]
    return own, team


# ------------------------------------------------------------------------------------------------
# the nodes section's rows (nodes.py): the text table and the markdown render these

NODES_COLUMNS = ("rows/token", "bytes/token", "p counted", "p formula", "every token B/token",
                 "packed / every token")


def nodes_rows(result: dict) -> tuple:
    """(time columns, rows, skipped): rows (shape NxG, routing, op, *times, *NODES_COLUMNS'
    values): times in us on GPUs (kernel, e2e) and ms on cpu (host wall); per token of a rank
    (its rows and bytes per call / its tokens); p counted = the rows / ((N - 1) T), p formula
    docs/internode.md's; every token = what a rail that carried every token sent; None where
    not measured. skipped: (shape, why) of the points that did not run."""
    cuda = result["meta"]["device"] == "cuda"
    modes = (kernel_mode("cuda"), e2e_mode("cuda")) if cuda else (kernel_mode("cpu"),)
    scale = 1e3 if cuda else 1.0
    rows, skipped = [], []
    for point in nodes_points(result):
        shape = nodes_shape(point["nodes"], point["ranks_per_node"])
        if point.get("skipped"):
            skipped.append((shape, point["skipped"]))
            continue
        for routing, formula in point["share_formula"].items():
            for op in NODES_OPS:
                found = [point["items"].get(nodes_item(routing, op, mode)) for mode in modes]
                if not any(found):
                    continue
                counted = next(row for row in found if row)
                tokens = counted["tokens"]
                rows.append((shape, routing, op,
                             *(row["median_ms"] * scale if row else None for row in found),
                             counted["rail_rows"] / tokens, counted["rail_bytes"] / tokens,
                             counted["share"], formula,
                             counted["every_token_bytes"] / tokens,
                             counted["rail_bytes"] / counted["every_token_bytes"]))
    times = ("kernel (us)", "e2e (us)") if cuda else ("host wall (ms)",)
    return times, rows, skipped


def nodes_check_summary(result: dict) -> tuple:
    """(checks passed, checks in all, [(shape, check, rank, value)] of those that did not
    pass)."""
    done, bad = 0, []
    for point in nodes_points(result):
        for name, per_rank in (point.get("checks") or {}).items():
            for rank, value in sorted(per_rank.items()):
                done += 1
                if not str(value).startswith("ok"):
                    bad.append((nodes_shape(point["nodes"], point["ranks_per_node"]), name, rank,
                                value))
    return done - len(bad), done, bad


def nodes_header(result: dict) -> str:
    """What the nodes rows are: the shape, backend, processes, timing and routings."""
    shape, section = result["shape"], result.get("nodes") or {}
    limited = section.get("node_limited") or {}
    backend = result["meta"].get("backend_resolved", shape["backend"])
    text = (f"HT over emulated nodes (docs/internode.md), backend {backend}, exact mode: "
            f"{shape['tokens']} tokens per rank, hidden {shape['hidden']}, top-{shape['topk']} "
            f"of {shape['experts']} experts, {shape['dtype']}; NxG = N nodes of G ranks, a "
            f"process per rank; routings: uniform, node_limited = {limited.get('groups')} "
            f"groups of experts, {limited.get('picks')} picked per token")
    placed = [f"{nodes_shape(point['nodes'], point['ranks_per_node'])} {point['placement']}"
              for point in nodes_points(result) if point.get("placement")]
    if result["meta"]["device"] == "cuda":
        return (text + "; " + ("; ".join(placed) or "no shape ran") + " (a proxy of the "
                "protocol's cost, not of a network's)")
    return text + "; the reference backend over gloo, host wall time"


# ------------------------------------------------------------------------------------------------
# the LL section's rows (ll.py): the text table and the markdown render these

# Printed against the numbers, never asserted: EP=1, bf16, T=128 (us), and HT / LL graph.
LL_TARGET_TOKENS = 128
LL_TARGETS = (("dispatch", "<=", 10.0), ("combine", "<=", 10.0), ("graph h+d+c", "<=", 25.0),
              ("HT / graph", ">=", 3.0))
LL_GPU_COLUMNS = ("handle", "dispatch", "combine", "graph h+d+c", "graph d+c", "HT h+d+c",
                  "HT / graph", "dispatch floor", "combine floor")
LL_CPU_COLUMNS = ("handle", "dispatch", "combine", "HT h+d+c")
LL_TEXT_NAMES = {"handle": "handle", "dispatch": "dispatch", "combine": "combine",
                 "graph h+d+c": "graph", "graph d+c": "graph_dc", "HT h+d+c": "HT",
                 "HT / graph": "HT/graph", "dispatch floor": "d_floor", "combine floor": "c_floor"}


def ll_ep(point: dict) -> str:
    """A point's EP as its rows name it: every local-team figure is a PROXY."""
    return f"{point['world']} PROXY" if point["proxy"] else str(point["world"])


def ll_rows(result: dict) -> tuple:
    """(columns, rows, skipped): rows (EP, SMs, T, payload, layout, *values), values in us on
    GPUs (HT / graph a ratio, floors of dispatch and combine) and ms on cpu, None where not
    measured; skipped: (EP, why) of the points that did not run."""
    cuda = result["meta"]["device"] == "cuda"
    section = result.get("ll") or {}
    scale = 1e3 if cuda else 1.0
    rows, skipped = [], []
    for point in section.get("points") or []:
        if point.get("skipped"):
            skipped.append((ll_ep(point), point["skipped"]))
            continue
        items = point["items"]
        for tokens in section["tokens"]:
            ht = items.get(ht_item(tokens, "h+d+c"))
            ht_time = ht["median_ms"] * scale if ht else None
            for payload in section["payloads"]:
                for layout in section["layouts"]:
                    found = {op: items.get(ll_item(tokens, payload, layout, op))
                             for op in LL_OPS}
                    if not any(found.values()):
                        continue
                    times = {op: row["median_ms"] * scale if row else None
                             for op, row in found.items()}
                    if cuda:
                        graph = times["graph h+d+c"]
                        values = [*times.values(), ht_time,
                                  ht_time / graph if ht_time and graph else None,
                                  *((found[op] or {}).get("floor_us")
                                    for op in ("dispatch", "combine"))]
                    else:
                        values = [times[op] for op in LL_OPS[:3]] + [ht_time]
                    rows.append((ll_ep(point), point["num_sms"], tokens, payload, layout,
                                 *values))
    return (LL_GPU_COLUMNS if cuda else LL_CPU_COLUMNS), rows, skipped


def ll_targets(result: dict) -> list:
    """(layout, SMs, what, value, relation, bound, met or None) of LL_TARGETS at EP=1, bf16
    payload, LL_TARGET_TOKENS (GPUs only: host wall times say nothing of them)."""
    if result["meta"]["device"] != "cuda":
        return []
    columns, rows, _ = ll_rows(result)
    found = []
    for ep, sms, tokens, payload, layout, *values in rows:
        if ep != "1" or tokens != LL_TARGET_TOKENS or payload != "bf16":
            continue
        by_name = dict(zip(columns, values))
        for what, relation, bound in LL_TARGETS:
            value = by_name.get(what)
            met = None if value is None else (value <= bound if relation == "<=" else
                                              value >= bound)
            found.append((layout, sms, what, value, relation, bound, met))
    return found


def ll_target_text(target: tuple) -> str:
    layout, sms, what, value, relation, bound, met = target
    unit = "" if what == "HT / graph" else " us"
    shown = "-" if value is None else f"{value:.1f}"
    verdict = {True: "met", False: "MISSED", None: "not measured"}[met]
    return (f"{layout}, {sms} SMs: {what} {shown}{unit} (target {relation} {bound:g}{unit}: "
            f"{verdict})")


def ll_memory_rows(result: dict) -> tuple:
    """(shape, rows, why skipped): rows (EP, layout, window, device, handles, total, DeepEP's
    buffer, DeepEP / total), sizes in MiB per rank; (EP, layout, error) where the query failed."""
    memory = (result.get("ll") or {}).get("memory") or {}
    if memory.get("skipped"):
        return None, [], memory["skipped"]
    mib = 2.0**20
    rows = []
    for row in memory.get("rows", []):
        if row.get("error"):
            rows.append((row["world"], row["layout"], row["error"]))
            continue
        sizes = [row.get(key) for key in ("window_bytes", "device_bytes", "handle_bytes",
                                          "total_bytes")]
        total = row.get("total_bytes")
        rows.append((row["world"], row["layout"],
                     *(None if v is None else v / mib for v in sizes), row["deepep_bytes"] / mib,
                     row["deepep_bytes"] / total if total else None))
    return memory.get("shape"), rows, ""


def ll_check_summary(result: dict) -> tuple:
    """(checks passed, checks in all, [(EP, check, value)] of those that did not pass)."""
    done, bad = 0, []
    for point in ll_points(result):
        for name, per_rank in (point.get("checks") or {}).items():
            for value in per_rank.values():
                done += 1
                if not str(value).startswith("ok"):
                    bad.append((ll_ep(point), name, value))
    return done - len(bad), done, bad


def ll_header(result: dict) -> str:
    """What the LL rows are: the shape, backend, SMs, timing, and the PROXY."""
    shape, section = result["shape"], result.get("ll") or {}
    backend = result["meta"].get("ll_backend_resolved", shape["backend"])
    text = (f"LL (docs/design.md §9), backend {backend}: hidden {shape['hidden']}, top-"
            f"{shape['topk']} of {shape['experts']} experts, {shape['dtype']} tokens, T_max = T")
    if result["meta"]["device"] != "cuda":
        return text + "; host wall time (ms); no CUDA graphs and no local teams on cpu"
    sms = ", ".join(f"EP={p['world']} {p['num_sms']}" for p in section.get("points", [])
                    if not p.get("skipped"))
    return (f"{text}; SMs per rank: {sms}; device time in us (EP=1: kernel mode; EP>1: a local "
            f"team, the last rank's start to the last rank's end). Every EP>1 figure is a PROXY: "
            f"{PROXY_NOTE}, the peers' windows in plain device memory, not NVLink")


# ------------------------------------------------------------------------------------------------
# the text table


def _text_table(first: str, width: int, names: list, specs: tuple, rows) -> list:
    """A header line (``first`` in ``width``, each name right-aligned in its spec's width) and a
    line per row: (label, *values), or a line as it is."""
    widths = [int(spec.split(".")[0]) for spec in specs]
    return [" ".join([f"{first:{width}s}"] + [f"{n:>{w}s}" for n, w in zip(names, widths)])] + [
        row if isinstance(row, str) else " ".join([f"{row[0]:{width}s}"] + cells(row[1:], specs))
        for row in rows]


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
        + "".join(f", {extra}" for extra in shape_extras(shape, rail=True))
        + "; medians of per-iteration slowest rank",
    ]


def _kernels(result: dict, cuda: bool) -> list:
    kern, backend = result.get("kernels") or {}, result["shape"]["backend"]
    if not kern:
        return []
    if cuda:
        return _text_table(f"ours ({backend})", 38, ["time_us", "phys GB/s", "logic GB/s",
                                                     "floor_us", "floor %"],
                           ("9.1f", "9.1f", "10.1f", "9.1f", "7.0f"),
                           [(name, *kernel_cells(row)) for name, row in kern.items()])
    mode = item_name("", kernel_mode("cpu"))  # the header says it instead of every row
    return _text_table(f"ours ({backend}), host wall", 38, ["time_ms"], ("9.2f",),
                       [(name.removesuffix(mode), row["median_ms"]) for name, row in kern.items()])


def _team(result: dict) -> list:
    points = team_rows(result)
    if not points:
        return []
    rows = []
    for world, skipped, ops in points:
        rows += ([f"{world:4d} skipped: {skipped}"] if skipped else
                 [(f"{world:4d} {op:24s}", *times) for op, *times in ops])
    return [f"team: EP>1 as a local team on GPU 0, {PROXY_NOTE}; "
            f"{result['team'][0]['num_sms']} SMs per rank"] + _text_table(
        f"{'EP':>4s} {'op':24s}", 29, ["collective_us", "busy_us/rank", "fastest_us"],
        ("13.1f", "12.1f", "10.1f"), rows)


def _ll(result: dict, cuda: bool) -> list:
    if not result.get("ll"):
        return []
    columns, rows, skipped = ll_rows(result)
    unit = "us" if cuda else "ms"
    names = [LL_TEXT_NAMES[name] + ("" if name == "HT / graph" else f"_{unit}")
             for name in columns]
    ht = "HT = mode 'ht' handle (count read) + dispatch + combine on the same batch"
    if cuda:
        ht = ("graph = handle + dispatch + combine in one CUDA graph, graph_dc = dispatch + "
              f"combine of one handle, {ht}; floors: HBM bytes / the HBM copy's rate")
    sms_head = f" {'SMs':>4s}" if cuda else ""  # no SM budget on cpu
    lines = [ll_header(result), ht] + _text_table(
        f"{'EP':>8s}{sms_head} {'T':>5s} {'payload':7s} {'layout':12s}", 37 + len(sms_head),
        names, tuple(f"{max(len(name), 8)}.{1 if cuda else 2}f" for name in names),
        [(f"{ep:>8s}" + (f" {sms:>4}" if cuda else "") + f" {tokens:5d} {payload:7s} {layout:12s}",
          *values) for ep, sms, tokens, payload, layout, *values in rows])
    lines += [f"{ep:>8s} skipped: {why}" for ep, why in skipped]
    targets = ll_targets(result)
    if targets:
        lines.append(f"LL targets, EP=1 T={LL_TARGET_TOKENS} bf16 (not asserted): "
                     + "; ".join(map(ll_target_text, targets)))
    shape, memory, why = ll_memory_rows(result)
    if why:
        lines.append(f"LL memory query skipped: {why}")
    for row in memory:
        if len(row) == 3:
            lines.append(f"LL memory EP={row[0]} {row[1]}: query failed: {row[2][:160]}")
            continue
        world, layout, window, device, handles, total, deepep, ratio = row
        lines.append(f"LL memory EP={world} {layout} (T_max {shape['tokens']}, hidden "
                     f"{shape['hidden']}, {shape['experts']} experts, top-{shape['topk']}, "
                     f"bf16), MiB per rank: window {fmt(window, '.1f')} + device "
                     f"{fmt(device, '.1f')} + handles {fmt(handles, '.1f')} = {fmt(total, '.1f')};"
                     f" DeepEP V1 LL buffer {deepep:.1f} ({fmt(ratio, '.1f')} x)")
    passed, done, bad = ll_check_summary(result)
    if done:
        lines.append(f"LL checks: {passed} of {done} ok")
    lines += [f"LL check EP={ep} {name}: {value}" for ep, name, value in bad]
    return lines


def _nodes(result: dict) -> list:
    if not result.get("nodes"):
        return []
    times, rows, skipped = nodes_rows(result)
    names = [name.replace(" (", "_").rstrip(")").replace(" ", "_") for name in times] + [
        "rows/tok", "B/tok", "p", "p_formula", "every_B/tok", "packed/every"]
    lines = [nodes_header(result), "per token of a rank, per call: rail rows and bytes "
             "(Group.info()'s counters); p = rows / ((N-1) T); every = a rail that carried "
             "every token"] + _text_table(
        f"{'NxG':>4s} {'routing':12s} {'op':13s}", 32, names,
        tuple(f"{max(len(n), 9)}.{2 if 'ms' in n else 1}f" for n in names[:len(times)])
        + ("8.3f", "9.1f", "6.3f", "9.3f", "11.1f", "12.3f"),
        [(f"{shape:>4s} {routing:12s} {op:13s}", *values)
         for shape, routing, op, *values in rows])
    lines += [f"{shape:>4s} skipped: {why}" for shape, why in skipped]
    passed, done, bad = nodes_check_summary(result)
    if done:
        lines.append(f"nodes checks (rail counters against the routing): {passed} of {done} ok")
    lines += [f"nodes check {shape} {name} rank {rank}: {value}"
              for shape, name, rank, value in bad]
    return lines


def _experts(result: dict) -> list:
    factor_rows, layer_rows = experts_rows(result)
    lines = []
    if factor_rows:
        lines += ["experts, EP=1 (ms, peak MiB): forward + backward on a budget of factor x the "
                  "balanced share, the same routed rows"]
        lines += _text_table("factor", 8, ["grouped", "MiB", "sequential", "MiB"],
                             ("10.2f", "8.0f") * 2, [(str(f), *v) for f, *v in factor_rows])
    if layer_rows:
        lines += _text_table("MoE layer fwd+bwd", 40, ["eager", "MiB", "graph", "MiB"],
                             ("8.2f", "8.0f") * 2, layer_rows)
    return lines


def _host(result: dict) -> list:
    op_rows, step_rows, meg_rows = host_rows(result)
    if not (op_rows or step_rows or meg_rows):
        return []
    lines = ["host section, EP=1 (us): host = enqueue time with the GPU held, a call in a loop "
             "(host, first: the first after a synchronize), kernel = device time; steps = "
             "handle + dispatch + combine, back to back"]
    if op_rows:
        lines += _text_table("configuration", 34, [op.replace(" ", "_") for op in HOST_OPS],
                             ("13.1f",) * len(HOST_OPS),
                             [(f"{config} {kind}", *values) for config, kind, *values in op_rows])
    floor = host_floor_us(result)
    if floor is not None:
        lines.append(f"floor: {FLOOR_OP} (torch.cuda._sleep) {floor:.1f} us to enqueue")
    if step_rows:
        lines += _text_table("configuration", 34, ["eager_step", "graph_step", "graph_kernel",
                                                   "eager/graph"],
                             ("12.1f",) * 3 + ("12.2f",), step_rows)
    if meg_rows:
        lines += _text_table("megatron nccl_ep methods, e2e", 34,
                             ["dispatch", "kernels", "over", "combine", "kernel", "over"],
                             ("10.1f",) * 6,
                             [(f"T={tokens}", *values) for tokens, *values in meg_rows])
    for name, rows in (result.get("host_profiles") or {}).items():
        lines.append(f"{name} (per step: calls, self CPU us): " + "; ".join(
            f"{event} {calls:g} {us:.1f}" for event, calls, us in rows))
    return lines


def _sweeps(result: dict, cuda: bool) -> list:
    rows = sweep_rows(result)
    if not rows:
        return []
    if cuda:
        lines = _text_table(f"{'sweep, kernel mode: tokens':>26s} {'SMs':>4s}", 31,
                            ["dispatch_us", "phys GB/s", "logic GB/s", "floor %", "combine_us",
                             "phys GB/s", "logic GB/s", "floor %"],
                            ("11.1f", "9.1f", "10.1f", "7.0f") * 2,
                            [(f"{tokens:26d} {sms:4d}", *values)
                             for tokens, sms, values, _ in rows])
    else:
        lines = _text_table(f"{'sweep, host wall: tokens':>26s}", 26,
                            ["dispatch_ms", "combine_ms"], ("11.2f",) * 2,
                            [(f"{tokens:26d}", *values) for tokens, _, values, _ in rows])
    return lines[:1] + [line + ("  check MISMATCH" if bad else "")
                        for line, (*_, bad) in zip(lines[1:], rows)]


def format_table(result: dict) -> str:
    """The short table printed last (the GPU script's summary takes it from TABLE_MARKER on)."""
    cuda = result["meta"]["device"] == "cuda"
    lines = header_lines(result) + ([result["note"]] if result.get("note") else [])
    ceilings = ceiling_rows(result) if cuda else []
    if ceilings:
        lines += _text_table("ceiling", 38, ["time_us", "GB/s"], ("9.1f",) * 2, ceilings)
    lines += _kernels(result, cuda)
    checks, team_checks = check_rows(result)
    lines += [f"check {name}: " + ", ".join(f"r{rank} {value}" for rank, value in values)
              for name, values in checks]
    unit, rows = megatron_rows(result)
    if rows:
        lines += _text_table("megatron dispatcher" + ("" if cuda else ", host wall"), 30,
                             [f"dispatch_{unit}", f"combine_{unit}", "fwd+bwd_ms", "expert_ms"],
                             ("12.0f" if cuda else "12.2f",) * 2 + ("12.2f", "10.2f"), rows)
    lines += _team(result)
    lines += _ll(result, cuda)
    lines += _nodes(result)
    lines += _host(result)
    lines += _experts(result)
    lines += [f"check team EP={world} {name}: " + ", ".join(map(str, values))
              for world, name, values in team_checks]
    lines += _sweeps(result, cuda)
    lines += [f"ERROR {err['section']}/{err['item']} rank {err['rank']}: "
              f"{first_line(err['error'])[:160]}" for err in result.get("errors", [])]
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
