"""The LL dispatch's FP8 cast (docs/design.md §9), the reference's bits for the CUDA kernel's
(``config.LL_PAYLOADS`` names it the ``torch.float8_e4m3fn`` payload's).

Per row and block of ``FP8_BLOCK`` columns, in float32: ``amax = max |x|``, ``amax' = max(amax,
FP8_AMAX_FLOOR)``, ``scale = amax' / FP8_MAX``, ``q = e4m3(x * (FP8_MAX / amax'))``: the factor
rounded once, the product rounded once, then round-to-nearest-even into float8_e4m3fn, saturating
at +-FP8_MAX. Every step is one IEEE float32 operation (a max is exact), so any device that
performs the same steps gets the same bits; the constants are the library's
(nccl_ep_limits.h, through ``limits``). Inputs are expected finite (a NaN propagates into its
block).
"""

from __future__ import annotations

import torch

from .limits import FP8_AMAX_FLOOR, FP8_BLOCK, FP8_MAX

FP8_DTYPE = torch.float8_e4m3fn


def _blocks(x: torch.Tensor) -> torch.Tensor:
    hidden = x.shape[-1]
    if hidden % FP8_BLOCK:
        raise ValueError(f"fp8_cast: the last dimension ({hidden}) must be a multiple of "
                         f"{FP8_BLOCK} (one scale per block of {FP8_BLOCK} columns)")
    return x.reshape(*x.shape[:-1], hidden // FP8_BLOCK, FP8_BLOCK)


def fp8_cast(x: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """``x [..., H]`` (bf16 / fp16 / fp32) -> ``(q [..., H] float8_e4m3fn, scales
    [..., H/FP8_BLOCK] float32)``, dequantized value ``q * scale``."""
    blocks = _blocks(x.to(torch.float32))  # exact for every LL token dtype
    amax = blocks.abs().amax(dim=-1)
    amax = torch.maximum(amax, torch.tensor(FP8_AMAX_FLOOR, dtype=torch.float32,
                                            device=x.device))
    fp8_max = torch.full_like(amax, float(FP8_MAX))
    # Divisions of two tensors, each one IEEE division: ``FP8_MAX / t`` is reciprocal() * FP8_MAX,
    # and on CUDA ``t / FP8_MAX`` multiplies by a rounded reciprocal of the scalar.
    scales = torch.div(amax, fp8_max)
    factor = torch.div(fp8_max, amax)
    scaled = blocks * factor.unsqueeze(-1)  # one rounded product
    # Saturation: torch's cast gives NaN from 480 up; clamping first is exact (|q| <= FP8_MAX is
    # what RNE with saturation gives for every value beyond FP8_MAX).
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scales


def fp8_dequant(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [..., H]`` float8_e4m3fn and ``scales [..., H/FP8_BLOCK]`` -> float32 ``q * scale``."""
    blocks = _blocks(q.to(torch.float32))
    return (blocks * scales.to(torch.float32).unsqueeze(-1)).reshape(q.shape)
