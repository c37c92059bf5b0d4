"""HT mode inside CUDA graphs (capacity mode and the fixed layout): handle creation, dispatch,
combine and combine_probs captured once per rank, replayed with new routing and inputs copied
into the captured tensors. Every replay's outputs are compared bitwise with eager calls on the
same inputs (themselves checked against the oracle by the parity suites), the outputs
NaN-poisoned before each replay. A graph holds three handles (an odd number: consecutive replays
must alternate the routing records' halves on the device), its handles are destroyed right after
the capture and eager handles made between replays (their slots must not be the graph's), and
at EP 2 the ranks are a local team that captures at once. A graph of an eager handle's ops, or
of its device-side getters, keeps reading that handle after it is destroyed. Exact mode is
refused inside a capture.

The Megatron layer: a MoE layer in capacity mode captured forward and backward, replayed; a
replay whose routing overflows the static budget raises at check_budgets(), naming the layer and
the rows needed; with a larger capacity factor the next captured step runs, bitwise equal to its
eager step."""

from __future__ import annotations

import threading

import pytest
import torch

import megatron_nccl_ep as ep
from gpu_common import requires_gpus

pytestmark = requires_gpus

BF16 = torch.bfloat16
TOKENS, HIDDEN, EXPERTS, TOPK, HANDLES = 96, 256, 16, 4, 3


def routing(gen: torch.Generator, device) -> torch.Tensor:
    """Random top-k ids with no duplicate expert per token, some slots masked (-1)."""
    idx = torch.rand(TOKENS, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK]
    idx[torch.rand(TOKENS, TOPK, generator=gen) < 0.1] = -1
    return idx.to(device)


def inputs(seed: int, rank: int, device) -> list:
    """One step's inputs of every handle: (topk_idx, x, probs, combine gradient)."""
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    return [(routing(gen, device),
             torch.randn(TOKENS, HIDDEN, generator=gen).to(device, BF16),
             torch.rand(TOKENS, TOPK, generator=gen).to(device),
             torch.rand(TOKENS, HIDDEN, generator=gen).to(device, BF16))
            for _ in range(HANDLES)]


def step(group, handle_inputs, keep: list) -> list:
    """HANDLES handles, each: dispatch (with probs), experts (x 3), combine, and the backward's
    combine_probs. Returns the outputs; ``keep`` receives the handles."""
    outputs = []
    for idx, x, probs, _ in handle_inputs:
        h = group.create_handle(idx)
        keep.append(h)
        recv_x, recv_probs = h.dispatch(x, probs)
        y = h.combine(recv_x * 3)
        grad_probs = h.combine_probs(recv_probs * 2)
        outputs.append((recv_x, recv_probs, y, grad_probs))
    return outputs


def run_team(groups, body) -> list:
    """``body(rank, group)`` on every rank of a local team (``ep.run_local_team``); the team
    destroyed afterwards, whatever happened."""
    try:
        return ep.run_local_team(groups, body)
    finally:
        for g in groups:
            g.destroy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("layout", ["capacity", "fixed"])
def test_ht_graph_replays_equal_eager_calls(world, layout, seed):
    extra = (dict(recv_mode="capacity", capacity_factor=2.0) if layout == "capacity"
             else dict(recv_mode="capacity", expert_capacity=TOKENS))
    kwargs = dict(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS, max_topk=TOPK,
                  dtype=BF16, num_sms=8, timeout_s=20.0, **extra)
    groups = ep.Group.local_team(world, **kwargs)
    meet = threading.Barrier(world)
    rounds = 4

    def body(rank, group):
        device = group.device
        static = inputs(seed, rank, device)
        captured: list = []
        step(group, static, [])  # an eager step first: lazy loads, the pool's slots
        graph = torch.cuda.CUDAGraph()
        meet.wait(timeout=60)
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            outputs = step(group, static, captured)
        finally:
            graph.capture_end()
        for h in captured:  # the graph keeps their slots
            h.destroy()
        mismatches = []
        for i in range(rounds):
            fresh = inputs(seed + 1 + i, rank, device)
            for dst, src in zip(static, fresh):
                for d, s in zip(dst, src):
                    d.copy_(s)
            for out in outputs:
                for t in out:
                    t.fill_(float("nan"))
            meet.wait(timeout=60)
            graph.replay()
            meet.wait(timeout=60)
            replayed = [[t.clone() for t in out] for out in outputs]
            kept: list = []
            eager = step(group, fresh, kept)  # new handles, maybe in freed slots
            for h in kept:
                h.destroy()
            for j, (got, want) in enumerate(zip(replayed, eager)):
                for name, a, b in zip(("recv_x", "recv_probs", "y", "grad_probs"), got, want):
                    if not same_bits(a, b):
                        mismatches.append(f"round {i} handle {j} {name}")
        group.check_errors()
        del graph
        return mismatches

    results = run_team(groups, body)
    assert results == [[]] * world, results


