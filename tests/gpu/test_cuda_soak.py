"""A random soak on the GPU machine (issue 8): the cuda backend against the reference backend on
the same GPUs and process group, BITWISE, for SOAK_SECONDS (300 in tests/gpu/run.sh's faults
stage; 15 under plain pytest), 0 mismatches.

Cases come from soak_cases.GPU (the generators the CPU soak, tests/test_reference_soak.py, draws
from too). A few groups live at once (token dtype, hidden size, including rows that are not a
multiple of 16 bytes, experts, top-k bound, exact or capacity mode, expert alignment, SM budget,
staging rings small enough to wrap many times per op); one is replaced every REPLACE_EVERY_S.
Every call draws the tokens of each rank (0 included), top-k, routing (random, masked, one
expert), the probs dtype (or no probs), the index dtype, and top-k ids or a routing map with a
router's dense probs. Outputs come from a NaN-poisoned allocator; expert outputs and gradients
hold NaN in every row that carries no token. The summary line gives iterations and mismatching
elements.

SOAK_DEADLINE (epoch seconds; run.sh sets it from the stage's time limit): the soak ends early
rather than run past it, and says so.
"""

from __future__ import annotations

import collections
import os
import random
import time

import pytest
import torch
import torch.distributed as tdist

import dense
import dist
import ep_cases
import soak_cases
from ep_cases import count_mismatches, group_pair, rank_inputs, recv_rows_bound
from gpu_common import (dense_probs_of, nan_outside, poison_allocator, requires_gpus,
                        routing_map_of, this_device)

pytestmark = requires_gpus

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "15"))
GROUPS_ALIVE = 3
REPLACE_EVERY_S = 15.0
TEARDOWN_S = 20.0  # kept before SOAK_DEADLINE: the last call, destroying the groups, reporting
WIDE_VALUES_MAX = 1 << 25  # elements; larger expert outputs are drawn more cheaply


def soak_world() -> int:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 4 if count >= 4 else 2 if count >= 2 else 1


class SoakGroup:
    """A group configuration drawn from soak_cases.GPU, with its reference and cuda groups."""

    def __init__(self, rng: random.Random, world: int, device):
        self.cfg = cfg = soak_cases.random_group(rng, world, soak_cases.GPU)
        local = cfg["num_experts"] // world
        C = cfg["expert_capacity"]  # > 0: the fixed-capacity layout
        capacity_mode = cfg["capacity_slack"] is not None
        self.capacity = None
        if capacity_mode and not C:  # room for any routing, plus the slack
            self.capacity = recv_rows_bound(world, cfg["max_tokens"], cfg["max_topk"], local,
                                            cfg["alignment"]) + cfg["capacity_slack"]
        # With C, capacity mode's size is the layout's own (the Group derives it).
        fixed = dict(recv_mode="capacity") if capacity_mode and C else {}
        self.ref, self.cuda = group_pair(
            device, experts=cfg["num_experts"], hidden=cfg["hidden"],
            max_tokens=cfg["max_tokens"], max_topk=cfg["max_topk"], dtype=cfg["dtype"],
            capacity=self.capacity, expert_alignment=cfg["alignment"], num_sms=cfg["num_sms"],
            staging_chunk_tokens=cfg["staging_chunk_tokens"], staging_depth=cfg["staging_depth"],
            ranks_per_node=cfg["ranks_per_node"], expert_capacity=C, **fixed)
        if fixed:
            self.capacity = self.cuda.config.max_recv_tokens_per_rank

    def describe(self) -> str:
        c = self.cfg
        mode = f"capacity {self.capacity}" if self.capacity is not None else "exact"
        return (f"E={c['num_experts']} H={c['hidden']} {str(c['dtype'])[6:]} "
                f"T<={c['max_tokens']} K<={c['max_topk']} A={c['alignment']} {mode} "
                f"sms={c['num_sms']} staging={c['staging_chunk_tokens']}x{c['staging_depth']} "
                f"G={c['ranks_per_node'] or 'all'} C={c['expert_capacity'] or 'off'}")

    def destroy(self) -> None:
        self.cuda.destroy()
        self.ref.destroy()


def expert_values(gen, rows: int, hidden: int, dtype) -> torch.Tensor:
    if rows * hidden <= WIDE_VALUES_MAX:
        return dense.wide_values(gen, (rows, hidden), dtype)
    return torch.randn(rows, hidden, generator=gen, device=gen.device).to(dtype)


