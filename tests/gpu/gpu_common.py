"""Shared pieces of the GPU tests: the skip condition, rank-local inputs drawn on the GPU, and the
allocator poisoning that makes unwritten output rows visible."""

from __future__ import annotations

import math

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
