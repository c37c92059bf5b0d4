"""docs/design.md §9, "LL across nodes", on the reference backend: an LL group of `R` ranks in
nodes of `G` (emulated: gloo ranks, `ranks_per_node=G`), 2 nodes of 2, 4 of 1 and 2 of 4.

- Dispatch: every output bitwise a one-node group's of the same `R`, made in the same processes
  from the same inputs (both layouts, bf16 / fp16 / fp32 tokens, token-dtype and FP8 payloads,
  masked slots, a rank with 0 tokens).
- Combine: bitwise the node order, computed independently token by token
  (tests/ll_oracle.py ``ll_combine_by_contract``) and by the one-process oracle; bitwise the
  one-node combine where the contract says the orders coincide (rank-major with `G = 1`; a
  token whose terms all lie on one node, but for a one-node -0.0, which the node order makes
  +0.0); and not the one-node combine on these inputs where they need not coincide, so a flat
  sum cannot pass for the node order.
- send_only + complete with two ops of each kind in flight: the eager bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dist
import ep_cases
import ll_cases
import ll_oracle
import megatron_nccl_ep as ep
from megatron_nccl_ep.config import GroupConfig

FP8 = torch.float8_e4m3fn
# (world size, ranks per node): N nodes x G ranks.
TOPOLOGIES = [pytest.param(4, 2, id="2x2"), pytest.param(4, 1, id="4x1"),
              pytest.param(8, 4, id="2x4")]
# A rank with 0 tokens (rank 1, and 5 of 8), masked slots, every 5th token wholly masked, T < T_max
# on some ranks; top-3 of 16 experts (4 per rank of 4, 2 per rank of 8), so tokens span nodes.
CASE = dict(tokens=(7, 0, 12, 5), hidden=256, num_experts=16, topk=3, max_tokens=12,
            routing="masked")


def _one_node(cfg: GroupConfig) -> GroupConfig:
    return dataclasses.replace(cfg, ranks_per_node=0)


def _nodes_of_token(slots, experts_per_node: int) -> set:
    return {e // experts_per_node for e in slots if e >= 0}


def _coincides(y_nodes: torch.Tensor, y_flat: torch.Tensor) -> bool:
    """The node order's bits where the contract says it meets the flat order: equal, but where
    the flat sum rounded to -0.0, which the node order's sum from +0.0 makes +0.0."""
    neg_zero = (y_flat == 0) & torch.signbit(y_flat)
    want = torch.where(neg_zero, torch.zeros_like(y_flat), y_flat)
    return ep_cases.count_mismatches(y_nodes, want) == 0


def _route_a_token_over_nodes(problem, world: int, G: int) -> None:
    """Token 2 of rank 0 to two terms on node 0 and one on node 1 (experts 0 and L: ranks 0 and
    1 where G > 1; experts 0 and 1 of rank 0 where G = 1; and node 1's first expert), in every
    process alike: a node partial of two terms, rounded, in a token that spans nodes, where the
    node order need not give the flat sum, whatever the draw."""
    L = problem.num_experts // world
    first = [0, L] if G > 1 else [0, 1]
    idx = problem.topk_idx[0]
    idx[2] = torch.tensor(first + [G * L], dtype=idx.dtype)


