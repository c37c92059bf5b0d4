"""docs/design.md §4, groups that span nodes, on the reference backend: with ranks_per_node = G
the combine sums each node's partials (2a) and then the nodes' sums (2b). G = 1 and G = R are
bitwise the flat combine; G strictly between changes the bits on order-sensitive inputs, and the
backend matches the independent oracle for every G. Dispatch and the probs paths do no arithmetic
and do not change with G."""

import math

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_oracle_nodes_of_one_and_of_all_ranks_are_the_flat_combine(dtype, seed):
    problem, expert_out = ep_cases.order_sensitive_outputs(seed, dtype)
    differ = 0
    for source in range(4):
        flat = dense.combine(problem, expert_out, source)
        for G in (1, 4):
            dense.assert_bitwise_equal(
                dense.combine(problem, expert_out, source, ranks_per_node=G), flat,
                f"oracle with {G} rank(s) per node against the flat combine, source {source}")
        two = dense.combine(problem, expert_out, source, ranks_per_node=2)
        differ += int((dense.bits(two) != dense.bits(flat)).sum())
    print(f"{dtype}: 2 nodes of 2 ranks differ from the flat combine in {differ} elements")
    assert differ > 0, "the inputs do not tell the node-level rounding from the flat sum"


def check_hierarchical_combine(case: dict, slack, ranks_per_node: int, dtype: torch.dtype,
                               seed: int) -> int:
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, dtype=dtype, **case)
    flat_group = ep_cases.make_group(problem, capacity_slack=slack)
    group = ep_cases.make_group(problem, capacity_slack=slack, ranks_per_node=ranks_per_node)
    capacity = group.config.max_recv_tokens_per_rank if slack is not None else None
    rows = ep_cases.capacity_or_rows(problem, 1, capacity)
    expert_out = ep_cases.poisoned_rows(problem, seed + 11, rows)
    x, idx, probs = ep_cases.share(problem, rank)
    handle, flat = group.create_handle(idx), flat_group.create_handle(idx)

    y = handle.combine(expert_out[rank])
    want = dense.combine(problem, expert_out, rank, ranks_per_node=ranks_per_node)
    assert not torch.isnan(want).any()
    dense.assert_bitwise_equal(y, want, f"combine with {ranks_per_node} rank(s) per node")
    if ranks_per_node in (1, world):
        dense.assert_bitwise_equal(y, flat.combine(expert_out[rank]),
                                   f"{ranks_per_node} rank(s) per node against the flat combine")
    # No arithmetic elsewhere: dispatch and the probs gradient do not depend on the nodes.
    for got, base in zip(handle.dispatch(x, probs), flat.dispatch(x, probs)):
        dense.assert_bitwise_equal(got, base, "dispatch with nodes against the flat group")
    grad = ep_cases.poisoned_rows(problem, seed + 13, rows, dtype=torch.float32, vector=True)
    dense.assert_bitwise_equal(handle.combine_probs(grad[rank]), flat.combine_probs(grad[rank]),
                               "combine_probs with nodes against the flat group")
    return int((idx >= 0).sum())


CASES = {
    "top12_of_16": (dict(tokens=24, hidden=48, num_experts=16, topk=12), None),
    "masked_uneven_capacity": (dict(tokens=(0, 23, 11, 5), hidden=40, num_experts=16, topk=5,
                                    routing="masked"), 7),
}


