"""docs/design.md §5 on the reference backend: gradients through megatron_nccl_ep.dispatch/combine equal a
dense single-process float64 computation; the backward ops are exactly the handle's combine,
combine_probs and dispatch; several handles alive at once, used out of order (micro-batches)."""

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep

# name -> (make_problem arguments, alignment, capacity slack or None)
GRAD_CASES = {
    "random": (dict(tokens=14, topk=3), 1, None),
    "masked_aligned_16_int32": (dict(tokens=(11, 0, 9), topk=4, routing="masked",
                                     idx_dtype=torch.int32), 16, None),
    "capacity_one_expert": (dict(tokens=10, topk=2, routing="one_expert"), 1, 6),
}

HIDDEN, EXPERTS = 8, 8


def expert_weights(seed: int) -> torch.Tensor:
    """Per-expert [H, H] matrices, identical on every rank."""
    return dense.wide_values(torch.Generator().manual_seed(seed), (EXPERTS, HIDDEN, HIDDEN),
                             torch.float64, -2, 2)


def run_experts(recv_x, recv_probs, tokens_per_expert, weights, rank: int, num_local: int):
    """recv_x rows split by tokens_per_expert (the way grouped GEMMs consume them), each block
    through its expert's matrix, scaled by its prob; rows beyond the counted ones stay zero."""
    counts = tokens_per_expert.cpu().tolist()
    used = sum(counts)
    blocks = torch.split(recv_x[:used], counts)
    out = [b @ weights[rank * num_local + l] for l, b in enumerate(blocks)]
    tail = recv_x[used:] * 0
    return torch.cat(out + [tail]) * recv_probs[:, None]


def distributed_moe(group, x, idx, probs, weights, rank):
    handle = group.create_handle(idx)
    recv_x, recv_probs = ep.dispatch(handle, x, probs)
    expert_out = run_experts(recv_x, recv_probs, handle.tokens_per_expert, weights, rank,
                             group.num_local_experts)
    return ep.combine(handle, expert_out)


def dense_reference(problem, rank, weights, grad_y):
    """y and the gradients of one rank's tokens without any dispatch: the closed-form gradients,
    cross-checked against autograd through the dense float64 forward."""
    x, idx, probs = ep_cases.share(problem, rank, requires_grad=True)
    y = dense.dense_moe_float64(x, idx, probs, weights)
    y.backward(grad_y)
    grad_x, grad_probs = dense.dense_moe_grads_float64(x.detach(), idx, probs.detach(), weights,
                                                       grad_y)
    assert_close64(grad_x, x.grad, "closed-form vs autograd dense grad x")
    assert_close64(grad_probs, probs.grad, "closed-form vs autograd dense grad probs")
    return y.detach(), grad_x, grad_probs


