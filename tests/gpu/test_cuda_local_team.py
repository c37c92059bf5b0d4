"""Multi-rank groups on ONE GPU: ``Group.local_team`` puts every rank of an EP group in this
process (each driven from its own thread and CUDA stream, the windows plain device memory), so
every device code path of 2, 4 and 8 ranks (the rings, ready/credit flags, the handle-creation
barrier, the call checks, the timeouts) runs without a second GPU.

Outputs are compared BITWISE with the single-process oracle of tests/dense.py (written from the
design, independent of both backends). Outputs are fresh allocations from a NaN-poisoned caching
allocator and the comparison covers every row (padding and the capacity tail included); expert
outputs and incoming gradients carry NaN in their padding rows, which the kernels must not read.
"""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
import torch

import dense
import megatron_nccl_ep as ep
from gpu_common import requires_gpus, routing_map_of

pytestmark = requires_gpus

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def sms_available() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def poison_stream(device, large_bytes: int = 1 << 30, small_blocks: int = 16) -> None:
    """``poison_allocator`` for the current stream only (the caching allocator keeps freed blocks
    per stream)."""
    big = torch.empty(large_bytes // 4, dtype=torch.float32, device=device).fill_(math.nan)
    small = [torch.empty(128 * 1024, dtype=torch.float32, device=device).fill_(math.nan)
             for _ in range(small_blocks)]
    del big, small
    torch.cuda.current_stream(device).synchronize()


def run_ranks(groups, fn):
    """``fn(rank, group)`` on every rank at once (``ep.run_local_team``: a thread and stream per
    rank), each rank's stream memory NaN-filled first, so that its outputs start as NaN."""
    return ep.run_local_team(groups, fn, prepare=lambda rank, group: poison_stream(group.device))


def make_team(world, case, **extra):
    kwargs = dict(num_experts=case["experts"], hidden=case["hidden"],
                  max_tokens_per_rank=max(1, case["max_tokens"]), max_topk=case["topk"],
                  dtype=case["dtype"], expert_alignment=case.get("alignment", 1),
                  num_sms=case.get("num_sms", 16),
                  staging_chunk_tokens=case.get("chunk", 0), staging_depth=case.get("depth", 0),
                  timeout_s=20.0)  # a protocol bug fails the test instead of stalling the suite
    kwargs.update(extra)
    return ep.Group.local_team(world, **kwargs)


def destroy_team(groups):
    for g in groups:
        g.destroy()


def dense_probs_of(idx: torch.Tensor, probs: torch.Tensor, num_experts: int, gen):
    """A router's dense [T, E]: the slot probs in their experts' columns, other columns random
    (dispatch must not read them)."""
    out = torch.rand(idx.shape[0], num_experts, generator=gen, dtype=torch.float64).to(probs.dtype)
    t, k = (idx >= 0).nonzero(as_tuple=True)
    out[t, idx[t, k]] = probs[t, k]
    return out


# Each case: world size, tokens per rank (cycled), hidden, top-k, experts, dtype, routing, and the
# library options. ``chunk``/``depth`` shrink the staging ring so that an op wraps it many times.
CASES = {
    "ep2_bench_shape": dict(world=2, tokens=4096, hidden=7168, topk=8, experts=256, dtype=BF16,
                            routing="random", num_sms=24),
    "ep2_ring_wraps_chunk4_depth2": dict(world=2, tokens=(1000, 777), hidden=2048, topk=4,
                                         experts=16, dtype=BF16, routing="random", chunk=4,
                                         depth=2, num_sms=8),
    "ep2_zero_token_rank_capacity_align16": dict(world=2, tokens=(0, 33), hidden=256, topk=8,
                                                 experts=8, dtype=FP32, routing="one_expert",
                                                 capacity=True, alignment=16),
    "ep4_masked_fp16_align16_int32": dict(world=4, tokens=(300, 17, 0, 512), hidden=128, topk=8,
                                          experts=64, dtype=FP16, routing="masked",
                                          alignment=16, idx_dtype=torch.int32, chunk=8),
    "ep4_rows_not_16_byte_multiple": dict(world=4, tokens=300, hidden=100, topk=4, experts=8,
                                          dtype=BF16, routing="masked", probs_dtype=BF16),
    "ep4_capacity_h7168": dict(world=4, tokens=(64, 1), hidden=7168, topk=2, experts=256,
                               dtype=BF16, routing="random", capacity=True),
    "ep8_top8_e64_num_sms16": dict(world=8, tokens=600, hidden=512, topk=8, experts=64,
                                   dtype=BF16, routing="random", num_sms=16, chunk=16),
    "ep2_no_probs_top1": dict(world=2, tokens=1024, hidden=2048, topk=1, experts=8, dtype=FP16,
                              routing="random", probs_dtype=None),
    # The fixed-capacity (drop-and-pad) layout, expert_capacity C: runs of C rows per (expert,
    # source), later slots dropped, empty rows zero. Each case drops slots and leaves rows empty.
    "fixed_capacity_ep1_one_expert": dict(world=1, tokens=300, hidden=256, topk=4, experts=16,
                                          dtype=BF16, routing="one_expert", expert_capacity=40),
    "fixed_capacity_ep2_bench_shape": dict(world=2, tokens=4096, hidden=7168, topk=8,
                                           experts=256, dtype=BF16, routing="random",
                                           num_sms=24, expert_capacity=128, alignment=16),
    "fixed_capacity_ep2_capacity_mode_wraps": dict(world=2, tokens=(500, 0), hidden=512, topk=4,
                                                   experts=8, dtype=FP32, routing="masked",
                                                   expert_capacity=100, capacity=True, chunk=8,
                                                   probs_dtype=BF16),
    "fixed_capacity_ep4_masked_fp16": dict(world=4, tokens=(300, 17, 0, 512), hidden=128,
                                           topk=8, experts=64, dtype=FP16, routing="masked",
                                           alignment=8, idx_dtype=torch.int32,
                                           expert_capacity=25),
    # Capacity mode that drops its overflow: the bound `drop_short` rows below what the fullest
    # rank needs (its last rows dropped: no row, not combined, 0 probs' gradient).
    "capacity_drop_ep2_align16": dict(world=2, tokens=(4096, 1000), hidden=2048, topk=8,
                                      experts=64, dtype=BF16, routing="random", capacity="drop",
                                      drop_short=1500, alignment=16, num_sms=24),
    "capacity_drop_ep4_one_expert_fp16": dict(world=4, tokens=(300, 17, 0, 256), hidden=256,
                                              topk=4, experts=16, dtype=FP16,
                                              routing="one_expert", capacity="drop",
                                              drop_short=200, chunk=8),
    # Top-k above a warp's 32 lanes (a token's slots taken 32 a pass), with at most 32 of them
    # on one rank: 48 of 128 experts over 4 ranks of 32; and every expert of every token (a
    # drop-and-pad routing map's worst case) with the fixed capacity, 8 ranks of 8 experts.
    "wide_ep4_e128_top48_masked": dict(world=4, tokens=(300, 17, 0, 256), hidden=256, topk=48,
                                       experts=128, dtype=BF16, routing="masked"),
    "wide_ep8_e64_every_expert_fixed_capacity": dict(world=8, tokens=(64, 40, 10, 0), hidden=128,
                                                     topk=64, experts=64, dtype=BF16,
                                                     routing="random", expert_capacity=20,
                                                     num_sms=16),
}


def check_drops_and_empty_rows(problem: dense.Problem, C: int, align: int, rows) -> None:
    """A fixed-capacity case does what it is for: some slots dropped, some rows empty."""
    slots = sum(int((idx >= 0).sum()) for idx in problem.topk_idx)
    kept = sum(sum(dense.layout(problem, d, align, expert_capacity=C).real_counts)
               for d in range(problem.world_size))
    assert kept < slots, f"no slot dropped ({kept} of {slots} kept)"
    assert kept < sum(rows), "no row left empty"


def slots_ascending(problem: dense.Problem) -> dense.Problem:
    """The problem as routing-map handles see it: each token's experts in ascending order (-1
    after the last), probs moved with their slots (combine sums a token's rows in slot order)."""
    idx, probs = [], []
    for s in range(problem.world_size):
        i = problem.topk_idx[s].long()
        key = torch.where(i >= 0, i, problem.num_experts)
        key, order = key.sort(dim=1)
        idx.append(torch.where(key < problem.num_experts, key, -1).to(problem.topk_idx[s].dtype))
        p = problem.probs[s]
        probs.append(None if p is None else p.gather(1, order))
    return dense.Problem(problem.world_size, problem.num_experts, problem.x, idx, probs)


def resolve(name):
    case = dict(CASES[name])
    world = case["world"]
    counts = [case["tokens"]] * world if isinstance(case["tokens"], int) else [
        case["tokens"][r % len(case["tokens"])] for r in range(world)]
    case["max_tokens"] = max(counts)
    return case


def check_team(name: str, seed: int, from_map: bool = False) -> str:
    case = resolve(name)
    world, device = case["world"], torch.device("cuda", torch.cuda.current_device())
    if world * case.get("num_sms", 16) > sms_available():
        pytest.skip(f"{world} ranks x {case.get('num_sms', 16)} SMs > {sms_available()} SMs")
    problem = dense.make_problem(seed, world, case["tokens"], case["hidden"], case["experts"],
                                 case["topk"], case["dtype"],
                                 probs_dtype=case.get("probs_dtype", FP32),
                                 idx_dtype=case.get("idx_dtype", torch.int64),
                                 routing=case["routing"])
    if from_map:
        problem = slots_ascending(problem)
    align = case.get("alignment", 1)
    C = case.get("expert_capacity")  # the fixed-capacity layout (None: off)
    rows = [dense.layout(problem, d, align, expert_capacity=C).num_rows for d in range(world)]
    D = None  # capacity mode's drop bound (None: overflow is an error)
    if C:
        check_drops_and_empty_rows(problem, C, align, rows)
        capacity = rows[0] if case.get("capacity") else None  # the layout's fixed size
    elif case.get("capacity") == "drop":
        capacity = D = max(rows) - case["drop_short"]
        assert capacity > 0
        rows = [min(n, D) for n in rows]
    else:
        capacity = max(rows) + 37 if case.get("capacity") else None
    extra = dict(recv_mode="capacity", max_recv_tokens_per_rank=capacity) if capacity else {}
    if D is not None:
        extra["capacity_overflow"] = "drop"
    groups = make_team(world, case, expert_capacity=C or 0, **extra)
    gen = torch.Generator().manual_seed(seed + 99)
    inputs = []
    for r in range(world):
        x, idx, probs = problem.x[r], problem.topk_idx[r], problem.probs[r]
        dense_probs = None if probs is None else dense_probs_of(idx.long(), probs,
                                                                case["experts"], gen)
        inputs.append((x.to(device), idx.to(device), None if probs is None else probs.to(device),
                       None if dense_probs is None else dense_probs.to(device)))
    want = [dense.dispatch(problem, d, align, capacity, expert_capacity=C, drop_past=D)
            for d in range(world)]
    handles = [None] * world

    def phase_dispatch(r, g):
        x, idx, probs, dense_probs = inputs[r]
        h = g.create_handle(routing_map=routing_map_of(idx.long(), case["experts"])) \
            if from_map else g.create_handle(idx)
        handles[r] = h
        recv_x, recv_probs = h.dispatch(x, dense_probs if from_map else probs)
        return h.num_recv_tokens, h.tokens_per_expert.cpu(), recv_x, recv_probs

    got = run_ranks(groups, phase_dispatch)
    for d in range(world):
        n, tpe, recv_x, recv_probs = got[d]
        w_x, w_p, w_tpe, w_rows = want[d]
        assert n == w_x.shape[0], f"rank {d}: num_recv_tokens {n}, expected {w_x.shape[0]}"
        dense.assert_bitwise_equal(tpe, w_tpe, f"{name} rank {d}: tokens_per_expert")
        dense.assert_bitwise_equal(recv_x, w_x, f"{name} rank {d}: recv_x")
        if w_p is None:
            assert recv_probs is None
        else:
            dense.assert_bitwise_equal(recv_probs, w_p, f"{name} rank {d}: recv_probs")

    # Combine: expert outputs with NaN in every row that carries no (token, slot).
    expert_out, grad_recv = [], []
    for d in range(world):
        lay = dense.layout(problem, d, align, expert_capacity=C, drop_past=D)
        n = want[d][0].shape[0]
        used = torch.zeros(n, dtype=torch.bool)
        used[:lay.num_rows] = torch.tensor([r is not None for r in lay.rows], dtype=torch.bool)
        eo = dense.wide_values(gen, (n, case["hidden"]), case["dtype"])
        eo[~used] = math.nan
        gr = torch.rand(n, generator=gen).to(want[d][1].dtype if want[d][1] is not None else FP32)
        gr[~used] = math.nan
        expert_out.append(eo)
        grad_recv.append(gr)

    def phase_combine(r, g):
        h = handles[r]
        y = h.combine(expert_out[r].to(device))
        gp = h.combine_probs(grad_recv[r].to(device), dense=from_map)
        h.destroy()
        return y, gp

    got = run_ranks(groups, phase_combine)
    cut = [e[:rows[d]] for d, e in enumerate(expert_out)]
    for s in range(world):
        y, gp = got[s]
        dense.assert_bitwise_equal(y, dense.combine(problem, cut, s, align, expert_capacity=C,
                                                    drop_past=D), f"{name} rank {s}: y")
        w_gp = dense.combine_probs(problem, grad_recv, s, align, expert_capacity=C, drop_past=D)
        if from_map:  # dense [T, E]: the slot values in their experts' columns, 0 elsewhere
            idx = problem.topk_idx[s].long()
            w_dense = torch.zeros(idx.shape[0], case["experts"], dtype=w_gp.dtype)
            t, k = (idx >= 0).nonzero(as_tuple=True)
            w_dense[t, idx[t, k]] = w_gp[t, k]
            w_gp = w_dense
        dense.assert_bitwise_equal(gp, w_gp, f"{name} rank {s}: combine_probs")
    info = groups[0].info()
    destroy_team(groups)
    return (f"{name}: EP={world} T={[x.shape[0] for x, *_ in inputs]} N={rows} "
            f"channels={info['channels']} chunk={info['staging_chunk_tokens']} "
            f"depth={info['staging_depth']} staging={info['staging_bytes'] / 2**20:.1f} MiB")


@pytest.mark.parametrize("name", list(CASES))
def test_local_team_bitwise_equals_oracle(name, seed, summary_line):
    summary_line(check_team(name, seed) + ": dispatch, counts, probs, combine, combine_probs "
                 "bitwise equal")


@pytest.mark.parametrize("name", ["ep2_bench_shape", "ep4_masked_fp16_align16_int32",
                                  "ep2_ring_wraps_chunk4_depth2",
                                  "fixed_capacity_ep4_masked_fp16", "wide_ep4_e128_top48_masked",
                                  "wide_ep8_e64_every_expert_fixed_capacity"])
def test_local_team_routing_map_dense_probs(name, seed, summary_line):
    summary_line(check_team(name, seed, from_map=True) + ": routing-map handles with dense "
                 "[T, E] probs and grads, bitwise equal")


def test_local_team_repeats_bitwise_identical(seed, summary_line):
    """The same inputs through 10 fresh handles: identical bits every time (no arrival order
    leaks into any output), with the ring wrapping many times per op."""
    case = resolve("ep2_ring_wraps_chunk4_depth2")
    problem = dense.make_problem(seed, 2, case["tokens"], case["hidden"], case["experts"],
                                 case["topk"], case["dtype"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(2, case)
    runs = []
    for i in range(10):
        def body(r, g):
            h = g.create_handle(problem.topk_idx[r].to(device))
            recv_x, recv_p = h.dispatch(problem.x[r].to(device), problem.probs[r].to(device))
            y = h.combine(recv_x)
            gp = h.combine_probs(recv_p)
            h.destroy()
            return [dense.bits(t) for t in (recv_x, recv_p, y, gp)]

        runs.append(run_ranks(groups, body))
    for i, run in enumerate(runs[1:], 1):
        for r in range(2):
            for name, a, b in zip(("recv_x", "recv_probs", "y", "combine_probs"), run[r],
                                  runs[0][r]):
                assert torch.equal(a, b), f"run {i} rank {r}: {name} differs from run 0"
    destroy_team(groups)
    summary_line("EP=2 local team, 10 runs (ring wrapped ~30 times per op): bitwise identical")


def test_local_team_autograd_matches_direct_calls(seed):
    """Through the autograd functions (dense router probs, as the Megatron dispatcher calls
    them): grad x = combine(grad recv_x), grad probs = combine_probs(grad recv_probs) in [T, E],
    grad expert_out = dispatch(grad y), on every rank."""
    case = resolve("ep4_masked_fp16_align16_int32")
    world = case["world"]
    problem = dense.make_problem(seed, world, case["tokens"], case["hidden"], case["experts"],
                                 case["topk"], case["dtype"], routing=case["routing"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(world, case)
    gen = torch.Generator().manual_seed(seed)
    dense_probs = [dense_probs_of(problem.topk_idx[r].long(), problem.probs[r], case["experts"],
                                  gen) for r in range(world)]

    def body(r, g):
        idx = problem.topk_idx[r].to(device).long()
        x = problem.x[r].to(device).requires_grad_(True)
        probs = dense_probs[r].to(device).requires_grad_(True)
        h = g.create_handle(routing_map=routing_map_of(idx, case["experts"]))
        seen = {}
        recv_x, recv_p = ep.dispatch(h, x, probs)
        recv_x.register_hook(lambda grad: seen.__setitem__("recv_x", grad))
        recv_p.register_hook(lambda grad: seen.__setitem__("recv_p", grad))
        out = recv_x * recv_p.to(recv_x.dtype)[:, None]
        out.register_hook(lambda grad: seen.__setitem__("out", grad))
        y = ep.combine(h, out)
        grad_y = dense.wide_values(torch.Generator(device=device).manual_seed(seed + r),
                                   tuple(y.shape), y.dtype)
        y.backward(grad_y)
        return (x.grad, h.combine(seen["recv_x"]), probs.grad,
                h.combine_probs(seen["recv_p"], dense=True), seen["out"], h.dispatch(grad_y)[0])

    for r, (gx, wx, gp, wp, gout, wout) in enumerate(run_ranks(groups, body)):
        dense.assert_bitwise_equal(gx, wx, f"rank {r}: grad x")
        dense.assert_bitwise_equal(gp, wp, f"rank {r}: grad probs (dense)")
        dense.assert_bitwise_equal(gout, wout, f"rank {r}: grad expert_out")
    destroy_team(groups)


def test_local_team_call_mismatch_raises_on_both_ranks(seed):
    """Rank 0 dispatches while rank 1 combines: both raise within the timeout. A rank that sees
    the mismatch raises the library's mismatch error naming both calls; a rank whose peer saw it
    first (and stopped the group) may instead raise the stop error naming that peer. At least one
    rank names the calls."""
    case = dict(resolve("ep2_no_probs_top1"), tokens=64, max_tokens=64)
    problem = dense.make_problem(seed, 2, 64, case["hidden"], case["experts"], case["topk"],
                                 case["dtype"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(2, case, timeout_s=20.0)

    def body(r, g):
        h = g.create_handle(problem.topk_idx[r].to(device))
        n = h.num_recv_tokens
        start = time.monotonic()
        try:
            if r == 0:
                h.dispatch(problem.x[r].to(device))
            else:
                h.combine(torch.zeros(n, case["hidden"], dtype=case["dtype"], device=device))
            g.check_errors()
        except ep.NcclEpError as exc:
            return str(exc), time.monotonic() - start
        return None, time.monotonic() - start

    mismatch = re.compile(r"inconsistent collective calls across ranks: rank \d called "
                          r"(dispatch \(without probs\)|combine) of handle #0 while rank \d "
                          r"called (dispatch \(without probs\)|combine) of handle #0")
    results = run_ranks(groups, body)
    saw = {r for r, (msg, _) in enumerate(results) if msg is not None and mismatch.search(msg)}
    assert saw, f"no rank named the mismatched calls: {results}"
    for r, (msg, took) in enumerate(results):
        assert msg is not None, f"rank {r} raised nothing"
        stopped_by = re.search(r"rank (\d+) stopped this group after a device-side error", msg)
        assert r in saw or (stopped_by and int(stopped_by.group(1)) in saw), msg
        assert took < 10.0, f"rank {r} took {took:.1f} s to fail"
    destroy_team(groups)


def test_local_team_rank_that_never_calls_times_out(seed):
    """Rank 1 skips a dispatch: rank 0's dispatch raises after timeout_s at the team's gate,
    naming rank 1 (not a hang); rank 1's next call raises that rank 0 stopped the group."""
    case = dict(resolve("ep2_no_probs_top1"), tokens=64, max_tokens=64)
    problem = dense.make_problem(seed, 2, 64, case["hidden"], case["experts"], case["topk"],
                                 case["dtype"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(2, case, timeout_s=2.0)
    handles = [None, None]

    def create(r, g):
        handles[r] = g.create_handle(problem.topk_idx[r].to(device))
        return handles[r].num_recv_tokens

    run_ranks(groups, create)
    start = time.monotonic()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        x0 = problem.x[0].to(device)
        with pytest.raises(ep.NcclEpError, match=r"timed out .* rank 0 waited for rank 1 .*"
                                                 r"dispatch call"):
            handles[0].dispatch(x0)
    took = time.monotonic() - start
    assert 1.5 < took < 15.0, f"timeout after {took:.1f} s, configured 2 s"
    with pytest.raises(ep.NcclEpError, match="rank 0 stopped this group"):
        groups[0].check_errors()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        with pytest.raises(ep.NcclEpError, match="rank 0 stopped this group"):
            handles[1].dispatch(problem.x[1].to(device))
    destroy_team(groups)


def test_local_team_calls_complete_around_device_wide_waits(seed):
    """The team's gate: while rank 1 already waits in its dispatch, rank 0 (Python work first)
    synchronizes the device, frees the allocator's cache (cudaFree), allocates, and launches
    kernels, then dispatches; later rank 1 does the same before its combine. Every call completes
    and the outputs equal the oracle's. Without the gate a rank's kernel would spin for its peer
    while that peer's thread waits for the whole device: a deadlock until the timeout."""
    case = dict(resolve("ep2_no_probs_top1"), tokens=64, max_tokens=64)
    problem = dense.make_problem(seed, 2, 64, case["hidden"], case["experts"], case["topk"],
                                 case["dtype"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(2, case, timeout_s=10.0)

    def wait_for_everything(rank, r):
        if rank == r:
            time.sleep(0.3)  # the peer is inside its call by now
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            scratch = torch.empty(96 << 20, dtype=torch.uint8, device=device)
            scratch.fill_(7)
            torch.cuda.synchronize(device)

    def body(r, g):
        h = g.create_handle(problem.topk_idx[r].to(device))
        x = problem.x[r].to(device)
        wait_for_everything(0, r)
        recv_x, _ = h.dispatch(x)
        wait_for_everything(1, r)
        y = h.combine(recv_x)
        return recv_x, y

    got = run_ranks(groups, body)
    want = [dense.dispatch(problem, d)[0] for d in range(2)]
    for r in range(2):
        dense.assert_bitwise_equal(got[r][0], want[r], f"rank {r}: recv_x")
        dense.assert_bitwise_equal(got[r][1], dense.combine(problem, want, r), f"rank {r}: y")
    destroy_team(groups)


def test_local_team_backward_on_autograd_worker_thread_is_refused(seed):
    """A local team's backward on autograd's shared worker thread (multithreaded backward on):
    every rank raises at once, naming the fix, instead of its calls waiting at the gate for
    calls that thread never makes."""
    case = dict(resolve("ep2_no_probs_top1"), tokens=64, max_tokens=64)
    problem = dense.make_problem(seed, 2, 64, case["hidden"], case["experts"], case["topk"],
                                 case["dtype"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(2, case)

    def body(r, g):
        x = problem.x[r].to(device).requires_grad_(True)
        h = g.create_handle(problem.topk_idx[r].to(device))
        recv_x, _ = ep.dispatch(h, x)
        y = ep.combine(h, recv_x * 2)
        start = time.monotonic()
        with torch.autograd.set_multithreading_enabled(True):
            with pytest.raises(RuntimeError, match=r"set_multithreading_enabled\(False\)"):
                y.sum().backward()
        return time.monotonic() - start

    for r, took in enumerate(run_ranks(groups, body)):
        assert took < 5.0, f"rank {r} took {took:.1f} s to refuse"
    destroy_team(groups)


def test_run_local_team_names_the_failing_rank():
    """A rank's exception comes back naming that rank, also when the others were waiting for it
    (its prepare failed before the ranks met), and the results of a clean run come by rank."""
    case = dict(resolve("ep2_no_probs_top1"), tokens=64, max_tokens=64)
    groups = make_team(2, case)

    def fail_on_1(rank, group):
        if rank == 1:
            raise ValueError("rank 1's own error")
        return rank

    with pytest.raises(RuntimeError, match=r"local team rank 1: ValueError: rank 1's own error"):
        ep.run_local_team(groups, fail_on_1)

    def prepare_fails_on_0(rank, group):
        if rank == 0:
            raise KeyError("no memory for rank 0")

    with pytest.raises(RuntimeError, match=r"local team rank 0: KeyError"):
        ep.run_local_team(groups, lambda rank, group: rank, prepare=prepare_fails_on_0)
    assert ep.run_local_team(groups, lambda rank, group: (rank, group.rank)) == [(0, 0), (1, 1)]
    destroy_team(groups)


def test_local_team_handles_destroyed_from_another_thread(seed):
    """A thread destroys handles (as a garbage collector would) while the ranks keep creating
    handles and running ops on the same groups: no crash, results stay right."""
    case = dict(resolve("ep2_no_probs_top1"), tokens=256, max_tokens=256)
    problem = dense.make_problem(seed, 2, 256, case["hidden"], case["experts"], case["topk"],
                                 case["dtype"])
    device = torch.device("cuda", torch.cuda.current_device())
    groups = make_team(2, case)
    graveyard, lock, stop = [], threading.Lock(), threading.Event()

    def reaper():
        while not stop.is_set() or graveyard:
            with lock:
                doomed = graveyard[:]
                graveyard.clear()
            for h in doomed:
                h.destroy()
            time.sleep(0.0005)

    reaper_thread = threading.Thread(target=reaper, daemon=True)
    reaper_thread.start()
    want = [dense.dispatch(problem, d)[0] for d in range(2)]

    def body(r, g):
        for _ in range(200):
            h = g.create_handle(problem.topk_idx[r].to(device))
            recv_x, _ = h.dispatch(problem.x[r].to(device))
            torch.cuda.current_stream().synchronize()
            with lock:
                graveyard.append(h)
            # At most a few live handles per rank: the group's preallocated slots (a new slot is
            # a device allocation, which must not happen while a peer waits in a kernel).
            while len(graveyard) > 2 and reaper_thread.is_alive():
                time.sleep(0.0002)
        return recv_x

    got = run_ranks(groups, body)
    stop.set()
    reaper_thread.join(30)
    for d in range(2):
        dense.assert_bitwise_equal(got[d], want[d], f"rank {d}: recv_x after 200 cycles")
    destroy_team(groups)


def test_local_team_staging_independent_of_max_tokens():
    """The ring is sized by channels x depth x chunk, not by max_tokens_per_rank."""
    sizes = {}
    for max_tokens in (1024, 16384):
        groups = ep.Group.local_team(2, num_experts=256, hidden=7168,
                                     max_tokens_per_rank=max_tokens, max_topk=8, num_sms=24)
        sizes[max_tokens] = groups[0].info()
        destroy_team(groups)
    assert sizes[1024]["staging_bytes"] == sizes[16384]["staging_bytes"] > 0, sizes
    assert sizes[1024]["routing_bytes"] < sizes[16384]["routing_bytes"], sizes
