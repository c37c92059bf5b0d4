"""The reference backend under load (the CPU versions of the CUDA soak and cycle tests):
- a time-boxed random soak (shapes, dtypes, routings, modes, alignment, nodes; drawn by
  soak_cases.py, whose GPU space tests/gpu/test_cuda_soak.py uses) compared bitwise with the
  independent oracle, 0 mismatches;
- thousands of create / dispatch / combine / destroy cycles with changing routing, with the
  process's memory flat."""

import random
import time

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep
import soak_cases


def soak(seed: int, seconds: float) -> tuple:
    rank, world = ep_cases.rank_and_size()
    rng = random.Random(seed)
    iterations = mismatches = fixed = 0
    deadline = time.monotonic() + seconds
    while True:
        # Every rank stops at the same iteration: rank 0's clock decides, shared by a collective.
        go = torch.tensor([time.monotonic() < deadline], dtype=torch.int32)
        torch.distributed.broadcast(go, src=0)
        if not bool(go):
            break
        case = soak_cases.random_case(rng, world, soak_cases.CPU)
        case_seed = rng.randrange(1 << 30)
        problem = dense.make_problem(case_seed, world, tokens=case["tokens"],
                                     hidden=case["hidden"], num_experts=case["num_experts"],
                                     topk=case["topk"], dtype=case["dtype"],
                                     routing=case["routing"])
        align, slack = case["alignment"], case["capacity_slack"]
        C = case["expert_capacity"] or None  # the fixed-capacity layout
        group = ep_cases.make_group(problem, alignment=align, capacity_slack=slack,
                                    ranks_per_node=case["ranks_per_node"],
                                    expert_capacity=C or 0)
        capacity = group.config.max_recv_tokens_per_rank if slack is not None else None
        rows = ep_cases.capacity_or_rows(problem, align, capacity, expert_capacity=C)
        x, idx, probs = ep_cases.share(problem, rank)
        handle = group.create_handle(idx)
        recv_x, recv_p = handle.dispatch(x, probs)
        want_x, want_p, want_tpe, _ = dense.dispatch(problem, rank, align, capacity,
                                                     expert_capacity=C)
        expert_out = ep_cases.poisoned_rows(problem, case_seed + 1, rows, align,
                                            expert_capacity=C)
        y = handle.combine(expert_out[rank])
        want_y = dense.combine(problem, expert_out, rank, align,
                               ranks_per_node=case["ranks_per_node"] or None, expert_capacity=C)
        for got, want in ((recv_x, want_x), (recv_p, want_p),
                          (handle.tokens_per_expert.cpu(), want_tpe), (y, want_y)):
            mismatches += int((dense.bits(got) != dense.bits(want)).sum())
        handle.destroy()
        group.destroy()
        iterations += 1
        fixed += C is not None
    return iterations, mismatches, fixed


@pytest.mark.parametrize("world_size", [2, 4])
def test_random_soak_is_bitwise_equal_to_the_oracle(world_size, seed, summary_line):
    results = dist.run(world_size, soak, seed, 10.0, timeout=120)
    iterations = {it for it, _, _ in results}
    assert len(iterations) == 1, results  # every rank ran the same cases
    total = sum(m for _, m, _ in results)
    summary_line(f"reference soak, R={world_size}: {iterations.pop()} cases in 10 s "
                 f"({results[0][2]} with the fixed-capacity layout), {total} mismatching elements")
    assert total == 0
    assert min(it for it, _, _ in results) >= 5, results


def resident_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4  # pages of 4 KiB


def cycles(seed: int, count: int) -> tuple:
    rank, world = ep_cases.rank_and_size()
    group = ep.Group(num_experts=8, hidden=64, max_tokens_per_rank=64, max_topk=3,
                     dtype=torch.bfloat16, backend="torch", device="cpu")
    gen = torch.Generator().manual_seed(seed * 31 + rank)

    def one(i: int) -> None:
        idx = torch.rand(64, 8, generator=gen).topk(3, dim=1).indices
        x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
        handle = group.create_handle(idx)
        recv_x, _ = handle.dispatch(x)
        handle.combine(recv_x)
        handle.destroy()

    for i in range(count // 10):  # warm-up: allocator pools and caches reach their size
        one(i)
    before = resident_kib()
    for i in range(count):
        one(i)
    after = resident_kib()
    group.destroy()
    return before, after


def test_handle_cycles_keep_memory_flat(seed):
    # 1000 cycles that each allocate ~100 KiB of handle state and rows: a leak of that per cycle
    # would add ~100 MiB; the bound allows allocator noise only. The count and the timeout leave
    # room for a CI box shared under heavy load (~8 s here when idle, 300 s was once not enough).
    for before, after in dist.run(2, cycles, seed, 1000, timeout=900):
        assert after - before < 16 * 1024, (before, after)
