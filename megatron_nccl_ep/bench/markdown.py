"""``--markdown PATH``: the run as markdown (the body of benchmarks/RESULTS.md).

A header that names the sources, the machine, the command and the shape, then one table per
section that ran, each headed by what it is and, where floors are derived, by the ceilings of the
same run.
"""

from __future__ import annotations

import os

from .report import floor_rates
from .sweeps import sweep_mode
from .team import OPS as TEAM_OPS
from .team import PROXY_NOTE
from .kernels import HANDLE, RANK_MAJOR
from .runner import MODES


def _table(header: list, rows: list) -> list:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + [""]


def _num(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _us(row, key: str = "median_ms") -> str:
    return _num(row[key] * 1e3, ".1f") if row else "-"


def _machine(meta: dict) -> str:
    if meta["device"] != "cuda":
        return (f"cpu: {meta.get('cpu_model', '?')}, {meta.get('cpu_count', '?')} cores; torch "
                f"{meta.get('torch')}")
    return (f"{meta.get('gpu_count', '?')} x {meta.get('device_name', '?')} "
            f"({meta.get('sm_count', '?')} SMs, {meta.get('gpu_memory_gib', '?')} GiB), driver "
            f"{meta.get('driver') or 'unknown'}; torch {meta.get('torch')}, CUDA "
            f"{meta.get('cuda_runtime')}, NCCL {meta.get('nccl')}")


def _header(result: dict) -> list:
    meta, shape, args = result["meta"], result["shape"], result["args"]
    source = meta.get("source") or {}
    cuda = meta["device"] == "cuda"
    budget = f"SM budget {shape['num_sms']} per rank" if cuda else "no SM budget (cpu)"
    extras = [f"staging chunks of {shape['staging_chunk_tokens']} tokens"
              if shape.get("staging_chunk_tokens") else "",
              f"staging depth {shape['staging_depth']}" if shape.get("staging_depth") else "",
              f"emulated nodes of {shape['ranks_per_node']} rank(s)"
              if shape.get("ranks_per_node") else ""]
    if cuda:
        timing = ("kernel = device time between CUDA events, the GPUs held while the host "
                  "enqueues and lined up by a one-element all-reduce; e2e = from idle GPUs and "
                  "hosts lined up by a gloo barrier to the end of the device work")
    else:
        timing = "host wall time from hosts lined up by a gloo barrier"
    lines = [
        "# megatron_nccl_ep benchmark",
        "",
        f"- sources: `{source.get('sources_sha256')}` (git `{source.get('git')}`)",
        f"- machine: {_machine(meta)}",
        f"- command: `{meta.get('command')}`",
        f"- shape: {shape['tokens']} tokens per rank, hidden {shape['hidden']}, top-"
        f"{shape['topk']} of {shape['experts']} experts, {shape['dtype']}, {budget}, "
        f"{shape['ranks']} rank(s), backend {shape['backend']}, {shape['recv_mode']} mode"
        + "".join(f", {e}" for e in extras if e),
        f"- times: medians over {args['iters']} iterations (after {args['warmup']} warm-up, "
        f"rotating {args['rotate']} random routings), per iteration the slowest rank; {timing}",
    ]
    if result.get("note"):
        lines.append(f"- cpu run: {result['note']}")
    return lines + [""]


def _ceilings_line(result: dict) -> str:
    rates = floor_rates(result)
    if rates["hbm"] is None:
        return "No ceilings section in this run: no floors."
    if rates["link"]:
        link = f", link {rates['link']:.1f} GB/s (peer copy)"
    else:
        link = ", no link (one rank)" if result["shape"]["ranks"] == 1 else ", no link measured"
    return (f"Ceilings of this run: HBM copy {rates['hbm']:.1f} GB/s (read+write){link}. Floor = "
            f"the larger of the op's minimal HBM bytes / the HBM rate and its link bytes / the "
            f"link rate; floor % = floor / kernel time.")


def _kernels(result: dict, out: list) -> None:
    kern = result.get("kernels") or {}
    if not kern:
        return
    out += [f"## Kernels: our dispatch and combine (backend {result['shape']['backend']})", ""]
    if result["meta"]["device"] != "cuda":
        out += _table(["op", "host wall (ms)"],
                      [[op, _num(kern[f"{op} (host wall)"]["median_ms"], ".2f")]
                       for op in (HANDLE, "dispatch", "combine") if f"{op} (host wall)" in kern])
    else:
        out += [_ceilings_line(result), "GB/s and floor are of the kernel-mode time.", ""]
        rows = []
        for op in (HANDLE, "dispatch", "combine"):
            k, e = kern.get(f"{op} (kernel)"), kern.get(f"{op} (e2e)")
            if k or e:
                k = k or {}
                rows.append([op, _us(k), _us(e), _num(k.get("phys_GBps"), ".1f"),
                             _num(k.get("logical_GBps"), ".1f"), _num(k.get("floor_us"), ".1f"),
                             _num(k.get("floor_pct"), ".0f")])
        out += _table(["op", "kernel (us)", "e2e (us)", "phys GB/s", "logical GB/s",
                       "floor (us)", "floor %"], rows)
    mode = MODES[result["meta"]["device"]][0]
    bound = [(op, kern.get(RANK_MAJOR.format(op=op, mode=mode)), kern.get(f"{op} ({mode})"))
             for op in ("dispatch", "combine")]
    if not any(row for _, row, _ in bound):
        return
    if mode == "kernel":
        out += ["### Rank-major lower bound", "",
                "DeepEP's layout through the same library: one row per (token, destination "
                "rank) instead of per (token, expert); the same link bytes, a K-th of the rows.",
                ""]
        out += _table(["op", "rank-major, kernel (us)", "expert-major, kernel (us)",
                       "phys GB/s", "logical GB/s"],
                      [[op, _us(rm), _us(em), _num((rm or {}).get("phys_GBps"), ".1f"),
                        _num((rm or {}).get("logical_GBps"), ".1f")] for op, rm, em in bound])
    else:
        out += ["### Rank-major layout", "",
                "One row per (token, destination rank) instead of per (token, expert), through "
                "the same library.", ""]
        out += _table(["op", "rank-major, host wall (ms)", "expert-major, host wall (ms)"],
                      [[op, _num(rm["median_ms"], ".2f") if rm else "-",
                        _num(em["median_ms"], ".2f") if em else "-"] for op, rm, em in bound])


def _checks(result: dict, out: list) -> None:
    lines = [f"- {name}: " + ", ".join(f"rank {r} {v}" for r, v in sorted(per_rank.items()))
             for name, per_rank in result.get("checks", {}).items()]
    for point in result.get("team") or []:
        lines += [f"- team EP={point['world']}, {name}: " + ", ".join(map(str, per_rank.values()))
                  for name, per_rank in point.get("checks", {}).items()]
    if lines:
        out += ["## Checks", ""] + lines + [""]


def _megatron(result: dict, out: list) -> None:
    meg = result.get("megatron") or {}
    if not meg:
        return
    cuda = result["meta"]["device"] == "cuda"
    out += ["## Megatron dispatchers, driven as MoELayer drives them", "",
            "dispatch = dispatch_preprocess + token_dispatch + dispatch_postprocess; combine = "
            "combine_preprocess + token_combine + combine_postprocess; fwd+bwd = dispatch, "
            "stand-in expert (rows x probs), combine, backward; expert = the stand-in expert's "
            "forward and backward alone. "
            + ("End to end from lined-up hosts (e2e)." if cuda else "Host wall time."), ""]
    scale, unit, spec = (1e3, "us", ".0f") if cuda else (1.0, "ms", ".2f")
    rows = []
    for disp in dict.fromkeys(name.split(".")[0] for name in meg):
        def cell(op, s, sp):
            row = meg.get(f"{disp}.{op}")
            return _num(row["median_ms"] * s, sp) if row else "-"
        rows.append([disp, cell("dispatch", scale, spec), cell("combine", scale, spec),
                     cell("fwd_bwd", 1.0, ".2f"), cell("expert_fwd_bwd", 1.0, ".2f")])
    out += _table(["dispatcher", f"dispatch ({unit})", f"combine ({unit})", "fwd+bwd (ms)",
                   "expert fwd+bwd (ms)"], rows)


def _team(result: dict, out: list) -> None:
    points = result.get("team") or []
    if not points:
        return
    out += ["## Team: EP>1 as a local team on one GPU", "",
            f"Every rank a thread with its own stream, {points[0]['num_sms']} SMs per rank: "
            f"{PROXY_NOTE}. collective = the last rank's start to the last "
            "rank's end; busy = each rank's own start to its end; fastest = the shortest "
            "collective.", ""]
    rows, skipped = [], []
    for point in points:
        if "skipped" in point:
            skipped.append(f"- EP={point['world']}: skipped, {point['skipped']}")
            continue
        for op in TEAM_OPS:
            row = point["items"].get(op)
            rows.append([point["world"], op, _us(row), _us(row, "busy_ms"), _us(row, "min_ms")])
    if rows:
        out += _table(["EP", "op", "collective (us)", "busy per rank (us)", "fastest (us)"], rows)
    if skipped:
        out += skipped + [""]


def _sweeps(result: dict, out: list) -> None:
    points = result.get("sweeps") or []
    if not points:
        return
    mode = sweep_mode(result)
    out += ["## Sweeps: the kernels section per tokens per rank and per SM budget", ""]
    if mode == "kernel":
        out += [_ceilings_line(result), ""]
        rows = []
        for p in points:
            row = [p["tokens"], p["num_sms"]]
            for op in ("dispatch", "combine"):
                r = p["items"].get(f"{op} (kernel)") or {}
                row += [_us(r) if r else "-", _num(r.get("phys_GBps"), ".1f"),
                        _num(r.get("logical_GBps"), ".1f"), _num(r.get("floor_pct"), ".0f")]
            rows.append(row)
        out += _table(["tokens", "SMs", "dispatch (us)", "phys GB/s", "logical GB/s", "floor %",
                       "combine (us)", "phys GB/s", "logical GB/s", "floor %"], rows)
    else:
        out += _table(["tokens", "dispatch, host wall (ms)", "combine, host wall (ms)"],
                      [[p["tokens"]] + [_num((p["items"].get(f"{op} ({mode})") or {})
                                             .get("median_ms"), ".2f")
                                        for op in ("dispatch", "combine")] for p in points])
    if result.get("plot"):
        out += [f"Plot: `{os.path.basename(result['plot'])}`", ""]


def render(result: dict) -> str:
    out = _header(result)
    ceil = result.get("ceilings") or {}
    if ceil:
        out += ["## Ceilings", "", "What the hardware moves without the library, on this "
                "run's GPUs (kernel mode).", ""]
        out += _table(["ceiling", "time (us)", "GB/s"],
                      [[name, _us(row), _num(row.get("phys_GBps"), ".1f")]
                       for name, row in ceil.items()])
    _kernels(result, out)
    _megatron(result, out)
    _team(result, out)
    _sweeps(result, out)
    _checks(result, out)
    if result.get("errors"):
        out += ["## Errors", ""]
        out += [f"- {e['section']}/{e['item']} rank {e['rank']}: "
                f"{((e['error'] or '').strip().splitlines() or [''])[0][:200]}"
                for e in result["errors"]] + [""]
    return "\n".join(out).rstrip() + "\n"


def write(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(render(result))
