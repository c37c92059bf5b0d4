"""An independent, single-process oracle for dispatch and combine, written from docs/design.md
(§3 layout, §4 arithmetic), not from the reference backend.

Every rank of a distributed test builds the whole problem (all ranks' inputs) from one seed, runs
the API on its own share, and compares with what this module computes for it. Loops over source
rank, token and slot, and over the summation order, are explicit; only the elementwise work along
the hidden dimension (and across tokens that share a step) is vectorized, which does not change the
IEEE operations performed on any element.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


class RankInputs:
    """What a problem of every rank's inputs (``world_size``, ``num_experts``, ``x[s] [T_s, H]``)
    says about its group."""

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def hidden(self) -> int:
        return self.x[0].shape[1]


@dataclasses.dataclass
class Problem(RankInputs):
    """All ranks' inputs. ``x[s] [T_s, H]``, ``topk_idx[s] [T_s, K]``, ``probs[s] [T_s, K]``."""

    world_size: int
    num_experts: int
    x: List[torch.Tensor]
    topk_idx: List[torch.Tensor]
    probs: List[Optional[torch.Tensor]]

    @property
    def topk(self) -> int:
        return self.topk_idx[0].shape[1]


# Exponent ranges wide enough that float32 (float64) sums of a few values round: 16-bit values
# of far-apart exponents do not fit exactly into float32's 24-bit significand. float16 stays
# clear of subnormals and of overflow in sums of up to 8 values.
EXPONENT_RANGE = {torch.bfloat16: (-40, 40), torch.float16: (-13, 11),
                  torch.float32: (-20, 20), torch.float64: (-30, 30)}


def wide_values(gen: torch.Generator, shape, dtype: torch.dtype, min_exp: Optional[int] = None,
                max_exp: Optional[int] = None) -> torch.Tensor:
    """Nonzero values of both signs whose magnitudes span 2**min_exp .. 2**max_exp (default:
    EXPONENT_RANGE), so that sums of a few of them depend on the order and the rounding points
    of the summation."""
    lo, hi = EXPONENT_RANGE[dtype]
    min_exp = lo if min_exp is None else min_exp
    max_exp = hi if max_exp is None else max_exp
    # Half the elements sit at the two extreme exponents with one of two mantissas, so that equal
    # magnitudes of opposite signs meet often: an exact cancellation of two large terms exposes
    # whether a small term was added before (absorbed) or after (kept) it.
    dev = gen.device  # a CUDA generator draws on its GPU (large GPU cases)
    ladder = torch.rand(shape, generator=gen, device=dev) < 0.5
    mant = torch.where(
        ladder, 1.0 + torch.randint(0, 2, shape, generator=gen, device=dev).to(torch.float64) / 2,
        1.0 + torch.rand(shape, generator=gen, dtype=torch.float64, device=dev))
    extreme = torch.where(torch.rand(shape, generator=gen, device=dev) < 0.5, min_exp, max_exp)
    exp = torch.where(ladder, extreme, torch.randint(min_exp, max_exp + 1, shape, generator=gen,
                                                     device=dev)).to(torch.float64)
    sign = torch.randint(0, 2, shape, generator=gen, device=dev).to(torch.float64) * 2 - 1
    return (sign * mant * torch.exp2(exp)).to(dtype)


def random_routing(gen: torch.Generator, tokens: int, topk: int, num_experts: int,
                   routing: str, target_expert: int = 0) -> torch.Tensor:
    """``routing``: 'random' (K distinct experts per token), 'masked' (random with about a third
    of the slots -1, and every 5th token fully masked), 'one_expert' (slot 0 -> target_expert,
    the other slots masked)."""
    dev = gen.device
    if routing == "one_expert":
        idx = torch.full((tokens, topk), -1, dtype=torch.int64, device=dev)
        idx[:, 0] = target_expert
        return idx
    idx = torch.rand(tokens, num_experts, generator=gen, device=dev).argsort(dim=1)[:, :topk]
    idx = idx.contiguous()
    if routing == "masked":
        drop = torch.rand(tokens, topk, generator=gen, device=dev) < 0.35
        drop[::5] = True
        idx[drop] = -1
    elif routing != "random":
        raise ValueError(f"unknown routing {routing!r}")
    return idx


