"""``--markdown PATH``: the run as markdown (benchmarks/RESULTS.md as published).

A header that names the sources, the machine, the command and the shape, then one table per
section that ran, each headed by what it is and, where floors are derived, by the ceilings of the
same run.
"""

from __future__ import annotations

import os

from . import experts
from .host import FLOOR_OP, HOST_OPS, HOST_REPEATS
from .kernels import HANDLE, RANK_MAJOR
from .report import (LL_TARGET_TOKENS, cells, ceiling_rows, check_rows, first_line, floor_rates,
                     host_floor_us, host_rows, kernel_cells, ll_check_summary, ll_header,
                     ll_memory_rows, ll_rows, ll_target_text, ll_targets, megatron_rows,
                     experts_rows, NODES_COLUMNS, nodes_check_summary, nodes_header, nodes_rows,
                     shape_extras, sweep_rows, team_rows, times_us)
from .runner import e2e_mode, item_name, kernel_mode
from .sweeps import sweep_mode
from .team import PROXY_NOTE


def _table(header: list, rows: list, specs: tuple = ()) -> list:
    """A table; the last cells of each row are numbers, formatted by ``specs`` (report.fmt).
    A column of numbers (or dashes) is aligned right, any other left; the first always left."""
    n = len(header) - len(specs)
    body = [list(map(str, row[:n])) + cells(row[n:], specs) for row in rows]

    def numeric(cell: str) -> bool:
        try:
            float(cell.strip().rstrip("x%").replace(",", ""))
            return True
        except ValueError:
            return cell.strip() in ("-", "")

    right = [i > 0 and all(numeric(r[i]) for r in body) for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(" ---: " if r else " --- " for r in right) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return lines + [""]


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
        + "".join(f", {extra}" for extra in shape_extras(shape)),
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
    device = result["meta"]["device"]
    mode = kernel_mode(device)
    if device != "cuda":
        out += _table(["op", "host wall (ms)"],
                      [[op, kern[item_name(op, mode)]["median_ms"]]
                       for op in (HANDLE, "dispatch", "combine") if item_name(op, mode) in kern],
                      (".2f",))
    else:
        out += [_ceilings_line(result), "GB/s and floor are of the kernel-mode time.", ""]
        rows = []
        for op in (HANDLE, "dispatch", "combine"):
            k, e = kern.get(item_name(op, mode)), kern.get(item_name(op, e2e_mode(device)))
            if k or e:  # GB/s and floor of the kernel mode
                time_us, *rates = kernel_cells(k)
                rows.append([op, time_us, *times_us(e, "median_ms"), *rates])
        out += _table(["op", "kernel (us)", "e2e (us)", "phys GB/s", "logical GB/s",
                       "floor (us)", "floor %"], rows, (".1f",) * 5 + (".0f",))
    bound = [(op, kern.get(item_name(RANK_MAJOR.format(op), mode)), kern.get(item_name(op, mode)))
             for op in ("dispatch", "combine")]
    if not any(row for _, row, _ in bound):
        return
    if mode == "kernel":
        out += ["### Rank-major lower bound", "",
                "DeepEP's layout through the same library: one row per (token, destination "
                "rank) instead of per (token, expert); the same link bytes, a K-th of the rows.",
                ""]
        rows = []
        for op, rm, em in bound:
            time_us, *rates = kernel_cells(rm, ("phys_GBps", "logical_GBps"))
            rows.append([op, time_us, *times_us(em, "median_ms"), *rates])
        out += _table(["op", "rank-major, kernel (us)", "expert-major, kernel (us)",
                       "phys GB/s", "logical GB/s"], rows, (".1f",) * 4)
    else:
        out += ["### Rank-major layout", "",
                "One row per (token, destination rank) instead of per (token, expert), through "
                "the same library.", ""]
        out += _table(["op", "rank-major, host wall (ms)", "expert-major, host wall (ms)"],
                      [[op, *((row or {}).get("median_ms") for row in (rm, em))]
                       for op, rm, em in bound], (".2f",) * 2)


def _checks(result: dict, out: list) -> None:
    checks, team_checks = check_rows(result)
    lines = [f"- {name}: " + ", ".join(f"rank {rank} {value}" for rank, value in values)
             for name, values in checks]
    lines += [f"- team EP={world}, {name}: " + ", ".join(map(str, values))
              for world, name, values in team_checks]
    if lines:
        out += ["## Checks", ""] + lines + [""]


def _megatron(result: dict, out: list) -> None:
    unit, rows = megatron_rows(result)
    if not rows:
        return
    cuda = result["meta"]["device"] == "cuda"
    out += ["## Megatron dispatchers, driven as MoELayer drives them", "",
            "dispatch = dispatch_preprocess + token_dispatch + dispatch_postprocess; combine = "
            "combine_preprocess + token_combine + combine_postprocess; fwd+bwd = dispatch, "
            "stand-in expert (rows x probs), combine, backward; expert = the stand-in expert's "
            "forward and backward alone. "
            + ("End to end from lined-up hosts (e2e)." if cuda else "Host wall time."), ""]
    out += _table(["dispatcher", f"dispatch ({unit})", f"combine ({unit})", "fwd+bwd (ms)",
                   "expert fwd+bwd (ms)"], rows, (".0f" if cuda else ".2f",) * 2 + (".2f",) * 2)


def _experts(result: dict, out: list) -> None:
    factor_rows, layer_rows = experts_rows(result)
    if not (factor_rows or layer_rows):
        return
    shape = ", ".join(f"{k} {v}" for k, v in experts.SHAPE.items())
    out += ["## Experts: what a dropless budget costs", "",
            f"One GPU, EP=1, check_training's GRAPH_MODEL MoE layer ({shape}, "
            f"{result['shape']['tokens']} tokens, bf16); kernel time of forward + backward, "
            "median, and the peak of memory allocated above the step's inputs. The budget is "
            "factor x the balanced share, the routed rows the same at every factor: nccl_ep's "
            "grouped experts (the packed layout, device counts) compute the routed rows, "
            "SequentialMLP (the fixed layout) every budget row.", ""]
    if factor_rows:
        out += _table(["budget factor", "grouped (ms)", "peak (MiB)", "SequentialMLP (ms)",
                       "peak (MiB)"], factor_rows, (".2f", ".0f") * 2)
    if layer_rows:
        out += ["Megatron's MoELayer (router, dispatcher, experts), forward + backward, eager "
                "and replayed from one CUDA graph:", ""]
        out += _table(["configuration", "eager (ms)", "peak (MiB)", "graph (ms)",
                       "peak (MiB)"], layer_rows, (".2f", ".0f") * 2)


def _training(result: dict, out: list) -> None:
    """examples/check_training.py's records (``result["training"]``, put there by
    ``python -m benchmarks.readme --training``): each check's outcome and each run's step."""
    records = result.get("training") or []
    if not records:
        return
    out += ["## Training: Megatron's pretrain() end to end", "",
            "examples/check_training.py: every run with --deterministic-mode; a step is "
            "Megatron's elapsed time per iteration (the median of its log intervals after the "
            "first, which holds the warm-up and the graph capture). The checks and their runs: "
            "the script's docstring.", ""]
    for record in records:
        source = record.get("source") or {}
        out += [f"- machine: {record.get('gpus')} x {record.get('device')}; sources "
                f"`{source.get('sources_sha256')}`; script: {record.get('script')}",
                f"- command: `{record.get('command')}`", ""]
        out += _table(["check", "outcome"],
                      [(check["label"], ("PASS: " if check["passed"] else "FAIL: ")
                        + check["detail"]) for check in record["checks"]])
        out += _table(["run", "iterations", "graphs", "step (ms)", "tokens/s"],
                      [(name, run["iterations"], "yes" if run["graphs"] else "no",
                        run.get("ms"), run.get("tokens_per_s"))
                       for name, run in record["runs"].items()], (".1f", ".0f"))


def _stress(result: dict, out: list) -> None:
    """tests/gpu/stress_teams.py's record (``result["stress"]``, put there by
    ``python -m benchmarks.readme --stress``): each configuration's totals."""
    record = result.get("stress")
    if not record:
        return
    source = record.get("source") or {}
    out += ["## Stress: local teams in fresh processes", "",
            "tests/gpu/stress_teams.py: each configuration first in a fresh process (CUDA module "
            f"loading {record['module_loading']}), then repeated with fresh uneven routing, a rank "
            "with no tokens, masked slots and torch work between the ops; every output compared "
            "bitwise with the reference arithmetic; the groups' timeout "
            f"{record['timeout_s']:g} s. A team is one process on one GPU (a proxy of EP ranks).",
            "", f"- machine: {record.get('device')}; sources `{source.get('sources_sha256')}`",
            f"- command: `{record.get('command')}`"
            + ("" if record.get("finished") else " (cut short: the configurations it finished)"),
            ""]
    configs = record["configurations"]
    out += _table(["configuration", "outcome", "processes", "repetitions", "timeouts",
                   "mismatching elements", "seconds"], _stress_rows(configs),
                  ("d",) * 4 + (".1f",))
    out += [f"{sum(c['clean'] for c in configs)} of {len(configs)} configurations clean.", ""]


def _stress_rows(configs: list) -> list:
    """A row per failed configuration, and one per mode and EP size ("LL EP=2") for the clean
    ones with the same processes: their variants named, repetitions and seconds summed."""
    rows, clean = [], {}
    for c in configs:
        if not c["clean"]:
            rows.append((c["name"], f"FAIL: {c['error'] or 'incomplete'}", c["processes"],
                         c["reps"], c["timeouts"], c["mismatches"], c["seconds"]))
            continue
        mode, ep, *variant = c["name"].split()
        clean.setdefault((f"{mode} {ep}", c["processes"]), []).append((" ".join(variant), c))
    for (prefix, processes), group in clean.items():
        name = (f"{prefix} {group[0][0]}" if len(group) == 1
                else f"{prefix}: {', '.join(variant for variant, _ in group)}")
        rows.append((name, "clean", processes, *(sum(c[key] for _, c in group)
                                                 for key in ("reps", "timeouts", "mismatches",
                                                             "seconds"))))
    return rows


def _host(result: dict, out: list) -> None:
    op_rows, step_rows, meg_rows = host_rows(result)
    if not (op_rows or step_rows or meg_rows):
        return
    out += ["## Host cost: what a call costs the host, next to its kernels", "",
            "EP=1, one process (benchmarks/host.py). host = the host's time to enqueue one call, "
            "the GPU held by a sleep kernel so that no call waits for it, of calls made in a loop "
            f"({HOST_REPEATS} in a row); host, first = the first of them, after a device "
            "synchronize; kernel = the call's "
            "device time; out= = the LL call writing into the previous call's outputs. HT on "
            f"{result['shape']['num_sms']} SMs, exact mode and capacity mode of T x top-k rows; "
            "LL on every SM, T_max = T; inference = NcclEpInferenceDispatcher's methods "
            "(dispatch: preprocess + token_dispatch + postprocess, the LL handle and dispatch; "
            "combine: the same three, the LL combine of the experts' fp32 rows) on a rank-major LL "
            "group on every SM. Times in us.", ""]
    if op_rows:
        out += _table(["configuration", "", *HOST_OPS], op_rows, (".1f",) * len(HOST_OPS))
    floor = host_floor_us(result)
    if floor is not None:
        out += [f"The floor of this run: {FLOOR_OP} (`torch.cuda._sleep(1)`, one launch through "
                f"torch) costs the host {floor:.1f} us to enqueue, measured as the calls are.", ""]
    if step_rows:
        out += ["A step = handle + dispatch + combine (inference: its methods' dispatch and "
                "combine). eager: steps back to back from an idle "
                "GPU, wall time per step; graph: the step captured once and replayed back to "
                "back, wall time per replay; graph kernel: one replay's device time.", ""]
        out += _table(["configuration", "eager step", "graph step", "graph kernel",
                       "eager / graph kernel"], step_rows, (".1f",) * 3 + (".2f",))
    if meg_rows:
        out += ["NcclEpTokenDispatcher's methods (dispatch = dispatch_preprocess + token_dispatch "
                "+ dispatch_postprocess, combine = combine_preprocess + token_combine + "
                "combine_postprocess), e2e from an idle GPU, next to the kernels they launch "
                "(the HT items of the same T and receive mode).", ""]
        out += _table(["T", "dispatch", "handle + dispatch kernels", "over", "combine",
                       "combine kernel", "over"], meg_rows, (".1f",) * 6)
    profiles = result.get("host_profiles") or {}
    if profiles:  # diagnostics: the bench prints them, results.json keeps them
        out += [f"torch.profiler profiles of the eager steps ({', '.join(profiles)}): the bench's "
                "output and results.json's `host_profiles`.", ""]


def _team(result: dict, out: list) -> None:
    points = team_rows(result)
    if not points:
        return
    out += ["## Team: EP>1 as a local team on one GPU", "",
            f"Every rank a thread with its own stream, {result['team'][0]['num_sms']} SMs per "
            f"rank: {PROXY_NOTE}. collective = the last rank's start to the last "
            "rank's end; busy = each rank's own start to its end; fastest = the shortest "
            "collective.", ""]
    rows = [(world, *op_row) for world, _, ops in points for op_row in ops]
    if rows:
        out += _table(["EP", "op", "collective (us)", "busy per rank (us)", "fastest (us)"], rows,
                      (".1f",) * 3)
    skipped = [f"- EP={world}: skipped, {why}" for world, why, _ in points if why]
    if skipped:
        out += skipped + [""]


def _ll(result: dict, out: list) -> None:
    if not result.get("ll"):
        return
    cuda = result["meta"]["device"] == "cuda"
    columns, rows, skipped = ll_rows(result)
    out += ["## LL: low-latency dispatch and combine", "", ll_header(result) + ".", ""]
    if cuda:
        rates = floor_rates(result)
        out += [("Floors: the op's minimal HBM bytes (the tokens read and the received rows "
                 "written once, or the reverse; a team's ranks summed, one HBM) / the HBM copy "
                 f"rate of this run, {rates['hbm']:.1f} GB/s. " if rates["hbm"] else
                 "No ceilings section in this run: no floors. ")
                + "graph h+d+c: handle, dispatch and combine in one CUDA graph, replayed; graph "
                "d+c: dispatch and combine of one handle; HT h+d+c: mode='ht' on the same "
                "routing and tokens, the exact-mode count read included; HT / graph = HT h+d+c / "
                "graph h+d+c.", ""]
    unit = "us" if cuda else "ms"
    header = ["EP"] + (["SMs"] if cuda else []) + ["T", "payload", "layout"] + [
        name if name == "HT / graph" else f"{name} ({unit})" for name in columns]
    specs = tuple(".1f" if cuda else ".2f" for _ in columns)
    if rows:  # no SM budget on cpu
        out += _table(header, [(ep, *([sms] if cuda else []), tokens, payload, layout, *v)
                               for ep, sms, tokens, payload, layout, *v in rows], specs)
    if skipped:
        out += [f"- EP={ep}: skipped, {why}" for ep, why in skipped] + [""]
    targets = ll_targets(result)
    if targets:
        out += [f"Targets at EP=1, T={LL_TARGET_TOKENS}, bf16 (printed, not asserted):", ""]
        out += [f"- {ll_target_text(target)}" for target in targets] + [""]
    _ll_memory(result, out)
    passed, done, bad = ll_check_summary(result)
    if done:
        out += [f"Checks (combine(dispatch(x)) against x and the rows against the routing; the "
                f"graphs bitwise against eager calls): {passed} of {done} ok.", ""]
        out += [f"- EP={ep}, {name}: {value}" for ep, name, value in bad]
        out += [""] if bad else []


def _nodes(result: dict, out: list) -> None:
    if not result.get("nodes"):
        return
    times, rows, skipped = nodes_rows(result)
    out += ["## Nodes: HT over emulated nodes, what the rail carries", "",
            nodes_header(result) + ".", "",
            "Per op and routing, per token of a rank and per call: the rows and bytes this rank "
            "handed the rail (the deltas of `Group.info()`'s `rail_rows_sent` / "
            "`rail_bytes_sent` over the timed calls); p counted = those rows / ((N - 1) T), the "
            "share of a token's slots on a given other node; p formula = docs/internode.md's; "
            "every token = the bytes of a rail that carried every token to every remote node "
            "(the dispatch's weights as max(E, K) slots of 8 bytes); packed / every token = "
            "the counted bytes over those.", ""]
    if rows:
        out += _table(["NxG", "routing", "op", *times, *NODES_COLUMNS], rows,
                      (".1f" if len(times) > 1 else ".2f",) * len(times)
                      + (".3f", ".1f", ".3f", ".3f", ".1f", ".3f"))
    if skipped:
        out += [f"- {shape}: skipped, {why}" for shape, why in skipped] + [""]
    passed, done, bad = nodes_check_summary(result)
    if done:
        out += [f"Checks (every rank's counted rail rows equal its routing's messages, its bytes "
                f"those rows x their row bytes, per op): {passed} of {done} ok.", ""]
        out += [f"- {shape}, {name}, rank {rank}: {value}" for shape, name, rank, value in bad]
        out += [""] if bad else []


def _ll_memory(result: dict, out: list) -> None:
    shape, rows, why = ll_memory_rows(result)
    out += ["### LL memory per rank", ""]
    if why:
        out += [f"The size query did not run: {why}.", ""]
        return
    out += [f"`ll_memory_size` at T_max {shape['tokens']}, hidden {shape['hidden']}, "
            f"{shape['experts']} experts, top-{shape['topk']}, {shape['dtype']}, next to DeepEP "
            "V1's low-latency buffer for the same shape (its get_low_latency_rdma_size_hint, "
            "which does not depend on the EP size).", ""]
    failed = [row for row in rows if len(row) == 3]
    done = [row for row in rows if len(row) != 3]
    if done:
        out += _table(["EP", "layout", "window (MiB)", "device (MiB)", "handles (MiB)",
                       "total (MiB)", "DeepEP V1 (MiB)", "DeepEP / total"], done,
                      (".1f",) * 6)
    if failed:
        out += [f"- EP={world} {layout}: the query failed: {first_line(error)[:200]}"
                for world, layout, error in failed] + [""]


def _sweeps(result: dict, out: list) -> None:
    points = sweep_rows(result)
    if not points:
        return
    out += ["## Sweeps: the kernels section per tokens per rank and per SM budget", ""]
    if sweep_mode(result) == "kernel":
        out += [_ceilings_line(result), ""]
        out += _table(["tokens", "SMs", "dispatch (us)", "phys GB/s", "logical GB/s", "floor %",
                       "combine (us)", "phys GB/s", "logical GB/s", "floor %"],
                      [(tokens, sms, *values) for tokens, sms, values, _ in points],
                      (".1f", ".1f", ".1f", ".0f") * 2)
    else:
        out += _table(["tokens", "dispatch, host wall (ms)", "combine, host wall (ms)"],
                      [(tokens, *values) for tokens, _, values, _ in points], (".2f",) * 2)
    if result.get("plot"):
        out += [f"Plot: `{os.path.basename(result['plot'])}`", ""]


def render(result: dict) -> str:
    out = _header(result)
    ceilings = ceiling_rows(result)
    if ceilings:
        out += ["## Ceilings", "", "What the hardware moves without the library, on this "
                "run's GPUs (kernel mode).", ""]
        out += _table(["ceiling", "time (us)", "GB/s"], ceilings, (".1f",) * 2)
    _kernels(result, out)
    _megatron(result, out)
    _team(result, out)
    _ll(result, out)
    _nodes(result, out)
    _host(result, out)
    _experts(result, out)
    _training(result, out)
    _stress(result, out)
    _sweeps(result, out)
    _checks(result, out)
    if result.get("errors"):
        out += ["## Errors", ""]
        out += [f"- {e['section']}/{e['item']} rank {e['rank']}: {first_line(e['error'])[:200]}"
                for e in result["errors"]] + [""]
    return "\n".join(out).rstrip() + "\n"


def write(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(render(result))
