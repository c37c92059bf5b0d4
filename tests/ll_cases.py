"""LL problems (docs/design.md §9) shared by the CPU tests of the reference and the GPU tests of
the cuda backend: every rank's routing, tokens and weights from one seed, expert outputs in a
layout with NaN in the rows that combine must ignore, and the bitwise comparison of dispatch
outputs over the rows the contract defines."""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch

import dense
from megatron_nccl_ep.config import FP8_BLOCK


@dataclasses.dataclass
class LLProblem(dense.RankInputs):
    """Every rank's inputs: ``topk_idx[s] [T_s, K_s]``, ``x[s] [T_s, H]``, ``weights[s] [T_s, K_s]``
    fp32 (None: no weights)."""

    world_size: int
    num_experts: int
    max_tokens: int
    max_topk: int
    topk_idx: List[torch.Tensor]
    x: List[torch.Tensor]
    weights: List[Optional[torch.Tensor]]

    def group_fields(self, layout: str, payload_dtype: Optional[torch.dtype] = None) -> dict:
        """The ``Group`` keyword fields of an LL group for this problem (``payload_dtype``: the
        dispatch's, None for the token dtype)."""
        return dict(mode="ll", ll_layout=layout, payload_dtype=payload_dtype,
                    num_experts=self.num_experts, hidden=self.hidden,
                    max_tokens_per_rank=self.max_tokens, max_topk=self.max_topk,
                    dtype=self.x[0].dtype)


def _cycled(value, rank: int):
    return value if isinstance(value, int) else value[rank % len(value)]


def make_ll_problem(world_size: int, tokens, hidden: int, num_experts: int, topk,
                    dtype: torch.dtype, *, routing: str = "random", seed: int = 0,
                    max_tokens: Optional[int] = None, max_topk: Optional[int] = None,
                    weights: bool = True, idx_dtype: torch.dtype = torch.int64,
                    special_rows: bool = True) -> LLProblem:
    """``tokens`` and ``topk``: an int (every rank) or a sequence cycled over the ranks.
    ``routing`` as ``dense.random_routing`` ('random', 'masked', 'one_expert': slot 0 of every
    token to one expert). ``special_rows``: a rank's token 0 is zero with a negative zero, and
    the first FP8 block of token 1 is tiny (amax below the 1e-4 floor), where there are such
    tokens. Values span wide exponents so that sums depend on their order."""
    gen = torch.Generator().manual_seed(seed)
    counts = [_cycled(tokens, s) for s in range(world_size)]
    ks = [_cycled(topk, s) for s in range(world_size)]
    max_tokens = max(1, max(counts)) if max_tokens is None else max_tokens
    max_topk = max(ks) if max_topk is None else max_topk
    target = int(torch.randint(0, num_experts, (1,), generator=gen))
    # FP8 keeps 4 significant bits per block: a narrower spread keeps most values nonzero.
    lo, hi = {torch.float16: (-10, 10)}.get(dtype, (-24, 24))
    xs, idxs, ws = [], [], []
    for s in range(world_size):
        x = dense.wide_values(gen, (counts[s], hidden), dtype, lo, hi)
        if special_rows and counts[s] > 0:
            x[0] = 0.0
            x[0, 1] = -0.0
        if special_rows and counts[s] > 1:
            tiny = dense.wide_values(gen, (min(hidden, FP8_BLOCK),), dtype, -22, -15)
            x[1, :tiny.numel()] = tiny
        xs.append(x)
        idxs.append(dense.random_routing(gen, counts[s], ks[s], num_experts, routing, target)
                    .to(idx_dtype))
        ws.append(torch.rand(counts[s], ks[s], generator=gen) * 1.5 + 0.25 if weights else None)
    return LLProblem(world_size, num_experts, max_tokens, max_topk, idxs, xs, ws)


