"""The types the backends build and the front end returns (below both: backends never import
the front end): ``LLDispatchOutput``, one LL dispatch's outputs (its field list is the one
statement of their names and order: the cuda bindings take it, ``FIELDS``),
``ll_dispatch_fields``, the one statement of their shapes and dtypes, and
``new_dispatch_output``, which allocates them."""

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
    ``x`` is of the group's ``payload_dtype`` (the token dtype by default); a payload with scales
    (FP8) adds ``scales [..., H/scale_block]`` fp32. Rows at and after the count are not part of
    the result."""

    x: torch.Tensor
    count: torch.Tensor
    scales: Optional[torch.Tensor] = None
    src: Optional[torch.Tensor] = None
    topk_idx: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None


FIELDS = tuple(f.name for f in dataclasses.fields(LLDispatchOutput))


def ll_dispatch_fields(config, world_size: int, with_weights: bool) -> tuple:
    """The outputs of one LL dispatch of a group of ``config`` on ``world_size`` ranks, in the
    order of ``LLDispatchOutput``'s fields: ``(shape, dtype)`` each, None for a field the layout
    leaves out (``with_weights``: the dispatch sends weights, which rank-major returns)."""
    rows = world_size * config.max_tokens_per_rank
    rank_major = config.ll_layout == "rank_major"
    lead = (rows,) if rank_major else (config.num_experts // world_size, rows)
    x_dtype, payload = config.ll_payload()
    scales = (None if payload is None else
              (lead + (config.hidden // payload.scale_block,), torch.float32))
    if rank_major:
        per_slot = (rows, config.max_topk)
        return ((lead + (config.hidden,), x_dtype), ((1,), torch.int32), scales, None,
                (per_slot, torch.int32), (per_slot, torch.float32) if with_weights else None)
    return ((lead + (config.hidden,), x_dtype), (lead[:1], torch.int32), scales,
            (lead, torch.int32), None, None)


def new_dispatch_output(fields: tuple, device, **given) -> LLDispatchOutput:
    """An ``LLDispatchOutput`` of ``fields`` (``ll_dispatch_fields``) on ``device``: the tensors
    ``given`` by field name, new ones (``torch.empty``) for the others."""
    return LLDispatchOutput(*[given[name] if name in given else
                              None if field is None else
                              torch.empty(field[0], dtype=field[1], device=device)
                              for name, field in zip(FIELDS, fields)])