def assert_close64(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def check_gradients(case_name: str, seed: int) -> None:
    rank, world = ep_cases.rank_and_size()
    problem_args, alignment, slack = GRAD_CASES[case_name]
    problem = dense.make_problem(seed, world, hidden=HIDDEN, num_experts=EXPERTS,
                                 dtype=torch.float64, probs_dtype=torch.float64,
                                 min_exp=-3, max_exp=3, **problem_args)
    weights = expert_weights(seed + 1)
    grad_y = dense.wide_values(torch.Generator().manual_seed(seed + 2 + rank),
                               problem.x[rank].shape, torch.float64, -2, 2)
    group = ep_cases.make_group(problem, alignment=alignment, capacity_slack=slack)
    x, idx, probs = ep_cases.share(problem, rank, requires_grad=True)
    y = distributed_moe(group, x, idx, probs, weights, rank)
    y.backward(grad_y)

    want_y, want_gx, want_gp = dense_reference(problem, rank, weights, grad_y)
    assert_close64(y.detach(), want_y, "y")
    assert_close64(x.grad, want_gx, "grad x")
    assert_close64(probs.grad, want_gp, "grad probs")
    masked = idx < 0
    assert bool((probs.grad[masked] == 0).all()), "masked slots get a zero probs gradient"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case_name", list(GRAD_CASES))
def test_gradients_equal_dense_float64(case_name, world_size, seed):
    dist.run(world_size, check_gradients, case_name, seed)


def check_backward_is_handle_ops(dtype: torch.dtype, alignment: int, seed: int) -> None:
    """In the token dtypes the backward results are bitwise the handle's own ops on the incoming
    gradients (§5), including their ordered §4 arithmetic; NaN in the padding rows of the
    incoming gradients must not reach grad x or grad probs."""
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=(13, 6), hidden=16, num_experts=8, topk=4,
                                 dtype=dtype, routing="masked")
    group = ep_cases.make_group(problem, alignment=alignment)
    x, idx, probs = ep_cases.share(problem, rank, requires_grad=True)
    handle = group.create_handle(idx)
    recv_x, recv_probs = ep.dispatch(handle, x, probs)
    rows = [dense.layout(problem, d, alignment).num_rows for d in range(world)]
    grad_recv_x = ep_cases.poisoned_rows(problem, seed + 3, rows, alignment)[rank]
    grad_recv_p = ep_cases.poisoned_rows(problem, seed + 4, rows, alignment,
                                         dtype=torch.float32, vector=True)[rank]
    torch.autograd.backward([recv_x, recv_probs], [grad_recv_x, grad_recv_p])
    dense.assert_bitwise_equal(x.grad, handle.combine(grad_recv_x), "grad x")
    dense.assert_bitwise_equal(x.grad, dense.combine(
        problem, ep_cases.poisoned_rows(problem, seed + 3, rows, alignment), rank, alignment),
        "grad x vs the oracle")
    dense.assert_bitwise_equal(probs.grad, handle.combine_probs(grad_recv_p), "grad probs")

    expert_out = recv_x.detach().clone().requires_grad_(True)
    y = ep.combine(handle, expert_out)
    grad_y = dense.wide_values(torch.Generator().manual_seed(seed + 5 + rank), y.shape, dtype)
    y.backward(grad_y)
    dense.assert_bitwise_equal(expert_out.grad, handle.dispatch(grad_y)[0], "grad expert_out")
    problem_gy = dense.Problem(world, problem.num_experts,
                               [dense.wide_values(torch.Generator().manual_seed(seed + 5 + s),
                                                  problem.x[s].shape, dtype)
                                for s in range(world)], problem.topk_idx, problem.probs)
    dense.assert_bitwise_equal(expert_out.grad,
                               dense.dispatch(problem_gy, rank, alignment)[0],
                               "grad expert_out vs the oracle")


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype,alignment", [(torch.bfloat16, 16), (torch.float16, 1),
                                             (torch.float32, 4)], ids=str)
def test_backward_is_handle_ops_bitwise(dtype, alignment, world_size, seed):
    dist.run(world_size, check_backward_is_handle_ops, dtype, alignment, seed)


def check_micro_batches(seed: int) -> None:
    """Three micro-batches with their own routing and handles on one group: forwards 0, 1, 2,
    then backwards 1, (a new forward 3), 0, 3, 2 -- each gradient equal to its dense float64
    computation. Handles are dropped by the caller right after the forward: the autograd graph
    keeps each alive until its backward."""
    rank, world = ep_cases.rank_and_size()
    tokens = [(9, 12), (12, 0, 5), (0, 7), (5,)]
    problems = [dense.make_problem(seed + 10 * m, world, tokens=tokens[m],
                                   hidden=HIDDEN, num_experts=EXPERTS, topk=2 + m % 3,
                                   dtype=torch.float64, probs_dtype=torch.float64,
                                   routing=("random", "masked")[m % 2], min_exp=-3, max_exp=3)
                for m in range(4)]
    weights = expert_weights(seed + 1)
    group = ep.Group(
        num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=12, max_topk=4,
        dtype=torch.float64, backend="torch", device="cpu")
    live = {}

    def forward(m):
        x, idx, probs = ep_cases.share(problems[m], rank, requires_grad=True)
        live[m] = (x, probs, distributed_moe(group, x, idx, probs, weights, rank))

    def backward_and_check(m):
        x, probs, y = live.pop(m)
        grad_y = dense.wide_values(torch.Generator().manual_seed(seed + 100 + m + rank),
                                   y.shape, torch.float64, -2, 2)
        y.backward(grad_y)
        want_y, want_gx, want_gp = dense_reference(problems[m], rank, weights, grad_y)
        assert_close64(y.detach(), want_y, f"micro-batch {m}: y")
        assert_close64(x.grad, want_gx, f"micro-batch {m}: grad x")
        assert_close64(probs.grad, want_gp, f"micro-batch {m}: grad probs")

    for m in (0, 1, 2):
        forward(m)
    backward_and_check(1)
    forward(3)
    for m in (0, 3, 2):
        backward_and_check(m)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_micro_batches_out_of_order(world_size, seed):
    dist.run(world_size, check_micro_batches, seed)


