"""The reference backend: docs/design.md §3 (layout) and §4 (arithmetic) in plain PyTorch over
torch.distributed. It is the oracle of every CUDA test (bitwise), and the path of machines without
a GPU (gloo on CPU).

Its transport mirrors the CUDA one: a token travels once to each rank that owns one of its experts
(``all_to_all_single`` of byte rows), then the destination expands it into its expert rows; combine
reduces a token's rows on each rank, sends one partial per (token, rank) back, and the source sums
the partials in rank order (node by node when the group has ``ranks_per_node``). Every sum starts
from +0.0 and adds in the order of the contract, one elementwise IEEE add at a time, so the bits do
not depend on the device that runs it.

NOTES: errors that one rank detects (bad routing, capacity overflow) are agreed on by every rank
before anyone raises, so no rank is left waiting in a collective. A rank that does not come (it
stopped, died, or calls something else) is caught by ``_collective``: every collective starts
only once the store says every rank arrived at it, within ``timeout_s``.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import ClassVar, List, Optional

import torch
import torch.distributed as dist

from . import ll_reference as llr
from . import rendezvous
from .config import GroupConfig, routing_error, shape_error
from .errors import NcclEpError
from .outputs import LLDispatchOutput, ll_dispatch_fields, new_dispatch_output


def _bytes_as(byte_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, w]`` uint8 (a column slice of received rows) as ``[n, w / itemsize]`` of ``dtype``.
    A copy into a fresh tensor: ``.contiguous()`` keeps the slice's row stride when n is 0, which
    ``view`` then rejects for wider dtypes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out = torch.empty((byte_rows.shape[0], byte_rows.shape[1] // itemsize), dtype=dtype,
                      device=byte_rows.device)
    out.view(torch.uint8).copy_(byte_rows)
    return out


def _word(op: str) -> str:
    """``op`` as one word of a progress record (its fields are separated by spaces)."""
    return op.replace(" ", "_")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 tokens accumulate in float64, every other token dtype in float32 (docs/design.md §4)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def routing_map_to_topk(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """``routing_map [T, E]`` (bool) -> ``[T, topk]`` int64: each token's routed experts in
    ascending order, -1 after the last. A token with n > topk routed experts holds ``-1 - n`` in
    its last slot (below -1: ``routing_error`` reports it), as the CUDA backend's record does."""
    tokens, num_experts = routing_map.shape
    slot = torch.cumsum(routing_map, dim=1) - 1
    # Unrouted experts (and those past the topk-th) go to a spare column that is dropped.
    slot = torch.where(routing_map & (slot < topk), slot, topk)
    experts = torch.arange(num_experts, device=routing_map.device).expand(tokens, -1)
    topk_idx = torch.full((tokens, topk + 1), -1, dtype=torch.int64, device=routing_map.device)
    topk_idx = topk_idx.scatter_(1, slot, experts)[:, :topk].contiguous()
    routed = routing_map.sum(1)
    over = routed > topk
    topk_idx[over, topk - 1] = -1 - routed[over]
    return topk_idx