def make_problem(seed: int, world_size: int, tokens, hidden: int, num_experts: int, topk: int,
                 dtype: torch.dtype, probs_dtype: Optional[torch.dtype] = torch.float32,
                 idx_dtype: torch.dtype = torch.int64, routing: str = "random",
                 min_exp: Optional[int] = None, max_exp: Optional[int] = None) -> Problem:
    """``tokens``: an int (every rank) or a sequence cycled over ranks (e.g. (0, 17))."""
    gen = torch.Generator().manual_seed(seed)
    counts = [tokens] * world_size if isinstance(tokens, int) else [
        tokens[s % len(tokens)] for s in range(world_size)]
    target = int(torch.randint(0, num_experts, (1,), generator=gen))
    xs, idxs, probs = [], [], []
    for t in counts:
        xs.append(wide_values(gen, (t, hidden), dtype, min_exp, max_exp))
        idxs.append(random_routing(gen, t, topk, num_experts, routing, target).to(idx_dtype))
        if probs_dtype is None:
            probs.append(None)
        else:
            # In (0, 1], never 0, so that a slot's probability is distinguishable from padding.
            probs.append((torch.rand(t, topk, generator=gen, dtype=torch.float64) * 0.9 + 0.1)
                         .to(probs_dtype))
    return Problem(world_size, num_experts, xs, idxs, probs)


# ----------------------------------------------------------------------------------------------
# layout (docs/design.md §3)
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankLayout:
    """Destination rank d: ``rows[i]`` is the (s, t, k) received into row i, or None for a padding
    row; ``tokens_per_expert[l]`` the rows (padding included) of local expert l."""

    rows: list
    tokens_per_expert: List[int]
    real_counts: List[int]

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def check_routing(problem: Problem) -> None:
    """The oracle only accepts valid routing; a generator bug must not pass as a backend bug."""
    for s, idx in enumerate(problem.topk_idx):
        for t, slots in enumerate(idx.tolist()):
            valid = [e for e in slots if e >= 0]
            assert all(-1 <= e < problem.num_experts for e in slots), (s, t, slots)
            assert len(set(valid)) == len(valid), (s, t, slots)