def soak_call(g: SoakGroup, call: dict, seed: int, rank: int, device, gen) -> dict:
    """One handle through both backends; mismatching elements per output."""
    cfg, E = g.cfg, g.cfg["num_experts"]
    case = dict(tokens=call["tokens"], hidden=cfg["hidden"], topk=call["topk"], experts=E,
                dtype=cfg["dtype"], routing=call["routing"], idx_dtype=call["idx_dtype"],
                probs_dtype=call["probs_dtype"])
    x, idx, probs = rank_inputs(case, seed, rank, device)
    # [T, E] probs read as slot order when E == K: routing maps only where the forms differ.
    use_map = call["routing_map"] and E != cfg["max_topk"]
    if use_map:
        routing_map = routing_map_of(idx, E)
        h_ref, h = (grp.create_handle(routing_map=routing_map) for grp in (g.ref, g.cuda))
        probs = None if probs is None else dense_probs_of(idx, probs, E)
    else:
        h_ref, h = (grp.create_handle(idx) for grp in (g.ref, g.cuda))
    bad = collections.Counter()
    n = h_ref.num_recv_tokens
    if h.num_recv_tokens != n:
        bad["num_recv_tokens"] += 1
    else:
        bad["tokens_per_expert"] += count_mismatches(h.tokens_per_expert, h_ref.tokens_per_expert)
        if probs is None:  # the rows that carry a (token, slot): all-ones probs mark them
            want_x, marks = h_ref.dispatch(x, torch.ones(idx.shape[0], h_ref.topk,
                                                         device=device))
            want_p, used = None, marks != 0
        else:
            want_x, want_p = h_ref.dispatch(x, probs)
            used = want_p != 0
        got_x, got_p = h.dispatch(x, probs)
        bad["recv_x"] += count_mismatches(got_x, want_x)
        bad["recv_probs"] += count_mismatches(got_p, want_p)
        expert_out = nan_outside(expert_values(gen, n, cfg["hidden"], cfg["dtype"]), used)
        bad["y"] += count_mismatches(h.combine(expert_out), h_ref.combine(expert_out))
        if probs is not None:
            grad = nan_outside(torch.rand(n, generator=gen, device=device).to(want_p.dtype), used)
            bad["combine_probs"] += count_mismatches(h.combine_probs(grad, dense=use_map),
                                                     h_ref.combine_probs(grad, dense=use_map))
    h.destroy()
    h_ref.destroy()
    return {k: v for k, v in bad.items() if v}


def soak(seed: int, seconds: float) -> dict:
    rank, world = ep_cases.rank_and_size()
    device = this_device()
    rng = random.Random(seed)  # drawn alike on every rank
    gen = torch.Generator(device=device).manual_seed(seed * 31 + rank)
    groups = [SoakGroup(rng, world, device) for _ in range(GROUPS_ALIVE)]
    stats = collections.Counter(groups=GROUPS_ALIVE)
    first = None
    start = last_replace = time.monotonic()
    while True:
        # Every rank does the same: rank 0's clock decides, shared by a collective.
        now = time.monotonic()
        flags = torch.tensor([now - start < seconds, now - last_replace >= REPLACE_EVERY_S],
                             dtype=torch.int32, device=device)
        tdist.broadcast(flags, src=0)
        go, replace = flags.tolist()
        if not go:
            break
        if replace:
            i = rng.randrange(GROUPS_ALIVE)
            groups[i].destroy()
            groups[i] = SoakGroup(rng, world, device)
            stats["groups"] += 1
            last_replace = now
        g = groups[rng.randrange(GROUPS_ALIVE)]
        call = soak_cases.random_call(rng, world, g.cfg, soak_cases.GPU)
        call_seed = rng.randrange(1 << 30)
        poison_allocator(device, large_bytes=1 << 30, small_blocks=32)
        bad = soak_call(g, call, call_seed, rank, device, gen)
        g.cuda.check_errors()  # a sticky device-side error would fail here, with its message
        stats["iterations"] += 1
        stats["capacity" if g.capacity is not None else "exact"] += 1
        stats["fixed capacity"] += bool(g.cfg["expert_capacity"])
        stats["routing maps"] += bool(call["routing_map"])
        stats["without probs"] += call["probs_dtype"] is None
        stats["a rank with 0 tokens"] += 0 in call["tokens"]
        stats[str(g.cfg["dtype"])[6:]] += 1
        mismatches = sum(bad.values())
        stats["mismatches"] += mismatches
        if mismatches and first is None:
            first = (f"call {stats['iterations']} in group {g.describe()}: {call}, seed "
                     f"{call_seed}: {dict(bad)}")
    for g in groups:
        g.destroy()
    return dict(stats=dict(stats), first=first, seconds=time.monotonic() - start, rank=rank)


def test_random_soak_bitwise_equal_to_the_reference(seed, summary_line):
    world = soak_world()
    seconds, note = SOAK_SECONDS, ""
    deadline = os.environ.get("SOAK_DEADLINE")
    if deadline:
        left = float(deadline) - time.time() - TEARDOWN_S
        if left < min(seconds, 30.0):
            pytest.fail(f"only {left:.0f} s left before SOAK_DEADLINE for a {seconds:.0f} s soak: "
                        "raise FAULTS_TIMEOUT or lower SOAK_SECONDS")
        if left < seconds:
            seconds, note = left, f" (cut from SOAK_SECONDS={SOAK_SECONDS:.0f} by the deadline)"
    per_rank = dist.run(world, soak, seed, seconds, backend="nccl", timeout=seconds + 120)
    s = per_rank[0]["stats"]
    dtypes = ", ".join(f"{d} {s.get(d, 0)}" for d in ("bfloat16", "float16", "float32"))
    summary_line(
        f"cuda vs reference soak x{world}: {per_rank[0]['seconds']:.0f} s{note}, "
        f"{s.get('iterations', 0)} calls in {s['groups']} groups (exact {s.get('exact', 0)} / "
        f"capacity {s.get('capacity', 0)}; fixed capacity {s.get('fixed capacity', 0)}; "
        f"routing maps {s.get('routing maps', 0)}; without probs {s.get('without probs', 0)}; "
        f"a rank with 0 tokens {s.get('a rank with 0 tokens', 0)}; "
        f"{dtypes}), mismatching elements per rank "
        f"{[o['stats'].get('mismatches', 0) for o in per_rank]}"
        + "".join(f" | rank {o['rank']} first mismatch: {o['first']}" for o in per_rank
                  if o["first"]))
    assert len({o["stats"].get("iterations", 0) for o in per_rank}) == 1, per_rank  # same calls
    assert all(o["stats"].get("mismatches", 0) == 0 for o in per_rank), per_rank
    assert s.get("iterations", 0) >= max(10, int(seconds) // 2), (
        f"only {s.get('iterations', 0)} calls in {seconds:.0f} s")
