"""The fixed-capacity ("drop-and-pad") layout of docs/design.md §3 on the reference backend
(``Group(expert_capacity=C)``, Megatron's ``moe_pad_expert_input_to_capacity``): every local
expert's block is R runs of C rows, one per source rank; a run holds that source's first C slots
for the expert in token order, later slots are dropped (no row, not combined, zero probability
gradient), unused rows are zero with prob 0, and every output has the same size and counts.
Compared bitwise with the independent oracle (tests/dense.py, ``expert_capacity``) on 1, 2 and
4 gloo ranks; each case also checks that it really drops slots and leaves rows empty."""

import math

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep
from megatron_nccl_ep.config import GroupConfig

# name -> make_problem arguments, plus C (expert_capacity), alignment, recv mode, and what the
# case is built to exercise on any number of ranks ("drops": some slots are dropped; "empty":
# some rows carry no slot).
CASES = {
    # Slot 0 of every token names one expert: its run overflows on every source, the other
    # experts' runs stay empty.
    "one_expert_bf16": dict(tokens=20, hidden=8, num_experts=8, topk=2, dtype=torch.bfloat16,
                            routing="one_expert", C=5, expect=("drops", "empty")),
    # ~5 slots per (source, expert) against C = 3; R * 3 rows padded to 8 per expert.
    "masked_int32_align8": dict(tokens=23, hidden=8, num_experts=12, topk=4,
                                dtype=torch.float32, probs_dtype=torch.bfloat16,
                                idx_dtype=torch.int32, routing="masked", C=3, alignment=8,
                                expect=("drops", "empty")),
    # Rank 0 has no token: every run from it is empty (and on 1 rank nothing is routed); C is
    # the other ranks' token count, so nothing is dropped.
    "rank_with_zero_tokens_fp16": dict(tokens=(0, 19), hidden=8, num_experts=8, topk=2,
                                       dtype=torch.float16, C=19, expect=("empty",)),
    "capacity_mode_one_expert": dict(tokens=18, hidden=8, num_experts=8, topk=2,
                                     dtype=torch.bfloat16, routing="one_expert", C=2,
                                     recv_mode="capacity", expect=("drops", "empty")),
    # C larger than the tokens (Megatron's alltoall cannot run this): nothing dropped, the tail
    # of every run empty.
    "capacity_above_tokens_f64": dict(tokens=9, hidden=4, num_experts=4, topk=4,
                                      dtype=torch.float64, probs_dtype=torch.float64, C=12,
                                      expect=("empty",)),
}
LAYOUT_KEYS = ("C", "alignment", "recv_mode", "expect")


def split_case(name: str):
    case = CASES[name]
    return ({k: v for k, v in case.items() if k not in LAYOUT_KEYS}, case["C"],
            case.get("alignment", 1), case.get("recv_mode", "exact"), case["expect"])


def make_group(problem: dense.Problem, C: int, alignment: int, recv_mode: str, **kwargs):
    tokens = max(1, max(x.shape[0] for x in problem.x))
    return ep.Group(num_experts=problem.num_experts, hidden=problem.hidden,
                    max_tokens_per_rank=tokens, max_topk=problem.topk, dtype=problem.x[0].dtype,
                    backend="torch", device="cpu", recv_mode=recv_mode,
                    expert_alignment=alignment, expert_capacity=C, **kwargs)


