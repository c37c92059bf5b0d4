"""What a group fixes for all its layers, and the checks of it that Python owns.

``GroupConfig`` is the one place a group's parameters are written: ``Group`` and
``Group.local_team`` take one or build one from the same keyword fields (``GroupConfig.build``).
Its checks are split by owner (docs/design.md §1, "Checks of a configuration"):
``check_fields`` is what only Python has (the words that pick the C library's enums, ``None``,
seconds), run for every backend; ``check_rules`` is the reference backend's copy of the library's
rules (bounds and shapes, the bounds read from its header through ``limits``), which the cuda
backend leaves to the library itself. ``LL_PAYLOADS`` says what each LL payload dtype other than
the tokens' own is. ``routing_error`` is the reference's check of routing values, HT's and LL's
alike. This module sits below the front end (``api.py``) and both backends (``reference.py``,
``cuda_backend.py``), which all import it and none of which it imports.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from .fp8 import FP8_DTYPE, fp8_cast, fp8_dequant
# The library's defaults and bounds (LL: docs/design.md §9), written in its header only.
from .limits import (DEFAULT_NUM_SMS, DEFAULT_TIMEOUT_S, FP8_BLOCK, LL_MAX_EXPERTS,  # noqa: F401
                     LL_MAX_TOKENS, LL_MAX_TOPK, LL_PACK_ELEMS, MAX_NUM_SMS,
                     MAX_STAGING_CHUNK_TOKENS, MAX_STAGING_DEPTH, MIN_STAGING_DEPTH)

TOKEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)
PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LL_TOKEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LL_LAYOUTS = ("expert_major", "rank_major")


@dataclasses.dataclass(frozen=True)
class PayloadFormat:
    """An LL dispatch payload other than the tokens' own dtype (docs/design.md §9): rows travel
    as the payload dtype with one fp32 scale per ``scale_block`` columns; ``cast`` (``x [..., H]``
    -> ``(q, scales)``) and ``dequant`` (``(q, scales)`` -> fp32) are the reference's, bitwise
    the library's."""

    scale_block: int
    cast: Callable
    dequant: Callable


