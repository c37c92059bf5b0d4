"""Megatron's drop-and-pad (``moe_pad_expert_input_to_capacity``) through the nccl_ep dispatcher
on the cuda backend, against Megatron's ``alltoall`` on the same GPU(s): the case of
tests/test_megatron_drop_and_pad.py (same weights and tokens, a skewed router so that slots are
dropped and columns padded), float32. The experts' input (rows, probs, tokens_per_expert) is
bitwise alltoall's and the oracle's; outputs and gradients agree within float32 rounding (the
baseline's unpermute adds with atomics); a rerun is bitwise identical. The cuda kernels take at
most 32 slots per token and the router's padded map may name every expert, so E x TP <= 32."""

import pytest
import torch

import dist
from gpu_common import cuda_devices, requires_gpus
from test_megatron_drop_and_pad import alltoall_case

pytestmark = requires_gpus


def cuda_case(seed: int, kwargs: dict) -> dict:
    return alltoall_case(seed=seed, backend="cuda", **kwargs)


CASES = {
    "ep1_e8_k2_skewed": (1, dict(num_experts=8, topk=2, factor=1.0, skewed=True)),
    "ep1_e32_k4_capacity_mode_position": (1, dict(num_experts=32, topk=4, factor=0.5,
                                                  policy="position", recv_mode="capacity",
                                                  skewed=True)),
    "ep2_e8_k2_skewed": (2, dict(num_experts=8, topk=2, factor=1.0, skewed=True)),
}


@pytest.mark.parametrize("case_name", list(CASES))
def test_drop_and_pad_on_cuda_matches_alltoall(case_name, seed, summary_line):
    world, kwargs = CASES[case_name]
    if torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {cuda_devices(world)}, found {torch.cuda.device_count()}")
    reports = dist.run(world, cuda_case, seed, kwargs, backend="nccl", timeout=120)
    assert all(r["dropped"] > 0 and r["padded"] > 0 for r in reports), reports
    summary_line(f"{case_name}: {reports}: experts' input bitwise alltoall's, outputs and "
                 "gradients within float32 rounding, rerun bitwise identical")
