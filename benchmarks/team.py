"""The team section: EP = N on ONE GPU, as a local team (``Group.local_team``); and the
local-team runner that the ll section's teams use too (``run_team``, ``team_loop``,
``emit_team_times``).

Every rank of the group lives in one process on GPU 0, each on its own thread and CUDA stream with
its own SM budget (``run_local_team``). A proxy for N GPUs, not a substitute: the peers' rings
are this GPU's memory (no NVLink), and the ranks share one HBM, so every rank's byte traffic lands
on it. What it does show is the engine's structure at EP >= 2 (smaller items, round and credit
waits, the handle's barrier) on a machine with one GPU.

Timing: per iteration every rank's thread meets the others, holds its stream with a sleep kernel
long enough for all ranks to enqueue, and brackets its op with CUDA events (one clock: one GPU).
The iteration's time runs from the last rank's start to the last rank's end (the collective from
the moment every rank is in it); per rank, its own start to its own end is its busy time.
Each world size is a point with its own process; a world is skipped, saying why, where its ranks'
CTAs cannot all be resident (world x --num-sms > the GPU's SMs) or its streams would share
hardware queues (CUDA_DEVICE_MAX_CONNECTIONS < 2 x world).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading

from .kernels import group_fields, rows_per_rank
from .machine import machine_info
from .runner import Rank, random_tokens, random_topk, run_into

OPS = ("handle: create", "dispatch", "combine")
PROXY_NOTE = "a proxy (one GPU: no NVLink, one HBM shared by every rank)"
# Every rank's host thread enqueues its op within this many sleep cycles of its stream.
HEAD_START_CYCLES = 1_000_000
MEET_TIMEOUT_S = 60.0  # how long a rank waits for its peers at an iteration's meeting
DEFAULT_CONNECTIONS = 8  # CUDA's hardware queues per context when the variable is unset


class _TeamRank:
    """One rank's inputs, handles and event pairs (on the stream run_local_team gives it)."""

    def __init__(self, rank: int, group, args: argparse.Namespace, dtype, elt: int):
        self.rank, self.group, self.args, self.dtype, self.elt = rank, group, args, dtype, elt
        self.pairs: dict = {op: [] for op in OPS}
        self.handles: list = []

    def prepare(self) -> None:
        """Before the ranks meet: this stream's memory, the inputs, and torch's sleep kernel
        loaded. An allocation that reaches cudaMalloc, or a kernel's first load, inside the timed
        ops could wait for the device, whose kernels wait for this rank's peers."""
        import torch

        a, device = self.args, self.group.device
        # Its expert rows (~T x K at any EP size, a quarter more for the spread) per routing and
        # one more, and its tokens.
        token_bytes = a.tokens * a.hidden * self.elt
        rows_bytes = a.topk * token_bytes
        reserve = torch.empty(int(1.25 * (a.rotate + 1) * rows_bytes)
                              + (2 * a.rotate + 2) * token_bytes, dtype=torch.uint8, device=device)
        del reserve
        # One generator for every input set of this rank (runner.Rank.input_set: one per draw).
        gen = torch.Generator(device=device).manual_seed(1000 + self.rank)
        self.routings = [random_topk(gen, a.tokens, a.experts, a.topk) for _ in range(a.rotate)]
        self.x = [random_tokens(gen, a.tokens, a.hidden, self.dtype) for _ in range(a.rotate)]
        torch.cuda._sleep(1)

    def start(self) -> None:
        """The ranks' first calls: a handle per routing and the rows to combine."""
        self.handles = [self.group.create_handle(r) for r in self.routings]
        rows = [h.num_recv_tokens for h in self.handles]  # waits for every rank's layout
        # The first routing's counts, checked after the team ends (a copy: the handles are gone).
        self.rows, self.tokens_per_expert = rows[0], self.handles[0].tokens_per_expert.clone()
        self.expert_out = [h.dispatch(x)[0] for h, x in zip(self.handles, self.x)]

    def items(self) -> dict:
        """{op: (setup, fn, after)} as team_loop takes them; iteration i on input set i mod
        --rotate."""
        n = self.args.rotate

        def create(i):
            return self.group.create_handle(self.routings[i % n])

        def created(i, handle):
            handle.num_recv_tokens  # waits for the peers' layouts (each rank its own stream)
            handle.destroy()

        def dispatch(i):
            self.handles[i % n].dispatch(self.x[i % n])

        def combine(i):
            self.handles[i % n].combine(self.expert_out[i % n])

        return {"handle: create": (None, create, created), "dispatch": (None, dispatch, None),
                "combine": (None, combine, None)}

    def release(self) -> None:
        for handle in self.handles:
            handle.destroy()


