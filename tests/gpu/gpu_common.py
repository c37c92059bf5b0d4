"""Shared pieces of the GPU tests: the skip condition, rank-local inputs drawn on the GPU, the
allocator poisoning that makes unwritten output rows visible, bitwise comparison on the device,
and memory readings."""

from __future__ import annotations

import gc
import math
import os

import pytest
import torch

import dense


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


def world_sizes():
    """1 rank (one GPU: the kernels without a peer), 2 ranks, and 4 (2 ranks is a degenerate
    all-to-all), each where enough GPUs exist: one rank a GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [pytest.param(n, marks=pytest.mark.skipif(
        count < n, reason=f"{n}-rank GPU cases need {n} CUDA devices, found {count}"))
        for n in (1, 2, 4)]


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


def tokens_of(tokens, rank: int) -> int:
    return tokens if isinstance(tokens, int) else tokens[rank % len(tokens)]


def rank_inputs(case: dict, seed: int, rank: int, device):
    """This rank's (x, topk_idx, probs or None), drawn on the GPU from (seed, rank)."""
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    tokens = tokens_of(case["tokens"], rank)
    x = dense.wide_values(gen, (tokens, case["hidden"]), case["dtype"])
    # The same target expert on every rank, so 'one_expert' sends everything to one rank.
    target = seed % case["experts"]
    idx = dense.random_routing(gen, tokens, case["topk"], case["experts"], case["routing"],
                               target).to(case.get("idx_dtype", torch.int64))
    probs_dtype = case.get("probs_dtype", torch.float32)
    probs = None
    if probs_dtype is not None:
        probs = (torch.rand(tokens, case["topk"], generator=gen, device=device,
                            dtype=torch.float64) * 0.9 + 0.1).to(probs_dtype)
    return x, idx, probs


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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def count_mismatches(got, want) -> int:
    """Elements of ``got`` whose bits differ from ``want``'s (NaN == NaN, -0 != +0), compared on
    ``got``'s device (large outputs never travel to the host). Two Nones agree; a None against a
    tensor, or a dtype or shape difference, counts every element (at least 1)."""
    if got is None or want is None:
        return 0 if got is None and want is None else max(1, (got if got is not None
                                                              else want).numel())
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return max(1, got.numel(), want.numel())
    a = got.detach().contiguous()
    b = want.detach().to(a.device).contiguous()
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    a, b = a.view(_INT_OF_SIZE[a.element_size()]), b.view(_INT_OF_SIZE[b.element_size()])
    return int((a != b).sum())


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


def recv_rows_bound(world: int, max_tokens: int, max_topk: int, local_experts: int,
                    alignment: int = 1) -> int:
    """The most rows any rank can receive in a group of this shape (every token of every rank
    routed here, alignment padding on every local expert): a capacity that never overflows."""
    return world * max_tokens * min(max_topk, local_experts) + local_experts * (alignment - 1)


def group_pair(device, *, experts: int, hidden: int, max_tokens: int, max_topk: int, dtype,
               capacity=None, backends=("torch", "cuda"), **extra):
    """Groups of one configuration on the default process group, one per backend (reference
    first): exact mode, or capacity mode with ``capacity`` rows."""
    import megatron_nccl_ep as ep

    if capacity is not None:
        extra.update(recv_mode="capacity", max_recv_tokens_per_rank=int(capacity))
    return [ep.Group(num_experts=experts, hidden=hidden, max_tokens_per_rank=max(1, max_tokens),
                     max_topk=max_topk, dtype=dtype, backend=backend, device=device, **extra)
            for backend in backends]
