"""LL mode (docs/design.md §9) on the GPU: the cuda backend against the reference's one-process
oracle (tests/ll_oracle.py, itself checked against an independent dense computation
by tests/test_ll_reference.py), BITWISE, at EP=1 and as local teams of 2, 4 and 8 ranks on one
GPU (every rank in this process, its windows plain device memory: the device code paths of a
multi-rank group, not NVLink); CUDA-graph replay with changing routing; the two-micro-batch
``send_only`` / ``complete()`` order; the double-buffering rule; errors on every rank.

Outputs come from a NaN-poisoned caching allocator (the rows the kernels must write would show
NaN otherwise) and every case runs twice with fresh inputs (stale rows of the first run would
show in the second); expert outputs hold NaN past the counts, which the combine must not read.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

import ll_cases
import ll_oracle
import megatron_nccl_ep as ep
from megatron_nccl_ep.config import LL_PAYLOADS
from megatron_nccl_ep.outputs import LLDispatchOutput
from test_cuda_local_team import run_ranks

from gpu_common import requires_gpus

pytestmark = requires_gpus

BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn
LAYOUTS = ("expert_major", "rank_major")

# name -> make_ll_problem arguments (tokens / topk cycled over the ranks).
CASES = {
    "uneven_bf16": dict(tokens=(7, 3, 11, 5), hidden=256, num_experts=16, topk=4, dtype=BF16),
    "zero_token_rank_fp16": dict(tokens=(0, 9, 4), hidden=384, num_experts=16, topk=3,
                                 dtype=FP16),
    "all_to_one_expert_fp32": dict(tokens=12, hidden=128, num_experts=8, topk=2, dtype=FP32,
                                   routing="one_expert"),
    "masked_k_below_max_bf16": dict(tokens=(10, 6), hidden=640, num_experts=32, topk=(3, 5),
                                    dtype=BF16, routing="masked", max_topk=6,
                                    idx_dtype=torch.int32),
    "t_equals_t_max_bf16": dict(tokens=16, hidden=1024, num_experts=64, topk=8, dtype=BF16,
                                max_tokens=16),
}


def team(world: int, problem: ll_cases.LLProblem, layout: str, payload, **extra):
    fields = dict(problem.group_fields(layout, payload), num_sms=16, timeout_s=20.0)
    fields.update(extra)
    return ep.Group.local_team(world, **fields)


def destroy(groups) -> None:
    for g in groups:
        g.destroy()


def expected(problem, layout: str, groups, seed: int):
    """The oracle's dispatch outputs, expert outputs for them, combine weights and y, by rank."""
    config, world = groups[0].config, problem.world_size
    want = ll_oracle.ll_dispatch_all(config, world, problem.topk_idx, problem.x,
                                     problem.weights)
    expert_out = ll_cases.expert_outputs(problem, layout, [w.count for w in want], seed)
    cw = ll_cases.fresh_weights(problem, seed + 1) if layout == "expert_major" else None
    want_y = ll_oracle.ll_combine_all(config, world, problem.topk_idx, expert_out, cw)
    return want, expert_out, cw, want_y


def to_cpu(out):
    return LLDispatchOutput(**{k: None if v is None else v.cpu() for k, v in vars(out).items()})


def cloned(out):
    return LLDispatchOutput(**{k: None if v is None else v.clone() for k, v in vars(out).items()})


def staged(tensors, device):
    """Host tensors (None kept) on the GPU, copied once from the main thread before the ranks
    meet."""
    out = [None if t is None else t.to(device) for t in tensors]
    torch.cuda.synchronize(device)
    return out


def check_against_oracle(problem, layout, groups, seed, results, want, want_y) -> None:
    for r, (got, y) in enumerate(results):
        bad = ll_cases.dispatch_mismatches(got, want[r], layout)
        assert not bad, f"rank {r}: dispatch differs from the oracle in {bad}"
        assert torch.equal(y.view(torch.uint8), want_y[r].view(torch.uint8)), \
            f"rank {r}: combine differs from the oracle"


