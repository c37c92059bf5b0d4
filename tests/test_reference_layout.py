"""docs/design.md §3 on the reference backend: rows, their order, tokens_per_expert and recv probs, compared
bitwise with the independent oracle (tests/dense.py), on 1, 2 and 4 gloo ranks."""

import math

import pytest
import torch

import dense
import dist
import ep_cases

# name -> make_problem / group arguments. E is a multiple of 4 so every case runs on 1, 2, 4 ranks.
CASES = {
    "random_bf16_probs_f32_int64": dict(tokens=24, hidden=16, num_experts=8, topk=3,
                                        dtype=torch.bfloat16),
    "masked_fp32_probs_bf16_int32": dict(tokens=23, hidden=8, num_experts=12, topk=4,
                                         dtype=torch.float32, probs_dtype=torch.bfloat16,
                                         idx_dtype=torch.int32, routing="masked"),
    "rank_with_zero_tokens_fp16": dict(tokens=(0, 19), hidden=8, num_experts=8, topk=2,
                                       dtype=torch.float16),
    "all_tokens_to_one_expert": dict(tokens=20, hidden=8, num_experts=8, topk=2,
                                     dtype=torch.bfloat16, routing="one_expert"),
    "alignment_16_masked": dict(tokens=21, hidden=8, num_experts=8, topk=3,
                                dtype=torch.bfloat16, routing="masked", alignment=16),
    "no_probs_fp64_topk1": dict(tokens=15, hidden=8, num_experts=4, topk=1,
                                dtype=torch.float64, probs_dtype=None),
    "capacity_random": dict(tokens=18, hidden=8, num_experts=8, topk=2, dtype=torch.bfloat16,
                            capacity_slack=5),
    "capacity_alignment_8_masked_int32": dict(tokens=17, hidden=8, num_experts=16, topk=3,
                                              dtype=torch.float32, routing="masked",
                                              idx_dtype=torch.int32, alignment=8,
                                              capacity_slack=3),
    "capacity_no_tail_probs_f64": dict(tokens=9, hidden=4, num_experts=4, topk=4,
                                       dtype=torch.float32, probs_dtype=torch.float64,
                                       capacity_slack=0),
}

GROUP_KEYS = ("alignment", "capacity_slack")


def split_case(case: dict):
    problem_args = {k: v for k, v in case.items() if k not in GROUP_KEYS}
    return problem_args, case.get("alignment", 1), case.get("capacity_slack")


def check_layout(case_name: str, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    problem_args, alignment, slack = split_case(CASES[case_name])
    problem = dense.make_problem(seed, world, **problem_args)
    dense.check_routing(problem)
    group = ep_cases.make_group(problem, alignment=alignment, capacity_slack=slack)
    capacity = group.config.max_recv_tokens_per_rank if slack is not None else None
    want_x, want_p, want_tpe, used = dense.dispatch(problem, rank, alignment, capacity)
    x, idx, probs = ep_cases.share(problem, rank)

    handle = group.create_handle(idx)
    assert handle.num_tokens == x.shape[0] and handle.topk == problem.topk
    assert handle.num_recv_tokens == want_x.shape[0], (
        f"num_recv_tokens {handle.num_recv_tokens}, expected {want_x.shape[0]}")
    recv_x, recv_p = handle.dispatch(x, probs)
    dense.assert_bitwise_equal(recv_x, want_x, "recv_x")
    if want_p is None:
        assert recv_p is None, "dispatch without probs returns recv_probs None"
    else:
        dense.assert_bitwise_equal(recv_p, want_p, "recv_probs")
    tpe = handle.tokens_per_expert
    assert tpe.dtype == torch.int64 and tuple(tpe.shape) == (problem.num_local_experts,)
    if capacity is None:
        assert tpe.device.type == "cpu", "exact mode: tokens_per_expert is a host tensor"
    else:
        assert tpe.device == group.device, "capacity mode: tokens_per_expert on the group device"
    dense.assert_bitwise_equal(tpe.cpu(), want_tpe, "tokens_per_expert")
    assert int(tpe.sum()) == used
    # The same handle serves a second dispatch of other tokens (e.g. a recomputed forward).
    x2 = dense.wide_values(torch.Generator().manual_seed(seed + 1 + rank), x.shape, x.dtype)
    recv_x2, _ = handle.dispatch(x2)
    problem2 = dense.Problem(world, problem.num_experts,
                             [dense.wide_values(torch.Generator().manual_seed(seed + 1 + s),
                                                problem.x[s].shape, x.dtype)
                              for s in range(world)], problem.topk_idx, problem.probs)
    dense.assert_bitwise_equal(recv_x2, dense.dispatch(problem2, rank, alignment, capacity)[0],
                               "recv_x of a second dispatch on the same handle")
    handle.destroy()
    group.destroy()
    return f"rank {rank}: {handle.num_recv_tokens} rows, tokens_per_expert {want_tpe.tolist()}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case_name", list(CASES))
