"""Local teams under fresh-process stress: the GPU script's ``stress`` stage (tests/gpu/run.sh).

Every configuration (EP 2/4/8 local teams; LL in both layouts with bf16, fp16 and FP8 payloads;
HT in exact and capacity mode) runs first in a fresh process, under CUDA's default (lazy)
module loading, then repeats in that process with fresh routing and inputs each repetition:
uneven token counts, one rank with no tokens, masked slots, and the torch work an expert does
between dispatch and combine (casts to and from the payload dtype, elementwise math, a new
allocation of a random size, now and then a stream or device synchronization). Every output is
compared bitwise with the reference arithmetic (LL: tests/ll_oracle.py, the whole group over
megatron_nccl_ep.ll_reference's steps; HT: tests/dense.py, the oracle the reference backend is
tested against), the combine on the expert outputs the GPU computed. Timeouts are the groups'
(``--timeout-s``, 6 s).

    python tests/gpu/stress_teams.py [--processes 2] [--reps 50] [--only SUBSTRING] [--json PATH]

(CUDA_DEVICE_MAX_CONNECTIONS defaults to 32 here: a local team needs a hardware queue per rank.)

Prints one line per configuration: processes, repetitions, timeouts, mismatching elements (and
the first error, if any); exits non-zero if any configuration timed out, mismatched, or did not
run all its repetitions. ``--json`` writes the same as a record (``record``), rewritten after every
process so that a run cut short leaves what it finished; ``python -m benchmarks.readme --stress``
puts it into benchmarks/results.json.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: dense, ll_cases, ep_cases

# payload word -> (the token dtype, the LL payload dtype: None = the token dtype), torch names.
PAYLOADS = {"bf16": ("bfloat16", None), "fp16": ("float16", None),
            "fp8": ("bfloat16", "float8_e4m3fn")}


def configurations() -> list:
    configs = []
    for world in (2, 4, 8):
        for layout in ("expert_major", "rank_major"):
            for payload in PAYLOADS:
                configs.append(dict(name=f"LL EP={world} {layout} {payload}", kind="ll",
                                    world=world, layout=layout, payload=payload))
        for mode in ("exact", "capacity"):
            configs.append(dict(name=f"HT EP={world} {mode}", kind="ht", world=world, mode=mode))
    return configs


# -- inputs (host, one repetition) ----------------------------------------------------------
def token_counts(rng: random.Random, world: int, max_tokens: int, rep: int) -> list:
    """Uneven counts in [1, max_tokens], one rank (a different one each repetition) with none."""
    counts = [rng.randint(1, max_tokens) for _ in range(world)]
    counts[rep % world] = 0
    return counts


def ll_problem(cfg: dict, seed: int, rep: int):
    import torch

    import ll_cases

    rng = random.Random(seed * 1000 + rep)
    dtype = getattr(torch, PAYLOADS[cfg["payload"]][0])
    return ll_cases.make_ll_problem(
        cfg["world"], tokens=token_counts(rng, cfg["world"], 24, rep), hidden=256,
        num_experts=4 * cfg["world"], topk=4, dtype=dtype, max_tokens=24, max_topk=4,
        routing="masked" if rep % 2 else "random", seed=seed * 1000 + rep)


def ht_problem(cfg: dict, seed: int, rep: int):
    import torch

    import dense

    rng = random.Random(seed * 1000 + rep)
    counts = token_counts(rng, cfg["world"], 48, rep)
    return dense.make_problem(seed * 1000 + rep, cfg["world"], counts, 256, 4 * cfg["world"], 4,
                              torch.bfloat16, routing="masked" if rep % 2 else "random")


# -- the torch work between dispatch and combine ---------------------------------------------
def between(rng: random.Random, device) -> None:
    """A new allocation of a random size (NaN-filled: later outputs may reuse its memory), and
    now and then a stream or a device synchronization."""
    import torch

    scratch = torch.empty(rng.randint(1, 48) << 18, dtype=torch.float32, device=device)
    scratch.fill_(math.nan)
    del scratch
    roll = rng.random()
    if roll < 0.1:
        torch.cuda.synchronize(device)
    elif roll < 0.2:
        torch.cuda.current_stream(device).synchronize()


def ll_expert(out, layout: str, dtype):
    """Dequantize (a payload with scales: FP8), widen, scale, cast back to the token dtype."""
    from megatron_nccl_ep.config import LL_PAYLOADS

    x = out.x.float()
    if out.scales is not None:
        x = LL_PAYLOADS[out.x.dtype].dequant(out.x, out.scales)
    return (x * 1.5 - 0.25).to(dtype)


def team_limit(reps: int) -> float:
    """Seconds a process's ranks may take for all repetitions (a clean one takes a fraction of
    a second; a failed op ends its rank within two group timeouts)."""
    return 60.0 + 2.0 * reps


def poison(rank, group) -> None:
    """NaN in the rank's stream's allocator cache before the ranks meet: outputs carved from it
    show any row the kernels leave unwritten."""
    import torch

    held = [torch.empty(64 << 20, dtype=torch.uint8, device=group.device)]
    held += [torch.empty(1 << 18, dtype=torch.float32, device=group.device) for _ in range(16)]
    for t in held:
        t.fill_(255 if t.dtype == torch.uint8 else math.nan)  # 0xff bytes: NaN in every float
    del held
    torch.cuda.current_stream(group.device).synchronize()


# -- one process: one configuration, all its repetitions -------------------------------------
def run_ll(cfg: dict, seed: int, reps: int, timeout_s: float, device) -> dict:
    import torch

    import ll_cases
    import megatron_nccl_ep as ep
    from megatron_nccl_ep.outputs import LLDispatchOutput

    dtype_name, payload_name = PAYLOADS[cfg["payload"]]
    dtype, layout, world = getattr(torch, dtype_name), cfg["layout"], cfg["world"]
    payload = None if payload_name is None else getattr(torch, payload_name)
    em = layout == "expert_major"
    problems = [ll_problem(cfg, seed, rep) for rep in range(reps)]
    weights = [ll_cases.fresh_weights(p, seed + rep) for rep, p in enumerate(problems)]
    groups = ep.Group.local_team(world, **problems[0].group_fields(layout, payload), num_sms=16,
                                 timeout_s=timeout_s, device=device)

    def step(r, g, rep, rng):
        p = problems[rep]
        idx, x, w = (t[r].to(device) for t in (p.topk_idx, p.x, p.weights))
        cw = weights[rep][r].to(device) if em else None
        h = g.create_handle(idx)
        send_only = rep % 3 == 2  # a staged dispatch now and then
        out = h.dispatch(x, w, send_only=send_only)
        if send_only:
            between(rng, device)
            h.complete()
        expert_out = ll_expert(out, layout, dtype)
        between(rng, device)
        y = h.combine(expert_out, cw)
        h.destroy()
        return (LLDispatchOutput(**{k: None if v is None else v.cpu()
                                    for k, v in vars(out).items()}), expert_out.cpu(), y.cpu())

    results = run_team(ep, groups, rank_body(step, reps, seed), reps)
    return score(results, reps, lambda rep, per_rank: ll_mismatches(
        groups[0].config, problems[rep], weights[rep] if em else None, per_rank, layout))


def ll_mismatches(config, problem, cw, per_rank, layout) -> int:
    import ll_oracle
    from ep_cases import count_mismatches

    world = problem.world_size
    want = ll_oracle.ll_dispatch_all(config, world, problem.topk_idx, problem.x, problem.weights)
    want_y = ll_oracle.ll_combine_all(config, world, problem.topk_idx,
                                      [expert for _, expert, _ in per_rank], cw)
    bad = 0
    for r, (got, _, y) in enumerate(per_rank):
        bad += dispatch_mismatches(got, want[r], layout, count_mismatches)
        bad += count_mismatches(y, want_y[r])
    return bad


def dispatch_mismatches(got, want, layout: str, count) -> int:
    """Mismatching elements in the parts of an LL dispatch output the contract defines: the
    counts, and the rows below them (rank-major: topk_idx and topk_weights whole)."""
    if not (got.count.shape == want.count.shape and bool((got.count == want.count).all())):
        return max(1, want.x.numel())
    counts = [int(c) for c in want.count.flatten().tolist()]
    bad = 0
    if layout == "expert_major":
        for name in ("x", "scales", "src"):
            a, b = getattr(got, name), getattr(want, name)
            for l, c in enumerate(counts):
                bad += count(None if a is None else a[l, :c], None if b is None else b[l, :c])
    else:
        for name in ("x", "scales"):
            a, b = getattr(got, name), getattr(want, name)
            bad += count(None if a is None else a[:counts[0]], None if b is None else b[:counts[0]])
        bad += count(got.topk_idx, want.topk_idx) + count(got.topk_weights, want.topk_weights)
    return bad


def run_ht(cfg: dict, seed: int, reps: int, timeout_s: float, device) -> dict:
    import torch

    import dense
    import megatron_nccl_ep as ep
    from ep_cases import recv_rows_bound

    world, capacity = cfg["world"], None
    alignment = 4
    problems = [ht_problem(cfg, seed, rep) for rep in range(reps)]
    extra = {}
    if cfg["mode"] == "capacity":  # room for every slot of every token: never an overflow
        capacity = recv_rows_bound(world, 48, 4, 4, alignment)
        extra = dict(recv_mode="capacity", max_recv_tokens_per_rank=capacity)
    groups = ep.Group.local_team(world, num_experts=4 * world, hidden=256,
                                 max_tokens_per_rank=48, max_topk=4, dtype=torch.bfloat16,
                                 expert_alignment=alignment, num_sms=16, timeout_s=timeout_s,
                                 device=device, **extra)

    def step(r, g, rep, rng):
        p = problems[rep]
        idx, x, probs = (t[r].to(device) for t in (p.topk_idx, p.x, p.probs))
        h = g.create_handle(idx)
        recv_x, recv_p = h.dispatch(x, probs)
        expert_out = (recv_x.float() * recv_p[:, None] + 0.5).to(recv_x.dtype)
        between(rng, device)
        y = h.combine(expert_out)
        h.destroy()
        return recv_x.cpu(), recv_p.cpu(), expert_out.cpu(), y.cpu()

    results = run_team(ep, groups, rank_body(step, reps, seed), reps)

    def mismatches(rep, per_rank) -> int:
        from ep_cases import count_mismatches

        p, bad = problems[rep], 0
        expert_outs = [expert for _, _, expert, _ in per_rank]
        for r, (recv_x, recv_p, _, y) in enumerate(per_rank):
            want_x, want_p, _, _ = dense.dispatch(p, r, alignment, capacity)
            bad += count_mismatches(recv_x, want_x) + count_mismatches(recv_p, want_p)
            bad += count_mismatches(y, dense.combine(p, expert_outs, r, alignment))
        return bad

    return score(results, reps, mismatches)


def rank_body(step, reps: int, seed: int):
    """A rank's function for run_local_team: ``step(rank, group, rep, rng)`` for every
    repetition, its results kept; an error ends the rank's repetitions and comes back with them
    (the parent counts it)."""
    def body(r, g):
        rng, done = random.Random(seed * 31 + r), []
        try:
            for rep in range(reps):
                done.append(step(r, g, rep, rng))
            g.check_errors()
            return done, None
        except Exception as exc:  # noqa: BLE001 - counted and reported by the parent
            return done, f"{type(exc).__name__}: {exc}"

    return body


class Hung(Exception):
    """Ranks still running after team_limit: their groups are left alone (destroying a group
    under a rank's call would turn the report into a crash)."""


def run_team(ep, groups, body, reps: int) -> list:
    try:
        results = ep.run_local_team(groups, body, prepare=poison, timeout_s=team_limit(reps))
    except RuntimeError as exc:
        if "still running" in str(exc):
            raise Hung(str(exc)) from None
        for g in groups:
            g.destroy()
        raise
    for g in groups:
        g.destroy()
    return results


def score(results: list, reps: int, mismatches) -> dict:
    """The repetitions every rank finished, checked; the first error; whether it was a timeout
    (the group's wait: on the device, at the team's gate, or a peer's stop after one)."""
    finished = min(len(done) for done, _ in results)
    errors = [err for _, err in results if err is not None]
    bad = sum(mismatches(rep, [done[rep] for done, _ in results]) for rep in range(finished))
    timed_out = any(("timed out" in e or "stopped this group" in e) for e in errors)
    return dict(reps=finished, timeouts=int(timed_out), mismatches=bad,
                error=errors[0] if errors else None)


def child(cfg: dict, seed: int, reps: int, timeout_s: float, conn) -> None:
    try:
        import torch

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        run = run_ll if cfg["kind"] == "ll" else run_ht
        start = time.monotonic()
        result = run(cfg, seed, reps, timeout_s, device)
        result["seconds"] = time.monotonic() - start
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        hung = isinstance(exc, Hung)
        result = dict(reps=0, timeouts=int(hung or "timed out" in str(exc)), mismatches=0,
                      error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}")
        if hung:  # ranks are still inside calls: report, then leave without tearing down
            conn.send(result)
            conn.close()
            os._exit(1)
    conn.send(result)
    conn.close()


def clean(total: dict, reps: int) -> bool:
    """A configuration ran every repetition of each of its processes, with no timeout, no
    mismatching element and no error."""
    return (total["timeouts"] == 0 and total["mismatches"] == 0 and total["error"] is None
            and total["reps"] == total["processes"] * reps)


def record(argv: list, args, totals: dict, finished: bool) -> dict:
    """What ``--json`` writes: the machine, the sources (the bench's hash of them), the command,
    the settings, and per configuration its totals (``error``: the first line of the first) and
    whether it is clean; ``finished``: every process of every configuration ran."""
    import shlex
    import subprocess

    from benchmarks.report import source_version

    try:  # nvidia-smi: this process never touches CUDA (its children each make a fresh context)
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        device = ""
    return {"device": device.strip() or None, "source": source_version(), "command": shlex.join(["python"] + argv),
            "processes": args.processes, "reps": args.reps, "timeout_s": args.timeout_s,
            "module_loading": os.environ.get("CUDA_MODULE_LOADING", "lazy"),
            "finished": finished,
            "configurations": [
                {"name": name, **{k: t[k] for k in ("processes", "reps", "timeouts",
                                                    "mismatches", "seconds")},
                 "error": None if t["error"] is None else t["error"].splitlines()[0],
                 "clean": clean(t, args.reps)}
                for name, t in totals.items() if t["processes"]]}


def write_record(path: str, rec: dict) -> None:
    import json

    with open(path + ".tmp", "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(path + ".tmp", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="fresh processes per config")
    parser.add_argument("--reps", type=int, default=50, help="repetitions per process")
    parser.add_argument("--timeout-s", type=float, default=6.0, help="the groups' timeout")
    parser.add_argument("--only", default="", help="configurations whose name has this")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="write the totals as a record here")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    configs = [c for c in configurations() if args.only in c["name"]]
    # Each child is forked from a server that imported torch but never touched CUDA: a fresh
    # CUDA context and fresh module loading, without paying the imports each time.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megatron_nccl_ep", "megatron_nccl_ep.cuda_backend",
                                "dense", "ll_cases", "ep_cases"])
    print(f"stress: {len(configs)} configurations x {args.processes} fresh processes x "
          f"{args.reps} repetitions, timeout {args.timeout_s} s, CUDA_MODULE_LOADING="
          f"{os.environ.get('CUDA_MODULE_LOADING', '(unset: lazy)')}, "
          f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}",
          flush=True)
    totals = {c["name"]: dict(processes=0, reps=0, timeouts=0, mismatches=0, seconds=0.0,
                              error=None) for c in configs}
    limit = team_limit(args.reps) + 90
    for p in range(args.processes):
        for cfg in configs:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child, args=(cfg, args.seed + 97 * p, args.reps,
                                                   args.timeout_s, send))
            proc.start()
            send.close()
            try:
                result = recv.recv() if recv.poll(limit) else dict(
                    reps=0, timeouts=1, mismatches=0, error=f"no result after {limit:.0f} s")
            except EOFError:
                result = dict(reps=0, timeouts=0, mismatches=0, error="the process died")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            total = totals[cfg["name"]]
            total["processes"] += 1
            for key in ("reps", "timeouts", "mismatches"):
                total[key] += result[key]
            total["seconds"] += result.get("seconds", 0.0)
            total["error"] = total["error"] or result["error"]
            if args.json:
                write_record(args.json, record(sys.argv, args, totals, finished=False))
            print(f"  process {p + 1}: {cfg['name']}: {result['reps']} reps, "
                  f"{result.get('seconds', 0):.1f} s, timeouts {result['timeouts']}, "
                  f"mismatches {result['mismatches']}"
                  + (f", error: {result['error'].splitlines()[0]}" if result["error"] else ""),
                  flush=True)
    failed = 0
    print("== stress: configuration | processes | repetitions | timeouts | mismatching elements")
    for name, t in totals.items():
        ok = clean(t, args.reps)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name} | {t['processes']} | {t['reps']} | "
              f"{t['timeouts']} | {t['mismatches']}"
              + ("" if t["error"] is None else f" | {t['error'].splitlines()[0]}"))
    print(f"== stress: {len(totals) - failed} of {len(totals)} configurations clean")
    if args.json:
        write_record(args.json, record(sys.argv, args, totals, finished=True))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
