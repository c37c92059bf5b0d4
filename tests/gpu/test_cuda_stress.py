"""The cuda backend under stress (issue 8), one rank per GPU over NCCL, every output compared
BITWISE with the reference backend on the same GPUs (and, where it is simple, with what the
routing says directly):

- several live handles created back to back, their counts read newest first, dispatched,
  destroyed and combined in shuffled orders, new handles made while old ones live;
- 10,000 create / dispatch / combine / destroy cycles with the routing (and token counts)
  changing every cycle: device memory (torch-allocated bytes, driver free bytes) and host RSS
  before and after, printed and bounded;
- every token to one expert, and every slot of every token to one rank, at 16384 tokens per rank
  (= max_tokens_per_rank) of hidden 7168: exact mode and a capacity exactly the rows needed.

Each test prints one summary line with what it measured.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as tdist

import dense
import dist
import ep_cases
from ep_cases import count_mismatches, group_pair, rank_inputs, recv_rows_bound
from gpu_common import (dense_probs_of, device_memory, nan_outside, poison_allocator,
                        requires_gpus, resident_bytes, routing_map_of, this_device, world_sizes)

pytestmark = requires_gpus

BF16 = torch.bfloat16
ROUTINGS = ("random", "masked", "one_expert")
MiB = 1 << 20


# ------------------------------------------------------------------------------------------------
# several live handles, used out of order
# ------------------------------------------------------------------------------------------------

LIVE = dict(hidden=1024, topk=6, experts=32, dtype=BF16, tokens=512)
LIVE_HANDLES = 6  # more than the 4 handle slots a group preallocates


def check_live_handles(recv_mode: str, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    device = this_device()
    rng = random.Random(seed)  # the same orders on every rank
    T, K, E = LIVE["tokens"], LIVE["topk"], LIVE["experts"]
    capacity = recv_rows_bound(world, T, K, E // world) if recv_mode == "capacity" else None
    ref, cuda = group_pair(device, experts=E, hidden=LIVE["hidden"], max_tokens=T, max_topk=K,
                           dtype=LIVE["dtype"], capacity=capacity)
    poison_allocator(device)
    specs = [dict(tokens=tuple(rng.choice((0, 1, 77, T)) for _ in range(world)),
                  topk=rng.randint(1, K), routing=rng.choice(ROUTINGS), routing_map=i % 3 == 2,
                  seed=rng.randrange(1 << 30)) for i in range(LIVE_HANDLES + 2)]
    gen = torch.Generator(device=device).manual_seed(seed + rank)

    def make(i: int) -> dict:
        sp = specs[i]
        case = dict(LIVE, tokens=sp["tokens"], topk=sp["topk"], routing=sp["routing"])
        x, idx, probs = rank_inputs(case, sp["seed"], rank, device)
        if sp["routing_map"]:  # a router's map and dense [T, E] probs
            routing_map = routing_map_of(idx, E)
            handles = [g.create_handle(routing_map=routing_map) for g in (ref, cuda)]
            probs = dense_probs_of(idx, probs, E)
        else:
            handles = [g.create_handle(idx) for g in (ref, cuda)]
        return dict(x=x, probs=probs, ref=handles[0], cuda=handles[1], dense=sp["routing_map"])

    bad = {}

    def compare(what: str, got, want) -> None:
        bad[what] = bad.get(what, 0) + count_mismatches(got, want)

    # Created back to back (no count read in between), counts read newest first.
    live = {i: make(i) for i in range(LIVE_HANDLES)}
    for i in reversed(range(LIVE_HANDLES)):
        h = live[i]
        compare("num_recv_tokens", torch.tensor(h["cuda"].num_recv_tokens),
                torch.tensor(h["ref"].num_recv_tokens))
        compare("tokens_per_expert", h["cuda"].tokens_per_expert, h["ref"].tokens_per_expert)

    def dispatch(i: int) -> None:
        h = live[i]
        want_x, want_p = h["ref"].dispatch(h["x"], h["probs"])
        got_x, got_p = h["cuda"].dispatch(h["x"], h["probs"])
        compare("recv_x", got_x, want_x)
        compare("recv_probs", got_p, want_p)
        h.update(recv_x=got_x, used=want_p != 0, probs_dtype=want_p.dtype)

    dispatch_order = rng.sample(range(LIVE_HANDLES), LIVE_HANDLES)
    for i in dispatch_order:
        dispatch(i)
    # Two handles destroyed out of order; two new ones take their slots while the others live.
    destroyed = rng.sample(range(LIVE_HANDLES), 2)
    for i in destroyed:
        live[i]["cuda"].destroy()
        live[i]["ref"].destroy()
        del live[i]
    for i in (LIVE_HANDLES, LIVE_HANDLES + 1):
        live[i] = make(i)
        dispatch(i)
    combine_order = rng.sample(sorted(live), len(live))
    for i in combine_order:
        h = live[i]
        n = h["recv_x"].shape[0]
        expert_out = nan_outside(dense.wide_values(gen, (n, LIVE["hidden"]), LIVE["dtype"]),
                                 h["used"])
        compare("y", h["cuda"].combine(expert_out), h["ref"].combine(expert_out))
        grad = nan_outside(torch.rand(n, generator=gen, device=device).to(h["probs_dtype"]),
                           h["used"])
        compare("combine_probs", h["cuda"].combine_probs(grad, dense=h["dense"]),
                h["ref"].combine_probs(grad, dense=h["dense"]))
    # The oldest live handle dispatches again, after all of that: the same bits as the first time.
    oldest = live[min(live)]
    compare("recv_x again", oldest["cuda"].dispatch(oldest["x"], oldest["probs"])[0],
            oldest["recv_x"])
    destroy_order = rng.sample(sorted(live), len(live))
    for i in destroy_order:
        live[i]["cuda"].destroy()
        live[i]["ref"].destroy()
    cuda.check_errors()
    cuda.destroy()
    ref.destroy()
    assert sum(bad.values()) == 0, f"rank {rank}: mismatching elements {bad}"
    return (f"x{world} {recv_mode}: {LIVE_HANDLES} live handles (counts read newest first), "
            f"dispatched {dispatch_order}, destroyed {destroyed}, created "
            f"{[LIVE_HANDLES, LIVE_HANDLES + 1]}, combined {combine_order}, oldest re-dispatched, "
            f"destroyed {destroy_order}: {sum(1 for _ in bad)} kinds of output bitwise equal to "
            f"the reference")


@pytest.mark.parametrize("world_size", world_sizes()[1:])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_live_handles_used_out_of_order(recv_mode, world_size, seed, summary_line):
    summary_line(dist.run(world_size, check_live_handles, recv_mode, seed, backend="nccl")[0])


# ------------------------------------------------------------------------------------------------
# 10,000 cycles with changing routing: memory flat
# ------------------------------------------------------------------------------------------------

CYCLES = 10_000
CYCLE = dict(hidden=512, topk=4, experts=16, dtype=BF16, tokens=256)
CYCLE_BANK = 37  # routings, token counts changing every cycle (0 tokens included)
CHECK_EVERY = 250  # cycles between bitwise checks of the outputs (each one synchronizes)
DRIVER_SLACK = 2 * MiB  # one allocation granule of the driver
RSS_SLACK = 32 * MiB  # malloc arenas and Python's pools: a per-cycle leak of 3.4 KiB exceeds it


def check_cycles(recv_mode: str, seed: int, count: int) -> dict:
    rank, world = ep_cases.rank_and_size()
    device = this_device()
    rng = random.Random(seed)
    T, K, E = CYCLE["tokens"], CYCLE["topk"], CYCLE["experts"]
    capacity = recv_rows_bound(world, T, K, E // world) if recv_mode == "capacity" else None
    ref, cuda = group_pair(device, experts=E, hidden=CYCLE["hidden"], max_tokens=T, max_topk=K,
                           dtype=CYCLE["dtype"], capacity=capacity)
    bank = []
    for i in range(CYCLE_BANK):
        case = dict(CYCLE, tokens=tuple(rng.choice((0, 1, 17, 128, T)) for _ in range(world)),
                    topk=rng.randint(1, K), routing=ROUTINGS[i % 3])
        x, idx, _ = rank_inputs(case, seed + i, rank, device)
        h = ref.create_handle(idx)
        recv_x, _ = h.dispatch(x)
        bank.append((x, idx, h.num_recv_tokens, h.tokens_per_expert.clone(), h.combine(recv_x)))
        h.destroy()
    ref.destroy()
    stats = dict(checked=0, wrong_counts=0, mismatches=0)

    def cycle(i: int) -> None:
        x, idx, rows, tpe, want_y = bank[(i * 11) % CYCLE_BANK]  # a different one every cycle
        h = cuda.create_handle(idx)
        recv_x, _ = h.dispatch(x)
        y = h.combine(recv_x)
        stats["wrong_counts"] += h.num_recv_tokens != rows  # exact mode: the count read
        if i % CHECK_EVERY == 0 or i == count - 1:
            stats["mismatches"] += (count_mismatches(y, want_y)
                                    + count_mismatches(h.tokens_per_expert, tpe))
            stats["checked"] += 1
        h.destroy()

    for i in range(2 * CYCLE_BANK):  # warm-up: every routing twice, pools at their size
        cycle(i)
    before = (*device_memory(device), resident_bytes())
    start = time.monotonic()
    for i in range(count):
        cycle(i)
    torch.cuda.synchronize(device)
    took = time.monotonic() - start
    after = (*device_memory(device), resident_bytes())
    cuda.check_errors()
    cuda.destroy()
    return dict(stats, before=before, after=after, took=took, rank=rank, world=world)


@pytest.mark.parametrize("world_size", world_sizes()[1:])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
def test_10k_cycles_with_changing_routing_keep_memory_flat(recv_mode, world_size, seed,
                                                          summary_line):
    per_rank = dist.run(world_size, check_cycles, recv_mode, seed, CYCLES, backend="nccl",
                        timeout=180)
    r = per_rank[0]
    (a0, f0, h0), (a1, f1, h1) = r["before"], r["after"]
    summary_line(
        f"x{world_size} {recv_mode}: {CYCLES} create/dispatch/combine/destroy cycles over "
        f"{CYCLE_BANK} routings in {r['took']:.1f} s ({1e6 * r['took'] / CYCLES:.0f} us/cycle); "
        f"rank 0: torch-allocated {a0} -> {a1} B, driver free {f0 / MiB:.1f} -> {f1 / MiB:.1f} "
        f"MiB, host RSS {h0 / MiB:.1f} -> {h1 / MiB:.1f} MiB; "
        + "; ".join(f"rank {o['rank']}: {o['checked']} bitwise checks, {o['mismatches']} "
                    f"mismatching elements, {o['wrong_counts']} wrong counts" for o in per_rank))
    for o in per_rank:
        (a0, f0, h0), (a1, f1, h1) = o["before"], o["after"]
        assert o["mismatches"] == 0 and o["wrong_counts"] == 0, o
        assert o["checked"] >= CYCLES // CHECK_EVERY, o
        assert a1 == a0, f"rank {o['rank']}: torch-allocated bytes {a0} -> {a1}"
        assert f1 >= f0 - DRIVER_SLACK, (
            f"rank {o['rank']}: driver free memory dropped by {(f0 - f1) / MiB:.1f} MiB")
        assert h1 - h0 <= RSS_SLACK, f"rank {o['rank']}: host RSS grew by {(h1 - h0) / MiB:.1f} MiB"


# ------------------------------------------------------------------------------------------------
# all tokens to one expert (or one rank) at the maximum token count
# ------------------------------------------------------------------------------------------------

HOT = dict(tokens=16384, hidden=7168, topk=8, experts=256, dtype=BF16)
# one_expert: slot 0 of every token of every rank -> one expert, the other slots masked;
# one_rank_top8: the 8 slots of every token -> experts 0..7, all on rank 0.
HOT_ROUTINGS = ("one_expert", "one_rank_top8")


def check_hot_spot(routing: str, recv_mode: str, seed: int) -> str:
    rank, world = ep_cases.rank_and_size()
    device = this_device()
    T, H, K, E, dtype = HOT["tokens"], HOT["hidden"], HOT["topk"], HOT["experts"], HOT["dtype"]
    L = E // world
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x = dense.wide_values(gen, (T, H), dtype)
    probs = (torch.rand(T, K, generator=gen, device=device, dtype=torch.float64) * 0.9
             + 0.1).float()
    idx = torch.full((T, K), -1, dtype=torch.int64, device=device)
    if routing == "one_expert":
        experts = [seed % E]  # the same on every rank
        idx[:, 0] = experts[0]
    else:
        experts = list(range(K))
        idx[:] = torch.arange(K, device=device)
    slots = list(range(len(experts)))  # slot k carries experts[k]
    dest = experts[0] // L
    per_expert = world * T  # rows of each hot expert: every token of every rank
    need = per_expert * len(experts)
    capacity = need if recv_mode == "capacity" else None  # exactly full: the overflow boundary
    ref, cuda = group_pair(device, experts=E, hidden=H, max_tokens=T, max_topk=K, dtype=dtype,
                           capacity=capacity)
    poison_allocator(device)
    h_ref, h = ref.create_handle(idx), cuda.create_handle(idx)
    bad = {}

    def compare(what: str, got, want) -> None:
        bad[what] = bad.get(what, 0) + count_mismatches(got, want)

    rows = h.num_recv_tokens
    want_rows = need if (rank == dest or capacity is not None) else 0
    want_tpe = torch.zeros(L, dtype=torch.int64)
    if rank == dest:
        want_tpe[[e % L for e in experts]] = per_expert
    compare("num_recv_tokens", torch.tensor(rows), torch.tensor(want_rows))
    compare("tokens_per_expert", h.tokens_per_expert.cpu(), want_tpe)
    compare("tokens_per_expert (reference)", h_ref.tokens_per_expert.cpu(), want_tpe)
    recv_x, recv_p = h.dispatch(x, probs)
    want_x, want_p = h_ref.dispatch(x, probs)
    compare("recv_x", recv_x, want_x)
    compare("recv_probs", recv_p, want_p)
    # Independent of both backends: each hot expert's block is every rank's tokens in rank then
    # token order (its rows sit in expert order), every other row zero.
    xs = [torch.empty_like(x) for _ in range(world)]
    ps = [torch.empty_like(probs) for _ in range(world)]
    tdist.all_gather(xs, x)
    tdist.all_gather(ps, probs)
    all_x, all_p = torch.cat(xs), torch.cat(ps)
    expect_x = torch.zeros(rows, H, dtype=dtype, device=device)
    expect_p = torch.zeros(rows, dtype=probs.dtype, device=device)
    if rank == dest:
        for j, k in enumerate(sorted(slots, key=lambda s: experts[s] % L)):
            expect_x[j * per_expert:(j + 1) * per_expert] = all_x
            expect_p[j * per_expert:(j + 1) * per_expert] = all_p[:, k]
    del xs, ps, all_x, all_p
    compare("recv_x (direct)", recv_x, expect_x)
    compare("recv_probs (direct)", recv_p, expect_p)
    del expect_x, expect_p, want_x
    used = want_p != 0
    expert_out = nan_outside(recv_x * recv_p.to(dtype)[:, None], used)
    y = h.combine(expert_out)
    compare("y", y, h_ref.combine(expert_out))
    # Also direct: one rank holds all of a token's rows, so y = its slots' sum in float32, in
    # slot order, rounded once (docs/design.md §4).
    acc = torch.zeros(T, H, dtype=torch.float32, device=device)
    for k in slots:
        acc += (x * probs[:, k].to(dtype)[:, None]).float()
    compare("y (direct)", y, acc.to(dtype))
    del expert_out, acc
    grad = nan_outside(torch.rand(rows, generator=gen, device=device), used)
    compare("combine_probs", h.combine_probs(grad), h_ref.combine_probs(grad))
    cuda.check_errors()
    for g in (h, h_ref, cuda, ref):
        g.destroy()
    assert sum(bad.values()) == 0, f"rank {rank}: mismatching elements {bad}"
    return dict(rows=rows, dest=dest, need=need, experts=len(experts), compared=len(bad))


@pytest.mark.parametrize("world_size", world_sizes()[1:])
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
@pytest.mark.parametrize("routing", HOT_ROUTINGS)
def test_all_tokens_to_one_expert_at_max_tokens(routing, recv_mode, world_size, seed,
                                                summary_line):
    start = time.monotonic()
    per_rank = dist.run(world_size, check_hot_spot, routing, recv_mode, seed, backend="nccl",
                        timeout=180)
    r = per_rank[0]
    summary_line(
        f"x{world_size} {routing} {recv_mode}: T={HOT['tokens']} (= max_tokens_per_rank) "
        f"H={HOT['hidden']} bf16 top-{HOT['topk']} E={HOT['experts']}: rank {r['dest']} receives "
        f"{r['need']} rows ({r['need'] * HOT['hidden'] * 2 / 2**30:.2f} GiB) into {r['experts']} "
        f"expert(s); dispatch rows per rank {[o['rows'] for o in per_rank]}; {r['compared']} "
        f"outputs (counts, recv_x, recv_probs, y, combine_probs) bitwise equal to the reference "
        f"and to the direct expectation, {time.monotonic() - start:.1f} s")
