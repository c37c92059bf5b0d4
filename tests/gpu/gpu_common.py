"""Shared pieces of the GPU tests: the skip condition, the allocator poisoning that makes
unwritten output rows visible, dense routing maps and probs, and memory readings (inputs, bitwise
comparison and group pairs that CPU tests share too: ep_cases.py)."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch


def _skip_reason():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        return f"GPU tests need a CUDA device, found {count}"
    from megatron_nccl_ep import cuda_backend

    if not cuda_backend.available():
        return f"CUDA extension not importable: {cuda_backend.unavailable_reason()}"
    return None


SKIP_REASON = _skip_reason()
requires_gpus = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def this_device() -> torch.device:
    """This rank's GPU (the current CUDA device, which the process harness sets per rank)."""
    return torch.device("cuda", torch.cuda.current_device())


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_needed(world_size: int, ranks_per_node: int = 0) -> int:
    """GPUs a case of ``world_size`` ranks needs: one a rank, except for groups of one rank per
    node (``ranks_per_node`` 1), whose ranks may share a GPU two by two as emulated hosts
    (tests/dist.py gpu_of_rank): such a group's traffic goes through NCCL, never between GPUs of a
    node, so a one-GPU machine still runs its 2-rank cases (time-sliced, slower, same results)."""
    return -(-world_size // 2) if ranks_per_node == 1 else world_size


def cuda_devices(n: int) -> str:
    """``n`` CUDA device(s), for skip reasons."""
    return f"{n} CUDA device{'' if n == 1 else 's'}"


def skip_without_gpus(world_size: int, ranks_per_node: int = 0) -> None:
    """Skips (with the reason) a case that needs more GPUs than the machine has."""
    need, count = gpus_needed(world_size, ranks_per_node), gpu_count()
    if count < need:
        pytest.skip(f"{world_size}-rank GPU case (ranks per node {ranks_per_node or 'all'}) "
                    f"needs {cuda_devices(need)}, found {count}")


def world_sizes(nodes_of_one: bool = False):
    """1 rank (one GPU: the kernels without a peer), 2 ranks, and 4 (2 ranks is a degenerate
    all-to-all), each where enough GPUs exist: one rank a GPU, or with ``nodes_of_one`` two ranks
    a GPU (a test that also runs other node sizes calls skip_without_gpus for those)."""
    count, ranks_per_node = gpu_count(), 1 if nodes_of_one else 0
    needs = {n: gpus_needed(n, ranks_per_node) for n in (1, 2, 4)}
    return [pytest.param(n, marks=pytest.mark.skipif(
        count < need, reason=f"{n}-rank GPU cases need {cuda_devices(need)}, found {count}"))
        for n, need in needs.items()]


def poison_allocator(device, large_bytes: int = 4 << 30, small_blocks: int = 128) -> None:
    """Fills freed caching-allocator memory with NaN: allocate, fill, free. The next allocations
    (the CUDA backend's torch.empty outputs included) are carved from these blocks, so a row the
    backend forgets to write holds NaN bits instead of a lucky zero."""
    free, _ = torch.cuda.mem_get_info(device)
    big = torch.empty(min(large_bytes, free // 4) // 4, dtype=torch.float32, device=device)
    big.fill_(math.nan)
    # Requests <= 1 MiB come from the small pool's 2 MiB segments.
    small = [torch.empty(128 * 1024, dtype=torch.float32, device=device).fill_(math.nan)
             for _ in range(small_blocks)]
    del big, small
    torch.cuda.synchronize(device)


def nan_outside(t: torch.Tensor, used_rows: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN in every row that is not a used (token, slot) row."""
    t = t.clone()
    t[~used_rows] = math.nan
    return t


def routing_map_of(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The dense boolean routing map [T, E] of ``idx`` (masked slots route nowhere)."""
    routing_map = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool, device=idx.device)
    valid = idx >= 0
    tokens = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1).expand_as(idx)
    routing_map[tokens[valid], idx[valid]] = True
    return routing_map


def dense_probs_of(idx: torch.Tensor, probs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A router's dense ``[T, E]`` probs on ``idx``'s device: each slot's prob in its expert's
    column, 0 elsewhere."""
    out = torch.zeros(idx.shape[0], num_experts, dtype=probs.dtype, device=idx.device)
    t, k = (idx >= 0).nonzero(as_tuple=True)
    out[t, idx[t, k].long()] = probs[t, k]
    return out


def device_memory(device):
    """(bytes held by live torch tensors, bytes the driver reports free), with the caching
    allocator's unused blocks handed back first so that both are comparable across time."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device), torch.cuda.mem_get_info(device)[0]


def resident_bytes() -> int:
    """This process's resident set (host RSS), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