def check_handles_used_out_of_order(seed: int) -> None:
    """Non-autograd handle ops interleaved across three live handles give each handle's own
    layout and combine (no state leaks from one handle into another)."""
    rank, world = ep_cases.rank_and_size()
    problems = [dense.make_problem(seed + m, world, tokens=10 + m, hidden=8, num_experts=8,
                                   topk=1 + m, dtype=torch.bfloat16, routing="masked")
                for m in range(3)]
    group = ep.Group(num_experts=8, hidden=8, max_tokens_per_rank=12, max_topk=3,
                     dtype=torch.bfloat16, backend="torch", device="cpu")
    handles = [group.create_handle(ep_cases.share(p, rank)[1]) for p in problems]
    outs = {}
    for m in (2, 0, 1):
        x, _, probs = ep_cases.share(problems[m], rank)
        outs[m] = handles[m].dispatch(x, probs)
    for m in (1, 2, 0):
        want_x, want_p, _, _ = dense.dispatch(problems[m], rank)
        dense.assert_bitwise_equal(outs[m][0], want_x, f"handle {m}: recv_x")
        dense.assert_bitwise_equal(outs[m][1], want_p, f"handle {m}: recv_probs")
        rows = [dense.layout(problems[m], d).num_rows for d in range(world)]
        expert_out = ep_cases.poisoned_rows(problems[m], seed + 50 + m, rows)
        dense.assert_bitwise_equal(handles[m].combine(expert_out[rank]),
                                   dense.combine(problems[m], expert_out, rank),
                                   f"handle {m}: combine")
    handles[1].destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        handles[1].combine(torch.ones(handles[1].num_recv_tokens, 8, dtype=torch.bfloat16))
    # The other handles are unaffected by destroying one of them.
    x, _, probs = ep_cases.share(problems[0], rank)
    dense.assert_bitwise_equal(handles[0].dispatch(x, probs)[0],
                               dense.dispatch(problems[0], rank)[0], "handle 0 after destroy 1")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_handles_used_out_of_order(world_size, seed):
    dist.run(world_size, check_handles_used_out_of_order, seed)


def check_dispatch_without_probs(seed: int) -> None:
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=9, hidden=8, num_experts=8, topk=2,
                                 dtype=torch.float64, probs_dtype=None, min_exp=-3, max_exp=3)
    group = ep_cases.make_group(problem)
    x, idx, _ = ep_cases.share(problem, rank, requires_grad=True)
    handle = group.create_handle(idx)
    recv_x, recv_probs = ep.dispatch(handle, x)
    assert recv_probs is None
    grad = dense.wide_values(torch.Generator().manual_seed(seed + 1), recv_x.shape,
                             torch.float64, -3, 3)
    recv_x.backward(grad)
    dense.assert_bitwise_equal(x.grad, handle.combine(grad), "grad x without probs")


@pytest.mark.parametrize("world_size", [1, 2])
def test_dispatch_without_probs_differentiable(world_size, seed):
    dist.run(world_size, check_dispatch_without_probs, seed)


def check_no_graph_to_record(seed: int) -> None:
    """Under torch.no_grad, or with inputs that need no gradient, dispatch and combine are the
    handle's plain ops (no autograd node), with the bits of the recorded ones; one input that
    needs a gradient records them."""
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=9, hidden=8, num_experts=8, topk=2,
                                 dtype=torch.float64, min_exp=-3, max_exp=3)
    group = ep_cases.make_group(problem)
    x, idx, probs = ep_cases.share(problem, rank, requires_grad=True)
    handle = group.create_handle(idx)
    recorded_x, recorded_p = ep.dispatch(handle, x, probs)
    recorded_y = ep.combine(handle, recorded_x)
    assert recorded_x.grad_fn is not None and recorded_y.grad_fn is not None
    with torch.no_grad():
        plain_x, plain_p = ep.dispatch(handle, x, probs)
        plain_y = ep.combine(handle, plain_x)
    detached_x, detached_p = ep.dispatch(handle, x.detach(), probs.detach())
    for got in (plain_x, plain_p, plain_y, detached_x, detached_p):
        assert got.grad_fn is None and not got.requires_grad
    for got, want in ((plain_x, recorded_x), (detached_x, recorded_x), (plain_p, recorded_p),
                      (detached_p, recorded_p), (plain_y, recorded_y)):
        dense.assert_bitwise_equal(got, want.detach(), "plain op against the recorded one")
    _, p_only = ep.dispatch(handle, x.detach(), probs)  # the probs alone need a gradient
    assert p_only.grad_fn is not None


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_graph_to_record_runs_the_plain_ops(world_size, seed):
    dist.run(world_size, check_no_graph_to_record, seed)
