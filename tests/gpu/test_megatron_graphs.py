"""A Megatron MoE layer with the nccl_ep dispatcher in capacity mode, forward and backward
captured in one CUDA graph (cuda backend, EP 1), with SequentialMLP (the fixed layout, float32)
and with nccl_ep's GroupedExperts (``--moe-grouped-gemm``: the packed layout, device counts,
bf16): replays with new tokens equal eager steps bitwise, the output, the input's gradient and
every weight's (router, experts); a replay that overflows the static budget (SequentialMLP:
every token to the same experts; GroupedExperts: a budget below the rows every step needs)
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


def graphed_case(seed: int, grouped: bool) -> list:
    problems = []
    dtype = torch.bfloat16 if grouped else torch.float32
    with megatron_parallel(1):
        torch.manual_seed(seed)
        layer = moe_layer("nccl_ep", EXPERTS, TOPK, params_dtype=dtype, grouped=grouped,
                          bf16=grouped, moe_router_load_balancing_type="none").cuda()
        layer.layer_number = 2
        layer.token_dispatcher.moe_layer = weakref.ref(layer)
        router = layer.router.weight
        trained = router.detach().clone()
        params = [p for p in layer.parameters() if p.requires_grad]
        x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=dtype, requires_grad=True)
        grad = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=dtype)

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
            return (out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in params))

        def capture(factor, check=True):
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
            if check:  # (else the eager step's overflow is raised with the replay's)
                check_budgets()
            # The tensors the graph writes: the output, the gradients of the input and of every
            # weight (allocated by the capture, held here while eager steps replace p.grad).
            return graph, (out, x.grad, *(p.grad for p in params))

        def replay(graph, outputs, tokens):
            with torch.no_grad():
                x.copy_(tokens)
            for t in outputs:
                t.detach().fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            return tuple(t.detach().clone() for t in outputs)

        names = ["output", "input grad", *(n for n, p in layer.named_parameters()
                                          if p.requires_grad)]
        assert any("router" in n for n in names) and any("local_experts" in n for n in names)

        def compare(got, want, what):
            for name, a, b in zip(names, got, want):
                if not torch.isfinite(b).all():
                    problems.append(f"{what}: the eager {name} is not finite")
                elif not torch.equal(a, b):
                    problems.append(f"{what}: {name} differs")

        def tokens_in():
            return torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=dtype)

        graph, out = capture(2.5)
        for i in range(3):
            tokens = tokens_in()
            got = replay(graph, out, tokens)
            check_budgets()
            compare(got, eager_bits(tokens), f"replay {i} against its eager step")
        tokens = SEQ * BATCH
        if grouped:  # the packed layout at EP 1 holds every step's tokens x top-k rows, a
            # budget of 0.75 x them none: the next capture's replay overflows
            del graph
            graph, out = capture(0.75, check=False)
            message = (f"MoE layer 2 needed {tokens * TOPK} rows on one rank, over its static "
                       f"budget of {-(-tokens * TOPK * 3 // 4)} rows")
        else:
            with torch.no_grad():
                router.zero_()  # equal scores: every token to experts 0 and 1
            message = (f"MoE layer 2 needed {tokens} rows for one expert from one rank, over "
                       f"its static budget of {-(-tokens * TOPK * 5 // (EXPERTS * 2))} rows")
        replay(graph, out, tokens_in())
        with pytest.raises(NcclEpError, match=message):
            check_budgets()
        del graph
        graph, out = capture(4.0)  # budget: every token
        tokens = tokens_in()
        got = replay(graph, out, tokens)
        check_budgets()
        compare(got, eager_bits(tokens), "the replay after raising the budget")
        with torch.no_grad():
            router.copy_(trained)
    return problems


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential_mlp", "grouped_experts"])
def test_captured_moe_layer_replays_and_reports_an_overflow_after_the_step(grouped, seed):
    assert dist.run(1, graphed_case, seed, grouped, backend="nccl", timeout=300) == [[]]