def test_exact_mode_handle_is_refused_inside_a_capture():
    [group] = ep.Group.local_team(1, num_experts=EXPERTS, hidden=HIDDEN,
                                  max_tokens_per_rank=TOKENS, max_topk=TOPK, dtype=BF16)

    def body(rank, group):
        idx = routing(torch.Generator().manual_seed(0), group.device)
        x = torch.zeros(TOKENS, HIDDEN, dtype=BF16, device=group.device)
        group.create_handle(idx).dispatch(x)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match="exact-mode group cannot be created inside a "
                                             "CUDA graph capture.*use capacity mode"):
            with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
                group.create_handle(idx)
        group.create_handle(idx).dispatch(x)  # eager calls go on
        group.check_errors()

    try:
        ep.run_local_team([group], body)
    finally:
        group.destroy()


def replays_after_destroy(seed: int, reference, captured) -> list:
    """On one rank, capacity mode: ``reference(group, handle, idx, x, probs)`` -> ``{name:
    bits}`` from eager calls; then ``captured(handle, x, probs)`` -> ``{name: output}`` inside a
    graph, the handle destroyed and three handles of other routings made and dispatched (which
    would take its slot back); two replays, outputs poisoned before each. Returns the names that
    differ."""
    [group] = ep.Group.local_team(1, num_experts=EXPERTS, hidden=HIDDEN,
                                  max_tokens_per_rank=TOKENS, max_topk=TOPK, dtype=BF16,
                                  recv_mode="capacity", capacity_factor=2.0)

    def body(rank, group):
        (idx, x, probs, _), = inputs(seed, rank, group.device)[:1]
        handle = group.create_handle(idx)
        want = reference(group, handle, idx, x, probs)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            got = captured(handle, x, probs)
        finally:
            graph.capture_end()
        handle.destroy()
        others = [group.create_handle(routing(torch.Generator().manual_seed(seed + i),
                                              group.device)) for i in range(3)]
        for other in others:
            other.dispatch(x, probs)
        mismatches = []
        for _ in range(2):
            for t in got.values():
                t.fill_(float("nan") if t.is_floating_point() else -7)
            graph.replay()
            mismatches += [name for name, t in got.items() if not same_bits(t, want[name])]
        group.check_errors()
        return mismatches

    try:
        return ep.run_local_team([group], body)[0]
    finally:
        group.destroy()


def test_graph_of_ops_keeps_an_eager_handle_after_destroy(seed):
    """A handle made eagerly, its dispatch and combine captured, the handle destroyed and new
    handles made: replays still read its routing, bitwise the eager calls' outputs."""
    def eager(group, handle, idx, x, probs):
        recv_x, recv_probs = (t.clone() for t in handle.dispatch(x, probs))
        return {"recv_x": recv_x, "recv_probs": recv_probs,
                "y": handle.combine(recv_x * 3).clone()}

    def captured(handle, x, probs):
        recv_x, recv_probs = handle.dispatch(x, probs)
        return {"recv_x": recv_x, "recv_probs": recv_probs, "y": handle.combine(recv_x * 3)}

    assert replays_after_destroy(seed, eager, captured) == []


