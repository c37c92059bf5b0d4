"""The LL arithmetic of docs/design.md §9 as pure functions, one rank's steps: the reference
backend's LL path (``reference.ReferenceBackend.ll_*``, one rank over torch.distributed) runs
them, and so does the tests' one-process oracle of a whole group (tests/ll_oracle.py, every
rank's outputs at once). The steps:

1. the source (``send_plan``, ``pack_dispatch``): one message per (token, destination rank that
   holds one of its experts), in token order per destination: token index, the top-k ids padded
   to ``max_topk`` with -1, the weights (rank-major with weights), the payload (the row, or its
   cast to the group's ``payload_dtype`` and the scales: ``config.LL_PAYLOADS``);
2. the destination (``fill_dispatch``): the messages of every source, in (source rank, token)
   order, placed into the layout's outputs; ``receive_record`` keeps where each slot went;
3. the combine's destination (``pack_combine``): one row per (message, local slot) in slot order
   (expert-major) or the caller's partial row per message (rank-major), back to the source;
4. the combine's source (``finish_combine``): the ordered fp32 sums, rounded once; in a group
   that spans nodes, node partials rounded, then summed over the nodes in ascending order.

Every step but the last is the same whatever ``ranks_per_node`` is: an LL group that spans
nodes dispatches exactly as a one-node group of the same size (the cuda backend's rail and
forwarding change where bytes travel, not what arrives), and only the combine's order of
summation follows the nodes.

Rows of the outputs that the contract leaves unspecified hold poison, never data: NaN (a payload
dtype's: the byte 0x7f, NaN in float8) in ``x`` and ``scales`` past the counts, -1 in ``src``
past ``count``. Outputs of a send-only op are poison everywhere (counts -1, ids INT32_MIN,
weights NaN) until the complete step fills them. Every sum adds one term at a time (``torch.where`` per step, never a reduction
over a dimension, whose order is unspecified).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence

import torch

from .config import LL_PAYLOADS, GroupConfig
from .outputs import FIELDS, LLDispatchOutput, ll_dispatch_fields

PAYLOAD_POISON_BYTE = 0x7F  # a NaN of float8_e4m3fn (and of e5m2)
_INT32_POISON = torch.iinfo(torch.int32).min
_POISON = {"count": -1, "src": -1, "topk_idx": _INT32_POISON}  # else NaN


# -- the source ---------------------------------------------------------------------------------
def owners(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """``[T, K]`` int64: the rank of each slot's expert, -1 for a masked slot."""
    idx = topk_idx.to(torch.int64)
    return torch.where(idx >= 0, idx // (num_experts // world_size), -1)


def send_plan(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> List[torch.Tensor]:
    """Per destination rank, the tokens (int64, ascending) with at least one expert there."""
    owner = owners(topk_idx, num_experts, world_size)
    return [(owner == d).any(1).nonzero().flatten() for d in range(world_size)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` as ``[n, bytes]`` uint8."""
    width = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Payload-dtype (FP8) tensors as their bytes (indexed writes are not defined for float8 on
    every device), others as they are."""
    return t.view(torch.uint8) if t.dtype in LL_PAYLOADS else t


def _as(byte_rows: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """A column slice of received byte rows as a fresh ``shape`` tensor of ``dtype``."""
    out = torch.empty(shape, dtype=dtype, device=byte_rows.device)
    out.view(torch.uint8).reshape(byte_rows.shape).copy_(byte_rows)
    return out


def payload_bytes(config: GroupConfig) -> int:
    """Bytes of one message's payload: the row in the payload dtype, and its fp32 scales where
    the payload has them (FP8)."""
    H = config.hidden
    dtype, payload = config.ll_payload()
    row = H * torch.empty((), dtype=dtype).element_size()
    return row if payload is None else row + 4 * (H // payload.scale_block)


def message_bytes(config: GroupConfig, with_weights: bool) -> int:
    """Bytes of one dispatch message: token index, ids, weights (with weights), payload."""
    return 4 + 4 * config.max_topk * (2 if with_weights else 1) + payload_bytes(config)


def pack_dispatch(config: GroupConfig, x: torch.Tensor, topk_idx: torch.Tensor,
                  weights: Optional[torch.Tensor], plan: List[torch.Tensor]) -> torch.Tensor:
    """The source's messages ``[sum of len(plan[d]), message_bytes]`` uint8, grouped by
    destination rank in rank order, tokens ascending inside. ``weights [T, K]`` fp32 travel when
    given (rank-major only)."""
    tokens, topk = topk_idx.shape
    device = x.device
    ids = torch.full((tokens, config.max_topk), -1, dtype=torch.int32, device=device)
    ids[:, :topk] = topk_idx
    parts = [_bytes(torch.arange(tokens, dtype=torch.int32, device=device).unsqueeze(1)),
             _bytes(ids)]
    if weights is not None:
        w = torch.zeros((tokens, config.max_topk), dtype=torch.float32, device=device)
        w[:, :topk] = weights
        parts.append(_bytes(w))
    payload = config.ll_payload()[1]
    if payload is None:
        parts.append(_bytes(x))
    else:
        q, scales = payload.cast(x)
        parts += [_bytes(q), _bytes(scales)]
    rows = torch.cat(parts, 1)
    return rows[torch.cat(plan)] if plan else rows[:0]


# -- the destination ----------------------------------------------------------------------------
@dataclasses.dataclass
class LLReceived:
    """One destination's record of a dispatch, in message order ((source rank, token) order):
    ``src``, ``token`` ``[n]`` int64, ``ids [n, max_topk]`` int64 (the source's ids, -1 padded),
    ``local_expert`` / ``row`` ``[n, max_topk]`` int64 (the slot's local expert and its row in
    that expert's block, -1 for a slot not on this rank), ``counts [L]`` int64."""

    src: torch.Tensor
    token: torch.Tensor
    ids: torch.Tensor
    local_expert: torch.Tensor
    row: torch.Tensor
    counts: torch.Tensor


def receive_record(config: GroupConfig, world_size: int, rank: int, src: torch.Tensor,
                   token: torch.Tensor, ids: torch.Tensor) -> LLReceived:
    """Where each received slot goes: inside local expert ``l`` the messages naming it take rows
    0, 1, ... in message order, i.e. by source rank, then token."""
    L = config.num_experts // world_size
    ids = ids.to(torch.int64)
    here = (ids >= 0) & (ids // L == rank)
    local_expert = torch.where(here, ids - rank * L, -1)
    row = torch.full_like(ids, -1)
    counts = torch.zeros(L, dtype=torch.int64, device=ids.device)
    for l in range(L):
        slot = local_expert == l  # at most one slot per message: a token names l at most once
        has = slot.any(1)
        position = torch.cumsum(has.to(torch.int64), 0) - 1
        row = torch.where(slot, position.unsqueeze(1), row)
        counts[l] = has.sum()
    return LLReceived(src.to(torch.int64), token.to(torch.int64), ids, local_expert, row, counts)


def empty_dispatch_output(config: GroupConfig, world_size: int, device,
                          with_weights: bool) -> LLDispatchOutput:
    """The layout's output tensors (``outputs.ll_dispatch_fields``), all poison (see the
    module's notes)."""
    made = []
    for name, field in zip(FIELDS, ll_dispatch_fields(config, world_size, with_weights)):
        if field is None:
            made.append(None)
        elif field[1] in LL_PAYLOADS:
            made.append(torch.full(field[0], PAYLOAD_POISON_BYTE, dtype=torch.uint8,
                                   device=device).view(field[1]))
        else:
            made.append(torch.full(field[0], _POISON.get(name, float("nan")), dtype=field[1],
                                   device=device))
    return LLDispatchOutput(*made)


def fill_dispatch(out: LLDispatchOutput, config: GroupConfig, world_size: int, rank: int,
                  messages: torch.Tensor, recv_counts: Sequence[int],
                  with_weights: bool) -> LLReceived:
    """Writes one destination's outputs (from ``empty_dispatch_output``) from ``messages``, the
    rows of every source in rank order (``recv_counts[s]`` from source s); returns the record
    the combine uses."""
    K, H, T_max = config.max_topk, config.hidden, config.max_tokens_per_rank
    n, device = messages.shape[0], messages.device
    at = 0

    def take(width: int) -> torch.Tensor:
        nonlocal at
        at += width
        return messages[:, at - width:at]

    token = _as(take(4), torch.int32, (n,))
    ids = _as(take(4 * K), torch.int32, (n, K))
    weights = _as(take(4 * K), torch.float32, (n, K)) if with_weights else None
    x_dtype, payload = config.ll_payload()
    x = _as(take(H * torch.empty((), dtype=x_dtype).element_size()), x_dtype, (n, H))
    scales = None
    if payload is not None:
        blocks = H // payload.scale_block
        scales = _as(take(4 * blocks), torch.float32, (n, blocks))
    src = torch.repeat_interleave(torch.arange(world_size, device=device),
                                  torch.tensor(list(recv_counts), dtype=torch.int64,
                                               device=device))
    record = receive_record(config, world_size, rank, src, token, ids)
    out_x, x = _raw(out.x), _raw(x)
    if config.ll_layout == "expert_major":
        m, k = (record.row >= 0).nonzero(as_tuple=True)
        where = (record.local_expert[m, k], record.row[m, k])
        out_x[where] = x[m]
        if scales is not None:
            out.scales[where] = scales[m]
        out.src[where] = (record.src[m] * T_max + record.token[m]).to(torch.int32)
        out.count.copy_(record.counts)
        return record
    here = record.row >= 0
    out_x[:n] = x
    if scales is not None:
        out.scales[:n] = scales
    out.topk_idx.fill_(-1)
    out.topk_idx[:n] = torch.where(here, record.ids, -1).to(torch.int32)
    if weights is not None:
        out.topk_weights.zero_()
        out.topk_weights[:n] = torch.where(here, weights, torch.zeros_like(weights))
    out.count.fill_(n)
    return record


# -- the combine --------------------------------------------------------------------------------
def pack_combine(config: GroupConfig, world_size: int, record: LLReceived,
                 expert_out: torch.Tensor) -> "tuple[torch.Tensor, List[int]]":
    """The destination's rows back to the sources, grouped by source rank (message order), and
    how many go to each source. Expert-major: one row per (message, slot here), slots ascending;
    rank-major: row i of ``expert_out`` for message i. Rows in the token dtype: fp32 rows are
    rounded to it (nearest even, as ``Tensor.to`` rounds), as the cuda kernel reads them."""
    if config.ll_layout == "expert_major":
        m, k = (record.row >= 0).nonzero(as_tuple=True)  # row-major: by message, then slot
        rows = expert_out[record.local_expert[m, k], record.row[m, k]]
        src = record.src[m]
    else:
        rows, src = expert_out[:len(record.src)], record.src
    return rows.to(config.dtype), torch.bincount(src, minlength=world_size).tolist()


def combine_recv_counts(config: GroupConfig, world_size: int, topk_idx: torch.Tensor,
                        plan: List[torch.Tensor]) -> List[int]:
    """Rows a source gets back from each destination: its slots there (expert-major) or its
    tokens there (rank-major)."""
    if config.ll_layout == "rank_major":
        return [len(p) for p in plan]
    owner = owners(topk_idx, config.num_experts, world_size)
    return [int((owner == d).sum()) for d in range(world_size)]


def finish_combine(y: torch.Tensor, config: GroupConfig, world_size: int,
                   topk_idx: torch.Tensor, weights: Optional[torch.Tensor],
                   plan: List[torch.Tensor], returned: torch.Tensor,
                   recv_counts: Sequence[int]) -> None:
    """Writes ``y [T, H]`` at the source from the rows returned by every destination (in rank
    order, ``recv_counts[d]`` from d). Each term: expert-major ``w[t, k] * fp32(out(t, k))`` per
    valid slot k, one rounded fp32 product; rank-major ``fp32(partial_d)`` per destination d
    that received t. One node (``ranks_per_node`` 0 or R): ``y[t]`` = the terms summed in
    ascending k (expert-major) or d (rank-major), rounded once. Nodes of G < R ranks: per node n
    ascending, the node partial ``np_n(t)`` = the terms of n's ranks in that order, rounded to
    the token dtype; ``y[t]`` = the fp32 sum of the token's node partials, rounded. Every sum
    from +0.0, one add at a time (docs/design.md §9, "Combine across nodes")."""
    tokens, topk = topk_idx.shape
    G = config.node_size(world_size)
    zeros = torch.zeros((tokens, config.hidden), dtype=torch.float32, device=y.device)
    parts = torch.split(returned, list(recv_counts))
    # The terms in the order of one node, each with its rank: (rank, tokens it covers, fp32 rows
    # of those tokens). Slots k ascending (expert-major) or ranks ascending (rank-major).
    terms = []
    if config.ll_layout == "rank_major":
        for d, (idx, part) in enumerate(zip(plan, parts)):
            rows = zeros.clone()
            rows[idx] = part.to(torch.float32)
            has = torch.zeros(tokens, dtype=torch.bool, device=y.device)
            has[idx] = True
            terms.append((torch.full((tokens,), d, device=y.device), has, rows))
    else:
        owner = owners(topk_idx, config.num_experts, world_size)
        out = torch.zeros((tokens, topk, config.hidden), dtype=torch.float32, device=y.device)
        for d, part in enumerate(parts):
            t, k = (owner == d).nonzero(as_tuple=True)  # by token, then slot: as it was sent
            out[t, k] = part.to(torch.float32)
        for k in range(topk):
            product = weights[:, k:k + 1] * out[:, k]  # one rounded fp32 product
            terms.append((owner[:, k], owner[:, k] >= 0, product))
    if G == world_size:
        acc = zeros
        for _, has, value in terms:
            acc = torch.where(has.unsqueeze(1), acc + value, acc)
        y.copy_(acc.to(y.dtype))
        return
    acc = zeros
    for n in range(world_size // G):
        node, on_node = zeros, torch.zeros(tokens, dtype=torch.bool, device=y.device)
        for rank, has, value in terms:
            here = has & (rank // G == n)
            node = torch.where(here.unsqueeze(1), node + value, node)
            on_node = on_node | here
        rounded = node.to(y.dtype).to(torch.float32)
        acc = torch.where(on_node.unsqueeze(1), acc + rounded, acc)
    y.copy_(acc.to(y.dtype))
