"""Bad input on the reference backend raises a clear error that names the problem, on every rank
(no rank is left waiting in a collective), and the group stays usable after a routing error."""

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep

E, H, T, K = 8, 16, 6, 3


def setup(seed: int, **group_kwargs):
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=T, hidden=H, num_experts=E, topk=K,
                                 dtype=torch.bfloat16)
    group = ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                     dtype=torch.bfloat16, backend="torch", device="cpu", **group_kwargs)
    x, idx, probs = ep_cases.share(problem, rank)
    return problem, group, x, idx, probs


def dispatch_with(seed, *, x=None, probs=None):
    _, group, x0, idx, p0 = setup(seed)
    handle = group.create_handle(idx)
    handle.dispatch(x0 if x is None else x(x0), p0 if probs is None else probs(p0))


def combine_with(seed, rows):
    _, group, _, idx, _ = setup(seed)
    handle = group.create_handle(idx)
    handle.combine(rows(handle))


def combine_probs_with(seed, rows):
    _, group, _, idx, _ = setup(seed)
    handle = group.create_handle(idx)
    handle.combine_probs(rows(handle))


def handle_with(seed, idx):
    _, group, _, idx0, _ = setup(seed)
    group.create_handle(idx(idx0))


def routing_with(slot_value):
    """The routing with token 1, slot 0 replaced (on every rank)."""
    def edit(idx):
        idx = idx.clone()
        idx[1, 0] = slot_value(idx[1])
        return idx
    return edit


# name -> (call(seed), exception type, pattern the message must contain)
ARGUMENT_CASES = {
    "x_wrong_dtype": (lambda s: dispatch_with(s, x=lambda x: x.float()), TypeError,
                      r"x must have dtype .*bfloat16.*got torch\.float32"),
    "x_not_a_tensor": (lambda s: dispatch_with(s, x=lambda x: x.tolist()), TypeError,
                       r"x must be a torch\.Tensor, got list"),
    "x_wrong_hidden": (lambda s: dispatch_with(s, x=lambda x: x[:, :-1]), ValueError,
                       rf"x must have shape \({T}, {H}\), got \({T}, {H - 1}\)"),
    "x_wrong_token_count": (lambda s: dispatch_with(s, x=lambda x: torch.cat([x, x[:1]])),
                            ValueError, rf"x must have shape \({T}, {H}\), got \({T + 1}, {H}\)"),
    "x_3d": (lambda s: dispatch_with(s, x=lambda x: x[None]), ValueError, r"x must be 2-D"),
    "x_wrong_device": (lambda s: dispatch_with(s, x=lambda x: x.to("meta")), ValueError,
                       r"x must be on cpu, got meta"),
    "probs_wrong_shape": (lambda s: dispatch_with(s, probs=lambda p: p[:, :1]), ValueError,
                          rf"probs must have shape \({T}, {K}\)"),
    "probs_integer": (lambda s: dispatch_with(s, probs=lambda p: (p * 10).long()), TypeError,
                      r"probs must have dtype .*got torch\.int64"),
    "expert_out_wrong_rows": (
        lambda s: combine_with(s, lambda h: torch.ones(h.num_recv_tokens + 1, H,
                                                       dtype=torch.bfloat16)),
        ValueError, r"expert_out must have shape"),
    "expert_out_wrong_dtype": (
        lambda s: combine_with(s, lambda h: torch.ones(h.num_recv_tokens, H)),
        TypeError, r"expert_out must have dtype"),
    "grad_recv_probs_wrong_shape": (
        lambda s: combine_probs_with(s, lambda h: torch.ones(h.num_recv_tokens + 2)),
        ValueError, r"grad_recv_probs must have shape"),
    "topk_idx_float": (lambda s: handle_with(s, lambda i: i.float()), TypeError,
                       r"topk_idx must have dtype .*got torch\.float32"),
    "topk_idx_1d": (lambda s: handle_with(s, lambda i: i[:, 0]), ValueError,
                    r"topk_idx must be 2-D"),
    "backend_unknown": (lambda s: ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T,
                                           max_topk=K, backend="nccl"),
                        ValueError, r"backend must be 'auto', 'torch' or 'cuda', got 'nccl'"),
    "backend_cuda_on_cpu": (lambda s: ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T,
                                               max_topk=K, backend="cuda", device="cpu"),
                            ValueError, r"backend='cuda' needs device of type 'cuda'"),
    "max_topk_above_experts": (lambda s: ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T,
                                                  max_topk=E + 1, backend="torch"),
                               ValueError, rf"max_topk must be in \[1, num_experts={E}\]"),
    "capacity_mode_without_bound": (
        lambda s: ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                           backend="torch", recv_mode="capacity"),
        ValueError, r"capacity mode needs max_recv_tokens_per_rank"),
    "token_dtype_int": (lambda s: ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T,
                                           max_topk=K, backend="torch", dtype=torch.int32),
                        ValueError, r"dtype must be one of"),
}

