"""The one-process oracle of a whole LL group (docs/design.md §9): every rank's dispatch outputs
(``ll_dispatch_all``) and combine outputs (``ll_combine_all``) at once, from every rank's inputs,
by the reference backend's own per-rank steps (megatron_nccl_ep.ll_reference). The CUDA tests of
local teams and over NVLink (tests/gpu/test_cuda_ll.py, test_cuda_ll_nvlink.py, stress_teams.py)
compare with it bitwise; tests/test_ll_reference.py checks it against the reference backend
over gloo and an independent per-token computation."""

from __future__ import annotations

from typing import List

import torch

from megatron_nccl_ep.config import GroupConfig, routing_error
from megatron_nccl_ep.outputs import LLDispatchOutput
from megatron_nccl_ep.ll_reference import (empty_dispatch_output, fill_dispatch, finish_combine,
                                           pack_combine, pack_dispatch, receive_record, send_plan)


def _weights_agreed(config: GroupConfig, weights_list) -> bool:
    given = [w is not None for w in (weights_list or [])]
    if any(given) and not all(given):
        raise ValueError(f"topk_weights given on ranks {[r for r, g in enumerate(given) if g]} "
                         "but not on the others: every rank passes them or none does")
    return bool(given) and all(given) and config.ll_layout == "rank_major"


def _check_routing_all(config: GroupConfig, topk_idx_list) -> None:
    for r, idx in enumerate(topk_idx_list):
        error = routing_error(idx.to(torch.int64), config.num_experts)
        if error is not None:
            raise ValueError(f"{error} (rank {r})")


def ll_dispatch_all(config: GroupConfig, world_size: int, topk_idx_list, x_list,
                    weights_list=None) -> List[LLDispatchOutput]:
    """Every rank's dispatch outputs (element d: rank d's) from every rank's ``topk_idx [T_s,
    K_s]``, ``x [T_s, H]`` and optional ``weights [T_s, K_s]`` (fp32; every rank's or none),
    on the inputs' device."""
    _check_routing_all(config, topk_idx_list)
    with_weights = _weights_agreed(config, weights_list)
    R = world_size
    sent = []
    for s, (idx, x) in enumerate(zip(topk_idx_list, x_list)):
        plan = send_plan(idx, config.num_experts, R)
        w = weights_list[s].to(torch.float32) if with_weights else None
        sent.append(torch.split(pack_dispatch(config, x, idx, w, plan), [len(p) for p in plan]))
    outs = []
    for d in range(R):
        messages = torch.cat([sent[s][d] for s in range(R)])
        out = empty_dispatch_output(config, R, x_list[0].device, with_weights)
        fill_dispatch(out, config, R, d, messages, [len(sent[s][d]) for s in range(R)],
                      with_weights)
        outs.append(out)
    return outs


def ll_combine_all(config: GroupConfig, world_size: int, topk_idx_list, expert_out_list,
                   weights_list=None) -> List[torch.Tensor]:
    """Every rank's combine output ``y [T_s, H]`` (token dtype) from every rank's routing (the
    layout is a function of it), every rank's ``expert_out`` in the group's layout, and (expert-
    major) every rank's ``weights [T_s, K_s]``."""
    _check_routing_all(config, topk_idx_list)
    R, K = world_size, config.max_topk
    plans = [send_plan(idx, config.num_experts, R) for idx in topk_idx_list]
    back = []  # back[d][s]: rows destination d returns to source s
    for d in range(R):
        src, token, ids = [], [], []
        for s, idx in enumerate(topk_idx_list):
            tokens = plans[s][d]
            padded = torch.full((len(tokens), K), -1, dtype=torch.int64, device=idx.device)
            padded[:, :idx.shape[1]] = idx[tokens]
            src.append(torch.full_like(tokens, s))
            token.append(tokens)
            ids.append(padded)
        record = receive_record(config, R, d, torch.cat(src), torch.cat(token), torch.cat(ids))
        rows, counts = pack_combine(config, R, record, expert_out_list[d])
        back.append(torch.split(rows, counts))
    ys = []
    for s, idx in enumerate(topk_idx_list):
        y = torch.empty((idx.shape[0], config.hidden), dtype=config.dtype,
                        device=expert_out_list[0].device)
        w = None
        if config.ll_layout == "expert_major":
            w = weights_list[s].to(torch.float32)
        parts = [back[d][s] for d in range(R)]
        finish_combine(y, config, R, idx, w, plans[s], torch.cat(parts),
                       [len(p) for p in parts])
        ys.append(y)
    return ys
