"""docs/design.md §4, groups that span nodes, on the reference backend: with ranks_per_node = G
the combine sums each node's partials (2a) and then the nodes' sums (2b). G = 1 and G = R are
bitwise the flat combine; G strictly between changes the bits on order-sensitive inputs, and the
backend matches the independent oracle for every G. Dispatch and the probs paths do no arithmetic
and do not change with G."""

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