# A wrong argument on one rank only: that rank raises its own error, every other rank a
# ValueError naming it, at once (not after the process group's timeout); the next, correct call
# works everywhere. name -> (the op called with the wrong argument on the bad rank, own pattern).
ONE_RANK_CASES = {
    "dispatch_x_wrong_hidden": (
        "dispatch", lambda h, x, p, rows: h.dispatch(x[:, :-1], p),
        rf"x must have shape \({T}, {H}\), got \({T}, {H - 1}\)"),
    "combine_rows_wrong_count": (
        "combine", lambda h, x, p, rows: h.combine(rows[:-1]), r"expert_out must have shape"),
    "combine_probs_wrong_dtype": (
        "combine_probs", lambda h, x, p, rows: h.combine_probs(torch.ones(rows.shape[0],
                                                                          dtype=torch.int32)),
        r"grad_recv_probs must have dtype in"),
}


def check_one_rank_argument_error(case_name: str, bad_rank: int, seed: int) -> None:
    op, wrong_call, pattern = ONE_RANK_CASES[case_name]
    rank, _ = ep_cases.rank_and_size()
    _, group, x, idx, probs = setup(seed)
    handle = group.create_handle(idx)
    rows = torch.ones(handle.num_recv_tokens, H, dtype=torch.bfloat16)
    good_calls = {"dispatch": lambda: handle.dispatch(x, probs),
                  "combine": lambda: handle.combine(rows),
                  "combine_probs": lambda: handle.combine_probs(torch.ones(rows.shape[0]))}
    if rank == bad_rank:
        with pytest.raises((TypeError, ValueError), match=pattern):
            wrong_call(handle, x, probs, rows)
    else:
        with pytest.raises(ValueError, match=rf"{op}: rank {bad_rank} passed wrong arguments "
                                             rf"\(.*\); every rank of the group raises"):
            good_calls[op]()
    recv_x, recv_p = handle.dispatch(x, probs)  # the group is still usable
    assert recv_x.shape == (handle.num_recv_tokens, H) and recv_p is not None
    assert handle.combine(recv_x).shape == x.shape


@pytest.mark.parametrize("world_size,bad_rank", [(2, 1), (4, 0)])
@pytest.mark.parametrize("case_name", list(ONE_RANK_CASES))
def test_argument_error_on_one_rank_raises_on_every_rank(case_name, world_size, bad_rank, seed):
    dist.run(world_size, check_one_rank_argument_error, case_name, bad_rank, seed, timeout=60)


# Routing errors, in values or in the shape against the group's bounds: the group stays usable
# afterwards. name -> (edit of one rank's topk_idx, pattern the message must contain).
ROUTING_CASES = {
    "expert_id_equal_to_num_experts": (routing_with(lambda row: E),
                                       rf"topk_idx\[1, 0\] = {E} is out of range"),
    "expert_id_below_minus_one": (routing_with(lambda row: -2),
                                  r"topk_idx\[1, 0\] = -2 is out of range"),
    "duplicate_expert_in_a_token": (routing_with(lambda row: row[1]),
                                    r"token 1 names expert \d+ twice"),
    "too_many_tokens": (lambda i: torch.cat([i, i[:1]]),
                        rf"{T + 1} tokens, more than max_tokens_per_rank={T}"),
    "topk_above_max_topk": (lambda i: torch.cat([i, i[:, :1]], 1),
                            rf"top-k {K + 1}.*max_topk={K}"),
}


def check_argument_error(case_name: str, seed: int) -> None:
    call, exc, pattern = ARGUMENT_CASES[case_name]
    with pytest.raises(exc, match=pattern):
        call(seed)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case_name", list(ARGUMENT_CASES))
def test_bad_argument_raises_clear_error(case_name, world_size, seed):
    dist.run(world_size, check_argument_error, case_name, seed)