def test_graph_of_getters_keeps_an_eager_handle_after_destroy(seed):
    """A handle's device-side getters (tokens_per_expert on the device, topk_idx) captured, the
    handle destroyed and new handles made: replays still read its counts and ids, bitwise those
    of an eager handle of the same routing."""
    def eager(group, handle, idx, x, probs):
        reference = group.create_handle(idx)
        want = {"tokens_per_expert": reference.tokens_per_expert.clone(),
                "topk_idx": reference.topk_idx.clone()}
        reference.destroy()
        return want

    def captured(handle, x, probs):  # each getter's first call: captured
        return {"tokens_per_expert": handle.tokens_per_expert, "topk_idx": handle.topk_idx}

    assert replays_after_destroy(seed, eager, captured) == []


@pytest.mark.parametrize("overflow", ["error", "drop"])
def test_overflow_inside_a_replayed_graph_on_a_local_team(overflow, seed):
    """Capacity mode, a local team of 2: a graph of one handle's creation, dispatch, combine and
    combine_probs, captured on routing that fits and replayed on routing that does not (every
    token of both ranks to rank 0's first experts: rank 0 would receive 2 x TOKENS x TOPK rows,
    over its 1.25 x TOKENS x TOPK). ``error``: ``check_errors()`` raises the overflow on both
    ranks, naming rank 0 and its rows. ``drop``: no error; the replay's outputs are bitwise the
    eager calls' on the same routing (rows past the bound dropped, docs/design.md §3), and the
    captured tokens_per_expert says how many rows rank 0 needed."""
    capacity = TOKENS * TOPK * 5 // 4
    groups = ep.Group.local_team(2, num_experts=EXPERTS, hidden=HIDDEN,
                                 max_tokens_per_rank=TOKENS, max_topk=TOPK, dtype=BF16,
                                 num_sms=8, timeout_s=20.0, recv_mode="capacity",
                                 max_recv_tokens_per_rank=capacity, capacity_overflow=overflow)
    meet = threading.Barrier(2)
    skewed = torch.arange(TOPK).repeat(TOKENS, 1)  # experts 0..TOPK-1: rank 0's

    def body(rank, group):
        device = group.device
        (idx, x, probs, _), = inputs(seed, rank, device)[:1]

        def ops(handle):
            recv_x, recv_probs = handle.dispatch(x, probs)
            return {"tokens_per_expert": handle.tokens_per_expert, "recv_x": recv_x,
                    "recv_probs": recv_probs, "y": handle.combine(recv_x * 3),
                    "grad_probs": handle.combine_probs(recv_probs * 2)}

        ops(group.create_handle(idx))  # eager first: lazy loads, the pool's slots
        captured: list = []
        graph = torch.cuda.CUDAGraph()
        meet.wait(timeout=60)
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            captured.append(group.create_handle(idx))
            got = ops(captured[0])
        finally:
            graph.capture_end()
        captured[0].destroy()
        for replay_idx in (idx, skewed.to(device)):
            with torch.no_grad():
                idx.copy_(replay_idx)
            for t in got.values():
                t.fill_(float("nan") if t.is_floating_point() else -7)
            meet.wait(timeout=60)
            graph.replay()
            torch.cuda.synchronize(device)
            meet.wait(timeout=60)
        if overflow == "error":
            with pytest.raises(ep.NcclEpError, match=f"capacity overflow: rank 0 would receive "
                                                     f"{2 * TOKENS * TOPK} rows but "
                                                     f"max_recv_tokens_per_rank={capacity}"):
                group.check_errors()
            return []
        group.check_errors()  # dropping: no error
        replayed = {name: t.clone() for name, t in got.items()}
        want = ops(group.create_handle(idx))
        mismatches = [name for name in want if not same_bits(replayed[name], want[name])]
        needed = int(replayed["tokens_per_expert"].sum())
        if needed != (2 * TOKENS * TOPK if rank == 0 else 0):
            mismatches.append(f"rank {rank} needed {needed} rows")
        del graph
        return mismatches

    results = run_team(groups, body)
    assert results == [[], []], results