def check_ll_across_nodes(ranks_per_node: int, layout: str, dtype, payload_dtype,
                          seed: int) -> dict:
    rank, world = ep_cases.rank_and_size()
    G = ranks_per_node
    problem = ll_cases.make_ll_problem(world, dtype=dtype, seed=seed, **CASE)
    _route_a_token_over_nodes(problem, world, G)
    fields = problem.group_fields(layout, payload_dtype)
    nodes = ep.Group(backend="torch", device="cpu", ranks_per_node=G, **fields)
    flat = ep.Group(backend="torch", device="cpu", **fields)
    assert nodes.config.node_size(world) == G < world
    em = layout == "expert_major"
    h_nodes = nodes.create_handle(problem.topk_idx[rank].clone())
    h_flat = flat.create_handle(problem.topk_idx[rank].clone())
    out_nodes = h_nodes.dispatch(problem.x[rank].clone(), problem.weights[rank].clone())
    out_flat = h_flat.dispatch(problem.x[rank].clone(), problem.weights[rank].clone())
    bad = ll_cases.dispatch_mismatches(out_nodes, out_flat, layout)
    assert not bad, f"rank {rank}: the dispatch over nodes differs from one node's in {bad}"

    counts = [o.count for o in ll_oracle.ll_dispatch_all(
        flat.config, world, problem.topk_idx, problem.x, problem.weights)]
    expert_out = ll_cases.expert_outputs(problem, layout, counts, seed + 11)
    cw = ll_cases.fresh_weights(problem, seed + 13)
    w_all = cw if em else None

    def combine(handle, rows):
        return handle.combine(rows[rank].clone(), cw[rank].clone() if em else None)

    y_nodes, y_flat = combine(h_nodes, expert_out), combine(h_flat, expert_out)
    want = ll_oracle.ll_combine_by_contract(nodes.config, world, problem.topk_idx, expert_out,
                                            w_all)[rank]
    want_flat = ll_oracle.ll_combine_by_contract(flat.config, world, problem.topk_idx,
                                                 expert_out, w_all)[rank]
    assert ep_cases.count_mismatches(y_nodes, want) == 0, (
        f"rank {rank}: combine over nodes, {ep_cases.count_mismatches(y_nodes, want)} elements "
        "differ from the node order")
    assert ep_cases.count_mismatches(y_flat, want_flat) == 0
    assert not bool(y_nodes.isnan().any())
    # The one-process oracle (the reference's own steps) follows the configuration's nodes.
    assert ep_cases.count_mismatches(ll_oracle.ll_combine_all(
        nodes.config, world, problem.topk_idx, expert_out, w_all)[rank], y_nodes) == 0

    # Where the orders coincide.
    per_node = G * (problem.num_experts // world)
    single = [len(_nodes_of_token(s, per_node)) <= 1 for s in problem.topk_idx[rank].tolist()]
    single = torch.tensor(single, dtype=torch.bool)
    assert _coincides(y_nodes[single], y_flat[single]), (
        f"rank {rank}: a token whose slots lie on one node differs from the one-node combine")
    if not em and G == 1:
        assert ep_cases.count_mismatches(y_nodes, y_flat) == 0, (
            "rank-major with one rank per node: the node order is the flat order")

    if dtype != torch.float32:  # fp32 expert rows, rounded to the token dtype as read
        wide = ll_cases.widened_outputs(expert_out, seed + 17)
        y_wide = combine(h_nodes, wide)
        want_wide = ll_oracle.ll_combine_by_contract(nodes.config, world, problem.topk_idx,
                                                     wide, w_all)[rank]
        assert ep_cases.count_mismatches(y_wide, want_wide) == 0
    nodes.destroy()
    flat.destroy()
    return {"differs_from_flat": ep_cases.count_mismatches(y_nodes, y_flat),
            "tokens_over_nodes": int((~single).sum()),
            "received": int(out_nodes.count.sum())}


DTYPES = [pytest.param(torch.bfloat16, None, id="bf16"),
          pytest.param(torch.bfloat16, FP8, id="bf16-fp8"),
          pytest.param(torch.float16, None, id="fp16"),
          pytest.param(torch.float32, FP8, id="fp32-fp8")]


@pytest.mark.parametrize("dtype,payload_dtype", DTYPES)
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("world_size,ranks_per_node", TOPOLOGIES)
def test_ll_across_nodes_bitwise(world_size, ranks_per_node, layout, dtype, payload_dtype,
                                 seed):
    per_rank = dist.run(world_size, check_ll_across_nodes, ranks_per_node, layout, dtype,
                        payload_dtype, seed)
    assert sum(r["received"] for r in per_rank) > 0
    assert sum(r["tokens_over_nodes"] for r in per_rank) > 0, "no token spans nodes"
    differs = sum(r["differs_from_flat"] for r in per_rank)
    if layout == "rank_major" and ranks_per_node == 1:
        assert differs == 0
    elif dtype != torch.float32:
        # The orders need not meet, and with 16-bit tokens (each node partial rounded to them)
        # on a token routed to do so (_route_a_token_over_nodes: 3 x hidden elements) they do
        # not: the combine matched the node order, not a flat sum that happens to be equal.
        # (fp32 tokens: node partials are not rounded, and sums of a few terms may associate
        # alike.)
        assert differs > 0, "the node order gave the flat sums on every rank"


# ------------------------------------------------------------------------------------------------
# staging: two ops of each kind in flight
# ------------------------------------------------------------------------------------------------


def check_staged_across_nodes(ranks_per_node: int, layout: str, payload_dtype, seed: int) -> None:
    """dispatch mb0 and mb1 send_only, complete both; combine mb0 and mb1 send_only, complete
    both: outputs poison until their complete(), then the eager one-node dispatch and the node
    order's combine, bitwise."""
    rank, world = ep_cases.rank_and_size()
    em = layout == "expert_major"
    mbs = [ll_cases.make_ll_problem(world, (9, 0, 4), 128, 16, 3, torch.bfloat16,
                                    seed=seed + i, max_tokens=9, routing="masked")
           for i in range(2)]
    group = ep.Group(backend="torch", device="cpu", ranks_per_node=ranks_per_node,
                     **mbs[0].group_fields(layout, payload_dtype))
    cfg = group.config
    hs = [group.create_handle(p.topk_idx[rank]) for p in mbs]
    outs = [h.dispatch(p.x[rank], p.weights[rank], send_only=True) for h, p in zip(hs, mbs)]
    assert all(bool((o.count == -1).all()) for o in outs), "poison until complete"
    combine_in = []
    for h, p, o, i in zip(hs, mbs, outs, range(2)):
        h.complete()
        want = ll_oracle.ll_dispatch_all(_one_node(cfg), world, p.topk_idx, p.x, p.weights)
        assert not ll_cases.dispatch_mismatches(o, want[rank], layout)
        eo = ll_cases.expert_outputs(p, layout, [w.count for w in want], seed + 20 + i)
        combine_in.append((eo, ll_cases.fresh_weights(p, seed + 30 + i) if em else None))
    ys = [h.combine(eo[rank], cw[rank] if em else None, send_only=True)
          for h, (eo, cw) in zip(hs, combine_in)]
    assert all(bool(y.isnan().all()) for y in ys if y.numel()), "poison until complete"
    for h in hs:
        h.complete()
    for y, p, (eo, cw) in zip(ys, mbs, combine_in):
        want = ll_oracle.ll_combine_by_contract(cfg, world, p.topk_idx, eo, cw)[rank]
        assert ep_cases.count_mismatches(y, want) == 0


@pytest.mark.parametrize("layout,payload_dtype", [("expert_major", FP8), ("rank_major", None),
                                                  ("rank_major", FP8)])
@pytest.mark.parametrize("world_size,ranks_per_node", TOPOLOGIES)
def test_ll_across_nodes_send_only(world_size, ranks_per_node, layout, payload_dtype, seed):
    dist.run(world_size, check_staged_across_nodes, ranks_per_node, layout, payload_dtype, seed)


# ------------------------------------------------------------------------------------------------
# the contract's corners, in one process
# ------------------------------------------------------------------------------------------------


def test_a_one_node_negative_zero_becomes_positive_over_nodes():
    """A token whose slots all lie on one node and whose one-node sum rounds to -0.0 (fp16: a
    tiny negative fp32 sum) gets +0.0 over nodes: its node partial, -0.0, is added to +0.0.
    Both oracles agree."""
    R, H = 2, 128
    fields = dict(mode="ll", ll_layout="expert_major", num_experts=4, hidden=H,
                  max_tokens_per_rank=1, max_topk=2, dtype=torch.float16)
    topk = [torch.tensor([[0, 1]]), torch.tensor([[-1, -1]])]  # rank 0's token: both on rank 0
    # fp16's least subnormal, 2^-24, weighted: the fp32 sum -0.375 x 2^-24 rounds to -0.0.
    least = torch.full((2, R, H), -(2.0 ** -24), dtype=torch.float16)
    expert_out = [least, torch.zeros(2, R, H, dtype=torch.float16)]
    weights = [torch.tensor([[0.125, 0.25]]), torch.zeros(1, 2)]
    ys = {}
    for G in (0, 1):
        cfg = GroupConfig.build(R, ranks_per_node=G, **fields)
        cfg.check_rules(R)
        ys[G] = ll_oracle.ll_combine_by_contract(cfg, R, topk, expert_out, weights)[0]
        assert ep_cases.count_mismatches(
            ll_oracle.ll_combine_all(cfg, R, topk, expert_out, weights)[0], ys[G]) == 0
    assert bool(torch.signbit(ys[0]).all()) and bool((ys[0] == 0).all())
    assert not bool(torch.signbit(ys[1]).any()) and bool((ys[1] == 0).all())


@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
@pytest.mark.parametrize("world_size,ranks_per_node", [(4, 4), (8, 2), (8, 1), (6, 3), (6, 2)])
def test_one_process_oracle_is_the_node_order(world_size, ranks_per_node, layout, seed):
    """The reference's steps (ll_oracle.ll_combine_all) give the independent node order for
    every G, including G = R (the one-node formula) and odd node counts."""
    problem = ll_cases.make_ll_problem(world_size, (5, 0, 8), 128, 4 * world_size, 4,
                                       torch.bfloat16, seed=seed, routing="masked")
    cfg = GroupConfig.build(world_size, ranks_per_node=ranks_per_node,
                            **problem.group_fields(layout))
    cfg.check_rules(world_size)
    counts = [o.count for o in ll_oracle.ll_dispatch_all(cfg, world_size, problem.topk_idx,
                                                         problem.x, problem.weights)]
    eo = ll_cases.expert_outputs(problem, layout, counts, seed + 1)
    w = ll_cases.fresh_weights(problem, seed + 2) if layout == "expert_major" else None
    got = ll_oracle.ll_combine_all(cfg, world_size, problem.topk_idx, eo, w)
    want = ll_oracle.ll_combine_by_contract(cfg, world_size, problem.topk_idx, eo, w)
    assert all(ep_cases.count_mismatches(a, b) == 0 for a, b in zip(got, want))
    flat = ll_oracle.ll_combine_by_contract(_one_node(cfg), world_size, problem.topk_idx, eo, w)
    differs = sum(ep_cases.count_mismatches(a, b) for a, b in zip(got, flat))
    assert (differs == 0) == (ranks_per_node == world_size
                              or (layout == "rank_major" and ranks_per_node == 1))
