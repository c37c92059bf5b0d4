"""The one-process oracle of a whole LL group (docs/design.md §9): every rank's dispatch outputs
(``ll_dispatch_all``) and combine outputs (``ll_combine_all``) at once, from every rank's inputs,
by the reference backend's own per-rank steps (megatron_nccl_ep.ll_reference). The CUDA tests of
local teams and over NVLink (tests/gpu/test_cuda_ll.py, test_cuda_ll_nvlink.py, stress_teams.py)
compare with it bitwise; tests/test_ll_reference.py checks it against the reference backend
over gloo and an independent per-token computation.

``ll_combine_by_contract`` is such an independent computation of the combine, here for groups
that span nodes (``ranks_per_node``): written token by token from §9's formulas, it shares no
code with ll_reference (where each slot's row is, the order of the terms, the node partials).
tests/test_ll_nodes_reference.py holds the reference backend to it, and the GPU tests of LL
across nodes may too."""

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
    major) every rank's ``weights [T_s, K_s]``; summed in the node order where ``config`` has
    nodes of ``ranks_per_node < world_size`` ranks (``finish_combine``)."""
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


def received(topk_idx_list, num_experts: int, world_size: int, d: int):
    """Rank d's dispatch, from the contract: its tokens (s, t) in (source, token) order, and per
    local expert the (s, t) naming it, in the same order."""
    L = num_experts // world_size
    tokens, per_expert = [], [[] for _ in range(L)]
    for s, idx in enumerate(topk_idx_list):
        for t, slots in enumerate(idx.tolist()):
            here = [e for e in slots if e >= 0 and e // L == d]
            if here:
                tokens.append((s, t))
            for e in here:
                per_expert[e - d * L].append((s, t))
    return tokens, per_expert


def ll_combine_by_contract(config: GroupConfig, world_size: int, topk_idx_list, expert_out_list,
                           weights_list=None) -> List[torch.Tensor]:
    """Every rank's combine output ``y [T_s, H]`` (token dtype, on the CPU) by docs/design.md §9
    token by token: the terms (expert-major: per valid slot k, ``w[t, k] * fp32(row)``, the
    product rounded to fp32; rank-major: per rank d that received t, ``fp32(row)``) summed from
    +0.0 in ascending k (d), rounded once, in a group of one node; in a group of nodes of
    ``G = config.ranks_per_node < R`` ranks, per node n ascending that holds a term of t, the
    terms of its ranks summed so and rounded to the token dtype (the node partial), and those
    summed from +0.0 in fp32, rounded once. Rows are read in the token dtype (fp32 rows rounded
    to it)."""
    R, dtype, H = world_size, config.dtype, config.hidden
    G = config.node_size(R)
    L = config.num_experts // R
    received_by = [received(topk_idx_list, config.num_experts, R, d) for d in range(R)]
    ys = []
    for s, idx in enumerate(topk_idx_list):
        y = torch.empty((idx.shape[0], H), dtype=dtype)
        for t, slots in enumerate(idx.tolist()):
            terms = []  # (rank the term comes from, fp32 row), in one node's order
            if config.ll_layout == "expert_major":
                for k, e in enumerate(slots):
                    if e >= 0:
                        d, l = e // L, e % L
                        row = expert_out_list[d][l, received_by[d][1][l].index((s, t))]
                        w = weights_list[s][t, k].to(torch.float32).cpu()
                        terms.append((d, w * row.cpu().to(dtype).to(torch.float32)))
            else:
                for d in range(R):
                    if (s, t) in received_by[d][0]:
                        row = expert_out_list[d][received_by[d][0].index((s, t))]
                        terms.append((d, row.cpu().to(dtype).to(torch.float32)))
            acc = torch.zeros(H, dtype=torch.float32)
            if G == R:
                for _, value in terms:
                    acc = acc + value
            else:
                for n in range(R // G):
                    mine = [value for d, value in terms if d // G == n]
                    if not mine:
                        continue
                    node = torch.zeros(H, dtype=torch.float32)
                    for value in mine:
                        node = node + value
                    acc = acc + node.to(dtype).to(torch.float32)
            y[t] = acc.to(dtype)
        ys.append(y)
    return ys
