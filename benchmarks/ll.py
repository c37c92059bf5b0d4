"""The LL section: the low-latency mode (docs/design.md §9) at decode batch sizes.

One point per EP size of ``--ll-sizes``, each in a process of its own: EP=1 is a single-rank
``Group``; EP>1 a local team on GPU 0 (``Group.local_team``, as team.py runs HT), a PROXY: one GPU,
the peers' windows in its plain device memory (not NVLink), one HBM for every rank. A point runs
every (tokens per rank T of ``--ll-tokens``, payload of ``--ll-payloads``, layout of
``--ll-layouts``) on a group of ``mode="ll"`` with ``T_max = T``, and per T the HT path on the same
routings and tokens. Items, each a median over ``--iters`` iterations:

* ``handle``: ``create_handle(topk_idx)`` (no communication);
* ``dispatch``, ``combine``: one eager op each. A handle serves one dispatch and its combine, so
  the work around the timed op (a fresh handle; for the combine, its dispatch) runs untimed;
* ``graph h+d+c``: handle, dispatch and combine captured in ONE CUDA graph and replayed (GPUs);
* ``graph d+c``: dispatch and combine of a handle made before the capture, replayed (GPUs);
* HT (``mode="ht"``, exact): handle creation with the count read, dispatch, combine of the
  dispatched rows, and the three in a row (``h+d+c``), as the kernels section (EP=1, with the
  probabilities) and the team section (EP>1) call them. ``HT / graph`` = HT h+d+c / LL graph h+d+c.

Expert-major dispatches send no weights (the combine takes them at the source); rank-major ones
send them (they come out next to the rows). Timing: at EP=1 the kernels section's kernel mode on
GPUs (device time between CUDA events, the GPU held while the host enqueues), host wall time on
cpu; in a team, per iteration the last rank's start to the last rank's end (team.py).

HBM floor (``add_floors``, by the ceilings section's HBM copy rate of the same run): the bytes the
op must move at the least: dispatch reads each rank's tokens and writes its received rows once
(expert-major: one per (token, slot) there; rank-major: one per (token, rank); FP8 rows are
``H`` bytes and ``H/128`` fp32 scales), combine reads those rows and writes ``y`` once; summed over
the ranks of a team (they share one HBM). Checks per configuration: combine(dispatch(x)) against
x (the weights sum to 1; FP8 rows dequantized), the received rows against the routing, and each
graph's output bitwise against the eager call's.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from .kernels import rows_per_rank
from .machine import machine_info
from .runner import Rank, kernel_mode, random_tokens, random_topk, run_into
from .team import DEFAULT_CONNECTIONS, emit_team_times, run_team, skip_reason, team_loop

LL_OPS = ("handle", "dispatch", "combine", "graph h+d+c", "graph d+c")
GRAPH_OPS = LL_OPS[3:]
HT_OPS = ("handle + count read", "dispatch", "combine", "h+d+c")
# Check tolerances of combine(dispatch(x)) against x (the weights sum to 1): bf16 rounding of the
# weighted sum, and FP8 e4m3's 3 mantissa bits.
CHECK_TOLERANCE = {"fp8": 0.1}
CHECK_TOLERANCE_TOKENS = 1e-2
# The size query's configuration (docs/design.md §9 ncclEpGetMemorySize), at EP=8 and EP=64.
MEMORY_SHAPE = {"tokens": 128, "hidden": 7168, "experts": 256, "topk": 8, "dtype": "bf16"}
MEMORY_WORLDS = (8, 64)
DEEPEP_FP8_BLOCK = 128  # columns per scale of DeepEP's FP8 rows (its own; ours: config.FP8_BLOCK)


def payload_dtype(word: str):
    """The group's ``payload_dtype`` of an ``--ll-payloads`` word: None for the token dtype."""
    import torch

    from .cli import LL_PAYLOAD_DTYPES

    return getattr(torch, LL_PAYLOAD_DTYPES[word]) if word in LL_PAYLOAD_DTYPES else None


def ll_item(tokens: int, payload: str, layout: str, op: str) -> str:
    return f"T={tokens} {payload} {layout}: {op}"


def ht_item(tokens: int, op: str) -> str:
    return f"T={tokens} HT: {op}"