def test_layout_matches_design(case_name, world_size, seed):
    for line in dist.run(world_size, check_layout, case_name, seed):
        print(line)


def check_capacity_factor(seed: int, alignment: int) -> None:
    """The capacity from a factor is the documented bound, ceil(factor * T * K) + L * (A - 1),
    rounded up to a multiple of A."""
    import megatron_nccl_ep as ep

    rank, world = ep_cases.rank_and_size()
    tokens, topk, experts = 16, 2, 8
    problem = dense.make_problem(seed, world, tokens=tokens, hidden=8, num_experts=experts,
                                 topk=topk, dtype=torch.bfloat16)
    # A factor of world_size bounds any routing: no rank receives more than R * T * K rows.
    factor = world + 0.25
    group = ep.Group(num_experts=experts, hidden=8, max_tokens_per_rank=tokens, max_topk=topk,
                     dtype=torch.bfloat16, backend="torch", device="cpu", recv_mode="capacity",
                     capacity_factor=factor, expert_alignment=alignment)
    capacity = math.ceil(factor * tokens * topk) + (experts // world) * (alignment - 1)
    capacity = -(-capacity // alignment) * alignment
    assert group.config.max_recv_tokens_per_rank == capacity
    x, idx, probs = ep_cases.share(problem, rank)
    handle = group.create_handle(idx)
    assert handle.num_recv_tokens == capacity
    recv_x, recv_p = handle.dispatch(x, probs)
    want_x, want_p, want_tpe, _ = dense.dispatch(problem, rank, alignment, capacity)
    dense.assert_bitwise_equal(recv_x, want_x, "recv_x")
    dense.assert_bitwise_equal(recv_p, want_p, "recv_probs")
    dense.assert_bitwise_equal(handle.tokens_per_expert.cpu(), want_tpe, "tokens_per_expert")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_capacity_factor_sizes_outputs(world_size, seed):
    dist.run(world_size, check_capacity_factor, seed, 4)


def test_single_rank_without_torch_distributed(seed):
    """process_group=None with torch.distributed not initialized is a single-rank group: run in
    the pytest process itself."""
    import torch.distributed as tdist

    assert not (tdist.is_available() and tdist.is_initialized())
    for case_name in ("masked_fp32_probs_bf16_int32", "alignment_16_masked", "capacity_random"):
        print(check_layout(case_name, seed))


SUBGROUP_LAYOUTS = {"contiguous": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]}


def check_subgroups(layout_name: str, seed: int) -> str:
    """EP groups smaller than the world (as Megatron builds them): each 2-rank subgroup is its own
    EP group with its own routing; ranks are numbered inside the subgroup."""
    import torch.distributed as tdist

    rank, world = ep_cases.rank_and_size()
    assert world == 4
    groups = [tdist.new_group(members) for members in SUBGROUP_LAYOUTS[layout_name]]
    which = next(i for i, m in enumerate(SUBGROUP_LAYOUTS[layout_name]) if rank in m)
    pg = groups[which]
    sub_rank = tdist.get_rank(pg)
    problem = dense.make_problem(seed + 1000 * which, 2, tokens=(13, 8), hidden=16,
                                 num_experts=8, topk=3, dtype=torch.bfloat16, routing="masked")
    group = ep_cases.make_group(problem, process_group=pg, alignment=4)
    assert (group.rank, group.world_size, group.num_local_experts) == (sub_rank, 2, 4)
    x, idx, probs = ep_cases.share(problem, sub_rank)
    handle = group.create_handle(idx)
    recv_x, recv_p = handle.dispatch(x, probs)
    want_x, want_p, want_tpe, _ = dense.dispatch(problem, sub_rank, 4)
    dense.assert_bitwise_equal(recv_x, want_x, "recv_x in a subgroup")
    dense.assert_bitwise_equal(recv_p, want_p, "recv_probs in a subgroup")
    dense.assert_bitwise_equal(handle.tokens_per_expert, want_tpe, "tokens_per_expert")
    rows = [dense.layout(problem, d, 4).num_rows for d in range(2)]
    expert_out = ep_cases.poisoned_rows(problem, seed + 5 + which, rows, 4)
    dense.assert_bitwise_equal(handle.combine(expert_out[sub_rank]),
                               dense.combine(problem, expert_out, sub_rank, 4),
                               "combine in a subgroup")
    return f"rank {rank} -> subgroup {which} rank {sub_rank}: {recv_x.shape[0]} rows"


@pytest.mark.parametrize("layout_name", list(SUBGROUP_LAYOUTS))
def test_ep_subgroups_of_the_world(layout_name, seed):
    for line in dist.run(4, check_subgroups, layout_name, seed):
        print(line)


def check_handle_cost_follows_tokens(seed: int) -> None:
    """Handle creation works on the tokens passed, not on max_tokens_per_rank: with a bound of
    2^23 tokens and a few tokens per rank, nothing it gathers holds more rows than the largest
    batch (the layout still matches the oracle)."""
    import megatron_nccl_ep as ep

    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=(5, 9), hidden=8, num_experts=8, topk=2,
                                 dtype=torch.bfloat16)
    group = ep.Group(num_experts=8, hidden=8, max_tokens_per_rank=1 << 23, max_topk=2,
                     dtype=torch.bfloat16, backend="torch", device="cpu")
    gathered = []
    all_gather = group._backend._all_gather

    def recording(op, t):
        gathered.append(tuple(t.shape))
        return all_gather(op, t)

    group._backend._all_gather = recording
    x, idx, probs = ep_cases.share(problem, rank)
    handle = group.create_handle(idx)
    most = max(t.shape[0] for t in problem.x)
    assert gathered and all(shape[0] <= max(most, 3) for shape in gathered), gathered
    want_x, _, want_tpe, _ = dense.dispatch(problem, rank)
    dense.assert_bitwise_equal(handle.dispatch(x, probs)[0], want_x, "recv_x")
    dense.assert_bitwise_equal(handle.tokens_per_expert, want_tpe, "tokens_per_expert")


