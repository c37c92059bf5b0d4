"""docs/design.md §4 on the reference backend: the two-stage, ordered combine compared bitwise with the
independent oracle, on inputs where the summation order shows in the bits; and the round trip
dispatch -> rows * probs -> combine == x * sum(probs)."""

import pytest
import torch

import dense
import dist
import ep_cases

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]

# Wrong arithmetic that a backend could plausibly implement, as switches of the oracle. The
# accumulation-dtype variant accumulates in another dtype than §4's (the token dtype for 16-bit
# tokens, float64 for float32, float32 for float64).
WRONG_ORDERS = {
    "slots in descending k": dict(k_descending=True),
    "ranks in descending order": dict(rank_descending=True),
    "one flat sum without per-rank rounding": dict(two_stage=False),
    "accumulation in another dtype": "acc",
}
OTHER_ACC = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
             torch.float32: torch.float64, torch.float64: torch.float32}


def wrong_variant(name: str, dtype: torch.dtype) -> dict:
    spec = WRONG_ORDERS[name]
    return dict(acc_dtype=OTHER_ACC[dtype]) if spec == "acc" else spec


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(WRONG_ORDERS))
def test_oracle_distinguishes_summation_orders(variant, dtype, seed):
    """The inputs the combine tests use are order sensitive: each wrong arithmetic gives other
    bits than §4 somewhere, so the bitwise comparison below would catch it."""
    problem, expert_out = ep_cases.order_sensitive_outputs(seed, dtype)
    differ = 0
    for source in range(4):
        right = dense.combine(problem, expert_out, source)
        wrong = dense.combine(problem, expert_out, source, **wrong_variant(variant, dtype))
        assert not torch.isnan(right).any()
        differ += int((dense.bits(right) != dense.bits(wrong)).sum())
    print(f"{variant}, {dtype}: {differ} elements differ from docs/design.md §4")
    assert differ > 0, (f"{variant} gives the same bits as docs/design.md §4 for {dtype}: the inputs do "
                        "not exercise the summation order")


# name -> (make_problem arguments, alignment, capacity slack or None)
COMBINE_CASES = {
    "random_top12": (dict(tokens=24, topk=12), 1, None),
    "masked_aligned_16": (dict(tokens=21, topk=6, routing="masked"), 16, None),
    "zero_token_rank_capacity": (dict(tokens=(0, 23, 11), topk=5), 1, 9),
    "one_expert_int32": (dict(tokens=13, topk=3, routing="one_expert", idx_dtype=torch.int32),
                         1, None),
}


def check_combine(case_name: str, dtype: torch.dtype, seed: int) -> int:
    rank, world = ep_cases.rank_and_size()
    problem_args, alignment, slack = COMBINE_CASES[case_name]
    problem = dense.make_problem(seed, world, hidden=48, num_experts=16, dtype=dtype,
                                 **problem_args)
    group = ep_cases.make_group(problem, alignment=alignment, capacity_slack=slack)
    capacity = group.config.max_recv_tokens_per_rank if slack is not None else None
    rows = ep_cases.capacity_or_rows(problem, alignment, capacity)
    # Expert outputs: order-sensitive values in the used rows, NaN in padding and tail rows.
    expert_out = ep_cases.poisoned_rows(problem, seed + 11, rows, alignment)
    grad_recv_probs = ep_cases.poisoned_rows(problem, seed + 13, rows, alignment,
                                             dtype=torch.float32, vector=True)
    _, idx, _ = ep_cases.share(problem, rank)
    handle = group.create_handle(idx)
    assert handle.num_recv_tokens == rows[rank]

    y = handle.combine(expert_out[rank])
    want = dense.combine(problem, expert_out, rank, alignment)
    assert not torch.isnan(want).any()
    dense.assert_bitwise_equal(y, want, f"combine output ({dtype})")

    grad_probs = handle.combine_probs(grad_recv_probs[rank])
    dense.assert_bitwise_equal(grad_probs,
                               dense.combine_probs(problem, grad_recv_probs, rank, alignment),
                               "combine_probs output")
    return int((problem.topk_idx[rank] >= 0).sum())


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case_name", list(COMBINE_CASES))
def test_combine_matches_design_bitwise(case_name, dtype, world_size, seed):
    slots = dist.run(world_size, check_combine, case_name, dtype, seed)
    print(f"{case_name} {dtype} x{world_size}: routed slots per rank {slots}")


# Tolerance of y = combine(bf16(recv_x * p)) against the exact x * sum(p): each product and each
# partial and the final sum are rounded once to the token dtype (relative eps each), so a handful
# of eps relative to sum(|p|) * |x| bounds it.
ROUND_TRIP_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24,
                  torch.float64: 2.0**-53}


def check_round_trip(dtype: torch.dtype, probs_dtype: torch.dtype, alignment: int, seed: int):
    rank, world = ep_cases.rank_and_size()
    # Moderate magnitudes: the error bound below is relative, which subnormals would break.
    problem = dense.make_problem(seed, world, tokens=(19, 7), hidden=16, num_experts=8, topk=4,
                                 dtype=dtype, probs_dtype=probs_dtype, routing="masked",
                                 min_exp=-4, max_exp=4)
    group = ep_cases.make_group(problem, alignment=alignment)
    x, idx, probs = ep_cases.share(problem, rank)
    handle = group.create_handle(idx)
    recv_x, recv_p = handle.dispatch(x, probs)
    expert_out = (recv_x.to(torch.float64) * recv_p.to(torch.float64)[:, None]).to(dtype)
    y = handle.combine(expert_out)

    p_sum = torch.where(idx >= 0, probs.to(torch.float64), 0).sum(1, keepdim=True)
    exact = x.to(torch.float64) * p_sum
    err = (y.to(torch.float64) - exact).abs()
    if dtype == torch.float64:
        bound = 1e-12 * exact.abs().clamp(min=1.0)
    else:
        bound = 8 * ROUND_TRIP_EPS[dtype] * x.to(torch.float64).abs() * p_sum
    assert bool((err <= bound).all()), (
        f"y != x * sum(probs): max error {float(err.max())}, bound there "
        f"{float(bound.flatten()[err.flatten().argmax()])}")
    # Fully masked tokens come back as zero rows.
    none = (idx < 0).all(1)
    assert bool(none.any()) == (x.shape[0] > 0)
    assert bool((y[none] == 0).all())


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype,probs_dtype,alignment", [
    (torch.float64, torch.float64, 1),
    (torch.float64, torch.float32, 16),
    (torch.float32, torch.float32, 1),
    (torch.bfloat16, torch.float32, 4),
    (torch.float16, torch.bfloat16, 1),
], ids=str)
def test_dispatch_scale_combine_returns_x_times_sum_of_probs(dtype, probs_dtype, alignment,
                                                             world_size, seed):
    dist.run(world_size, check_round_trip, dtype, probs_dtype, alignment, seed)