# ------------------------------------------------------------------------------------------------
# DeepEP's low-latency buffer, for the size query's comparison


def deepep_ll_buffer_bytes(tokens: int, hidden: int, experts: int) -> int:
    """Bytes per rank of DeepEP V1's low-latency buffer (its ``get_low_latency_rdma_size_hint``,
    the total of its ``LowLatencyLayout``), re-derived: two (odd/even) sets of a send buffer, a
    receive buffer and a signal buffer. A dispatch message is a 16-byte header and the larger of
    the bf16 row and the FP8 row with its fp32 scales; a combine message a bf16 row and a bf16
    pair per 128 columns. Receive buffers hold ``experts x tokens`` messages of either kind (send:
    ``tokens`` dispatch or ``experts x tokens`` combine messages), signals one int per expert
    rounded up to 128 bytes; the total then gains up to 128 bytes of alignment. It does not depend
    on the EP size."""
    scales = hidden // DEEPEP_FP8_BLOCK
    dispatch_msg = 16 + max(2 * hidden, hidden + 4 * scales)
    combine_msg = 4 * scales + 2 * hidden
    send = max(tokens * dispatch_msg, experts * tokens * combine_msg)
    recv = experts * tokens * max(dispatch_msg, combine_msg)
    signal = -(-4 * experts // 128) * 128
    total = 2 * (send + recv + signal)
    return (total // 128 + 1) * 128


def memory_query() -> dict:
    """``cuda_backend.ll_memory_size`` at MEMORY_SHAPE for EP=8 and EP=64, both layouts, next to
    DeepEP's buffer; ``{"skipped": why}`` where the query is missing."""
    try:
        import torch

        from megatron_nccl_ep import cuda_backend
        from megatron_nccl_ep.config import LL_LAYOUTS, GroupConfig
    except Exception as exc:  # noqa: BLE001 - the bench reports it instead of failing
        return {"skipped": f"megatron_nccl_ep.cuda_backend not importable: {exc}"}
    query = getattr(cuda_backend, "ll_memory_size", None)
    if query is None:
        return {"skipped": "megatron_nccl_ep.cuda_backend has no ll_memory_size"}
    s = MEMORY_SHAPE
    deepep = deepep_ll_buffer_bytes(s["tokens"], s["hidden"], s["experts"])
    rows = []
    for world in MEMORY_WORLDS:
        for layout in LL_LAYOUTS:
            row = {"world": world, "layout": layout, "deepep_bytes": deepep}
            try:
                config = GroupConfig.build(world, num_experts=s["experts"], hidden=s["hidden"],
                                           max_tokens_per_rank=s["tokens"], max_topk=s["topk"],
                                           dtype=torch.bfloat16, mode="ll", ll_layout=layout)
                row.update({key: int(value) for key, value in query(config, world).items()})
            except Exception as exc:  # noqa: BLE001 - one row's failure is its row's note
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return {"shape": dict(s), "rows": rows}


# ------------------------------------------------------------------------------------------------
# one rank's inputs and ops


class _Inputs:
    """One rank's ``--rotate`` routings, weights (softmax over the K slots) and tokens at T tokens,
    drawn from one generator per (rank, T): the LL configurations and HT of a T get the same."""

    def __init__(self, args, rank: int, tokens: int, dtype, device):
        import torch

        gen = torch.Generator(device=device).manual_seed(1_000_003 * tokens + 7919 * rank + 1)
        sets = range(args.rotate)
        self.tokens = tokens
        self.topk = [random_topk(gen, tokens, args.experts, args.topk) for _ in sets]
        self.weights = [torch.rand(tokens, args.topk, generator=gen, device=device).softmax(-1)
                        for _ in sets]
        self.x = [random_tokens(gen, tokens, args.hidden, dtype) for _ in sets]


def received(routings: list, experts: int, world: int) -> tuple:
    """(slots, pairs) per destination rank from one routing per source rank: slots = (token,
    slot) with the slot's expert there (expert-major rows), pairs = (token, rank) with at least
    one of the token's experts there (rank-major rows)."""
    import torch

    slots, pairs = [0] * world, [0] * world
    for topk in routings:
        for d, n in enumerate(rows_per_rank(topk, experts, world)):
            slots[d] += n
        valid = topk >= 0
        dest = torch.zeros(topk.shape[0], world, dtype=torch.bool, device=topk.device)
        dest.scatter_(1, torch.where(valid, topk // (experts // world), 0), valid)
        for d, n in enumerate(dest.sum(0).tolist()):
            pairs[d] += n
    return slots, pairs


def hbm_bytes(args, tokens: int, elt: int, everyone: list) -> dict:
    """The HBM floors' bytes (module doc), summed over the ranks (``everyone``'s inputs) and
    averaged over input sets: {(payload, layout, op) or ("ht", op): bytes}."""
    import torch

    from megatron_nccl_ep.config import LL_PAYLOADS

    world = len(everyone)
    token_row = args.hidden * elt
    payload_row = {}  # a payload dtype's row and scales
    for word in args.ll_payloads:
        dtype = payload_dtype(word)
        if dtype is not None:
            payload_row[word] = (args.hidden * torch.empty((), dtype=dtype).element_size()
                                 + 4 * (args.hidden // LL_PAYLOADS[dtype].scale_block))
    totals: dict = {}
    for s in range(args.rotate):
        slots, pairs = received([inp.topk[s] for inp in everyone], args.experts, world)
        inputs = world * tokens * token_row
        ht = inputs + sum(slots) * token_row
        found = {("ht", "dispatch"): ht, ("ht", "combine"): ht, ("ht", "h+d+c"): 2 * ht}
        for payload, layout in _configs(args):
            rows = sum(slots if layout == "expert_major" else pairs)
            dispatch = inputs + rows * payload_row.get(payload, token_row)
            combine = rows * token_row + inputs
            found.update({(payload, layout, "dispatch"): dispatch,
                          (payload, layout, "combine"): combine,
                          **{(payload, layout, op): dispatch + combine for op in GRAPH_OPS}})
        for key, value in found.items():
            totals[key] = totals.get(key, 0.0) + value / args.rotate
    return totals


class _LLOps:
    """One rank's LL configuration: its group, inputs, the combine's input and the ops timed."""

    def __init__(self, group, inputs: _Inputs, layout: str, dtype, rank: int):
        import torch

        self.group, self.inputs, self.layout, self.dtype = group, inputs, layout, dtype
        cfg = group.config
        rows = group.world_size * cfg.max_tokens_per_rank
        shape = ((group.num_local_experts, rows, cfg.hidden) if layout == "expert_major"
                 else (rows, cfg.hidden))
        gen = torch.Generator(device=group.device).manual_seed(31 * inputs.tokens + rank + 5)
        # The combine's input (rows past the counts are ignored), fresh values per point.
        self.expert_out = torch.empty(shape, dtype=dtype, device=group.device).normal_(
            generator=gen)
        self.n = len(inputs.topk)
        self.held = None  # the handle of the op being timed
        self.dc_handle = None  # the handle the d+c graph replays
        self.pairs: dict = {}
        self.keep: dict = {}  # op -> (graph, (its handle or None, its y))

    def handle(self, i: int):
        return self.group.create_handle(self.inputs.topk[i % self.n])

    def dispatch(self, handle, i: int):
        s = i % self.n
        rank_major = self.layout == "rank_major"
        return handle.dispatch(self.inputs.x[s], self.inputs.weights[s] if rank_major else None)

    def combine(self, handle, i: int):
        s = i % self.n
        expert_major = self.layout == "expert_major"
        return handle.combine(self.expert_out, self.inputs.weights[s] if expert_major else None)

    def eager_items(self) -> dict:
        """{op: (setup, fn, after)} as runner.Rank.measure takes them."""
        def fresh(i):
            self.held = self.handle(i)

        def fresh_dispatched(i):
            fresh(i)
            self.dispatch(self.held, i)

        def finish(i, _):
            self.held.destroy()
            self.held = None

        def combine_and_finish(i, out):
            self.combine(self.held, i)
            finish(i, out)

        return {"handle": (None, self.handle, lambda i, h: h.destroy()),
                "dispatch": (fresh, lambda i: self.dispatch(self.held, i), combine_and_finish),
                "combine": (fresh_dispatched, lambda i: self.combine(self.held, i), finish)}

    # -- the check: combine(dispatch(x)) = x (the weights sum to 1); rows against the routing ----
    def check_dispatch(self) -> None:
        self.check_handle = self.handle(0)
        self.check_out = self.dispatch(self.check_handle, 0)

    def check_rows(self) -> None:
        """The combine's input from the dispatch's valid rows (FP8 dequantized: ``q * scale``):
        expert-major the rows, rank-major each row times its weights' sum on this rank. No peer
        waits on it: in a team it runs between the team's calls."""
        import torch

        from megatron_nccl_ep.config import LL_PAYLOADS

        out = self.check_out
        valid = torch.arange(out.x.shape[-2], device=out.x.device) < out.count.unsqueeze(-1)
        if self.layout == "rank_major":
            valid = valid[0]
        rows = (out.x[valid].float() if out.scales is None else
                LL_PAYLOADS[out.x.dtype].dequant(out.x[valid], out.scales[valid]))
        if self.layout == "rank_major":
            rows = rows * out.topk_weights[valid].sum(-1, keepdim=True)
        self.expert_out[valid] = rows.to(self.dtype)
        self.check_count = int(out.count.sum())

    def check_combine(self) -> None:
        self.check_y = self.combine(self.check_handle, 0)

    def check_value(self, payload: str, expected_rows: int) -> str:
        ref = self.inputs.x[0].double() * self.inputs.weights[0].double().sum(-1, keepdim=True)
        err = ((self.check_y.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        self.check_handle.destroy()
        del self.check_out, self.check_y
        ok = (self.check_count == expected_rows
              and err < CHECK_TOLERANCE.get(payload, CHECK_TOLERANCE_TOKENS))
        return (f"{'ok' if ok else 'MISMATCH'} rows {self.check_count}/{expected_rows}, rel err "
                f"{err:.1e}")

    # -- graphs -----------------------------------------------------------------------------------
    def full_step(self) -> tuple:
        """(handle, y) of handle + dispatch + combine on input set 0."""
        handle = self.handle(0)
        self.dispatch(handle, 0)
        return handle, self.combine(handle, 0)

    def dc_step(self) -> tuple:
        self.dispatch(self.dc_handle, 0)
        return None, self.combine(self.dc_handle, 0)

    def graph_references(self) -> None:
        """Eager runs of what the graphs capture: a replay must give their outputs' bits."""
        handle, self.ref_full = self.full_step()
        handle.destroy()
        self.dc_handle = self.handle(0)
        self.ref_dc = self.dc_step()[1]

    def capture(self) -> None:
        self.keep["graph h+d+c"] = capture(self.full_step)
        self.keep["graph d+c"] = capture(self.dc_step)

    def replay(self, op: str):
        graph = self.keep[op][0]
        return lambda i: graph.replay()

    def graph_value(self) -> str:
        import torch

        same = [torch.equal(self.keep[op][1][1], ref)
                for op, ref in (("graph h+d+c", self.ref_full), ("graph d+c", self.ref_dc))]
        return (f"{'ok' if all(same) else 'MISMATCH'} graph h+d+c {'==' if same[0] else '!='} "
                f"eager, graph d+c {'==' if same[1] else '!='} eager (bitwise)")

    def release(self) -> None:
        """Frees the graphs, then the handles they replayed."""
        handles = [kept[1][0] for kept in self.keep.values()] + [self.dc_handle, self.held]
        self.keep.clear()
        for handle in handles:
            if handle is not None:
                handle.destroy()
        self.dc_handle = self.held = None


def capture(step) -> tuple:
    """(graph, what ``step()`` returned while captured), on a side stream after the current
    stream's work, capturing this thread's calls only (a local team's ranks capture at once).
    Not ``torch.cuda.graph``: that synchronizes the device and empties the allocator's cache,
    which a local team's streams keep their memory in."""
    import torch

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            kept = step()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the step's error is the one to report
                pass
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, kept


class _HTOps:
    """One rank's HT group on the same inputs: handles, their rows and the ops timed."""

    def __init__(self, group, inputs: _Inputs, probs: bool):
        self.group, self.inputs, self.probs = group, inputs, probs
        self.n = len(inputs.topk)
        self.handles: list = []
        self.pairs: dict = {}

    def _probs(self, s: int):
        return self.inputs.weights[s] if self.probs else None

    def start(self) -> None:
        self.handles = [self.group.create_handle(t) for t in self.inputs.topk]
        self.counts = [h.num_recv_tokens for h in self.handles]  # every rank's layout done
        self.rows = [h.dispatch(x)[0] for h, x in zip(self.handles, self.inputs.x)]

    def _counted(self, i: int):
        handle = self.group.create_handle(self.inputs.topk[i % self.n])
        handle.num_recv_tokens  # noqa: B018 - the exact-mode count read, as kernels times it
        return handle

    def _sequence(self, i: int):
        s = i % self.n
        handle = self._counted(s)
        recv, _ = handle.dispatch(self.inputs.x[s], self._probs(s))
        handle.combine(recv)
        return handle

    def eager_items(self) -> dict:
        x, n = self.inputs.x, self.n
        return {"handle + count read": (None, self._counted, lambda i, h: h.destroy()),
                "dispatch": (None, lambda i: self.handles[i % n].dispatch(
                    x[i % n], self._probs(i % n)), None),
                "combine": (None, lambda i: self.handles[i % n].combine(self.rows[i % n]), None),
                "h+d+c": (None, self._sequence, lambda i, h: h.destroy())}

    def destroy(self) -> None:
        for handle in self.handles:
            handle.destroy()


def group_fields(args, tokens: int, **mode) -> dict:
    """A point's Group keywords at T_max = ``tokens``, with ``mode``'s."""
    fields = {"num_experts": args.experts, "max_topk": args.topk, "hidden": args.hidden,
              "max_tokens_per_rank": tokens, "timeout_s": args.device_timeout, **mode}
    if args.ll_sms:
        fields["num_sms"] = args.ll_sms
    return fields


def _configs(args) -> list:
    return [(p, lay) for p in args.ll_payloads for lay in args.ll_layouts]


# ------------------------------------------------------------------------------------------------
# how a point calls its ranks: EP=1 on this thread, EP>1 a local team (team.py's runner)


class _One:
    """EP=1: a single-rank Group, every call on this thread, timed by runner.Rank.measure."""

    def __init__(self, me: Rank):
        self.me = me

    def groups(self, fields: dict) -> list:
        from megatron_nccl_ep.api import Group

        return [Group(backend=self.me.args.backend, device=self.me.device, dtype=self.me.dtype,
                      **fields)]

    def together(self, groups, fn, reserve: int) -> None:
        fn(0)

    def time(self, groups, names: dict, items, ranks, reserve: int) -> None:
        """Each op of ``names`` ({op: (item, HBM bytes or None)}); ``items(rank, op)`` gives its
        (setup, fn, after)."""
        me = self.me
        for op, (item, nbytes) in names.items():
            setup, fn, after = items(0, op)
            me.attempt(item, lambda: me.measure(
                item, fn, mode=kernel_mode(me.args.device), setup=setup, after=after,
                collective=False, extra={"hbm_bytes": nbytes} if nbytes else {}))


class _Team(_One):
    """EP>1: a local team on GPU 0, every rank a thread with its own stream (team.run_team)."""

    def groups(self, fields: dict) -> list:
        from megatron_nccl_ep.api import Group

        return Group.local_team(self.me.args.ll_world, dtype=self.me.dtype, device=self.me.device,
                                **fields)

    def together(self, groups, fn, reserve: int) -> None:
        _run_reserved(groups, lambda rank, group, meet: fn(rank), reserve)

    def time(self, groups, names: dict, items, ranks, reserve: int) -> None:
        def body(rank, group, meet):
            for op in names:
                ranks[rank].pairs[op] = team_loop(meet, self.me.args, *items(rank, op))

        try:
            _run_reserved(groups, body, reserve)
        finally:  # what every rank finished still counts
            emit_team_times(self.me, ranks, names)


def _run_reserved(groups: list, body, reserve: int):
    """``team.run_team(groups, body)`` with the ranks' memory reserved: before the ranks meet,
    each stream takes ``reserve`` bytes (and some small blocks) into its allocator cache, so that
    no call inside waits for a cudaMalloc, and torch's sleep kernel is loaded. The cache's free
    blocks are released first (the device is idle here): each call's streams are new to the
    allocator, which keeps blocks per stream."""
    import torch

    torch.cuda.empty_cache()

    def prepare(rank, group):
        import torch

        held = [torch.empty(reserve, dtype=torch.uint8, device=group.device)]
        held += [torch.empty(2**20, dtype=torch.uint8, device=group.device) for _ in range(16)]
        del held
        torch.cuda._sleep(1)

    return run_team(groups, body, prepare=prepare)


# ------------------------------------------------------------------------------------------------
# worker


def section(me: Rank) -> None:
    """One point's worker (no process group): every T of --ll-tokens, its LL configurations,
    then HT on the same inputs."""
    args, world = me.args, me.args.ll_world
    drive = _One(me) if world == 1 else _Team(me)
    for tokens in args.ll_tokens:
        everyone = [_Inputs(args, r, tokens, me.dtype, me.device) for r in range(world)]
        floor = hbm_bytes(args, tokens, me.elt, everyone)
        for payload, layout in _configs(args):
            me.attempt(f"T={tokens} {payload} {layout}", lambda: _ll_point(
                me, drive, tokens, payload, layout, everyone, floor))
        me.attempt(f"T={tokens} HT", lambda: _ht_point(me, drive, tokens, everyone, floor))


def _sync(me: Rank) -> None:
    if me.cuda:
        me.torch.cuda.synchronize()


def _report_check(me: Rank, name: str, values: list) -> None:
    """One check per configuration: a team's ranks' values in rank order after its verdict."""
    if len(values) > 1:
        status = "MISMATCH" if any(not v.startswith("ok") for v in values) else "ok"
        values = [f"{status}: " + "; ".join(f"r{r} {v}" for r, v in enumerate(values))]
    me.check(name, values[0])


def _ll_point(me: Rank, drive: _One, tokens: int, payload: str, layout: str, everyone: list,
              floor: dict) -> None:
    args = me.args
    groups = drive.groups(group_fields(args, tokens, mode="ll", ll_layout=layout,
                                       payload_dtype=payload_dtype(payload)))
    me.emit("info", data={"ll_backend_resolved": groups[0].backend_name})
    ranks = []
    try:
        ranks = [_LLOps(g, everyone[r], layout, me.dtype, r) for r, g in enumerate(groups)]
        _sync(me)
        # A rank's dispatch output and the check's copies of it, and its tokens' worth of y.
        reserve = 2 * ranks[0].expert_out.numel() * me.elt + 8 * tokens * args.hidden * me.elt \
            + 2**25

        def names(ops):
            return {op: (ll_item(tokens, payload, layout, op), floor.get((payload, layout, op)))
                    for op in ops}

        drive.time(groups, names(LL_OPS[:3]), lambda r, op: ranks[r].eager_items()[op], ranks,
                   reserve)
        # The check: the dispatch, the rows made from it between the ranks' calls, the combine.
        drive.together(groups, lambda r: ranks[r].check_dispatch(), reserve)
        for mine in ranks:
            mine.check_rows()
        _sync(me)
        drive.together(groups, lambda r: ranks[r].check_combine(), reserve)
        slots, pairs = received([inp.topk[0] for inp in everyone], args.experts, len(everyone))
        expected = slots if layout == "expert_major" else pairs
        _report_check(me, ll_item(tokens, payload, layout, "check"),
                      [mine.check_value(payload, expected[r]) for r, mine in enumerate(ranks)])
        if not me.cuda:
            return
        drive.together(groups, lambda r: ranks[r].graph_references(), reserve)
        _sync(me)
        # Every rank captures on its own thread at once: the captured calls pass the team's gate.
        drive.together(groups, lambda r: ranks[r].capture(), reserve)
        drive.time(groups, names(GRAPH_OPS), lambda r, op: (None, ranks[r].replay(op), None),
                   ranks, reserve)
        _report_check(me, ll_item(tokens, payload, layout, "graphs"),
                      [mine.graph_value() for mine in ranks])
    finally:
        _sync(me)
        for mine in ranks:
            mine.release()
        for group in groups:
            group.destroy()


def _ht_point(me: Rank, drive: _One, tokens: int, everyone: list, floor: dict) -> None:
    """HT on the same inputs: EP=1 as the kernels section calls it (with the probabilities),
    EP>1 as the team section does (without)."""
    args = me.args
    groups = drive.groups(group_fields(args, tokens, staging_chunk_tokens=args.staging_chunk_tokens,
                                       staging_depth=args.staging_depth))
    ranks = [_HTOps(g, everyone[r], probs=len(groups) == 1) for r, g in enumerate(groups)]
    # Per rank ~T x K rows for each input set and the timed ones, a quarter more for the spread.
    reserve = int(1.25 * (args.rotate + 2) * tokens * args.topk * args.hidden * me.elt) + 2**25
    try:
        drive.together(groups, lambda r: ranks[r].start(), reserve)
        drive.time(groups, {op: (ht_item(tokens, op), floor.get(("ht", op))) for op in HT_OPS},
                   lambda r, op: ranks[r].eager_items()[op], ranks, reserve)
    finally:
        _sync(me)
        for mine in ranks:
            mine.destroy()
        for group in groups:
            group.destroy()


# ------------------------------------------------------------------------------------------------
# parent


def team_skip_reason(world: int, num_sms: Optional[int], device: str,
                     sm_count: Optional[int]) -> str:
    """Why EP=``world`` cannot run as a local team here ('' when it can)."""
    if device != "cuda":
        return "a local team needs a GPU (Group.local_team runs the cuda backend)"
    from megatron_nccl_ep import cuda_backend

    problem = cuda_backend.unavailable_reason()
    if problem:
        return f"a local team needs the built extension: {problem}"
    if not num_sms:
        return f"{world} ranks leave no SM per rank on the GPU's {sm_count} SMs"
    connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") or DEFAULT_CONNECTIONS)
    return skip_reason(world, num_sms, sm_count, connections)


def point_sms(args, world: int, sm_count: Optional[int]) -> list:
    """The CTAs per LL kernel of a rank of each point at EP=``world``: each --ll-num-sms value
    ('all': the GPU's SMs), in a team at most the GPU's SMs / ranks (every CTA of every rank
    resident at once), without repeats; [None] on cpu."""
    if args.device != "cuda":
        return [None]
    wanted = [sm_count if value == "all" else value for value in args.ll_num_sms]
    return list(dict.fromkeys(v if world == 1 else min(v, sm_count // world) for v in wanted))


def run(result: dict, args: argparse.Namespace, budget_end: float) -> None:
    """Each EP size of --ll-sizes as a point of ``result['ll']['points']``, in its own process,
    and the size query (``memory_query``)."""
    cuda = args.device == "cuda"
    sm_count = machine_info("cuda")["sm_count"] if cuda else None
    out = result["ll"] = {"tokens": list(args.ll_tokens), "payloads": list(args.ll_payloads),
                          "layouts": list(args.ll_layouts), "points": [],
                          "memory": memory_query()}
    for world in args.ll_sizes:
        for sms in point_sms(args, world, sm_count):
            point = {"world": world, "num_sms": sms, "proxy": world > 1}
            reason = team_skip_reason(world, sms, args.device, sm_count) if world > 1 else ""
            if reason:
                out["points"].append({**point, "skipped": reason})
                continue
            if not cuda:
                point["skipped_items"] = {op: "CUDA graphs need a GPU" for op in GRAPH_OPS}
            point_args = argparse.Namespace(**{**vars(args), "nproc": 1, "ll_world": world,
                                               "ll_sms": sms})
            label = f"ll(EP={world})" if sms is None else f"ll(EP={world}, {sms} SMs)"
            items, checks, _ = run_into(result, label, section, point_args, budget_end,
                                        process_groups=False)
            out["points"].append({**point, "items": items, "checks": checks})


def points(result: dict) -> list:
    return (result.get("ll") or {}).get("points") or []


def add_floors(result: dict, hbm_gbps: float) -> None:
    """``floor_us`` and ``floor_pct`` of every LL item with HBM bytes, at the run's HBM rate."""
    for point in points(result):
        for row in point.get("items", {}).values():
            if isinstance(row.get("hbm_bytes"), float) and row.get("median_ms"):
                row["floor_us"] = row["hbm_bytes"] / hbm_gbps / 1e3
                row["floor_pct"] = 100.0 * row["floor_us"] / (row["median_ms"] * 1e3)