@pytest.mark.parametrize("world_size", [1, 2])
def test_handle_creation_cost_follows_the_tokens_passed(world_size, seed):
    dist.run(world_size, check_handle_cost_follows_tokens, seed)


def check_nothing_received(dtype: torch.dtype) -> None:
    """A rank that receives no token gets empty outputs of the right dtypes (the received byte
    rows of width hidden + probs must not be viewed through their strides when there are none)."""
    import megatron_nccl_ep as ep

    rank, _ = ep_cases.rank_and_size()
    group = ep.Group(num_experts=4, hidden=5, max_tokens_per_rank=4, max_topk=2, dtype=dtype,
                     backend="torch", device="cpu")
    # Rank 0 has no tokens; rank 1 routes only to its own experts (2, 3).
    tokens = 0 if rank == 0 else 3
    idx = torch.tensor([[2, 3]] * tokens, dtype=torch.int64).reshape(tokens, 2)
    x = torch.ones(tokens, 5, dtype=dtype)
    probs = torch.full((tokens, 2), 0.5, dtype=torch.float32)
    handle = group.create_handle(idx)
    recv_x, recv_p = handle.dispatch(x, probs)
    want = 0 if rank == 0 else 6
    assert recv_x.shape == (want, 5) and recv_x.dtype == dtype
    assert recv_p.shape == (want,) and recv_p.dtype == torch.float32
    assert handle.combine(recv_x).shape == (tokens, 5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_rank_that_receives_nothing(dtype):
    dist.run(2, check_nothing_received, dtype)
