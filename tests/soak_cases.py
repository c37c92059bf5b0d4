"""Random cases for the soak tests, drawn alike on every rank from one shared ``random.Random``.

A case is a group (what a ``Group`` fixes: experts, hidden, dtype, mode, alignment, ...) and a
call in it (what changes from one handle to the next: tokens per rank, top-k, routing, probs and
index dtypes, top-k ids or a routing map). ``CPU`` is the reference backend's space
(tests/test_reference_soak.py draws a new group for every case, against the oracle of dense.py);
``GPU`` is the cuda backend's (tests/gpu/test_cuda_soak.py keeps a few groups alive, since a cuda
group costs an NCCL communicator, and draws calls in them, against the reference backend).
"""

from __future__ import annotations

import dataclasses
import random

import torch

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@dataclasses.dataclass(frozen=True)
class Space:
    """The values a soak draws from."""

    tokens: tuple            # tokens per rank; a group's max_tokens_per_rank is one of them
    hidden: tuple
    local_experts: tuple     # experts per rank (num_experts = this x group size)
    max_topk: int            # top-k is drawn from 1 .. min(max_topk, num_experts)
    dtypes: tuple            # token dtypes
    routings: tuple = ("random", "masked", "one_expert")  # dense.random_routing's kinds
    alignments: tuple = (1, 1, 4)
    capacity_slack: tuple = (None, 0, 5)  # None: exact mode; n: capacity mode, n rows to spare
    node_sizes: bool = False  # draw ranks_per_node (the reference's hierarchical combine)
    probs_dtypes: tuple = (FP32,)  # None: dispatch without probs
    idx_dtypes: tuple = (torch.int64,)
    routing_maps: tuple = (False,)  # True: the handle is made from the dense routing map
    num_sms: tuple = (24,)
    staging: tuple = ((0, 0),)  # (staging_chunk_tokens, staging_depth); 0 = library default
    expert_capacities: tuple = (0,)  # C > 0: the fixed-capacity (drop-and-pad) layout


CPU = Space(tokens=(0, 1, 2, 7, 16, 33), hidden=(8, 24, 40), local_experts=(1, 2, 3), max_topk=6,
            dtypes=(BF16, FP16, FP32, FP64), node_sizes=True, expert_capacities=(0, 0, 0, 1, 4))

# Rows of 200 bytes (hidden 100 bf16/fp16) are not a multiple of 16 (the kernels' element path);
# staging (4, 2) and (16, 3) make every op wrap its ring many times; 0 tokens on a rank happens;
# ranks per node below the group size take the rail (groups that span nodes).
GPU = Space(tokens=(0, 1, 17, 300, 1024), hidden=(100, 128, 1024, 2048, 7168),
            local_experts=(1, 4, 32), max_topk=8, dtypes=(BF16, FP16, FP32),
            alignments=(1, 1, 16), capacity_slack=(None, 0, 37), node_sizes=True,
            probs_dtypes=(FP32, BF16, FP16, None), idx_dtypes=(torch.int64, torch.int32),
            routing_maps=(False, True), num_sms=(8, 24), staging=((0, 0), (4, 2), (16, 3)),
            expert_capacities=(0, 0, 0, 0, 16, 300))


def random_group(rng: random.Random, world: int, space: Space) -> dict:
    """A group configuration: ``num_experts, hidden, dtype, max_tokens, max_topk, alignment,
    capacity_slack, ranks_per_node, num_sms, staging_chunk_tokens, staging_depth,
    expert_capacity`` (with a capacity slack, the fixed-capacity layout's capacity mode is its
    fixed size: the slack is not used)."""
    experts = rng.choice(space.local_experts) * world
    chunk, depth = rng.choice(space.staging)
    return dict(
        num_experts=experts, hidden=rng.choice(space.hidden), dtype=rng.choice(space.dtypes),
        max_tokens=max(1, rng.choice(space.tokens)),
        max_topk=rng.randint(1, min(space.max_topk, experts)),
        alignment=rng.choice(space.alignments), capacity_slack=rng.choice(space.capacity_slack),
        ranks_per_node=rng.choice([d for d in (0, 1, 2, world) if d == 0 or world % d == 0])
        if space.node_sizes else 0,
        num_sms=rng.choice(space.num_sms), staging_chunk_tokens=chunk, staging_depth=depth,
        expert_capacity=rng.choice(space.expert_capacities))


def random_call(rng: random.Random, world: int, group: dict, space: Space) -> dict:
    """One handle's inputs within ``group``: ``tokens`` (a tuple, one count per rank, each at most
    the group's max_tokens), ``topk``, ``routing``, ``probs_dtype``, ``idx_dtype``,
    ``routing_map``."""
    fits = [t for t in space.tokens if t <= group["max_tokens"]]
    return dict(tokens=tuple(rng.choice(fits) for _ in range(world)),
                topk=rng.randint(1, group["max_topk"]), routing=rng.choice(space.routings),
                probs_dtype=rng.choice(space.probs_dtypes),
                idx_dtype=rng.choice(space.idx_dtypes),
                routing_map=rng.choice(space.routing_maps))


def random_case(rng: random.Random, world: int, space: Space = CPU) -> dict:
    """A group and one call in it, as one dict (the group's keys, then the call's)."""
    group = random_group(rng, world, dataclasses.replace(space, tokens=(max(space.tokens),)))
    return dict(group, **random_call(rng, world, group, space))