def check_routing_error(case_name: str, bad_ranks, seed: int) -> None:
    """Only ``bad_ranks`` pass the bad routing; every rank must raise (the peers of a bad rank
    would otherwise wait forever in the routing exchange)."""
    rank, world = ep_cases.rank_and_size()
    edit, pattern = ROUTING_CASES[case_name]
    problem, group, x, idx, probs = setup(seed)
    bad = edit(idx) if rank in bad_ranks else idx
    with pytest.raises(ValueError, match=pattern):
        group.create_handle(bad)
    # The same group still works, bitwise as the oracle.
    handle = group.create_handle(idx)
    recv_x, recv_p = handle.dispatch(x, probs)
    want_x, want_p, _, _ = dense.dispatch(problem, rank)
    dense.assert_bitwise_equal(recv_x, want_x, "recv_x after a routing error")
    dense.assert_bitwise_equal(recv_p, want_p, "recv_probs after a routing error")


@pytest.mark.parametrize("world_size,bad_ranks", [(1, (0,)), (2, (0, 1)), (2, (1,)),
                                                  (4, (2,))], ids=str)
@pytest.mark.parametrize("case_name", list(ROUTING_CASES))
def test_bad_routing_raises_on_every_rank(case_name, world_size, bad_ranks, seed):
    dist.run(world_size, check_routing_error, case_name, bad_ranks, seed)


def check_capacity_overflow(routing: str, seed: int) -> None:
    rank, world = ep_cases.rank_and_size()
    problem = dense.make_problem(seed, world, tokens=T, hidden=H, num_experts=E, topk=K,
                                 dtype=torch.bfloat16, routing=routing)
    need = ep_cases.max_rows(problem)
    group = ep_cases.make_group(problem, recv_mode="capacity", max_recv_tokens_per_rank=need - 1)
    with pytest.raises(ep.NcclEpError, match=r"capacity overflow.*max_recv_tokens_per_rank="
                                             rf"{need - 1}") as info:
        group.create_handle(problem.topk_idx[rank])
    assert isinstance(info.value, RuntimeError)
    # One row more is enough: the bound is exact, not approximate.
    exact = ep_cases.make_group(problem, recv_mode="capacity", max_recv_tokens_per_rank=need)
    assert exact.create_handle(problem.topk_idx[rank]).num_recv_tokens == need


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("routing", ["random", "one_expert"])
def test_capacity_overflow_raises_ncclep_error(routing, world_size, seed):
    dist.run(world_size, check_capacity_overflow, routing, seed)


# Each rank's Group arguments differ from rank 0's in one field.
MISMATCHES = {
    "hidden": (dict(hidden=H), lambda r: dict(hidden=H + r)),
    "dtype": (dict(dtype=torch.bfloat16),
              lambda r: dict(dtype=torch.bfloat16 if r == 0 else torch.float16)),
    "expert_alignment": (dict(expert_alignment=1), lambda r: dict(expert_alignment=1 + r)),
    "max_tokens_per_rank": (dict(max_tokens_per_rank=T),
                            lambda r: dict(max_tokens_per_rank=T + r)),
    "expert_capacity": (dict(expert_capacity=0), lambda r: dict(expert_capacity=2 + r)),
}


def check_config_mismatch(field: str) -> None:
    rank, _ = ep_cases.rank_and_size()
    base = dict(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                dtype=torch.bfloat16, backend="torch", device="cpu")
    base.update(MISMATCHES[field][1](rank))
    with pytest.raises(ValueError, match=rf"inconsistent configuration across ranks: {field}="):
        ep.Group(**base)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("field", list(MISMATCHES))
def test_mismatched_config_across_ranks(field, world_size):
    dist.run(world_size, check_config_mismatch, field)


def check_group_shape_errors(seed: int) -> None:
    rank, world = ep_cases.rank_and_size()
    with pytest.raises(ValueError, match=rf"num_experts \({2 * world + 1}\) must be a multiple "
                                         rf"of the group size \({world}\)"):
        ep.Group(num_experts=2 * world + 1, hidden=H, max_tokens_per_rank=T, max_topk=1,
                 backend="torch")
    # One ring slot cannot hold the combine's chunk j while chunk j - 1 is summed.
    with pytest.raises(ValueError, match=r"staging_depth 0 or in \[2, 64\] .*got 0 and 1"):
        ep.Group(num_experts=2 * world, hidden=H, max_tokens_per_rank=T, max_topk=1,
                 backend="torch", staging_depth=1)
    # top-k must agree across ranks even though each rank's topk_idx is valid on its own.
    problem, group, x, idx, probs = setup(seed)
    mine = idx[:, :1 + rank % 2]
    with pytest.raises(ValueError, match=r"top-k differs across ranks"):
        group.create_handle(mine)
    group.destroy()
    with pytest.raises(RuntimeError, match=r"Group was destroyed"):
        group.create_handle(idx)


@pytest.mark.parametrize("world_size", [2, 4])
def test_group_shape_errors(world_size, seed):
    dist.run(world_size, check_group_shape_errors, seed)
