"""Rank-side helpers shared by the distributed tests (CPU and GPU): this rank's share of a problem,
a Group sized for it, the poisoned expert outputs / gradients that combine must ignore, rank-local
inputs drawn on the rank's device, groups of one configuration on two backends, and bitwise
comparison on the device."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import dense
import megatron_nccl_ep as ep


def rank_and_size():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(problem: dense.Problem, rank: int, device="cpu", requires_grad: bool = False):
    """This rank's ``(x, topk_idx, probs)`` on ``device``: fresh copies, so that gradients and
    in-place edits never alias the problem (or a second share of it)."""
    x = problem.x[rank].to(device).clone()
    idx = problem.topk_idx[rank].to(device).clone()
    probs = problem.probs[rank]
    probs = None if probs is None else probs.to(device).clone()
    if requires_grad:
        x.requires_grad_(True)
        if probs is not None:
            probs.requires_grad_(True)
    return x, idx, probs


def max_rows(problem: dense.Problem, alignment: int = 1) -> int:
    return max(dense.layout(problem, d, alignment).num_rows for d in range(problem.world_size))


def make_group(problem: dense.Problem, *, backend: str = "torch", device="cpu",
               alignment: int = 1, capacity_slack=None, max_tokens=None, **kwargs):
    """A Group fitting ``problem``. ``capacity_slack=n``: capacity mode with n rows more than the
    fullest rank needs (so a tail exists to check); with ``expert_capacity``, capacity mode at
    the fixed-capacity layout's own size."""
    tokens = max(x.shape[0] for x in problem.x)
    if capacity_slack is not None and kwargs.get("expert_capacity"):
        kwargs.update(recv_mode="capacity")
    elif capacity_slack is not None:
        kwargs.update(recv_mode="capacity",
                      max_recv_tokens_per_rank=max_rows(problem, alignment) + capacity_slack)
    return ep.Group(num_experts=problem.num_experts, hidden=problem.hidden,
                    max_tokens_per_rank=max(1, tokens) if max_tokens is None else max_tokens,
                    max_topk=problem.topk, dtype=problem.x[0].dtype, backend=backend,
                    device=device, expert_alignment=alignment, **kwargs)


def poisoned_rows(problem: dense.Problem, seed: int, num_rows, alignment: int = 1,
                  dtype=None, vector: bool = False, expert_capacity=None, drop_past=None):
    """For every rank d, a ``[num_rows[d], H]`` tensor (``[num_rows[d]]`` with vector=True) of
    order-sensitive values in the rows that carry a (token, slot), NaN in every padding and tail
    row: whatever combine or combine_probs reads from those rows would show up as NaN."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or problem.x[0].dtype
    out = []
    for d in range(problem.world_size):
        lay = dense.layout(problem, d, alignment, expert_capacity=expert_capacity,
                           drop_past=drop_past)
        shape = (num_rows[d],) if vector else (num_rows[d], problem.hidden)
        t = dense.wide_values(gen, shape, dtype)
        used = torch.zeros(num_rows[d], dtype=torch.bool)
        used[:lay.num_rows] = torch.tensor([r is not None for r in lay.rows], dtype=torch.bool)
        t[~used] = math.nan
        out.append(t)
    return out


def capacity_or_rows(problem: dense.Problem, alignment: int, capacity, expert_capacity=None):
    """Rows of each rank's dispatch output: the capacity when given, else the exact count."""
    return [capacity if capacity is not None else
            dense.layout(problem, d, alignment, expert_capacity=expert_capacity).num_rows
            for d in range(problem.world_size)]


# Tokens with slots on every rank (top-12 of 16 over 4 ranks): a few terms per partial and partials
# from all 4 ranks, so that the order and grouping of the sums show in the bits.
ORDER_PROBLEM = dict(tokens=64, hidden=128, num_experts=16, topk=12)


def order_sensitive_outputs(seed: int, dtype: torch.dtype):
    """A 4-rank problem of ORDER_PROBLEM's shape and every rank's expert outputs for it."""
    problem = dense.make_problem(seed, 4, dtype=dtype, **ORDER_PROBLEM)
    rows = [dense.layout(problem, d).num_rows for d in range(4)]
    return problem, poisoned_rows(problem, seed + 7, rows)


def tokens_of(tokens, rank: int) -> int:
    return tokens if isinstance(tokens, int) else tokens[rank % len(tokens)]