def layout(problem: Problem, dest: int, alignment: int = 1, *,
           expert_capacity: Optional[int] = None, drop_past: Optional[int] = None) -> RankLayout:
    """``expert_capacity=C``: the fixed-capacity layout: each expert's block is R runs of C
    rows, one per source rank; a run holds the source's first C slots for the expert in token
    order (later ones are dropped: in no row), then None rows up to C. ``drop_past=N``: capacity
    mode that drops its overflow: the rows from N on are dropped (their slots are in no row),
    while ``tokens_per_expert`` still counts every block whole."""
    L = problem.num_local_experts
    buckets = [[] for _ in range(L)]
    # Ascending s, then t; a token names an expert at most once, so (s, t) orders a bucket fully.
    for s in range(problem.world_size):
        runs = [[] for _ in range(L)]
        for t, slots in enumerate(problem.topk_idx[s].tolist()):
            for k, e in enumerate(slots):
                if e >= 0 and e // L == dest:
                    runs[e % L].append((s, t, k))
        for bucket, run in zip(buckets, runs):
            if expert_capacity is None:
                bucket.extend(run)
            else:
                kept = run[:expert_capacity]
                bucket.extend(kept + [None] * (expert_capacity - len(kept)))
    rows, tpe, real = [], [], []
    for bucket in buckets:
        padded = -(-len(bucket) // alignment) * alignment
        rows.extend(bucket)
        rows.extend([None] * (padded - len(bucket)))
        tpe.append(padded)
        real.append(sum(r is not None for r in bucket))
    if drop_past is not None:
        rows = rows[:drop_past]
    return RankLayout(rows, tpe, real)


def _row_gather(lay: RankLayout):
    """(source ranks, tokens, slots, valid mask) as tensors over the rows of ``lay``."""
    s = torch.tensor([r[0] if r else 0 for r in lay.rows], dtype=torch.int64)
    t = torch.tensor([r[1] if r else 0 for r in lay.rows], dtype=torch.int64)
    k = torch.tensor([r[2] if r else 0 for r in lay.rows], dtype=torch.int64)
    valid = torch.tensor([r is not None for r in lay.rows], dtype=torch.bool)
    return s, t, k, valid


def dispatch(problem: Problem, dest: int, alignment: int = 1, capacity: Optional[int] = None, *,
             expert_capacity: Optional[int] = None, drop_past: Optional[int] = None):
    """Expected ``(recv_x, recv_probs or None, tokens_per_expert int64 [L], used_rows)`` on rank
    ``dest``. Capacity mode: outputs have ``capacity`` rows, the tail beyond the used rows is zero
    (prob 0). ``expert_capacity``, ``drop_past``: the fixed-capacity layout, capacity mode's
    dropped overflow (see ``layout``)."""
    lay = layout(problem, dest, alignment, expert_capacity=expert_capacity, drop_past=drop_past)
    n = lay.num_rows if capacity is None else capacity
    assert n >= lay.num_rows, f"capacity {capacity} < {lay.num_rows} rows needed on rank {dest}"
    recv_x = torch.zeros(n, problem.hidden, dtype=problem.x[0].dtype)
    pdtype = problem.probs[0].dtype if problem.probs[0] is not None else None
    recv_p = None if pdtype is None else torch.zeros(n, dtype=pdtype)
    for i, r in enumerate(lay.rows):
        if r is None:
            continue
        s, t, k = r
        recv_x[i] = problem.x[s][t]
        if recv_p is not None:
            recv_p[i] = problem.probs[s][t, k]
    return recv_x, recv_p, torch.tensor(lay.tokens_per_expert, dtype=torch.int64), lay.num_rows


def acc_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def combine(problem: Problem, expert_out: list, source: int, alignment: int = 1, *,
            ranks_per_node: Optional[int] = None, k_descending: bool = False,
            rank_descending: bool = False, two_stage: bool = True,
            acc_dtype: Optional[torch.dtype] = None,
            expert_capacity: Optional[int] = None,
            drop_past: Optional[int] = None) -> torch.Tensor:
    """Expected ``y`` on rank ``source`` from every rank's ``expert_out[d] [N_d, H]``.

    Defaults are docs/design.md §4 (flat). ``ranks_per_node=G``: §4 for groups that span nodes,
    2a and 2b over nodes of G consecutive ranks, always both steps (so G = 1 and G = R can be
    compared with the flat sum). The keyword switches build wrong variants (slot order reversed,
    rank order reversed, one flat sum without the per-rank rounding, accumulation in another
    dtype); the tests use them to show that the inputs they use tell the orders apart.
    """
    dtype = expert_out[0].dtype
    acc = acc_dtype if acc_dtype is not None else acc_dtype_for(dtype)
    R, K = problem.world_size, problem.topk
    idx = problem.topk_idx[source].to(torch.int64)
    T, H = idx.shape[0], expert_out[0].shape[1]
    # row_of[d][t, k]: the row of (source, t, k) on rank d, or -1.
    row_of = []
    for d in range(R):
        m = torch.full((T, K), -1, dtype=torch.int64)
        for i, r in enumerate(layout(problem, d, alignment, expert_capacity=expert_capacity,
                                     drop_past=drop_past).rows):
            if r is not None and r[0] == source:
                m[r[1], r[2]] = i
        row_of.append(m)
    ranks = range(R - 1, -1, -1) if rank_descending else range(R)
    slots = range(K - 1, -1, -1) if k_descending else range(K)
    total = torch.zeros(T, H, dtype=acc)
    for d in ranks:
        partial = torch.zeros(T, H, dtype=acc) if two_stage else total
        for k in slots:
            rows = row_of[d][:, k]
            on_d = rows >= 0
            if not bool(on_d.any()):
                continue  # adding +0.0 to an accumulator that started at +0.0 changes nothing
            vals = expert_out[d][rows.clamp(min=0)].to(acc)
            partial = partial + torch.where(on_d[:, None], vals, torch.zeros((), dtype=acc))
        if ranks_per_node is not None:  # 2a into this node's sum; 2b after its last rank
            if d % ranks_per_node == 0:
                node = torch.zeros(T, H, dtype=acc)
            node = node + partial.to(dtype).to(acc)
            if d % ranks_per_node == ranks_per_node - 1:
                total = total + node.to(dtype).to(acc)
        elif two_stage:
            total = total + partial.to(dtype).to(acc)
        else:
            total = partial
    return total.to(dtype)


def combine_probs(problem: Problem, grad_recv_probs: list, source: int,
                  alignment: int = 1, *, expert_capacity: Optional[int] = None,
                  drop_past: Optional[int] = None) -> torch.Tensor:
    """Expected ``grad_probs [T, K]`` on rank ``source``: the row's value, 0 at masked (and
    dropped) slots."""
    T, K = problem.topk_idx[source].shape
    out = torch.zeros(T, K, dtype=grad_recv_probs[0].dtype)
    for d in range(problem.world_size):
        for i, r in enumerate(layout(problem, d, alignment, expert_capacity=expert_capacity,
                                     drop_past=drop_past).rows):
            if r is not None and r[0] == source:
                out[r[1], r[2]] = grad_recv_probs[d][i]
    return out


# ----------------------------------------------------------------------------------------------
# a dense float64 MoE for gradients
# ----------------------------------------------------------------------------------------------


def dense_moe_float64(x: torch.Tensor, topk_idx: torch.Tensor, probs: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum over valid k of probs[t, k] * (x[t] @ weights[topk_idx[t, k]])``, float64,
    on one rank's tokens, without any dispatch: the single-process model the distributed
    gradients are compared with."""
    idx = topk_idx.to(torch.int64)
    valid = (idx >= 0).to(torch.float64)
    w = weights[idx.clamp(min=0)]  # [T, K, H, H]
    return torch.einsum("th,tkhj,tk->tj", x, w, probs * valid)


def dense_moe_grads_float64(x: torch.Tensor, topk_idx: torch.Tensor, probs: torch.Tensor,
                            weights: torch.Tensor, grad_y: torch.Tensor):
    """Closed-form gradients of ``sum(dense_moe_float64(...) * grad_y)``, written out rather than
    taken from autograd: ``grad_x[t] = sum over valid k of probs[t, k] * (grad_y[t] @ W_e^T)`` and
    ``grad_probs[t, k] = (x[t] @ W_e) . grad_y[t]`` for valid slots, 0 at masked ones."""
    idx = topk_idx.to(torch.int64)
    T, K = idx.shape
    grad_x = torch.zeros_like(x, dtype=torch.float64)
    grad_probs = torch.zeros(T, K, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            if e < 0:
                continue
            grad_x[t] += probs[t, k].double() * (grad_y[t] @ weights[e].T)
            grad_probs[t, k] = (x[t] @ weights[e]) @ grad_y[t]
    return grad_x, grad_probs


# ----------------------------------------------------------------------------------------------
# comparisons
# ----------------------------------------------------------------------------------------------

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (so that NaN == NaN and -0 != +0), on the CPU."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.view(_BITS[t.element_size()])


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    gb, wb = bits(got), bits(want)
    if not torch.equal(gb, wb):
        diff = (gb != wb)
        where = diff.nonzero()[:5].tolist()
        first = tuple(where[0])
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ bitwise; first at "
            f"{where}: got {got.detach().cpu()[first].item()!r}, "
            f"expected {want.detach().cpu()[first].item()!r}")