def fresh_weights(problem: LLProblem, seed: int) -> List[torch.Tensor]:
    """Combine weights ``[T_s, K_s]`` fp32 per rank, other values than the dispatch's."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(idx.shape, generator=gen) * 2 - 0.5 for idx in problem.topk_idx]


def expert_outputs(problem: LLProblem, layout: str, counts: List[torch.Tensor],
                   seed: int) -> List[torch.Tensor]:
    """Per rank d, expert outputs in ``layout`` (token dtype) for a dispatch whose counts are
    ``counts[d]``: order-sensitive values in the rows combine reads, NaN at and after the counts
    (a combine that reads them shows NaN)."""
    gen = torch.Generator().manual_seed(seed)
    R, T_max, H = problem.world_size, problem.max_tokens, problem.hidden
    dtype = problem.x[0].dtype
    out = []
    for d in range(R):
        n = [int(c) for c in counts[d].flatten().tolist()]
        if layout == "expert_major":
            t = dense.wide_values(gen, (problem.num_local_experts, R * T_max, H), dtype)
            for l, c in enumerate(n):
                t[l, c:] = math.nan
        else:
            t = dense.wide_values(gen, (R * T_max, H), dtype)
            t[n[0]:] = math.nan
        out.append(t)
    return out


def widened_outputs(rows: List[torch.Tensor], seed: int) -> List[torch.Tensor]:
    """fp32 expert outputs near 16-bit ones (bf16 or fp16): each value widened, the bits below
    the 16-bit mantissa drawn at random, a quarter of them exactly half a unit (ties, which
    round-to-nearest-even settles by the kept last bit); NaN stays NaN. Rounded back to 16 bits,
    about half the values move to a neighbour."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in rows:
        low_bits = {torch.bfloat16: 16, torch.float16: 13}[t.dtype]
        low = torch.randint(0, 1 << low_bits, t.shape, generator=gen, dtype=torch.int32)
        tie = torch.rand(t.shape, generator=gen) < 0.25
        low = torch.where(tie, torch.full_like(low, 1 << (low_bits - 1)), low)
        out.append((t.to(torch.float32).view(torch.int32) | low).view(torch.float32))
    return out


def valid_rows(out, layout: str) -> dict:
    """The parts of a dispatch output the contract defines: counts, rows below the counts of
    ``x`` / ``scales`` / ``src``, and (rank-major) ``topk_idx`` / ``topk_weights`` whole. Byte
    views, on the output's device."""
    def raw(t):
        return None if t is None else t.contiguous().view(torch.uint8)

    counts = [int(c) for c in out.count.flatten().tolist()]
    parts = {"count": out.count}
    if layout == "expert_major":
        for name in ("x", "scales", "src"):
            t = getattr(out, name)
            if t is not None:
                for l, c in enumerate(counts):
                    parts[f"{name}[{l}]"] = raw(t[l, :c])
    else:
        for name in ("x", "scales"):
            t = getattr(out, name)
            if t is not None:
                parts[name] = raw(t[:counts[0]])
        parts["topk_idx"] = out.topk_idx
        parts["topk_weights"] = raw(out.topk_weights)
    return parts


def dispatch_mismatches(got, want, layout: str) -> List[str]:
    """Names of the defined parts where ``got`` and ``want`` differ in shape, dtype or bits."""
    if tuple(got.count.shape) != tuple(want.count.shape) or not torch.equal(
            got.count.cpu(), want.count.cpu()):
        return [f"count {got.count.tolist()} != {want.count.tolist()}"]
    for name in ("x", "scales", "src", "topk_idx", "topk_weights"):
        a, b = getattr(got, name), getattr(want, name)
        if (a is None) != (b is None) or (a is not None and (a.dtype != b.dtype
                                                             or a.shape != b.shape)):
            return [f"{name}: {None if a is None else (a.dtype, tuple(a.shape))} != "
                    f"{None if b is None else (b.dtype, tuple(b.shape))}"]
    g, w = valid_rows(got, layout), valid_rows(want, layout)
    bad = []
    for name in g:
        a, b = g[name], w[name]
        if (a is None) != (b is None):
            bad.append(name)
        elif a is not None and not torch.equal(a.cpu(), b.cpu()):
            bad.append(name)
    return bad