def rank_inputs(case: dict, seed: int, rank: int, device):
    """This rank's (x, topk_idx, probs or None), drawn on the GPU from (seed, rank)."""
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    tokens = tokens_of(case["tokens"], rank)
    x = dense.wide_values(gen, (tokens, case["hidden"]), case["dtype"])
    # The same target expert on every rank, so 'one_expert' sends everything to one rank.
    target = seed % case["experts"]
    idx = dense.random_routing(gen, tokens, case["topk"], case["experts"], case["routing"],
                               target).to(case.get("idx_dtype", torch.int64))
    probs_dtype = case.get("probs_dtype", torch.float32)
    probs = None
    if probs_dtype is not None:
        probs = (torch.rand(tokens, case["topk"], generator=gen, device=device,
                            dtype=torch.float64) * 0.9 + 0.1).to(probs_dtype)
    return x, idx, probs


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def count_mismatches(got, want) -> int:
    """Elements of ``got`` whose bits differ from ``want``'s (NaN == NaN, -0 != +0), compared on
    ``got``'s device (large outputs never travel to the host). Two Nones agree; a None against a
    tensor, or a dtype or shape difference, counts every element (at least 1)."""
    if got is None or want is None:
        return 0 if got is None and want is None else max(1, (got if got is not None
                                                              else want).numel())
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return max(1, got.numel(), want.numel())
    a = got.detach().contiguous()
    b = want.detach().to(a.device).contiguous()
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    a, b = a.view(_INT_OF_SIZE[a.element_size()]), b.view(_INT_OF_SIZE[b.element_size()])
    return int((a != b).sum())


def recv_rows_bound(world: int, max_tokens: int, max_topk: int, local_experts: int,
                    alignment: int = 1) -> int:
    """The most rows any rank can receive in a group of this shape (every token of every rank
    routed here, alignment padding on every local expert): a capacity that never overflows."""
    return world * max_tokens * min(max_topk, local_experts) + local_experts * (alignment - 1)


def group_pair(device, *, experts: int, hidden: int, max_tokens: int, max_topk: int, dtype,
               capacity=None, backends=("torch", "cuda"), **extra):
    """Groups of one configuration on the default process group, one per backend (reference
    first): exact mode, or capacity mode with ``capacity`` rows."""
    if capacity is not None:
        extra.update(recv_mode="capacity", max_recv_tokens_per_rank=int(capacity))
    return [ep.Group(num_experts=experts, hidden=hidden, max_tokens_per_rank=max(1, max_tokens),
                     max_topk=max_topk, dtype=dtype, backend=backend, device=device, **extra)
            for backend in backends]


# -- routing that spans nodes (docs/internode.md: what a rail message carries) --------------------
def uniform_routing(gen: torch.Generator, tokens: int, num_experts: int,
                    topk: int) -> torch.Tensor:
    """[tokens, topk] int64: top-k of E experts uniformly at random (distinct per token)."""
    return torch.rand(tokens, num_experts, generator=gen).topk(topk, dim=1).indices


def group_limited_routing(gen: torch.Generator, tokens: int, num_experts: int, groups: int,
                          groups_per_token: int, topk: int) -> torch.Tensor:
    """[tokens, topk] int64, node-limited routing as DeepSeek-V3's router: experts in ``groups``
    equal groups of consecutive ids; each token picks ``groups_per_token`` groups at random, then
    ``topk`` distinct experts among theirs."""
    size = num_experts // groups
    picked = torch.rand(tokens, groups, generator=gen).topk(groups_per_token, dim=1).indices
    experts = (picked.unsqueeze(2) * size + torch.arange(size)).flatten(1)
    choice = torch.rand(experts.shape, generator=gen).topk(topk, dim=1).indices
    return experts.gather(1, choice)


def rail_counts_by_token(routing: list, ranks_per_node: int, experts_per_node: int) -> list:
    """c[s][n]: the tokens of rank s (``routing[s]`` [T_s, K], -1 masked) with a slot on node
    n != node(s), counted token by token (0 at s's own node): the rows of s's rail message to
    n."""
    nodes = len(routing) // ranks_per_node
    counts = [[0] * nodes for _ in routing]
    for s, idx in enumerate(routing):
        for row in idx.tolist():
            for n in {e // experts_per_node for e in row if e >= 0}:
                if n != s // ranks_per_node:
                    counts[s][n] += 1
    return counts


def rail_rows_sent(counts: list, rank: int, ranks_per_node: int, budget=None) -> tuple:
    """(dispatch, combine) token rows that ``rank`` hands the rail: its own tokens per remote
    node, and per remote node m those of the rank of its index there that have a slot on this
    node; with a capacity-mode ``budget``, that many per remote node."""
    G = ranks_per_node
    home, q, nodes = rank // G, rank % G, len(counts) // G
    remote = [n for n in range(nodes) if n != home]
    if budget is not None:
        return len(remote) * budget, len(remote) * budget
    return (sum(counts[rank][n] for n in remote), sum(counts[m * G + q][home] for m in remote))


def rail_bytes_sent(rows: tuple, hidden_bytes: int, max_topk: int, with_probs: bool) -> dict:
    """Group.info()["rail_bytes_sent"] after one dispatch, combine and combine_probs of
    ``rows`` = (dispatch, combine) rows: token rows, and weights as max_topk 8-byte slots."""
    slots = 8 * max_topk
    return {"dispatch": rows[0] * (hidden_bytes + (slots if with_probs else 0)),
            "combine": rows[1] * hidden_bytes, "combine_probs": rows[1] * slots}
