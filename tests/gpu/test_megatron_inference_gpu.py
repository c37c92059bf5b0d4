"""NcclEpInferenceDispatcher on the cuda backend (EP 1, one GPU), with Megatron's fused inference
experts (``mcore_fused_moe``: its Triton kernels and torch's grouped GEMM on the GPU):

* the cases of tests/test_megatron_inference.py against ``NCCLAllGatherDispatcher``: the experts'
  input bitwise, the combine within fp32 rounding of the exact sum, reruns bitwise (top-k 1 for
  the fused experts: with more slots per token their unpermute adds with atomics, in any order);
* a decode step (dispatch, fused experts, combine) captured in a CUDA graph and replayed with new
  tokens and routing copied into the captured inputs: equal to eager steps (bitwise at top-k 1,
  within a bf16 rounding of the atomics' order at top-k 2).
"""

import pytest
import torch

import dist
from gpu_common import requires_gpus
from test_megatron_inference import (FFN, HIDDEN, T_MAX, combine, dispatch, dispatchers, fused_moe,
                                     random_routing, routing_case)

pytestmark = requires_gpus

CASES = {
    "synthetic_experts_k2": dict(tokens=[6], num_experts=4, topk=2, payload_fp32=False),
    "synthetic_experts_k3_fp32_payload": dict(tokens=[T_MAX], num_experts=8, topk=3,
                                              payload_fp32=True),
    "fused_experts_k1": dict(tokens=[T_MAX], num_experts=4, topk=1, payload_fp32=False,
                             experts="fused"),
    "fused_experts_k1_fp32_payload": dict(tokens=[5], num_experts=8, topk=1, payload_fp32=True,
                                          experts="fused"),
}


def cuda_case(seed: int, kwargs: dict) -> dict:
    return routing_case(seed, backend="cuda", **kwargs)


@pytest.mark.parametrize("case_name", list(CASES))
def test_inference_dispatcher_on_cuda_matches_nccl_allgather(case_name, seed, summary_line):
    reports = dist.run(1, cuda_case, seed, CASES[case_name], backend="nccl", timeout=120)
    summary_line(f"{case_name}: {reports}")


def graph_case(seed: int, num_experts: int, topk: int, payload_fp32: bool) -> dict:
    from megatron.core.inference.moe.fused_moe import ActivationType
    from megatron.core.transformer.moe.token_dispatcher_inference import (
        InferenceAllGatherDispatcherBase)

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    fc1 = (torch.randn(num_experts, FFN, HIDDEN, generator=gen) / HIDDEN ** 0.5)
    fc2 = (torch.randn(num_experts, HIDDEN, FFN, generator=gen) / FFN ** 0.5)
    fc1, fc2 = (w.to(torch.bfloat16).to(device) for w in (fc1, fc2))
    fused = fused_moe()

    def inputs():
        return (torch.randn(T_MAX, 1, HIDDEN, generator=gen).to(torch.bfloat16).to(device),
                random_routing(T_MAX, num_experts, topk, gen).to(device),
                torch.rand(T_MAX, topk, generator=gen).to(device))

    with dispatchers(num_experts, topk, payload_fp32, False, "cuda", device) as (_, ours):
        x, ids, probs = inputs()  # the captured inputs: each replay's values are copied in

        def step():
            rx, rp, rg, _ = dispatch(ours, x, ids, probs, keep=False)
            out = fused(rx, rp, fc1, fc2, ActivationType.SQUARED_RELU, num_experts, 0,
                        InferenceAllGatherDispatcherBase._valid_tokens(), rg)
            return combine(ours, out)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, eager: creates the group, compiles the kernels
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_graph = step()
        worst = 0.0
        for _ in range(3):
            for captured, new in zip((x, ids, probs), inputs()):
                captured.copy_(new)
            graph.replay()
            replayed = y_graph.clone()
            eager = step()
            torch.cuda.synchronize()
            if topk == 1:
                assert torch.equal(replayed, eager)
            else:
                torch.testing.assert_close(replayed.float(), eager.float(), rtol=2 ** -7,
                                           atol=2 ** -8)
            worst = max(worst, float((replayed.float() - eager.float()).abs().max()))
        from megatron_nccl_ep.dispatcher_common import GROUPS

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        assert [g.config.num_sms for g in GROUPS.cached("ll")] == [sms]  # every SM
        return {"replays": 3, "max_diff_vs_eager": worst,
                "captured_handles": len(ours._captured)}


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("payload_fp32", [False, True], ids=["bf16_payload", "fp32_payload"])
def test_decode_step_replays_in_a_cuda_graph(topk, payload_fp32, seed, summary_line):
    [report] = dist.run(1, graph_case, seed, 4, topk, payload_fp32, backend="nccl", timeout=120)
    assert report["captured_handles"] == 1, report
    summary_line(f"top-k {topk}: {report}")