def run_eager(groups, problem, layout, expert_out, cw):
    dev = groups[0].device
    idx, x, w = (staged(v, dev) for v in (problem.topk_idx, problem.x, problem.weights))
    eo, cwd = staged(expert_out, dev), staged(cw or [None] * len(groups), dev)

    def body(r, g):
        h = g.create_handle(idx[r])
        out = h.dispatch(x[r], w[r])
        y = h.combine(eo[r], cwd[r])
        g.check_errors()
        h.destroy()
        return out, y

    return [(to_cpu(out), y.cpu()) for out, y in run_ranks(groups, body)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("payload", [None, FP8], ids=["tokens", "fp8"])
def test_ll_bitwise_equals_oracle(world, case, layout, payload, seed):
    args = dict(CASES[case])
    if payload is not None and args["hidden"] % 128:
        args["hidden"] = 128 * -(-args["hidden"] // 128)
    problem = ll_cases.make_ll_problem(world, seed=seed, **args)
    groups = team(world, problem, layout, payload)
    try:
        for rerun in range(2):  # fresh inputs on reused memory: stale rows would show
            problem = ll_cases.make_ll_problem(world, seed=seed + 17 * rerun, **args)
            want, expert_out, cw, want_y = expected(problem, layout, groups, seed + rerun)
            results = run_eager(groups, problem, layout, expert_out, cw)
            check_against_oracle(problem, layout, groups, seed, results, want, want_y)
    finally:
        destroy(groups)


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("case", ["uneven_bf16", "zero_token_rank_fp16", "t_equals_t_max_bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("send_only", [False, True])
def test_ll_combine_of_fp32_rows_equals_the_rounded_rows(world, case, layout, send_only, seed):
    """fp32 expert rows into a 16-bit group: rounded as read (nearest even, ties among them),
    bitwise the oracle's combine of the rows rounded first; with ``send_only`` the own rows go
    through the window too."""
    problem = ll_cases.make_ll_problem(world, seed=seed, **CASES[case])
    groups = team(world, problem, layout, None)
    try:
        want, expert_out, cw, _ = expected(problem, layout, groups, seed)
        wide = ll_cases.widened_outputs(expert_out, seed + 3)
        dtype = problem.x[0].dtype
        want_y = ll_oracle.ll_combine_all(groups[0].config, world, problem.topk_idx,
                                          [w.to(dtype) for w in wide], cw)
        dev = groups[0].device
        idx, x, w = (staged(v, dev) for v in (problem.topk_idx, problem.x, problem.weights))
        eo, cwd = staged(wide, dev), staged(cw or [None] * world, dev)

        def body(r, g):
            h = g.create_handle(idx[r])
            h.dispatch(x[r], w[r])
            y = h.combine(eo[r], cwd[r], send_only=send_only)
            if send_only:
                h.complete()
            g.check_errors()
            h.destroy()
            return y

        for r, y in enumerate(run_ranks(groups, body)):
            assert y.dtype == dtype
            assert torch.equal(y.cpu().view(torch.uint8), want_y[r].view(torch.uint8)), \
                f"rank {r}: combine of fp32 rows differs from the oracle's of the rounded rows"
    finally:
        destroy(groups)


@pytest.mark.parametrize("world,layout,payload", [(1, "expert_major", None),
                                                  (1, "rank_major", FP8),
                                                  (8, "rank_major", None),
                                                  (8, "expert_major", FP8)])
def test_ll_bench_shape_bitwise(world, layout, payload, seed):
    """The decode shape of the bench (hidden 7168, top-8 of 256), 128 tokens a rank at EP=1 and
    32 a rank at EP=8 (the oracle's expert-major outputs are L x R*T_max rows on the host)."""
    tokens = 128 if world == 1 else 32
    problem = ll_cases.make_ll_problem(world, tokens=tokens, hidden=7168, num_experts=256,
                                       topk=8, dtype=BF16, seed=seed)
    groups = team(world, problem, layout, payload)
    try:
        want, expert_out, cw, want_y = expected(problem, layout, groups, seed)
        results = run_eager(groups, problem, layout, expert_out, cw)
        check_against_oracle(problem, layout, groups, seed, results, want, want_y)
    finally:
        destroy(groups)


# -- CUDA graphs --------------------------------------------------------------------------------
def expert_fn(out, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for the experts, the same elementwise arithmetic on both sides: the received
    rows (dequantized with their scales under a payload dtype that has them: FP8) times 2."""
    x = out.x
    if out.scales is not None:
        x = LL_PAYLOADS[x.dtype].dequant(x, out.scales).to(dtype)
    return x * 2


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout,payload", [("expert_major", None), ("rank_major", None),
                                            ("expert_major", FP8)])
def test_ll_graph_replay_with_new_routing_equals_eager(world, layout, payload, seed):
    """Handle creation, dispatch, the experts and combine captured once per rank, replayed with
    new routing, tokens and weights copied into the captured inputs: every replay bitwise equal
    to the oracle and to eager calls on the same inputs. A replay has no gate (nccl_ep.h,
    ncclEpCreateLocalTeam): the ranks' threads meet before and after their replays."""
    args = dict(tokens=24, hidden=512, num_experts=16, topk=4, dtype=BF16)
    rounds = [ll_cases.make_ll_problem(world, seed=seed + i, **args) for i in range(3)]
    groups = team(world, rounds[0], layout, payload)
    cws = [ll_cases.fresh_weights(p, seed + 7 + i) for i, p in enumerate(rounds)]

    dev = groups[0].device
    inputs = [[staged(v, dev) for v in (p.topk_idx, p.x, p.weights, cws[i])]
              for i, p in enumerate(rounds)]
    static = [[t.clone() for t in (v[r] for v in inputs[0])] for r in range(world)]
    torch.cuda.synchronize(dev)
    meet = threading.Barrier(world)

    def body(r, g):
        idx, x, w, cw = static[r]
        em = layout == "expert_major"
        # One eager step first (outside the capture), then the capture.
        h0 = g.create_handle(idx)
        h0.combine(expert_fn(h0.dispatch(x, w), layout, BF16), cw if em else None)
        # The ranks capture at once, each its own calls (thread-local mode), and none waits
        # for the whole device while a peer captures: torch.cuda.graph's entry synchronizes the
        # device and empties the allocator's cache, a wait that a peer's capture can hold up.
        graph = torch.cuda.CUDAGraph()
        meet.wait(timeout=60)
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            h = g.create_handle(idx)
            out = h.dispatch(x, w)
            y = h.combine(expert_fn(out, layout, BF16), cw if em else None)
        finally:
            graph.capture_end()
        replayed, eager = [], []
        for i in range(len(rounds)):
            ri, rx, rw, rcw = (v[r] for v in inputs[i])
            for dst, src in zip((idx, x, w, cw), (ri, rx, rw, rcw)):
                dst.copy_(src)
            meet.wait(timeout=60)
            graph.replay()
            meet.wait(timeout=60)
            replayed.append((cloned(out), y.clone()))
            he = g.create_handle(ri)
            oe = he.dispatch(rx, rw)
            ye = he.combine(expert_fn(oe, layout, BF16), rcw if em else None)
            eager.append((oe, ye))
            he.destroy()  # its slot back to the pool (reused in stream order)
        g.check_errors()
        return replayed, eager

    try:
        results = [[[(to_cpu(o), y.cpu()) for o, y in part] for part in rank]
                   for rank in run_ranks(groups, body)]
        config = groups[0].config
        for i, p in enumerate(rounds):
            want = ll_oracle.ll_dispatch_all(config, world, p.topk_idx, p.x, p.weights)
            eo = [expert_fn(o, layout, BF16) for o in want]
            want_y = ll_oracle.ll_combine_all(config, world, p.topk_idx, eo,
                                              cws[i] if layout == "expert_major" else None)
            for r in range(world):
                (got, y), (got_e, y_e) = results[r][0][i], results[r][1][i]
                assert not ll_cases.dispatch_mismatches(got, want[r], layout), (i, r)
                assert not ll_cases.dispatch_mismatches(got, got_e, layout), (i, r)
                assert torch.equal(y.view(torch.uint8), want_y[r].view(torch.uint8)), (i, r)
                assert torch.equal(y.view(torch.uint8), y_e.view(torch.uint8)), (i, r)
    finally:
        destroy(groups)


# -- staging ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout,payload", [("expert_major", None), ("rank_major", FP8)])
def test_ll_two_micro_batches_send_only(world, layout, payload, seed):
    """The seed's decode order: dispatch mb0 and mb1 send-only, complete mb0, its experts, combine
    mb0 send-only, complete mb1, ..., complete both combines; bitwise equal to the oracle. A
    third dispatch while two are in flight is refused on every rank, before anything runs."""
    args = dict(tokens=(9, 14), hidden=256, num_experts=16, topk=3, dtype=BF16)
    mbs = [ll_cases.make_ll_problem(world, seed=seed + i, **args) for i in range(3)]
    groups = team(world, mbs[0], layout, payload)
    em = layout == "expert_major"
    cws = [ll_cases.fresh_weights(p, seed + 5 + i) for i, p in enumerate(mbs)]

    dev = groups[0].device
    inputs = [[staged(v, dev) for v in (p.topk_idx, p.x, p.weights, cws[i])]
              for i, p in enumerate(mbs)]

    def body(r, g):
        (i0, x0, w0, c0), (i1, x1, w1, c1), (i2, x2, w2, _) = ([v[r] for v in mb] for mb in inputs)
        hs = [g.create_handle(i) for i in (i0, i1, i2)]
        outs = [hs[0].dispatch(x0, w0, send_only=True), hs[1].dispatch(x1, w1, send_only=True)]
        with pytest.raises(RuntimeError, match="2 dispatches are already in flight"):
            hs[2].dispatch(x2, w2, send_only=True)
        ys = []
        for i, cw in enumerate((c0, c1)):
            hs[i].complete()
            # A fresh temporary: the send keeps what the receive needs of it.
            ys.append(hs[i].combine(expert_fn(outs[i], layout, BF16),
                                    cw.clone() if em else None, send_only=True))
        for i in range(2):
            hs[i].complete()
        g.check_errors()
        return list(zip(outs, ys))

    try:
        results = [[(to_cpu(o), y.cpu()) for o, y in rank] for rank in run_ranks(groups, body)]
        config = groups[0].config
        for i in range(2):
            p = mbs[i]
            want = ll_oracle.ll_dispatch_all(config, world, p.topk_idx, p.x, p.weights)
            eo = [expert_fn(o, layout, BF16) for o in want]
            want_y = ll_oracle.ll_combine_all(config, world, p.topk_idx, eo,
                                              cws[i] if em else None)
            for r in range(world):
                got, y = results[r][i]
                assert not ll_cases.dispatch_mismatches(got, want[r], layout), (i, r)
                assert torch.equal(y.view(torch.uint8), want_y[r].view(torch.uint8)), (i, r)
    finally:
        destroy(groups)


def test_ll_library_refuses_a_third_op_in_flight(seed):
    """The C library's own rule (the Python front end refuses first): the backend called
    directly, a third send-only dispatch, and a dispatch two ops behind a pending one, are
    ncclInvalidUsage with the reason."""
    problem = ll_cases.make_ll_problem(1, tokens=4, hidden=128, num_experts=4, topk=2,
                                       dtype=BF16, seed=seed)
    (g,) = team(1, problem, "expert_major", None)
    try:
        dev, backend = g.device, g._backend
        states = [backend.ll_create_handle(problem.topk_idx[0].to(dev)) for _ in range(3)]
        x = problem.x[0].to(dev)
        for s in states[:2]:
            backend.ll_dispatch(s, x, None, True)
        with pytest.raises(ValueError, match="already in flight"):
            backend.ll_dispatch(states[2], x, None, True)
        with pytest.raises(ValueError, match="send_only and not completed"):
            backend.ll_dispatch(states[0], x, None, False)
        for s in states[:2]:
            backend.ll_complete(s)
        with pytest.raises(ValueError, match="no dispatch or combine sent with send_only"):
            backend.ll_complete(states[0])
        backend.ll_dispatch(states[2], x, None, False)
        # After a fused op, the next one would write the pending op's buffer set.
        backend.ll_dispatch(states[0], x, None, True)
        backend.ll_dispatch(states[1], x, None, False)
        with pytest.raises(ValueError, match="2 dispatches before this one is not completed"):
            backend.ll_dispatch(states[2], x, None, False)
        backend.ll_complete(states[0])
        backend.ll_dispatch(states[2], x, None, False)
        g.check_errors()
    finally:
        g.destroy()


# -- errors on every rank -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["out_of_range", "repeated"])
def test_ll_routing_value_error_on_every_rank(kind, seed):
    """A bad id on rank 1 is found by its handle's kernel; the group stops and every rank raises
    at check_errors: rank 1 the routing error, the others naming rank 1. Nothing hangs."""
    world = 4
    problem = ll_cases.make_ll_problem(world, tokens=6, hidden=128, num_experts=8, topk=2,
                                       dtype=BF16, seed=seed)
    idx = problem.topk_idx[1].clone()
    idx[3, 1] = 8 if kind == "out_of_range" else idx[3, 0]
    problem.topk_idx[1] = idx
    groups = team(world, problem, "rank_major", None, timeout_s=10.0)
    idx, x = staged(problem.topk_idx, groups[0].device), staged(problem.x, groups[0].device)

    def body(r, g):
        # The error comes at the first call after the handle's kernel found it, or at the check.
        try:
            h = g.create_handle(idx[r])
            h.dispatch(x[r])
            g.check_errors()
        except (ValueError, ep.NcclEpError) as exc:
            return str(exc)
        return None

    try:
        messages = run_ranks(groups, body)
    finally:
        destroy(groups)
    want = "out of range" if kind == "out_of_range" else "twice"
    assert messages[1] is not None and want in messages[1], messages
    for r in (0, 2, 3):
        assert messages[r] is not None and re.search(r"rank 1 stopped this group", messages[r]), \
            (r, messages)


def test_ll_rank_that_never_calls_times_out_naming_it(seed):
    world = 2
    problem = ll_cases.make_ll_problem(world, tokens=5, hidden=128, num_experts=4, topk=2,
                                       dtype=BF16, seed=seed)
    groups = team(world, problem, "expert_major", None, timeout_s=2.0)
    idx, x = staged(problem.topk_idx, groups[0].device), staged(problem.x, groups[0].device)

    def body(r, g):
        h = g.create_handle(idx[r])
        if r == 1:
            return None
        with pytest.raises(ep.NcclEpError, match=r"rank 0 waited for rank 1 .*LL dispatch"):
            h.dispatch(x[r])
        return None

    try:
        run_ranks(groups, body)
    finally:
        destroy(groups)
