"""LL over NVLink (docs/design.md §9): one process per GPU, the library's own NCCL communicator and
symmetric windows (not a local team), each rank's outputs BITWISE against the one-process oracle
(tests/ll_oracle.py), which every rank computes from the same seed. The cases of
tests/gpu/test_cuda_ll.py at EP 2, 4 and 8, the decode shape, the two-micro-batch ``send_only``
order and CUDA-graph replay with new routing. Runs where the machine has that many GPUs (the
multi-GPU run); skips otherwise, naming why."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

import dist
import ll_cases
import ll_oracle
import megatron_nccl_ep as ep
from gpu_common import cuda_devices, gpu_count, poison_allocator, requires_gpus, this_device
from test_cuda_ll import CASES, LAYOUTS, expert_fn, to_cpu

pytestmark = requires_gpus

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def nvlink_world_sizes():
    return [pytest.param(n, marks=pytest.mark.skipif(
        gpu_count() < n, reason=f"LL over NVLink at EP={n} needs {cuda_devices(n)}, found "
                                f"{gpu_count()}")) for n in (2, 4, 8)]


def group_of(problem, layout: str, payload):
    return ep.Group(backend="cuda", num_sms=24, timeout_s=30.0,
                    **problem.group_fields(layout, payload))


def oracle(problem, config, layout: str, seed: int, expert=None):
    """Every rank's dispatch outputs, this step's expert outputs, combine weights and y."""
    world = problem.world_size
    want = ll_oracle.ll_dispatch_all(config, world, problem.topk_idx, problem.x,
                                     problem.weights)
    if expert is None:
        expert_out = ll_cases.expert_outputs(problem, layout, [w.count for w in want], seed)
    else:
        expert_out = [expert(o) for o in want]
    cw = ll_cases.fresh_weights(problem, seed + 1) if layout == "expert_major" else None
    return want, expert_out, cw, ll_oracle.ll_combine_all(config, world, problem.topk_idx,
                                                          expert_out, cw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def check_case(case: dict, layout: str, payload, seed: int) -> str:
    rank, world, dev = tdist.get_rank(), tdist.get_world_size(), this_device()
    problem = ll_cases.make_ll_problem(world, seed=seed, **case)
    g = group_of(problem, layout, payload)
    try:
        for rerun in range(2):  # fresh inputs on reused memory: stale rows would show
            problem = ll_cases.make_ll_problem(world, seed=seed + 17 * rerun, **case)
            want, expert_out, cw, want_y = oracle(problem, g.config, layout, seed + rerun)
            poison_allocator(dev)
            w = problem.weights[rank]
            h = g.create_handle(problem.topk_idx[rank].to(dev))
            out = h.dispatch(problem.x[rank].to(dev), None if w is None else w.to(dev))
            y = h.combine(expert_out[rank].to(dev), None if cw is None else cw[rank].to(dev))
            torch.cuda.synchronize(dev)
            g.check_errors()
            bad = ll_cases.dispatch_mismatches(to_cpu(out), want[rank], layout)
            assert not bad, f"rank {rank}: dispatch differs from the oracle in {bad}"
            assert same_bits(y, want_y[rank]), f"rank {rank}: combine differs from the oracle"
            h.destroy()
    finally:
        g.destroy()
    return "ok"


@pytest.mark.parametrize("world", nvlink_world_sizes())
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("payload", [None, FP8], ids=["tokens", "fp8"])
def test_ll_nvlink_bitwise_equals_oracle(world, case, layout, payload, seed):
    args = dict(CASES[case])
    if payload is not None and args["hidden"] % 128:
        args["hidden"] = 128 * -(-args["hidden"] // 128)
    assert dist.run(world, check_case, args, layout, payload, seed,
                    backend="nccl") == ["ok"] * world


@pytest.mark.parametrize("world", nvlink_world_sizes())
@pytest.mark.parametrize("layout,payload", [("expert_major", FP8), ("rank_major", None)])
def test_ll_nvlink_decode_shape(world, layout, payload, seed):
    """128 tokens a rank, hidden 7168, top-8 of 256 (the bench's decode shape)."""
    args = dict(tokens=128, hidden=7168, num_experts=256, topk=8, dtype=BF16)
    assert dist.run(world, check_case, args, layout, payload, seed,
                    backend="nccl") == ["ok"] * world


def check_staged_and_graph(layout: str, payload, seed: int) -> str:
    """The two-micro-batch send_only order, then one graph of handle + dispatch + experts +
    combine replayed on new routing; every result against the oracle."""
    rank, world, dev = tdist.get_rank(), tdist.get_world_size(), this_device()
    args = dict(tokens=(9, 14, 5, 11), hidden=512, num_experts=32, topk=4, dtype=BF16)
    em = layout == "expert_major"
    mbs = [ll_cases.make_ll_problem(world, seed=seed + i, **args) for i in range(4)]
    g = group_of(mbs[0], layout, payload)
    expert = lambda o: expert_fn(o, layout, BF16)  # noqa: E731
    try:
        refs = [oracle(p, g.config, layout, seed + i, expert) for i, p in enumerate(mbs)]
        hs = [g.create_handle(p.topk_idx[rank].to(dev)) for p in mbs[:2]]
        outs = [hs[i].dispatch(mbs[i].x[rank].to(dev), mbs[i].weights[rank].to(dev),
                               send_only=True) for i in range(2)]
        ys = []
        for i in range(2):
            hs[i].complete()
            cw = refs[i][2]
            ys.append(hs[i].combine(expert(outs[i]), cw[rank].to(dev) if em else None,
                                    send_only=True))
        for h in hs:
            h.complete()
        torch.cuda.synchronize(dev)
        g.check_errors()
        for i in range(2):
            assert not ll_cases.dispatch_mismatches(to_cpu(outs[i]), refs[i][0][rank], layout)
            assert same_bits(ys[i], refs[i][3][rank]), (rank, i)

        p0, cw0 = mbs[2], refs[2][2]
        idx, x = p0.topk_idx[rank].to(dev), p0.x[rank].to(dev)
        w, cw = p0.weights[rank].to(dev), (cw0[rank].to(dev) if em else None)
        h0 = g.create_handle(idx)  # one eager step before the capture
        h0.combine(expert(h0.dispatch(x, w)), cw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h = g.create_handle(idx)
            out = h.dispatch(x, w)
            y = h.combine(expert(out), cw)
        for i in (2, 3):
            p = mbs[i]
            idx.copy_(p.topk_idx[rank])
            x.copy_(p.x[rank])
            w.copy_(p.weights[rank])
            if em:
                cw.copy_(refs[i][2][rank])
            graph.replay()
            torch.cuda.synchronize(dev)
            assert not ll_cases.dispatch_mismatches(to_cpu(out), refs[i][0][rank], layout), i
            assert same_bits(y, refs[i][3][rank]), (rank, i)
        g.check_errors()
    finally:
        g.destroy()
    return "ok"


@pytest.mark.parametrize("world", nvlink_world_sizes())
@pytest.mark.parametrize("layout,payload", [("expert_major", None), ("rank_major", FP8)])
def test_ll_nvlink_send_only_and_graph_replay(world, layout, payload, seed):
    assert dist.run(world, check_staged_and_graph, layout, payload, seed,
                    backend="nccl") == ["ok"] * world