def section(me: Rank) -> None:
    """Runs in a worker of its own (no process group): the whole team is this process."""
    from megatron_nccl_ep.api import Group

    args = me.args
    world = args.team_world
    groups = Group.local_team(world, num_experts=args.experts, max_topk=args.topk,
                              dtype=me.dtype, device=me.device, recv_mode=args.recv_mode,
                              capacity_factor=args.capacity_factor, **group_fields(args))
    try:
        ranks = [_TeamRank(r, g, args, me.dtype, me.elt) for r, g in enumerate(groups)]

        def body(rank: int, group, meet) -> None:
            import torch

            mine = ranks[rank]
            mine.start()
            items = mine.items()
            for op in OPS:
                mine.pairs[op] = team_loop(meet, args, *items[op])
            torch.cuda.current_stream().synchronize()

        run_team(groups, body, prepare=lambda rank, group: ranks[rank].prepare(),
                 cleanup=lambda rank: ranks[rank].release())
        info = groups[0].info()  # the library's staging choices: facts of this point
        me.emit("point", data={key: int(info[key]) for key in ("staging_chunk_tokens",
                                                               "staging_depth") if key in info})
        # Rows every rank receives from the team's first routing.
        sent = [rows_per_rank(mine.routings[0], args.experts, world) for mine in ranks]
        expected = [sum(rows[d] for rows in sent) for d in range(world)]
        got = [(mine.rows, int(mine.tokens_per_expert.sum())) for mine in ranks]
        ok = all(counts == want and (args.recv_mode == "capacity" or rows == want)
                 for (rows, counts), want in zip(got, expected))
        me.check("rows / sum(tokens_per_expert) / expected, per rank",
                 f"{'ok' if ok else 'MISMATCH'} "
                 + " ".join(f"{rows}/{counts}/{want}" for (rows, counts), want
                            in zip(got, expected)))
        emit_team_times(me, ranks, {op: (op, None) for op in OPS})
    finally:
        for group in groups:
            group.destroy()


# ------------------------------------------------------------------------------------------------
# the local-team runner: this section's teams and the ll section's


def run_team(groups: list, body, *, prepare=None, cleanup=None) -> list:
    """``body(rank, group, meet)`` on every rank of a local team at once (api.run_local_team,
    which runs ``prepare(rank, group)`` on each rank's stream before the ranks meet), ``meet`` a
    fresh barrier of the ranks (``team_loop``'s). A rank that raises breaks it, so that its peers
    stop waiting for it; then ``cleanup(rank)`` runs on the rank's thread, whatever happened."""
    from megatron_nccl_ep.api import run_local_team

    meet = threading.Barrier(len(groups))

    def guarded(rank, group):
        try:
            return body(rank, group, meet)
        except BaseException:
            meet.abort()  # the peers stop waiting for this rank
            raise
        finally:
            if cleanup is not None:
                cleanup(rank)

    return run_local_team(groups, guarded, prepare=prepare)


def team_loop(meet, args, setup, fn, after) -> list:
    """One rank's (start, end) events of one timed op: per iteration the ranks meet, ``setup``
    runs untimed, the stream is held while every rank enqueues, then ``fn`` between the events
    (``after`` on its result, untimed)."""
    import torch

    pairs = []
    for it in range(args.warmup + args.iters):
        meet.wait(timeout=MEET_TIMEOUT_S)
        if setup is not None:
            setup(it)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HEAD_START_CYCLES)
        start.record()
        out = fn(it)
        end.record()
        if after is not None:
            after(it, out)
        del out
        torch.cuda.current_stream().synchronize()
        if it >= args.warmup:
            pairs.append((start, end))
    return pairs


def summarize(iterations: list) -> tuple:
    """Per iteration, every rank's (start, end) in ms on one clock -> per iteration the
    collective time (the last start to the last end), and the median of every rank's busy time
    (its own start to its own end)."""
    collective = [max(e for _, e in it) - max(s for s, _ in it) for it in iterations]
    busy = [e - s for it in iterations for s, e in it]
    return collective, statistics.median(busy)


def emit_team_times(me: Rank, ranks: list, names: dict) -> None:
    """Per op of ``names`` ({op: (item, HBM bytes or None)}) that every rank timed in full (a
    rank's ``pairs[op]``, from ``team_loop``): per iteration the last start to the last end on
    rank 0's clock (one GPU), and a rank's median busy time (``summarize``)."""
    for op, (item, nbytes) in names.items():
        if not all(len(mine.pairs.get(op, ())) == me.args.iters for mine in ranks):
            continue
        ref = ranks[0].pairs[op][0][0]  # one clock for every rank: rank 0's first start
        iterations = [[(ref.elapsed_time(mine.pairs[op][it][0]),
                        ref.elapsed_time(mine.pairs[op][it][1])) for mine in ranks]
                      for it in range(me.args.iters)]
        collective, busy = summarize(iterations)
        extra = {"busy_ms": busy, **({"hbm_bytes": nbytes} if nbytes else {})}
        me.emit("times", item, times_ms=collective, extra=extra)


# ------------------------------------------------------------------------------------------------
# parent


def skip_reason(world: int, num_sms: int, sm_count: int, connections: int) -> str:
    """Why a world cannot run as a local team on this GPU ('' when it can)."""
    if world * num_sms > sm_count:
        return (f"{world} ranks x {num_sms} SMs > the GPU's {sm_count} SMs (every CTA of every "
                f"rank must be resident at once)")
    if connections < 2 * world:
        return (f"{world} ranks need CUDA_DEVICE_MAX_CONNECTIONS >= {2 * world}, this process "
                f"has {connections}: set it (e.g. 32) before the bench starts")
    return ""


def run(result: dict, args: argparse.Namespace, budget_end: float) -> None:
    """Each world size of --team-sizes as a point of ``result['team']``, in its own process
    (with the library's staging choices of that world, where its worker reported them)."""
    sm_count = machine_info("cuda")["sm_count"]
    connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") or DEFAULT_CONNECTIONS)
    for world in args.team_sizes:
        point = {"world": world, "num_sms": args.num_sms}
        reason = skip_reason(world, args.num_sms, sm_count, connections)
        if reason:
            result["team"].append({**point, "skipped": reason})
            continue
        team_args = argparse.Namespace(**{**vars(args), "nproc": 1, "team_world": world})
        items, checks, facts = run_into(result, f"team(EP={world})", section, team_args,
                                        budget_end, process_groups=False)
        result["team"].append({**point, **facts, "items": items, "checks": checks})