@pytest.mark.parametrize("world_size,ranks_per_node", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case_name", list(CASES))
def test_reference_hierarchical_combine_matches_design_bitwise(case_name, dtype, world_size,
                                                                ranks_per_node, seed):
    case, slack = CASES[case_name]
    slots = dist.run(world_size, check_hierarchical_combine, case, slack, ranks_per_node, dtype,
                     seed)
    print(f"{case_name} {dtype} R={world_size} G={ranks_per_node}: routed slots {slots}")


@pytest.mark.parametrize("ranks_per_node", [-1, 2, 3])
def test_ranks_per_node_must_divide_the_group(ranks_per_node):
    with pytest.raises(ValueError, match=rf"ranks_per_node must be 0 .* divisor of the group size "
                                         rf"\(1\).*got {ranks_per_node}"):
        ep.Group(num_experts=4, hidden=8, max_tokens_per_rank=4, max_topk=2, backend="torch",
                 device="cpu", ranks_per_node=ranks_per_node)


def check_bad_ranks_per_node(ranks_per_node: int) -> str:
    try:
        ep.Group(num_experts=8, hidden=8, max_tokens_per_rank=4, max_topk=2, backend="torch",
                 device="cpu", ranks_per_node=ranks_per_node)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_per_node_that_does_not_divide_raises_on_every_rank():
    messages = dist.run(4, check_bad_ranks_per_node, 3)
    for m in messages:
        assert "ranks_per_node must be 0 (one node) or a divisor of the group size (4)" in m, m


# -- what the rail carries (docs/internode.md: a node gets only what it needs) ---------------------
# E = 32 experts in 8 groups of 4; node-limited routing picks 4 of the 8 groups per token.
RAIL_SHAPE = dict(num_experts=32, hidden=24, max_tokens_per_rank=512, max_topk=4, groups=8,
                  groups_per_token=4)


def rail_routing(kind: str, seed: int, rank: int, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    s = RAIL_SHAPE
    if kind == "uniform":
        return ep_cases.uniform_routing(gen, tokens, s["num_experts"], s["max_topk"])
    return ep_cases.group_limited_routing(gen, tokens, s["num_experts"], s["groups"],
                                          s["groups_per_token"], s["max_topk"])


def share_on_other_node(kind: str, nodes: int) -> float:
    """p: the chance that a token has a slot on a given other node (docs/internode.md's
    formulas), for RAIL_SHAPE's routing with each node holding E / nodes experts."""
    s = RAIL_SHAPE
    E, K = s["num_experts"], s["max_topk"]
    if kind == "uniform":
        return 1 - math.comb(E - E // nodes, K) / math.comb(E, K)
    groups, M = s["groups"], s["groups_per_token"]
    size, per_node = E // groups, groups // nodes
    p = 0.0
    for j in range(0, min(M, per_node) + 1):  # j of the token's M groups on the node
        chance = (math.comb(per_node, j) * math.comb(groups - per_node, M - j)
                  / math.comb(groups, M))
        p += chance * (1 - math.comb((M - j) * size, K) / math.comb(M * size, K))
    return p


def check_rail_counts(kind: str, ranks_per_node: int, recv_mode: str, seed: int) -> tuple:
    """One dispatch, combine and combine_probs; Group.info()'s rail counters against the
    messages counted token by token. Returns (this rank's selected tokens, its tokens x remote
    nodes)."""
    rank, world = ep_cases.rank_and_size()
    s = RAIL_SHAPE
    T, H, K, E = s["max_tokens_per_rank"], s["hidden"], s["max_topk"], s["num_experts"]
    tokens = [T - 37 * r for r in range(world)]  # uneven: messages differ per pair
    routing = [rail_routing(kind, seed, r, tokens[r]) for r in range(world)]
    G = ranks_per_node
    fields = dict(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                  dtype=torch.bfloat16, ranks_per_node=G)
    budget = None
    if recv_mode == "capacity":
        budget = T - 5  # above every pair's count (at most the source's tokens)
        fields.update(recv_mode="capacity", max_recv_tokens_per_rank=world * T * K,
                      rail_capacity=budget)
    group = ep.Group(backend="torch", device="cpu", **fields)
    assert group.info()["rail_rows_sent"] == {"dispatch": 0, "combine": 0, "combine_probs": 0}
    handle = group.create_handle(routing[rank])
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(tokens[rank], H, generator=gen).to(torch.bfloat16)
    probs = torch.rand(tokens[rank], K, generator=gen)
    recv_x, recv_probs = handle.dispatch(x, probs)
    handle.combine(recv_x)
    handle.combine_probs(recv_probs)
    counts = ep_cases.rail_counts_by_token(routing, G, E // (world // G))
    rows = ep_cases.rail_rows_sent(counts, rank, G, budget)
    info = group.info()
    assert info["rail_rows_sent"] == {"dispatch": rows[0], "combine": rows[1],
                                      "combine_probs": rows[1]}, (info, rows)
    assert info["rail_bytes_sent"] == ep_cases.rail_bytes_sent(rows, H * 2, K, True), info
    handle.dispatch(x)  # no probs: rows alone
    after = group.info()
    assert after["rail_rows_sent"]["dispatch"] == 2 * rows[0]
    assert (after["rail_bytes_sent"]["dispatch"]
            == info["rail_bytes_sent"]["dispatch"] + rows[0] * H * 2)
    group.destroy()
    home = rank // G
    return (sum(c for n, c in enumerate(counts[rank]) if n != home),
            tokens[rank] * (world // G - 1))


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_rail_counts_are_the_messages_of_every_token_with_a_slot_there(ranks_per_node, seed):
    """Exact mode: each rank's rail rows are its tokens with a slot on each remote node (and back
    in the combine); uniform and node-limited routing hit the share of the design's formula, and
    node-limited routing sends fewer."""
    shares = {}
    for kind in ("uniform", "group_limited"):
        per_rank = dist.run(4, check_rail_counts, kind, ranks_per_node, "exact", seed)
        selected, possible = (sum(v) for v in zip(*per_rank))
        nodes = 4 // ranks_per_node
        shares[kind] = selected / possible
        want = share_on_other_node(kind, nodes)
        print(f"G={ranks_per_node} {kind}: p = {shares[kind]:.3f} (formula {want:.3f})")
        assert abs(shares[kind] - want) < 0.05, (kind, shares[kind], want)
    if ranks_per_node == 1:  # 4 nodes: the formula's gap is many standard deviations wide
        assert shares["group_limited"] < shares["uniform"] - 0.03, shares


def test_rail_capacity_mode_sends_the_budget_per_remote_node(seed):
    dist.run(4, check_rail_counts, "group_limited", 1, "capacity", seed)


def check_rail_overflow(budget: int) -> str:
    """Rank 0's tokens all on node 1 (experts 8..15 with G = 1, 4 nodes); the others' on their own
    node."""
    rank, world = ep_cases.rank_and_size()
    group = ep.Group(backend="torch", device="cpu", num_experts=32, hidden=8,
                     max_tokens_per_rank=16, max_topk=2, ranks_per_node=1, recv_mode="capacity",
                     max_recv_tokens_per_rank=256, rail_capacity=budget)
    experts = torch.tensor([[8, 9]]) if rank == 0 else torch.tensor([[8 * rank, 8 * rank + 1]])
    idx = experts.repeat(10, 1)
    try:
        group.create_handle(idx)
    except ep.NcclEpError as e:
        return str(e)
    finally:
        group.destroy()
    return "no error"


def test_rail_overflow_raises_on_every_rank_naming_the_pair():
    for message in dist.run(4, check_rail_overflow, 9):
        assert message.startswith("rail capacity overflow: rank 0 has 10 tokens with a slot on "
                                  "node 1 but rail_capacity=9"), message
    assert dist.run(4, check_rail_overflow, 10) == ["no error"] * 4


@pytest.mark.parametrize("fields", [dict(rail_capacity=5),
                                    dict(recv_mode="capacity", max_recv_tokens_per_rank=64,
                                         rail_capacity=17),
                                    dict(recv_mode="capacity", max_recv_tokens_per_rank=64,
                                         rail_capacity=-1)])
def test_rail_capacity_is_checked(fields):
    with pytest.raises(ValueError, match=r"rail_capacity must be in \[0, max_tokens_per_rank=16\] "
                                         r".*0 in exact mode"):
        ep.Group(num_experts=4, hidden=8, max_tokens_per_rank=16, max_topk=2, backend="torch",
                 device="cpu", **fields)
