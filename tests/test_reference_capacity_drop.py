"""Capacity mode that drops its overflow (``capacity_overflow="drop"``, docs/design.md §3) on the
reference backend, against the independent oracle (tests/dense.py, ``drop_past``): the rows past
the output's bound are dropped (no row, never combined, 0 in the probs' gradient),
``tokens_per_expert`` still counts every block whole (its sum is the rows the routing needed),
and the group stays usable; on 1, 2 and 4 gloo ranks."""

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep

# name -> (make_problem arguments, alignment, rows short of what the fullest rank needs)
CASES = {
    "random_bf16": (dict(tokens=24, hidden=16, num_experts=8, topk=3, dtype=torch.bfloat16), 1, 7),
    "masked_aligned_8_fp32": (dict(tokens=23, hidden=8, num_experts=16, topk=4,
                                   dtype=torch.float32, routing="masked"), 8, 8),
    "one_expert_fp16": (dict(tokens=20, hidden=8, num_experts=8, topk=2, dtype=torch.float16,
                             routing="one_expert"), 1, 11),
    "zero_token_rank_bf16": (dict(tokens=(19, 0), hidden=8, num_experts=8, topk=2,
                                  dtype=torch.bfloat16), 4, 4),
}


def check_drop(case_name: str, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    args, alignment, short = CASES[case_name]
    problem = dense.make_problem(seed, world, **args)
    needed = [dense.layout(problem, d, alignment).num_rows for d in range(world)]
    capacity = max(0, max(needed) - short)
    group = ep_cases.make_group(problem, alignment=alignment, recv_mode="capacity",
                                max_recv_tokens_per_rank=capacity, capacity_overflow="drop")
    x, idx, probs = ep_cases.share(problem, rank, requires_grad=True)
    handle = group.create_handle(idx)
    assert handle.num_recv_tokens == capacity
    recv_x, recv_p = ep.dispatch(handle, x, probs)
    want_x, want_p, want_tpe, _ = dense.dispatch(problem, rank, alignment, capacity,
                                                 drop_past=capacity)
    dense.assert_bitwise_equal(recv_x, want_x, "recv_x (rows past the capacity dropped)")
    dense.assert_bitwise_equal(recv_p, want_p, "recv_probs")
    tpe = handle.tokens_per_expert
    assert tpe.device == group.device
    dense.assert_bitwise_equal(tpe.cpu(), want_tpe, "tokens_per_expert (every block whole)")
    assert int(tpe.sum()) == needed[rank]
    # Combine reads only the rows kept: every other row is NaN.
    expert_out = ep_cases.poisoned_rows(problem, seed + 3, [capacity] * world, alignment,
                                        drop_past=capacity)
    y = ep.combine(handle, expert_out[rank].clone().requires_grad_(True))
    want_y = dense.combine(problem, expert_out, rank, alignment, drop_past=capacity)
    dense.assert_bitwise_equal(y, want_y, "combine (dropped slots not summed)")
    # The probs' gradient: the received row's value, 0 at dropped (and masked) slots.
    grad_rows = ep_cases.poisoned_rows(problem, seed + 5, [capacity] * world, alignment,
                                       vector=True, dtype=probs.dtype, drop_past=capacity)
    grad_p = handle.combine_probs(grad_rows[rank])
    want_gp = dense.combine_probs(problem, grad_rows, rank, alignment, drop_past=capacity)
    dense.assert_bitwise_equal(grad_p, want_gp, "combine_probs (0 at dropped slots)")
    dropped = sum(n - capacity for n in needed if n > capacity)
    # An overflow is no error: the group takes the next handle (one that fits, here).
    fits = torch.full_like(idx, -1)
    h2 = group.create_handle(fits)
    assert int(h2.tokens_per_expert.sum()) == 0
    dense.assert_bitwise_equal(h2.combine(torch.zeros(capacity, problem.hidden,
                                                      dtype=x.dtype)),
                               torch.zeros_like(x.detach()), "combine of a later handle")
    group.destroy()
    return f"rank {rank}: needs {needed[rank]} rows of {capacity}; {dropped} rows dropped in all"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case_name", list(CASES))
def test_overflow_dropped_as_designed(case_name, world_size, seed):
    lines = dist.run(world_size, check_drop, case_name, seed)
    for line in lines:
        print(line)
    assert not lines[0].endswith(" 0 rows dropped in all"), (
        "the case overflows no rank: it would not test a drop")


def check_drop_over_nodes(seed: int) -> None:
    """Groups that span nodes: the same drops, the hierarchical combine of the kept rows."""
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=17, hidden=8, num_experts=8, topk=3,
                                 dtype=torch.bfloat16)
    capacity = max(dense.layout(problem, d).num_rows for d in range(world)) - 5
    group = ep_cases.make_group(problem, recv_mode="capacity", max_recv_tokens_per_rank=capacity,
                                capacity_overflow="drop", ranks_per_node=2)
    x, idx, probs = ep_cases.share(problem, rank)
    handle = group.create_handle(idx)
    dense.assert_bitwise_equal(handle.dispatch(x, probs)[0],
                               dense.dispatch(problem, rank, 1, capacity, drop_past=capacity)[0],
                               "recv_x over nodes")
    expert_out = ep_cases.poisoned_rows(problem, seed + 3, [capacity] * world, drop_past=capacity)
    dense.assert_bitwise_equal(handle.combine(expert_out[rank]),
                               dense.combine(problem, expert_out, rank, ranks_per_node=2,
                                             drop_past=capacity), "combine over nodes")


def test_overflow_dropped_over_nodes(seed):
    dist.run(4, check_drop_over_nodes, seed)


@pytest.mark.parametrize("fields, message", [
    (dict(capacity_overflow="drop"), "capacity_overflow='drop' needs recv_mode='capacity'"),
    (dict(recv_mode="capacity", max_recv_tokens_per_rank=8, capacity_overflow="skip"),
     "capacity_overflow must be 'error' or 'drop', got 'skip'"),
    (dict(mode="ll", capacity_overflow="drop", recv_mode="capacity", max_recv_tokens_per_rank=8),
     "capacity_overflow keep their defaults"),
])
def test_capacity_overflow_setting_refused(fields, message):
    """Refused by the fields' checks (``GroupConfig.build``) or by the rules (``validate``, the
    reference backend's)."""
    with pytest.raises(ValueError, match=message):
        ep.GroupConfig.build(1, num_experts=8, hidden=8, max_tokens_per_rank=4, max_topk=2,
                             **fields).validate(1)