def drop_past_capacity(routing: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``routing [R, T, K]`` (every source rank's top-k ids) with each source's slots for an
    expert past the ``capacity``-th, counted in token order, masked (-1): the drop of the
    fixed-capacity layout (docs/design.md §3). It depends on the source's own routing only."""
    tokens = routing.shape[1]
    s, t, k = (routing >= 0).nonzero(as_tuple=True)
    run = s * num_experts + routing[s, t, k]  # one run per (source, expert)
    order = torch.argsort(run * tokens + t)  # unique keys: a token names an expert once
    run_sorted = run[order]
    position = torch.empty_like(order)
    position[order] = (torch.arange(len(order), device=routing.device)
                       - torch.searchsorted(run_sorted, run_sorted))
    drop = position >= capacity
    routing = routing.clone()
    routing[s[drop], t[drop], k[drop]] = -1
    return routing


#: The ops that send over the rail, as ``Group.info()`` names them (ncclEpGroupInfo_t's order).
RAIL_OPS = ("dispatch", "combine", "combine_probs")
#: Bytes of one routing weight (or its gradient) on the rail: a slot of max_topk per token,
#: whatever the dtype (docs/internode.md).
RAIL_SLOT_BYTES = 8


def rail_message_tokens(routing: torch.Tensor, config: GroupConfig,
                        world_size: int) -> Optional[torch.Tensor]:
    """Groups that span nodes (docs/internode.md): ``[R, N]`` int64, the tokens of source s
    with a slot on node n != node(s) (0 at its own node): its rail message to n, from every
    rank's routing ``[R, T, K]`` as gathered (masked slots and padding -1; before any
    fixed-capacity drop). None for a group of one node."""
    G = config.node_size(world_size)
    if G == world_size:
        return None
    N, per_node = world_size // G, G * (config.num_experts // world_size)
    node_of = torch.where(routing >= 0, routing // per_node, -1)  # [R, T, K]
    counts = torch.stack([(node_of == n).any(2).sum(1) for n in range(N)], 1)  # [R, N]
    home = torch.arange(world_size, device=routing.device) // G
    counts[torch.arange(world_size, device=routing.device), home] = 0
    return counts.to(torch.int64)


@dataclasses.dataclass
class ReferenceHandleState:
    num_recv_tokens: int
    tokens_per_expert: torch.Tensor  # [L] int64
    topk_idx: torch.Tensor  # [T, K] int64, this rank's routing
    send_tokens: List[torch.Tensor]  # per destination rank: token indices with a slot there, asc.
    recv_counts: List[int]  # per source rank: tokens received (one per token, not per slot)
    recv_rows: torch.Tensor  # [sum(recv_counts), K] int64: output row of each slot here, or -1
    # Groups that span nodes: the tokens this rank hands the rail per op, as the cuda backend's
    # messages carry them (docs/internode.md): (dispatch, combine and combine_probs).
    rail_rows: tuple = (0, 0)
    # Creation read its shapes on the host (.tolist()) after converting the routing.
    routing_released: ClassVar[bool] = True


@dataclasses.dataclass
class ReferenceLLState:
    """One LL handle (docs/design.md §9): this rank's routing, what it sends where, and between
    a dispatch and its combine where the received slots went."""

    topk_idx: torch.Tensor  # [T, K] int64
    error: Optional[str]  # the routing's value error, raised at the dispatch on every rank
    plan: Optional[List[torch.Tensor]]  # per destination rank: tokens with an expert there
    received: Optional[llr.LLReceived] = None  # the latest dispatch's record (once complete)
    pending: Optional[object] = None  # send_only: the complete step (writes the outputs)
    num_recv_tokens: ClassVar[int] = 0  # HT's fields: an LL handle has no HT layout
    tokens_per_expert: ClassVar[Optional[torch.Tensor]] = None
    routing_released: ClassVar[bool] = True  # the routing is copied at creation


def _records_nothing(backward) -> None:
    """The reference's ops record no autograd (``records_grad_fn`` False: autograd.py wraps them
    in Functions)."""
    if backward is not None:
        raise TypeError("the reference backend records no backward in its ops (records_grad_fn "
                        "is False): call it with backward=None")


class ReferenceBackend:
    """``backend.Backend`` in plain PyTorch."""

    name = "torch"
    #: The front end checks every call (the reference takes what it is given).
    checks_calls = False
    #: autograd.py wraps its ops in torch.autograd.Functions (``backward`` is always None).
    records_grad_fn = False

    @staticmethod
    def check(config: GroupConfig, world_size: int, device) -> None:
        """The library's rules of a configuration, in Python (``GroupConfig.check_rules``: the
        reference has no library to ask); every configuration that passes runs here (any dtype,
        device, hierarchy, capacity)."""
        config.check_rules(world_size)

    def __init__(self, config: GroupConfig, process_group, device=None):
        self.config = config
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.num_local_experts = config.num_experts // self.world_size
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._calls = 0  # collectives entered, the same count on every rank of a healthy group
        self._stopped: Optional[str] = None
        # What the rail carried from this rank, per op (the cuda backend's ncclEpGroupGetInfo).
        self._rail_sent = {op: [0, 0] for op in RAIL_OPS}
        if self.world_size > 1:
            prefix, seq = rendezvous.next_scope(process_group, "progress")
            self._progress = f"{prefix}/{seq}"
            self._host_wait = dist.get_backend(process_group) == "gloo"

    @classmethod
    def local_team(cls, config: GroupConfig, world_size: int, device=None) -> list:
        raise RuntimeError("the reference backend has no local team: its ranks are processes of "
                           "a torch.distributed group (Group.local_team runs the cuda backend)")

    def info(self) -> dict:
        """Nothing allocated or chosen beyond the configuration; what a group that spans nodes
        handed the rail, counted as the cuda backend's messages carry it (0 on one node)."""
        return {"rail_rows_sent": {op: rows for op, (rows, _) in self._rail_sent.items()},
                "rail_bytes_sent": {op: size for op, (_, size) in self._rail_sent.items()}}

    def _count_rail(self, op: str, rows: int, row_bytes: int) -> None:
        self._rail_sent[op][0] += rows
        self._rail_sent[op][1] += rows * row_bytes

    # -- collectives (identity with a single rank) -------------------------------------------------
    def _collective(self, op: str, launch) -> None:
        """Runs ``launch()`` (an ``async_op=True`` collective) once every rank has arrived at it,
        as its record in the store says (calls entered, op, stopped or not), waiting at most
        ``timeout_s`` for that and, over gloo, again for the collective (a peer dying inside). A
        rank that is not heard from is named, and the group stops: every later call raises at
        once, and a late peer finds the stop in the records instead of entering a collective
        that nobody else joins (gloo aborts a process whose peer sends a mismatched one)."""
        if self._stopped is not None:
            raise NcclEpError(self._stopped)
        self._calls += 1
        kv = rendezvous.store()
        kv.set(self._record(self.rank), f"{self._calls} {_word(op)}")
        self._await_peers(op, kv)
        try:
            work = launch()
            if self._host_wait:  # gloo: the work is done on the host anyway
                work.wait(timeout=datetime.timedelta(seconds=self.config.timeout_s))
            else:  # NCCL: stream-ordered, as before; its watchdog covers a peer dying inside
                work.wait()
        except RuntimeError as exc:
            self._stop(op, kv, f"the collective failed: {str(exc).strip()}")

    def _record(self, rank: int) -> str:
        return f"{self._progress}/{rank}"

    def _read_record(self, kv, rank: int) -> Optional[tuple]:
        """(calls entered, last op, stopped) of ``rank``, None before its first call."""
        key = self._record(rank)
        if not kv.check([key]):
            return None
        calls, last, *state = kv.get(key).decode().split()
        return int(calls), last, bool(state)

    def _await_peers(self, op: str, kv) -> None:
        waiting = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.config.timeout_s
        pause = 0.0
        while waiting:
            for r in list(waiting):
                record = self._read_record(kv, r)
                if record is not None and record[2]:
                    self._stop(op, kv, "")
                if record is not None and record[0] >= self._calls:
                    waiting.remove(r)
            if waiting and time.monotonic() >= deadline:
                self._stop(op, kv, f"not heard from within timeout_s={self.config.timeout_s:g} s")
            if waiting:
                time.sleep(pause)
                pause = min(2 * pause or 1e-4, 5e-3)

    def _stop(self, op: str, kv, detail: str) -> None:
        """Stops the group on this rank and raises the reason, read from the peers' records."""
        n, me = self._calls, self.rank
        behind, stopped = [], []
        for r in range(self.world_size):
            if r == me:
                continue
            record = self._read_record(kv, r)
            if record is None:
                behind.append(f"rank {r} (no call recorded: none made, or its group destroyed)")
            elif record[2]:  # (calls, rank, why): the first to stop is the root cause
                stopped.append((record[0], r, f"rank {r} stopped this group after its "
                                              f"{record[1]} failed"))
            elif record[0] < n:
                behind.append(f"rank {r} (its last call: {record[1]}, #{record[0]})")
        kv.set(self._record(me), f"{n} {_word(op)} stopped")
        self._stopped = (f"this group stopped after {op} failed on rank {me}; destroy it and "
                         "create a new one on every rank")
        # The root cause first: a peer that stopped the group when that is what this rank saw
        # (peers behind it may just be slower), else a rank that never came, else one that gave
        # up before this one.
        if stopped and not detail:
            why = f"{min(stopped)[2]} (seen by rank {me})"
        elif behind:
            why = f"rank {me} waited for {', '.join(behind)}, which did not reach this {op} " \
                  f"(call #{n})"
        elif stopped:
            why = f"{min(stopped)[2]} (seen by rank {me})"
        else:
            why = f"rank {me}: every peer reached it"
        raise NcclEpError(f"{op}: {why}" + (f"; {detail}" if detail else "")
                          + "; this group is stopped") from None

    def _all_gather(self, op: str, t: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return t.unsqueeze(0)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._collective(op, lambda: dist.all_gather(parts, t.contiguous(), group=self.group,
                                                     async_op=True))
        return torch.stack(parts)

    def _all_gather_text(self, op: str, text: Optional[str]) -> list:
        """Every rank's ``text`` (None allowed), through two timed tensor all-gathers."""
        data = torch.tensor(list((text or "").encode()), dtype=torch.uint8, device=self.device)
        sizes = self._all_gather(op, torch.tensor([-1 if text is None else len(data)],
                                                  dtype=torch.int64, device=self.device))
        padded = torch.zeros(max(1, int(sizes.max())), dtype=torch.uint8, device=self.device)
        padded[:len(data)] = data
        rows = self._all_gather(op, padded)
        return [None if n < 0 else bytes(rows[r, :n].tolist()).decode()
                for r, n in enumerate(sizes.flatten().tolist())]

    def _all_to_all_rows(self, op: str, rows: torch.Tensor, send_counts: List[int],
                         recv_counts: List[int]) -> torch.Tensor:
        """Sends ``rows`` (grouped by destination rank) and returns the received rows grouped by
        source rank. Rows travel as bytes so any dtype works on any backend."""
        width = rows.shape[1]
        if self.world_size == 1:
            return rows.clone()
        out = torch.empty((sum(recv_counts), width), dtype=rows.dtype, device=rows.device)
        if width == 0:
            return out
        self._collective(op, lambda: dist.all_to_all_single(
            out.view(torch.uint8), rows.contiguous().view(torch.uint8),
            output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group,
            async_op=True))
        return out

    def _first_error(self, op: str, error: Optional[str]) -> tuple:
        """(rank, message) of the lowest rank whose ``error`` is not None. Collective: call it
        on every rank once a collective has shown that some rank has one."""
        messages = [error] if self.world_size == 1 else self._all_gather_text(op, error)
        return next((r, m) for r, m in enumerate(messages) if m is not None)

    def _raise_agreed_error(self, op: str, error: Optional[str], any_error: bool,
                            exc_type) -> None:
        """Raise ``exc_type`` on every rank when any rank found an error (``any_error``, agreed
        by a collective the caller already made); the message is the first failing rank's."""
        if not any_error:
            return
        first, message = self._first_error(op, error)
        where = "" if self.world_size == 1 else f" (rank {first})"
        raise exc_type(message + where)

    def agree_on_arguments(self, op: str, error: Optional[Exception]) -> None:
        """Raises on every rank when any rank's arguments to ``op`` are wrong: the failing rank
        its own exception, the others a ValueError naming that rank and its reason."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        flags = self._all_gather(op, torch.tensor([error is not None], device=self.device))
        if not bool(flags.any()):
            return
        first, message = self._first_error(op, None if error is None else str(error))
        if error is not None:
            raise error
        raise ValueError(f"{op}: rank {first} passed wrong arguments ({message}); every rank of "
                         "the group raises")

    # -- handle ------------------------------------------------------------------------------------
    def create_handle(self, routing: torch.Tensor, from_map: bool) -> ReferenceHandleState:
        cfg, R, L = self.config, self.world_size, self.num_local_experts
        device = routing.device
        if from_map:
            topk_idx = routing_map_to_topk(routing, cfg.max_topk)
        else:
            topk_idx = routing.to(torch.int64)
        tokens, topk = topk_idx.shape
        name = "routing_map" if from_map else "topk_idx"
        error = (shape_error(topk_idx, cfg, name)
                 or routing_error(topk_idx, cfg.num_experts, from_map))
        shapes = self._all_gather("create_handle", torch.tensor(
            [tokens, topk, error is not None], dtype=torch.int64, device=device)).tolist()
        self._raise_agreed_error("create_handle", error, any(bad for _, _, bad in shapes),
                                 ValueError)
        if any(k != topk for _, k, _ in shapes):
            raise ValueError(f"topk_idx top-k differs across ranks: {[k for _, k, _ in shapes]}; "
                             "every rank must route with the same top-k")
        # Padded to the most tokens any rank has now, not to max_tokens_per_rank: the cost
        # follows the batch.
        t_pad = max(1, max(t for t, _, _ in shapes))
        padded = torch.full((t_pad, topk), -1, dtype=torch.int64, device=device)
        padded[:tokens] = topk_idx
        routing = self._all_gather("create_handle", padded)  # [R, t_pad, K]: all routing
        rail_counts = rail_message_tokens(routing, cfg, R)  # before the drop, as the library
        C = cfg.expert_capacity
        if C:  # fixed capacity: dropped slots are masked from here on
            routing = drop_past_capacity(routing, cfg.num_experts, C)

        # Rows per (destination rank, local expert), then the expert-major bases of every rank.
        owner = torch.where(routing >= 0, routing // L, -1)
        counts = torch.zeros((R, cfg.num_experts), dtype=torch.int64, device=device)
        valid = routing >= 0
        src = torch.arange(R, device=device).view(R, 1, 1).expand_as(routing)
        counts.index_put_((src[valid], routing[valid]),
                          torch.ones_like(routing[valid]), accumulate=True)
        per_expert = counts.sum(0).view(R, L)  # [dest, local expert]
        align = cfg.expert_alignment
        if C:  # R sub-blocks of C rows per expert, whatever the routing
            blocks = torch.full_like(per_expert, cfg.expert_block_rows(R))
        else:
            blocks = (per_expert + align - 1) // align * align
        recv_totals = blocks.sum(1)
        dropping = cfg.recv_mode == "capacity" and cfg.capacity_overflow == "drop"
        if cfg.recv_mode == "capacity" and not dropping:
            over = [(d, int(n)) for d, n in enumerate(recv_totals.tolist())
                    if n > cfg.max_recv_tokens_per_rank]
            if over:
                d, n = over[0]
                raise NcclEpError(
                    f"capacity overflow: rank {d} would receive {n} rows but "
                    f"max_recv_tokens_per_rank={cfg.max_recv_tokens_per_rank}; raise the capacity "
                    "(or capacity factor) or use exact mode")
        rail_rows = self._rail_rows(rail_counts)
        me = self.rank
        base = torch.cumsum(blocks[me], 0) - blocks[me]  # [L] first row of each local expert

        # Output row of every slot owned here: ordered by (local expert, source rank, token).
        s_idx, t_idx, k_idx = (owner == me).nonzero(as_tuple=True)
        local_expert = routing[s_idx, t_idx, k_idx] - me * L
        order = torch.argsort((local_expert * R + s_idx) * t_pad + t_idx)
        le_sorted = local_expert[order]
        first_of_expert = torch.cumsum(per_expert[me], 0) - per_expert[me]
        rows_sorted = base[le_sorted] + torch.arange(len(order), device=device) \
            - first_of_expert[le_sorted]
        if C:  # each source's run starts at its own sub-block, s * C rows into the expert's
            s_sorted = s_idx[order]
            from_source = counts.view(R, R, L)[:, me]  # [source, local expert]: slots here
            before = torch.cumsum(from_source, 0) - from_source  # of lower source ranks
            rows_sorted = rows_sorted - before[s_sorted, le_sorted] + s_sorted * C
        if dropping:  # rows past the output: no row (the token still arrives, its slot is -1)
            rows_sorted = torch.where(rows_sorted < cfg.max_recv_tokens_per_rank, rows_sorted, -1)
        slot_rows = torch.full_like(routing, -1)
        slot_rows[s_idx[order], t_idx[order], k_idx[order]] = rows_sorted

        # Tokens received: one per (source, token) with a slot here, source-major, token order.
        has_slot_here = (owner == me).any(2)  # [R, t_pad]
        recv_counts = has_slot_here.sum(1).tolist()
        recv_rows = slot_rows[has_slot_here]  # [n_recv, K], (s, t) order
        send_tokens = [(owner[me, :tokens] == d).any(1).nonzero().flatten() for d in range(R)]

        num_recv = (cfg.max_recv_tokens_per_rank if cfg.recv_mode == "capacity"
                    else int(recv_totals[me]))
        tokens_per_expert = blocks[me].clone()  # padded: sum == N_d (docs/design.md §3)
        tokens_per_expert = (tokens_per_expert.cpu() if cfg.recv_mode == "exact"
                             else tokens_per_expert.to(device))
        return ReferenceHandleState(num_recv, tokens_per_expert, topk_idx, send_tokens,
                                    recv_counts, recv_rows, rail_rows)

    def _rail_rows(self, counts: Optional[torch.Tensor]) -> tuple:
        """(dispatch, return) rows this rank hands the rail per op, from ``counts`` [R, N] (the
        tokens of source s with a slot on node n): exact mode its own tokens per remote node in
        the dispatch, and per remote node m those of the rank of its index there in the combine
        and combine_probs; capacity mode ``rail_capacity`` rows per remote node, after checking
        every pair against it (an error on every rank: each computes every pair)."""
        if counts is None:
            return (0, 0)
        cfg, R = self.config, self.world_size
        G = cfg.node_size(R)
        N, home, q = R // G, self.rank // G, self.rank % G
        if cfg.recv_mode == "capacity":
            budget = cfg.rail_capacity or cfg.max_tokens_per_rank
            for s, row in enumerate(counts.tolist()):
                for n, c in enumerate(row):
                    if c > budget:
                        raise NcclEpError(
                            f"rail capacity overflow: rank {s} has {c} tokens with a slot on node "
                            f"{n} but rail_capacity={budget} tokens per message between nodes; "
                            "raise rail_capacity (0 = max_tokens_per_rank, which never "
                            "overflows) or use exact mode")
            return ((N - 1) * budget, (N - 1) * budget)
        remote = [n for n in range(N) if n != home]
        return (sum(int(counts[self.rank, n]) for n in remote),
                sum(int(counts[m * G + q, home]) for m in remote))

    def check_errors(self) -> None:
        """Nothing is ever pending: the reference raises every error in the call itself."""

    def topk_idx(self, state: ReferenceHandleState) -> torch.Tensor:
        return state.topk_idx.clone()  # the state may hold the caller's own tensor

    def destroy_handle(self, state: ReferenceHandleState) -> None:
        pass

    def destroy(self) -> None:
        # A stopped group keeps its record: a late peer reads who stopped it.
        if self.world_size > 1 and self._stopped is None:
            try:
                rendezvous.store().delete_key(f"{self._progress}/{self.rank}")
            except (RuntimeError, NotImplementedError):  # a store without deletion keeps it
                pass

    # -- operations --------------------------------------------------------------------------------
    def dispatch(self, state: ReferenceHandleState, x: torch.Tensor,
                 probs: Optional[torch.Tensor], dense: bool = False, backward=None):
        _records_nothing(backward)
        hidden_bytes = x.shape[1] * x.element_size()
        if probs is not None and dense:  # [T, E] -> slot order (masked slots carry nothing)
            probs = probs.gather(1, state.topk_idx.clamp(min=0))
        send_idx = torch.cat(state.send_tokens)
        payload = [x[send_idx].view(torch.uint8)]
        if probs is not None:
            payload.append(probs[send_idx].view(torch.uint8))
        received = self._all_to_all_rows("dispatch", torch.cat(payload, 1),
                                         self._send_counts(state), state.recv_counts)
        weights = 0 if probs is None else RAIL_SLOT_BYTES * self.config.max_topk
        self._count_rail("dispatch", state.rail_rows[0], hidden_bytes + weights)
        recv_tokens = _bytes_as(received[:, :hidden_bytes], x.dtype)

        recv_x = torch.zeros((state.num_recv_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
        slot_valid = state.recv_rows >= 0
        token_of_slot = torch.arange(len(state.recv_rows),
                                     device=x.device).unsqueeze(1).expand_as(state.recv_rows)
        rows = state.recv_rows[slot_valid]
        recv_x[rows] = recv_tokens[token_of_slot[slot_valid]]
        if probs is None:
            return recv_x, None
        recv_slot_probs = _bytes_as(received[:, hidden_bytes:], probs.dtype)
        recv_probs = torch.zeros(state.num_recv_tokens, dtype=probs.dtype, device=x.device)
        recv_probs[rows] = recv_slot_probs[slot_valid]
        return recv_x, recv_probs

    def combine(self, state: ReferenceHandleState, expert_out: torch.Tensor,
                backward=None) -> torch.Tensor:
        _records_nothing(backward)
        acc_dtype = accumulation_dtype(expert_out.dtype)
        hidden = expert_out.shape[1]
        # Stage 1, here: one partial per received token, slots in ascending k, rounded.
        partial = torch.zeros((len(state.recv_rows), hidden), dtype=acc_dtype,
                              device=expert_out.device)
        for k in range(state.recv_rows.shape[1]):
            slot = state.recv_rows[:, k]
            has = (slot >= 0).nonzero().flatten()
            partial[has] = partial[has] + expert_out[slot[has]].to(acc_dtype)
        partial = partial.to(expert_out.dtype)
        returned = self._all_to_all_rows("combine", partial, state.recv_counts,
                                         self._send_counts(state))
        self._count_rail("combine", state.rail_rows[1], hidden * expert_out.element_size())
        # Stage 2, at the source, node by node: 2a each node's partials summed over its ranks in
        # ascending order, rounded; 2b those summed over the nodes in ascending order, rounded.
        # The bits do not depend on where 2a runs. One node: its sum is the output (rounding an
        # exactly converted value again changes nothing), so it is summed into y directly.
        tokens = state.topk_idx.shape[0]
        G = self.config.node_size(self.world_size)
        one_node = G == self.world_size
        y = torch.zeros((tokens, hidden), dtype=acc_dtype, device=expert_out.device)
        start = 0
        for d, idx in enumerate(state.send_tokens):
            if d % G == 0 and not one_node:
                node = torch.zeros_like(y)
                in_node = torch.zeros(tokens, dtype=torch.bool, device=y.device)
            sums = y if one_node else node
            sums[idx] = sums[idx] + returned[start:start + len(idx)].to(acc_dtype)
            start += len(idx)
            if not one_node:
                in_node[idx] = True
                if d % G == G - 1:
                    y[in_node] = y[in_node] + node[in_node].to(expert_out.dtype).to(acc_dtype)
        return y.to(expert_out.dtype)

    def combine_probs(self, state: ReferenceHandleState, grad_recv_probs: torch.Tensor,
                      dense: bool = False) -> torch.Tensor:
        grad = self._combine_slot_probs(state, grad_recv_probs)
        if not dense:
            return grad
        # [T, K] -> [T, E]: each routed slot's value in its expert's column, 0 elsewhere.
        out = torch.zeros((grad.shape[0], self.config.num_experts), dtype=grad.dtype,
                          device=grad.device)
        t, k = (state.topk_idx >= 0).nonzero(as_tuple=True)
        out[t, state.topk_idx[t, k]] = grad[t, k]
        return out

    def _combine_slot_probs(self, state: ReferenceHandleState,
                            grad_recv_probs: torch.Tensor) -> torch.Tensor:
        slot_valid = state.recv_rows >= 0
        per_slot = torch.zeros(state.recv_rows.shape, dtype=grad_recv_probs.dtype,
                               device=grad_recv_probs.device)
        per_slot[slot_valid] = grad_recv_probs[state.recv_rows[slot_valid]]
        returned = self._all_to_all_rows("combine_probs", per_slot, state.recv_counts,
                                         self._send_counts(state))
        self._count_rail("combine_probs", state.rail_rows[1],
                         RAIL_SLOT_BYTES * self.config.max_topk)
        grad = torch.zeros(state.topk_idx.shape, dtype=grad_recv_probs.dtype,
                           device=grad_recv_probs.device)
        L, start = self.num_local_experts, 0
        for d, idx in enumerate(state.send_tokens):
            owned = state.topk_idx[idx] // L == d  # masked slots: -1 // L == -1
            block = grad[idx]
            block[owned] = returned[start:start + len(idx)][owned]
            grad[idx] = block
            start += len(idx)
        return grad

    @staticmethod
    def _send_counts(state: ReferenceHandleState) -> List[int]:
        return [len(idx) for idx in state.send_tokens]

    # -- LL (docs/design.md §9; the arithmetic: ll_reference.py) ---------------------------------
    def stop_after_local_error(self, op: str, error: Exception) -> None:
        """A call that raises on this rank alone (an LL handle's host-side check: no
        communication to agree in) stops the group here: each peer's next collective raises at
        once, naming this rank, instead of waiting ``timeout_s`` for it. The caller raises
        ``error``."""
        if self.world_size > 1 and self._stopped is None:
            rendezvous.store().set(self._record(self.rank),
                                   f"{self._calls} {_word(op)} stopped")
            self._stopped = (f"this group stopped after {op} failed on rank {self.rank} ({error});"
                             " destroy it and create a new one on every rank")

    def ll_create_handle(self, topk_idx: torch.Tensor) -> ReferenceLLState:
        """No communication: the routing, what goes where, and its value error if any."""
        cfg = self.config
        idx = topk_idx.to(torch.int64).clone()
        error = routing_error(idx, cfg.num_experts)
        plan = None if error else llr.send_plan(idx, cfg.num_experts, self.world_size)
        return ReferenceLLState(idx, error, plan)

    def ll_new_output(self, with_weights: bool, given: dict) -> LLDispatchOutput:
        return new_dispatch_output(ll_dispatch_fields(self.config, self.world_size, with_weights),
                                   self.device, **given)

    def ll_dispatch(self, state: ReferenceLLState, x: torch.Tensor,
                    topk_weights: Optional[torch.Tensor], send_only: bool,
                    out: Optional[LLDispatchOutput] = None) -> LLDispatchOutput:
        cfg, R, op = self.config, self.world_size, "LL dispatch"
        # One all-gather settles what the messages need: any rank's routing error, the weights
        # on every rank or none, and how many messages each rank sends to each.
        sends = [0] * R if state.plan is None else [len(p) for p in state.plan]
        mine = torch.tensor([state.error is not None, topk_weights is not None] + sends,
                            dtype=torch.int64, device=self.device)
        everyone = self._all_gather(op, mine)
        self._raise_agreed_error(op, state.error, bool(everyone[:, 0].any()), ValueError)
        given = everyone[:, 1].tolist()
        if any(given) and not all(given):
            raise ValueError(f"{op}: topk_weights given on ranks "
                             f"{[r for r, g in enumerate(given) if g]} but not on the others: "
                             "every rank passes them or none does")
        with_weights = bool(all(given)) and cfg.ll_layout == "rank_major"
        weights = topk_weights if with_weights else None
        recv_counts = everyone[:, 2 + self.rank].tolist()
        messages = self._all_to_all_rows(
            op, llr.pack_dispatch(cfg, x, state.topk_idx, weights, state.plan), sends,
            recv_counts)
        if out is None:
            out = llr.empty_dispatch_output(cfg, R, x.device, with_weights)

        def complete():
            state.received = llr.fill_dispatch(out, cfg, R, self.rank, messages, recv_counts,
                                               with_weights)

        self._finish_or_keep(state, complete, send_only)
        return out

    def ll_combine(self, state: ReferenceLLState, expert_out: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], send_only: bool,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        cfg, R = self.config, self.world_size
        rows, sends = llr.pack_combine(cfg, R, state.received, expert_out)
        recv_counts = llr.combine_recv_counts(cfg, R, state.topk_idx, state.plan)
        returned = self._all_to_all_rows("LL combine", rows, sends, recv_counts)
        y = out if out is not None else torch.full(
            (state.topk_idx.shape[0], cfg.hidden), float("nan"), dtype=cfg.dtype,
            device=expert_out.device)  # poison until written
        self._finish_or_keep(state, lambda: llr.finish_combine(
            y, cfg, R, state.topk_idx, topk_weights, state.plan, returned, recv_counts),
            send_only)
        return y

    def ll_complete(self, state: ReferenceLLState) -> None:
        """The op's communication ran at the send: what is left writes the outputs."""
        complete, state.pending = state.pending, None
        complete()

    @staticmethod
    def _finish_or_keep(state: ReferenceLLState, complete, send_only: bool) -> None:
        if send_only:
            state.pending = complete
        else:
            complete()
