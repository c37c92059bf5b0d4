"""Handles made from a router's dense routing map [T, E] (the form Megatron's routers produce):
its top-k form (ascending experts, -1 after the last, max_topk slots), layouts and outputs equal
to a handle made from that top-k form, and a token with too many experts raising on every rank."""

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep

E, H, T, K = 8, 16, 12, 3


def group_for_test(**kwargs):
    return ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K,
                    dtype=torch.bfloat16, backend="torch", device="cpu", **kwargs)


def random_map(gen: torch.Generator, tokens: int, most: int) -> torch.Tensor:
    """Between 0 and ``most`` routed experts per token, at random experts."""
    counts = torch.randint(0, most + 1, (tokens, 1), generator=gen)
    order = torch.rand(tokens, E, generator=gen).argsort(dim=1).argsort(dim=1)
    return order < counts


def check_map_equals_topk(seed: int) -> None:
    rank, world = ep_cases.rank_and_size()
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    routing_map = random_map(gen, T - rank, K)
    x = dense.wide_values(gen, (T - rank, H), torch.bfloat16)
    probs = torch.rand(T - rank, K, generator=gen) + 0.1
    group = group_for_test(expert_alignment=4)
    from_map = group.create_handle(routing_map=routing_map)
    assert from_map.routing_released, "the reference reads its shapes on the host at creation"
    want_idx = torch.full((T - rank, K), -1, dtype=torch.int64)
    for t in range(T - rank):
        experts = routing_map[t].nonzero().flatten()
        want_idx[t, :len(experts)] = experts
    assert torch.equal(from_map.topk_idx, want_idx)
    from_idx = group.create_handle(want_idx)
    assert from_map.num_recv_tokens == from_idx.num_recv_tokens
    assert torch.equal(from_map.tokens_per_expert, from_idx.tokens_per_expert)
    got, want = from_map.dispatch(x, probs), from_idx.dispatch(x, probs)
    dense.assert_bitwise_equal(got[0], want[0], "recv_x")
    dense.assert_bitwise_equal(got[1], want[1], "recv_probs")
    rows = dense.wide_values(gen, tuple(got[0].shape), torch.bfloat16)
    dense.assert_bitwise_equal(from_map.combine(rows), from_idx.combine(rows), "y")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_routing_map_handle_equals_topk_handle(world_size, seed):
    dist.run(world_size, check_map_equals_topk, seed)


def check_too_many_experts(bad_ranks, seed: int) -> None:
    rank, _ = ep_cases.rank_and_size()
    gen = torch.Generator().manual_seed(seed + rank)
    routing_map = random_map(gen, T, K)
    bad = routing_map.clone()
    bad[5] = False
    bad[5, :K + 2] = True
    group = group_for_test()
    with pytest.raises(ValueError, match=rf"routing_map row 5 routes to {K + 2} experts, more "
                                         rf"than max_topk={K}"):
        group.create_handle(routing_map=bad if rank in bad_ranks else routing_map)
    # The group still works.
    assert group.create_handle(routing_map=routing_map).topk_idx.shape == (T, K)


@pytest.mark.parametrize("world_size,bad_ranks", [(1, (0,)), (2, (1,)), (4, (0, 3))], ids=str)
def test_routing_map_with_too_many_experts_raises_on_every_rank(world_size, bad_ranks, seed):
    dist.run(world_size, check_too_many_experts, bad_ranks, seed)


def test_routing_map_argument_errors():
    group = group_for_test()
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"routing_map must have dtype .*torch\.bool.*got "
                                        r"torch\.int64"):
        group.create_handle(routing_map=routing_map.long())
    with pytest.raises(ValueError,
                       match=rf"routing_map must have shape \('\*', {E}\), got \({T}, {E - 1}\)"):
        group.create_handle(routing_map=routing_map[:, :-1])
    with pytest.raises(TypeError, match="exactly one of topk_idx and routing_map"):
        group.create_handle(torch.zeros(T, K, dtype=torch.int64), routing_map=routing_map)
    with pytest.raises(TypeError, match="exactly one of topk_idx and routing_map"):
        group.create_handle()


def check_map_with_too_many_tokens(seed: int) -> None:
    rank, _ = ep_cases.rank_and_size()
    gen = torch.Generator().manual_seed(seed + rank)
    group = group_for_test()
    tokens = T + 1 if rank == 0 else T
    with pytest.raises(ValueError, match=rf"routing_map has {T + 1} tokens, more than "
                                         rf"max_tokens_per_rank={T} of this group"):
        group.create_handle(routing_map=random_map(gen, tokens, K))


@pytest.mark.parametrize("world_size", [1, 2])
def test_routing_map_with_too_many_tokens_raises_on_every_rank(world_size, seed):
    dist.run(world_size, check_map_with_too_many_tokens, seed)


def check_dense_probs(seed: int) -> None:
    """A router's dense probs [T, E] dispatch exactly like their slot-order form [T, K] (slot k
    reads the column of its expert; the other columns are never read), and their gradient comes
    back dense: each routed expert's column holds its slot's gradient, every other column 0."""
    rank, _ = ep_cases.rank_and_size()
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    routing_map = random_map(gen, T - rank, K)
    x = dense.wide_values(gen, (T - rank, H), torch.bfloat16)
    dense_probs = torch.rand(T - rank, E, generator=gen) + 0.1
    group = group_for_test()
    h = group.create_handle(routing_map=routing_map)
    idx = h.topk_idx
    slot_probs = dense_probs.gather(1, idx.clamp(min=0))
    assert h.probs_are_dense(dense_probs) and not h.probs_are_dense(slot_probs)
    got, want = h.dispatch(x, dense_probs), h.dispatch(x, slot_probs)
    dense.assert_bitwise_equal(got[1], want[1], "recv_probs from dense probs")
    grad_recv = torch.rand(h.num_recv_tokens, generator=gen)
    slot_grad = h.combine_probs(grad_recv)
    dense_grad = h.combine_probs(grad_recv, dense=True)
    want_dense = torch.zeros(T - rank, E)
    for t in range(T - rank):
        for k in range(K):
            if idx[t, k] >= 0:
                want_dense[t, idx[t, k]] = slot_grad[t, k]
    dense.assert_bitwise_equal(dense_grad, want_dense, "dense combine_probs")
    # Through autograd: the gradient of dense probs is dense.
    probs = dense_probs.clone().requires_grad_(True)
    recv_x, recv_p = ep.dispatch(h, x, probs)
    (recv_p * grad_recv).sum().backward()
    dense.assert_bitwise_equal(probs.grad, want_dense, "autograd gradient of dense probs")


@pytest.mark.parametrize("world_size", [1, 2])
def test_dense_router_probs(world_size, seed):
    dist.run(world_size, check_dense_probs, seed)