# The payload dtypes an LL group may dispatch in besides its token dtype (``payload_dtype``), by
# dtype; the library's are its ncclEpPayloadDtype_t (csrc/include/nccl_ep.h).
LL_PAYLOADS = {
    FP8_DTYPE: PayloadFormat(FP8_BLOCK, fp8_cast, fp8_dequant),
}


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    """Everything a group fixes for all its layers. Identical on every rank (checked at group
    creation)."""

    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    max_topk: int
    dtype: torch.dtype = torch.bfloat16
    recv_mode: str = "exact"  # "exact" | "capacity"
    max_recv_tokens_per_rank: Optional[int] = None  # capacity mode: rows of each dispatch output
    # Capacity mode, a rank that would receive more rows (docs/design.md §3): "error" stops the
    # group with an error on every rank; "drop" drops the rows past the bound (no row, never
    # combined, 0 in the probs' gradient) and keeps every expert block in tokens_per_expert, so
    # their sum is the rows the routing needed.
    capacity_overflow: str = "error"
    expert_alignment: int = 1  # pad each expert block to a multiple of this many rows
    num_sms: int = DEFAULT_NUM_SMS  # SM budget per CUDA operation
    timeout_s: float = DEFAULT_TIMEOUT_S  # device-side and rendezvous waits: NcclEpError after
    # CUDA staging ring per (channel, peer): slots of this many tokens (0 = library default)
    staging_chunk_tokens: int = 0
    staging_depth: int = 0  # ring slots (0 = library default)
    # Ranks per node G (docs/design.md §4, groups that span nodes): consecutive ranks, node
    # n = rank // G; 0 = one node for the torch backend, NCCL's LSA team for the cuda backend.
    ranks_per_node: int = 0
    # Drop-and-pad (docs/design.md §3, fixed capacity): C rows per (local expert, source rank)
    # block; a source's slots past the C-th for an expert (in token order) are dropped, unused
    # rows are zero (prob 0). 0 = off (the exact layout).
    expert_capacity: int = 0
    # Groups that span nodes in capacity mode (docs/internode.md): every rail message carries
    # this many tokens (B), whatever the routing; a source with more tokens with a slot on a
    # remote node is an error on every rank, whatever capacity_overflow says. 0 =
    # max_tokens_per_rank (never overflows); exact mode sizes each message to its tokens (0).
    rail_capacity: int = 0
    # The algorithm (docs/design.md §9): "ht" (high throughput: training, prefill) or "ll" (low
    # latency: decode). LL reads max_tokens_per_rank as T_max and adds:
    mode: str = "ht"
    ll_layout: str = "expert_major"  # "expert_major" (3D, per expert) | "rank_major" (gathered)
    # LL: the dtype the dispatch moves rows in: None = the token dtype, or a key of LL_PAYLOADS
    # (torch.float8_e4m3fn: FP8 e4m3 with one fp32 scale per FP8_BLOCK columns).
    payload_dtype: Optional[torch.dtype] = None

    @classmethod
    def build(cls, world_size: int, *, capacity_factor: Optional[float] = None,
              **fields) -> "GroupConfig":
        """The configuration of a group of ``world_size`` ranks from its keyword fields, its
        fields checked (``check_fields``; the rules are the backend's, at group creation). In
        capacity mode without ``max_recv_tokens_per_rank`` the rows come from
        ``expert_capacity`` (the drop-and-pad layout's fixed size), else from
        ``capacity_factor`` (``capacity_from_factor``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unexpected group parameter(s) {unknown}; GroupConfig's fields are "
                            f"{sorted(known)} (and capacity_factor)")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in fields]
        if missing:
            raise TypeError(f"missing group parameter(s) {missing}")
        config = cls(**fields)
        if config.recv_mode == "capacity" and config.max_recv_tokens_per_rank is None:
            rows = None
            if config.expert_capacity > 0 and config.expert_alignment >= 1:
                # (A bad alignment is left to the rules to report.)
                rows = config.static_recv_rows(world_size)
            elif capacity_factor:
                rows = capacity_from_factor(capacity_factor, config.max_tokens_per_rank,
                                            config.max_topk, config.num_experts // world_size,
                                            config.expert_alignment)
            if rows is not None:
                config = dataclasses.replace(config, max_recv_tokens_per_rank=rows)
        config.check_fields()
        return config

    def node_size(self, world_size: int) -> int:
        """Ranks per node as the torch backend uses it: G, or world_size for 0 (the cuda backend
        resolves 0 to NCCL's LSA team: ``Group.info()["ranks_per_node"]``)."""
        return self.ranks_per_node or world_size

    def expert_block_rows(self, world_size: int) -> Optional[int]:
        """With ``expert_capacity`` C: the rows of each local expert's block, R * C rounded up
        to the alignment (the same for every expert and every handle); None without. (§3's
        arithmetic, which the library computes too: its check of a capacity-mode config against
        these rows holds the two equal, tests/test_one_owner.py.)"""
        if not self.expert_capacity:
            return None
        rows = world_size * self.expert_capacity
        return -(-rows // self.expert_alignment) * self.expert_alignment

    def static_recv_rows(self, world_size: int) -> Optional[int]:
        """With ``expert_capacity``: the rows of every dispatch output, L blocks of
        ``expert_block_rows``; None without."""
        block = self.expert_block_rows(world_size)
        return None if block is None else (self.num_experts // world_size) * block

    def ll_payload(self) -> "tuple[torch.dtype, Optional[PayloadFormat]]":
        """LL: the dtype the dispatch moves rows in, and its ``PayloadFormat`` (None for the
        token dtype's own rows, which have no scales)."""
        if self.payload_dtype is None:
            return self.dtype, None
        return self.payload_dtype, LL_PAYLOADS[self.payload_dtype]

    def validate(self, world_size: int) -> None:
        """Every check Python has of this configuration for a group of ``world_size`` ranks: its
        fields and the reference backend's copy of the library's rules (what ``backend="torch"``
        runs). Raises ValueError naming the field and the expected value."""
        self.check_fields()
        self.check_rules(world_size)

    def check_fields(self) -> None:
        """What only Python has, checked for every backend before anything else: the words that
        pick the library's enums (``mode``, ``recv_mode``, ``capacity_overflow``, ``ll_layout``,
        ``payload_dtype``), a capacity given where C has a number, ``timeout_s`` in seconds, an
        SM budget (Python has no "0 = the library's default") and a torch dtype."""
        _need(isinstance(self.dtype, torch.dtype),
              f"dtype must be a torch.dtype, got {self.dtype!r}")
        _need(self.mode in ("ht", "ll"), f"mode must be 'ht' or 'll', got {self.mode!r}")
        _need(self.recv_mode in ("exact", "capacity"),
              f"recv_mode must be 'exact' or 'capacity', got {self.recv_mode!r}")
        _need(self.recv_mode != "capacity" or self.max_recv_tokens_per_rank is not None,
              "capacity mode needs max_recv_tokens_per_rank (or a capacity_factor), got None")
        _need(self.capacity_overflow in ("error", "drop"),
              f"capacity_overflow must be 'error' or 'drop', got {self.capacity_overflow!r}")
        _need(self.capacity_overflow == "error" or self.recv_mode == "capacity",
              "capacity_overflow='drop' needs recv_mode='capacity' (exact mode sizes every output "
              f"to its rows), got recv_mode={self.recv_mode!r}")
        _need(self.num_sms >= 1, f"num_sms must be >= 1, got {self.num_sms}")
        _need(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        _need(self.mode != "ll" or self.ll_layout in LL_LAYOUTS,
              f"ll_layout must be one of {LL_LAYOUTS}, got {self.ll_layout!r}")
        _need(self.payload_dtype is None or self.payload_dtype in LL_PAYLOADS,
              f"payload_dtype must be None (the token dtype) or one of {tuple(LL_PAYLOADS)}, got "
              f"{self.payload_dtype!r}")

    def check_rules(self, world_size: int) -> None:
        """The library's rules of a configuration for a group of ``world_size`` ranks, as the
        reference backend applies them (the cuda backend runs the library's own: config.cc
        ``check_config``): shapes, bounds (nccl_ep_limits.h's, through ``limits``) and which
        fields go together. What only the cuda backend lacks is not the reference's: its kernels'
        limits (group size, slots per rank, expert count, float64 tokens) and LL groups that span
        nodes (designed, not built there: docs/internode.md), which the library refuses (config.cc
        ``check_ll_config``). Expects ``check_fields`` passed."""
        _need(self.num_experts > 0, f"num_experts must be > 0, got {self.num_experts}")
        _need(self.num_experts % world_size == 0,
              f"num_experts ({self.num_experts}) must be a multiple of the group size "
              f"({world_size})")
        _need(self.hidden > 0, f"hidden must be > 0, got {self.hidden}")
        _need(self.max_tokens_per_rank >= 1,
              f"max_tokens_per_rank must be >= 1, got {self.max_tokens_per_rank}")
        _need(1 <= self.max_topk <= self.num_experts,
              f"max_topk must be in [1, num_experts={self.num_experts}], got {self.max_topk}")
        _need(self.dtype in TOKEN_DTYPES, f"dtype must be one of {TOKEN_DTYPES}, got {self.dtype}")
        if self.recv_mode == "capacity":
            _need(self.max_recv_tokens_per_rank >= 0,
                  "capacity mode needs max_recv_tokens_per_rank >= 0, got "
                  f"{self.max_recv_tokens_per_rank}")
        _need(self.expert_alignment >= 1,
              f"expert_alignment must be >= 1, got {self.expert_alignment}")
        _need(self.num_sms <= MAX_NUM_SMS,
              f"num_sms must be in [1, {MAX_NUM_SMS}], got {self.num_sms}")
        _need(0 <= self.staging_chunk_tokens <= MAX_STAGING_CHUNK_TOKENS
              and (self.staging_depth == 0
                   or MIN_STAGING_DEPTH <= self.staging_depth <= MAX_STAGING_DEPTH),
              f"staging_chunk_tokens must be in [0, {MAX_STAGING_CHUNK_TOKENS}] and staging_depth "
              f"0 or in [{MIN_STAGING_DEPTH}, {MAX_STAGING_DEPTH}] (0 = default; the combine sends "
              f"chunk j while it sums chunk j - 1), got {self.staging_chunk_tokens} and "
              f"{self.staging_depth}")
        _need(self.ranks_per_node == 0 or (1 <= self.ranks_per_node <= world_size
                                           and world_size % self.ranks_per_node == 0),
              f"ranks_per_node must be 0 (one node) or a divisor of the group size ({world_size}) "
              f"from 1 to {world_size}, got {self.ranks_per_node}")
        _need(self.expert_capacity >= 0,
              f"expert_capacity must be >= 0 (0 = off), got {self.expert_capacity}")
        _need(0 <= self.rail_capacity <= self.max_tokens_per_rank
              and (self.rail_capacity == 0 or self.recv_mode == "capacity"),
              f"rail_capacity must be in [0, max_tokens_per_rank={self.max_tokens_per_rank}] (0 = "
              "max_tokens_per_rank) and 0 in exact mode (its rail messages have the size of their "
              f"tokens), got {self.rail_capacity}")
        if self.mode == "ll":
            self._check_ll_rules(world_size)
        else:
            _need(self.payload_dtype is None,
                  f"payload_dtype is an LL option (mode='ll'), got {self.payload_dtype}")
        static = self.static_recv_rows(world_size)
        if static is not None and self.recv_mode == "capacity":
            _need(self.max_recv_tokens_per_rank == static,
                  f"expert_capacity={self.expert_capacity} fixes every dispatch output at "
                  f"{static} rows (L={self.num_experts // world_size} experts x R={world_size} "
                  f"ranks x C, aligned to {self.expert_alignment}); capacity mode's "
                  f"max_recv_tokens_per_rank must be that or None, got "
                  f"{self.max_recv_tokens_per_rank}")

    def _check_ll_rules(self, world_size: int) -> None:
        _need(self.dtype in LL_TOKEN_DTYPES,
              f"mode='ll' moves tokens of dtype {LL_TOKEN_DTYPES}, got {self.dtype}")
        _need(self.max_tokens_per_rank <= LL_MAX_TOKENS,
              f"mode='ll' needs max_tokens_per_rank (T_max) <= {LL_MAX_TOKENS}, got "
              f"{self.max_tokens_per_rank}")
        _need(self.num_experts <= LL_MAX_EXPERTS and self.max_topk <= LL_MAX_TOPK,
              f"mode='ll' needs num_experts <= {LL_MAX_EXPERTS} and max_topk <= {LL_MAX_TOPK}, got "
              f"{self.num_experts} and {self.max_topk}")
        _need(self.hidden % LL_PACK_ELEMS == 0,
              f"mode='ll' moves rows in packs of {LL_PACK_ELEMS} elements: hidden must be a "
              f"multiple of {LL_PACK_ELEMS}, got {self.hidden}")
        payload = LL_PAYLOADS.get(self.payload_dtype)
        if payload is not None:
            _need(self.hidden % payload.scale_block == 0,
                  f"payload_dtype {self.payload_dtype} casts blocks of {payload.scale_block} "
                  f"columns: hidden must be a multiple of {payload.scale_block}, got {self.hidden}")
        _need(self.recv_mode == "exact" and self.expert_alignment == 1
              and self.expert_capacity == 0 and self.capacity_overflow == "error",
              "mode='ll' has its own layouts: recv_mode, expert_alignment, expert_capacity and "
              "capacity_overflow keep their defaults ('exact', 1, 0, 'error')")


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"GroupConfig: {what}")


def capacity_from_factor(capacity_factor: float, max_tokens_per_rank: int, max_topk: int,
                         num_local_experts: int, expert_alignment: int) -> int:
    """Rows for capacity mode: capacity_factor times the balanced share of rows per rank
    (T * K), plus the worst-case alignment padding of every local expert, rounded up to a
    multiple of the alignment (so the unused tail, counted by Megatron's dispatcher as the last
    expert's rows, keeps that expert's count aligned)."""
    rows = math.ceil(capacity_factor * max_tokens_per_rank * max_topk)
    rows += num_local_experts * (expert_alignment - 1)
    return -(-rows // expert_alignment) * expert_alignment


def shape_error(topk_idx: torch.Tensor, config: GroupConfig,
                name: str = "topk_idx") -> Optional[str]:
    """The problem with one rank's routing shape (``topk_idx [T, K]``, or the ``[T, max_topk]``
    top-k form of a routing map, ``name``) against the group's bounds, or None."""
    tokens, topk = topk_idx.shape
    if tokens > config.max_tokens_per_rank:
        return (f"{name} has {tokens} token{'s' if tokens != 1 else ''}, more than "
                f"max_tokens_per_rank={config.max_tokens_per_rank} of this group")
    if not 1 <= topk <= config.max_topk:
        return f"topk_idx has top-k {topk}, expected 1 <= top-k <= max_topk={config.max_topk}"
    return None


def routing_error(topk_idx: torch.Tensor, num_experts: int,
                  from_map: bool = False) -> Optional[str]:
    """The first problem with one rank's routing, or None: an expert id outside [-1, E), or a
    token naming the same expert twice; for the top-k form of a routing map, a token with more
    routed experts than slots."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        t, k = (int(v) for v in bad.nonzero()[0])
        if from_map:
            return (f"routing_map row {t} routes to {-1 - int(topk_idx[t, k])} experts, more "
                    f"than max_topk={topk_idx.shape[1]} of this group")
        return (f"topk_idx[{t}, {k}] = {int(topk_idx[t, k])} is out of range: expert ids must be "
                f"in [-1, {num_experts}) (-1 = masked slot)")
    if topk_idx.shape[1] > 1:
        ordered = topk_idx.sort(dim=1).values
        dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
        if bool(dup.any()):
            t, k = (int(v) for v in dup.nonzero()[0])
            return (f"topk_idx token {t} names expert {int(ordered[t, k])} twice: a token may "
                    "route to each expert at most once")
    return None
