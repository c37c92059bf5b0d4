"""The types the backends build and the front end returns (below both: backends never import
the front end): ``LLDispatchOutput``, one LL dispatch's outputs."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class LLDispatchOutput:
    """One LL dispatch's outputs, all on the group's device (docs/design.md §9).

    Expert-major: ``x [L, R*T_max, H]``, ``count [L]`` int32, ``src [L, R*T_max]`` int32
    (``s * T_max + t``). Rank-major: ``x [R*T_max, H]``, ``count [1]`` int32, ``topk_idx
    [R*T_max, max_topk]`` int32 and ``topk_weights`` fp32 (None without dispatched weights).
    With ``dispatch_fp8``: ``x`` is float8_e4m3fn and ``scales [..., H/FP8_BLOCK]`` fp32. Rows at
    and after the count are not part of the result."""

    x: torch.Tensor
    count: torch.Tensor
    scales: Optional[torch.Tensor] = None
    src: Optional[torch.Tensor] = None
    topk_idx: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
