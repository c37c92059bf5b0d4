"""A Megatron MoE layer with the nccl_ep dispatcher in capacity mode, forward and backward
captured in one CUDA graph (cuda backend, EP 1): replays with new tokens equal eager steps
bitwise; a replay whose routing overflows the static budget (every token to the same experts)
raises at check_budgets(), after the step, naming the layer and the rows it needed; with a
capacity factor that holds them, the next step (its group made eagerly, then captured) runs and
equals its eager step. The CPU suite checks the same at EP 2 (tests/test_megatron_dispatcher.py:
every rank raises)."""

from __future__ import annotations

import weakref

import pytest
import torch

import dist
from gpu_common import requires_gpus
from megatron_nccl_ep.dispatcher import check_budgets
from megatron_nccl_ep.errors import NcclEpError
from megatron_nccl_ep.options import NcclEpOptions
from test_megatron_dispatcher import BATCH, HIDDEN, SEQ, megatron_parallel, moe_layer

pytestmark = requires_gpus

EXPERTS, TOPK = 8, 2


def graphed_case(seed: int) -> list:
    problems = []
    with megatron_parallel(1):
        torch.manual_seed(seed)
        layer = moe_layer("nccl_ep", EXPERTS, TOPK, params_dtype=torch.float32,
                          moe_router_load_balancing_type="none").cuda()
        layer.layer_number = 2
        layer.token_dispatcher.moe_layer = weakref.ref(layer)
        router = layer.router.weight
        trained = router.detach().clone()
        x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True)
        grad = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")

        def step():
            out, _ = layer(x)
            out.backward(grad)
            return out

        def eager_bits(tokens):
            with torch.no_grad():
                x.copy_(tokens)
            layer.zero_grad()
            x.grad = None
            out = step()
            torch.cuda.synchronize()
            return out.detach().clone(), x.grad.clone()

        def capture(factor):
            layer.config.nccl_ep_options = NcclEpOptions(backend="cuda", recv_mode="capacity",
                                                         capacity_factor=factor)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()  # eager: the group of this budget is made outside the capture
                layer.zero_grad()
                x.grad = None
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    out = step()
            torch.cuda.current_stream().wait_stream(stream)
            check_budgets()
            return graph, (out, x.grad)  # the tensors the graph writes

        def replay(graph, outputs, tokens):
            with torch.no_grad():
                x.copy_(tokens)
            for t in outputs:
                t.detach().fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            return tuple(t.detach().clone() for t in outputs)

        graph, out = capture(2.5)
        for i in range(3):
            tokens = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
            got = replay(graph, out, tokens)
            check_budgets()
            want = eager_bits(tokens)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                problems.append(f"replay {i} differs from its eager step")
        with torch.no_grad():
            router.zero_()  # equal scores: every token to experts 0 and 1
        replay(graph, out, torch.randn(SEQ, BATCH, HIDDEN, device="cuda"))
        tokens = SEQ * BATCH
        with pytest.raises(NcclEpError, match=f"MoE layer 2 needed {tokens} rows for one expert "
                                              f"from one rank, over its static budget of "
                                              f"{-(-tokens * TOPK * 5 // (EXPERTS * 2))} rows"):
            check_budgets()
        del graph
        graph, out = capture(4.0)  # budget: every token
        tokens_in = torch.randn(SEQ, BATCH, HIDDEN, device="cuda")
        got = replay(graph, out, tokens_in)
        check_budgets()
        if not all(torch.equal(a, b) for a, b in zip(got, eager_bits(tokens_in))):
            problems.append("the replay after raising the budget differs from its eager step")
        with torch.no_grad():
            router.copy_(trained)
    return problems


def test_captured_moe_layer_replays_and_reports_an_overflow_after_the_step(seed):
    assert dist.run(1, graphed_case, seed, backend="nccl", timeout=300) == [[]]
