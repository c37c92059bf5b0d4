"""Megatron's 1F1B EP overlap on GPUs (tests/test_megatron_ep_overlap.py runs the same case on
CPU with stand-in streams): the cuda backend, NCCL, Megatron's real communication stream, so
dispatch and combine of one micro-batch run concurrently with another's compute. The overlapped
schedule must give the plain schedule's losses and gradients bitwise."""

import pytest
import torch

import dist
from gpu_common import requires_gpus
from test_megatron_ep_overlap import check_overlap_runs, overlap_case

pytestmark = requires_gpus


# A rank whose peer stopped raises after this (not the default 100 s): an op matched wrongly
# across ranks under the overlap must fail inside the test's time, naming the calls.
GROUP_TIMEOUT_S = 20.0


def gpu_overlap_case(seed: int, recv_mode: str, layers: int, microbatches: int) -> dict:
    # Math attention: the fused SDPA kernels' backward may accumulate with atomics.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    return overlap_case(seed, recv_mode, layers, microbatches, backend="cuda",
                        timeout_s=GROUP_TIMEOUT_S)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="EP overlap needs 2 CUDA devices")
@pytest.mark.parametrize("recv_mode,layers,microbatches", [("capacity", 2, 4), ("exact", 2, 3)])
def test_ep_overlap_on_gpus_matches_the_plain_schedule_bitwise(recv_mode, layers, microbatches,
                                                                seed):
    for runs in dist.run(2, gpu_overlap_case, seed, recv_mode, layers, microbatches,
                         backend="nccl", timeout=120):
        check_overlap_runs(runs, layers, microbatches)