def block_rows(world: int, C: int, alignment: int) -> int:
    return -(-world * C // alignment) * alignment


def check_exercised(problem: dense.Problem, C: int, alignment: int, expect) -> None:
    """The case does what it is for (on every rank alike): slots dropped, rows left empty."""
    slots = sum(int((idx >= 0).sum()) for idx in problem.topk_idx)
    lays = [dense.layout(problem, d, alignment, expert_capacity=C)
            for d in range(problem.world_size)]
    kept = sum(sum(lay.real_counts) for lay in lays)
    empty = sum(lay.num_rows for lay in lays) - kept
    assert ("drops" in expect) == (kept < slots), (kept, slots)
    assert ("empty" in expect) == (empty > 0), empty


def check_layout(case_name: str, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    problem_args, C, alignment, recv_mode, expect = split_case(case_name)
    problem = dense.make_problem(seed, world, **problem_args)
    dense.check_routing(problem)
    check_exercised(problem, C, alignment, expect)
    group = make_group(problem, C, alignment, recv_mode)
    L = problem.num_local_experts
    block = block_rows(world, C, alignment)
    assert group.config.static_recv_rows(world) == L * block
    if recv_mode == "capacity":
        assert group.config.max_recv_tokens_per_rank == L * block

    x, idx, probs = ep_cases.share(problem, rank)
    handle = group.create_handle(idx)
    assert handle.num_recv_tokens == L * block, "the output size is fixed by C"
    recv_x, recv_p = handle.dispatch(x, probs)
    want_x, want_p, want_tpe, _ = dense.dispatch(problem, rank, alignment, expert_capacity=C)
    dense.assert_bitwise_equal(recv_x, want_x, "recv_x")
    dense.assert_bitwise_equal(recv_p, want_p, "recv_probs")
    tpe = handle.tokens_per_expert
    assert tpe.dtype == torch.int64
    assert tpe.device.type == "cpu"  # exact mode: host; capacity mode: the group's device (cpu)
    assert tpe.tolist() == [block] * L, "counts are the same constant for every expert"
    dense.assert_bitwise_equal(tpe.cpu(), want_tpe, "tokens_per_expert")
    # Empty rows are zero with prob 0 (independently of the oracle's own zeros).
    lay = dense.layout(problem, rank, alignment, expert_capacity=C)
    empty = torch.tensor([r is None for r in lay.rows], dtype=torch.bool)
    assert bool((recv_x[empty] == 0).all()) and bool((recv_p[empty] == 0).all())

    # combine: dropped slots and empty rows are never read (NaN there), the rest in §4 order.
    rows = [L * block] * world
    expert_out = ep_cases.poisoned_rows(problem, seed + 11, rows, alignment, expert_capacity=C)
    dense.assert_bitwise_equal(handle.combine(expert_out[rank]),
                               dense.combine(problem, expert_out, rank, alignment,
                                             expert_capacity=C), "combine")
    grad_p = ep_cases.poisoned_rows(problem, seed + 12, rows, alignment, dtype=torch.float32,
                                    vector=True, expert_capacity=C)
    got_gp = handle.combine_probs(grad_p[rank])
    dense.assert_bitwise_equal(got_gp, dense.combine_probs(problem, grad_p, rank, alignment,
                                                           expert_capacity=C), "combine_probs")
    # A dropped slot gets exactly 0: the slots without a row anywhere.
    has_row = torch.zeros(idx.shape, dtype=torch.bool)
    for d in range(world):
        for r in dense.layout(problem, d, alignment, expert_capacity=C).rows:
            if r is not None and r[0] == rank:
                has_row[r[1], r[2]] = True
    assert bool((got_gp[~has_row] == 0).all())
    dropped = int(((idx >= 0) & ~has_row).sum())
    return f"rank {rank}: {handle.num_recv_tokens} rows, {dropped} of my slots dropped"


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case_name", list(CASES))
def test_fixed_capacity_layout_matches_oracle(case_name, world_size, seed):
    for line in dist.run(world_size, check_layout, case_name, seed):
        print(line)


def check_keeps_first_slots_in_token_order() -> None:
    """Hand-made routing on 2 ranks, E = 4 (L = 2), C = 2: which slots are kept is the source's
    own token order, whatever the other rank routes."""
    rank, world = ep_cases.rank_and_size()
    assert world == 2
    # Rank 0: tokens 0..3 all name expert 1 (slot 1 for tokens 1 and 3), token 2 also expert 2.
    # Rank 1: tokens 0, 1 name expert 1; token 2 names expert 3.
    idx = [torch.tensor([[1, -1], [0, 1], [2, 1], [-1, 1]]),
           torch.tensor([[1, 3], [1, -1], [3, -1]])][rank]
    x = (torch.arange(idx.shape[0], dtype=torch.float64)[:, None] + 1 + 10 * rank).expand(-1, 3)
    probs = torch.full(idx.shape, 0.5, dtype=torch.float64) + rank
    group = ep.Group(num_experts=4, hidden=3, max_tokens_per_rank=4, max_topk=2,
                     dtype=torch.float64, backend="torch", device="cpu", expert_capacity=2)
    handle = group.create_handle(idx)
    recv_x, recv_p = handle.dispatch(x.contiguous(), probs)
    tag = recv_x[:, 0].tolist()  # 0: empty; 10 * source + token + 1 otherwise
    if rank == 0:  # experts 0, 1: [src 0 | src 1] runs of 2 rows each
        assert tag == [2, 0, 0, 0,      # expert 0: rank 0 token 1; nothing from rank 1
                       1, 2, 11, 12]    # expert 1: rank 0 tokens 0, 1 (2 and 3 dropped)
    else:  # experts 2, 3
        assert tag == [3, 0, 0, 0,      # expert 2: rank 0 token 2
                       0, 0, 11, 13]    # expert 3: rank 1 tokens 0, 2
    assert handle.tokens_per_expert.tolist() == [4, 4]
    assert torch.equal(recv_p == 0, recv_x[:, 0] == 0)
    y = handle.combine(recv_x)  # each kept slot returns its token once
    kept_slots = {0: [1, 2, 1, 0], 1: [2, 1, 1]}[rank]  # rank 0 token 2: expert 2 only
    assert torch.equal(y, x * torch.tensor(kept_slots, dtype=torch.float64)[:, None])
    grad = handle.combine_probs(torch.arange(1, 9, dtype=torch.float64))
    dropped = {0: [(2, 1), (3, 1)], 1: []}[rank]
    for t, k in dropped:
        assert grad[t, k] == 0
    assert int((grad != 0).sum()) == sum(kept_slots)


def test_keeps_each_sources_first_slots_in_token_order():
    dist.run(2, check_keeps_first_slots_in_token_order)


def check_autograd_dense_probs_from_map(seed: int) -> None:
    """Megatron's use: a routing map that may name every expert (the router pads each expert to
    its capacity with zero-probability tokens) on a group of max_topk = E, its dense [T, E]
    probs with dense=True (E == K would otherwise read them as slot order). Gradients: grad x is
    the combine of the rows' gradients over kept slots, grad probs the row's gradient in the
    slot's expert column, 0 where dropped or unrouted."""
    rank, world = ep_cases.rank_and_size()
    E, H, T, C = 4 * world, 6, 10, 3
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    routing_map = torch.rand(T, E, generator=gen) < 0.6
    x = dense.wide_values(gen, (T, H), torch.float64, -3, 3).requires_grad_()
    probs = (torch.rand(T, E, generator=gen, dtype=torch.float64) * routing_map
             ).requires_grad_()
    group = ep.Group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=E,
                     dtype=torch.float64, backend="torch", device="cpu", expert_capacity=C)
    handle = group.create_handle(routing_map=routing_map)
    recv_x, recv_p = ep.dispatch(handle, x, probs, dense=True)

    # The oracle's problem: every rank's routing as top-k ids, probs in slot order.
    maps, xs, ps = [], [], []
    for s in range(world):
        g = torch.Generator().manual_seed(seed * 7 + s)
        m = torch.rand(T, E, generator=g) < 0.6
        xs.append(dense.wide_values(g, (T, H), torch.float64, -3, 3))
        ps.append(torch.rand(T, E, generator=g, dtype=torch.float64) * m)
        maps.append(m)
    topk = [torch.stack([torch.cat([m[t].nonzero().flatten(),
                                    torch.full((E - int(m[t].sum()),), -1)]) for t in range(T)])
            for m in maps]
    slot_p = [p.gather(1, i.clamp(min=0)) * (i >= 0) for p, i in zip(ps, topk)]
    problem = dense.Problem(world, E, xs, topk, slot_p)
    assert torch.equal(handle.topk_idx, topk[rank])
    want_x, want_p, _, _ = dense.dispatch(problem, rank, expert_capacity=C)
    dense.assert_bitwise_equal(recv_x.detach(), want_x, "recv_x")
    dense.assert_bitwise_equal(recv_p.detach(), want_p, "recv_probs (dense columns)")
    assert handle.tokens_per_expert.tolist() == [world * C] * (E // world)

    rows = [recv_x.shape[0]] * world
    grad_rows = ep_cases.poisoned_rows(problem, seed + 3, rows, expert_capacity=C)
    grad_vec = ep_cases.poisoned_rows(problem, seed + 4, rows, dtype=torch.float64, vector=True,
                                      expert_capacity=C)
    torch.autograd.backward([recv_x, recv_p], [grad_rows[rank], grad_vec[rank]])
    dense.assert_bitwise_equal(x.grad, dense.combine(problem, grad_rows, rank,
                                                     expert_capacity=C), "grad x")
    want_gp_slots = dense.combine_probs(problem, grad_vec, rank, expert_capacity=C)
    want_gp = torch.zeros(T, E, dtype=torch.float64)
    t, k = (topk[rank] >= 0).nonzero(as_tuple=True)
    want_gp[t, topk[rank][t, k]] = want_gp_slots[t, k]
    dense.assert_bitwise_equal(probs.grad, want_gp, "grad probs (dense)")
    assert bool((routing_map & (want_gp == 0)).any()), "the case should drop a routed slot"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_autograd_with_dense_probs_from_a_routing_map(world_size, seed):
    dist.run(world_size, check_autograd_dense_probs_from_map, seed)


def test_configuration_rules():
    base = dict(num_experts=8, hidden=4, max_tokens_per_rank=16, max_topk=2,
                dtype=torch.float32, backend="torch", device="cpu")
    with pytest.raises(ValueError, match=r"expert_capacity must be >= 0"):
        ep.Group(**base, expert_capacity=-1)
    # One rank: L = 8 experts, blocks of 5 rows rounded up to the alignment 4.
    group = ep.Group(**base, expert_capacity=5, expert_alignment=4, recv_mode="capacity",
                     capacity_factor=2.0)
    assert group.config.max_recv_tokens_per_rank == 8 * 8
    assert group.config.expert_block_rows(1) == 8
    with pytest.raises(ValueError, match=r"expert_capacity=5 fixes every dispatch output at 40 "
                                         r"rows.*max_recv_tokens_per_rank"):
        ep.Group(**base, expert_capacity=5, recv_mode="capacity", max_recv_tokens_per_rank=41)
    assert ep.Group(**base, expert_capacity=5, recv_mode="capacity",
                    max_recv_tokens_per_rank=40).config.max_recv_tokens_per_rank == 40
    assert ep.Group(**base).config.static_recv_rows(1) is None


def test_cuda_backend_refuses_more_slots_per_rank_than_its_kernels():
    """The cuda kernels take a lane per slot of a token on one rank (32): a drop-and-pad routing
    map (max_topk = E) over too few ranks, which the reference takes, is refused by the library's
    check of the configuration (no GPU needed), naming the option and the ways out. The
    fixed-capacity layout itself, and top-k above 32 with at most 32 local experts, run there
    (tests/gpu: bitwise)."""
    from megatron_nccl_ep import cuda_backend

    if not cuda_backend.available():
        pytest.skip(f"CUDA library not built: {cuda_backend.unavailable_reason()}")
    config = GroupConfig(num_experts=64, hidden=16, max_tokens_per_rank=32, max_topk=64,
                         expert_capacity=4)
    config.validate(1)
    with pytest.raises(ValueError, match=r"min\(max_topk=64, local experts=64\) slots on one "
                                         r"rank, at most 32 .*drop-and-pad.*more ranks"):
        cuda_backend.CudaBackend(config, None)
