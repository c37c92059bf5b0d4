"""Groups that span nodes on the cuda backend (docs/design.md §4, docs/internode.md): tokens
cross between nodes over NCCL send/receive on the rail communicator and fan out over NVLink in the
node; combine sums node by node. Every output and gradient BITWISE equal to the reference
backend with the same ranks per node G (whose G = 1 is bitwise its flat result:
tests/test_reference_hierarchy.py). The GPU soak (test_cuda_soak.py) draws G too, with dense
[T, E] probs among its random calls.

The rail carries to each remote node only the tokens with a slot there (docs/internode.md): the
library's counters of what it sent equal the reference's and a count token by token, on uniform
and node-limited routing, and a rail_capacity below a pair's count raises on every rank.

Emulated nodes on one machine, two ways (docs/design.md §7):
- the group option: ``ranks_per_node=G`` over the normal communicator (NVLink carries the rail);
- ``NCCL_HOSTID`` set per rank: NCCL sees one host per rank, so its LSA team is one rank and the
  default G resolves to 1; NCCL's own transport between "hosts" carries the rail.
"""

import os
import re

import pytest
import torch

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep
from ep_cases import rank_inputs, tokens_of
from gpu_common import cuda_devices, gpu_count, gpus_needed, poison_allocator, requires_gpus
from test_cuda_parity import check_parity, resolve

pytestmark = requires_gpus

GPUS = gpu_count()

# Exact and capacity mode, uneven token counts, a rank with 0 tokens, every token to one expert
# (one_expert: so one node's tokens all go to the other node), masked slots, rows that are not a
# multiple of 16 bytes, no probs, the bench shape, the fixed-capacity layout (whose drops the
# rail's receivers apply to the records of the sources they stand in for).
NODE_CASES = ["bench_shape_4096x7168_top8_e256", "t16384_e64_top2_capacity",
              "zero_token_rank_one_expert_top8", "one_expert_capacity_align16_h7168",
              "t17_e2_top1_fp32_align16_masked_int32", "t1_e8_fp16_capacity_align16_probs_bf16",
              "no_probs_fp16_top8_e64", "h100_rows_not_16_byte_multiple",
              "fixed_capacity_bench_shape_c128_align16",
              "fixed_capacity_one_expert_capacity_mode", "wide_every_expert_e64_fixed_capacity"]


def world_and_nodes():
    """(world, G) pairs: 2 ranks as 2 nodes of 1; 4 ranks as 2 nodes of 2 and 4 nodes of 1 (nodes
    of one rank may share GPUs: gpus_needed)."""
    return [pytest.param(w, g, marks=pytest.mark.skipif(
        GPUS < gpus_needed(w, g),
        reason=f"{w}-rank GPU cases of G={g} need {cuda_devices(gpus_needed(w, g))}, found {GPUS}"))
        for w, g in ((2, 1), (4, 2), (4, 1))]


@pytest.mark.parametrize("world_size,ranks_per_node", world_and_nodes())
@pytest.mark.parametrize("case_name", NODE_CASES)
def test_nodes_equal_reference_bitwise(case_name, world_size, ranks_per_node, seed,
                                       summary_line):
    per_rank = dist.run(world_size, check_parity, case_name, seed, None, False, ranks_per_node,
                        backend="nccl")
    summary_line(f"{per_rank[0][0]} G={ranks_per_node}: T={[r[1] for r in per_rank]} "
                 f"N={[r[2] for r in per_rank]}: outputs, counts, probs, grads bitwise equal")


@pytest.mark.parametrize("world_size,ranks_per_node", world_and_nodes())
@pytest.mark.parametrize("case_name", ["t4096_e64_fp16_masked_align16", "e40_top3_masked",
                                       "wide_every_expert_e64_fixed_capacity"])
def test_nodes_from_routing_map_bitwise(case_name, world_size, ranks_per_node, seed,
                                        summary_line):
    per_rank = dist.run(world_size, check_parity, case_name, seed, None, True, ranks_per_node,
                        backend="nccl")
    summary_line(f"{per_rank[0][0]} G={ranks_per_node} from routing_map: bitwise equal")


def check_hostid(case_name: str, seed: int) -> str:
    """One emulated host per rank (NCCL_HOSTID, set before this process's first NCCL call; the
    process group is gloo): the cuda group's default G resolves to 1. The reference runs on the
    CPU over gloo with G = 1; the same IEEE operations, so the bits must agree."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    case = resolve(case_name, world)
    x, idx, probs = rank_inputs(case, seed, rank, device)
    tokens = max(tokens_of(case["tokens"], r) for r in range(world))
    common = dict(num_experts=case["experts"], hidden=case["hidden"],
                  max_tokens_per_rank=max(1, tokens), max_topk=case["topk"], dtype=case["dtype"],
                  expert_alignment=case.get("alignment", 1))
    if case.get("capacity"):  # a bound a little above the fullest rank's need: a tail exists
        probe = ep.Group(backend="torch", device=torch.device("cpu"), **common)
        need = torch.tensor([probe.create_handle(idx.cpu()).num_recv_tokens])
        torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX)
        probe.destroy()
        common.update(recv_mode="capacity", max_recv_tokens_per_rank=int(need) + 37)
    cuda = ep.Group(backend="cuda", device=device, **common)
    info = cuda.info()
    assert info["ranks_per_node"] == 1, f"NCCL_HOSTID per rank: expected G = 1, got {info}"
    ref = ep.Group(backend="torch", device=torch.device("cpu"), ranks_per_node=1, **common)
    h_cuda, h_ref = cuda.create_handle(idx), ref.create_handle(idx.cpu())
    poison_allocator(device)  # a row the kernels do not write holds NaN, not a lucky zero
    assert h_cuda.num_recv_tokens == h_ref.num_recv_tokens
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    n = h_ref.num_recv_tokens
    expert_out = dense.wide_values(gen, (n, case["hidden"]), case["dtype"])
    probs_cpu = None if probs is None else probs.cpu()
    want = [*h_ref.dispatch(x.cpu(), probs_cpu), h_ref.combine(expert_out)]
    got = [*h_cuda.dispatch(x, probs), h_cuda.combine(expert_out.to(device))]
    if probs is not None:
        grad_recv = torch.rand(n, generator=gen).to(probs.dtype)
        want.append(h_ref.combine_probs(grad_recv))
        got.append(h_cuda.combine_probs(grad_recv.to(device)))
    torch.cuda.synchronize(device)
    for name, w, g in zip(("recv_x", "recv_probs", "y", "combine_probs"), want, got):
        if w is None:
            assert g is None, name
            continue
        dense.assert_bitwise_equal(g.cpu(), w, f"{case_name} (NCCL_HOSTID): {name}")
    for h in (h_cuda, h_ref):
        h.destroy()
    cuda.destroy()
    ref.destroy()
    return f"{case_name} x{world} NCCL_HOSTID per rank: G=1 resolved, N={n}, bitwise equal"


def hostid_rank(case_name: str, seed: int) -> str:
    os.environ["NCCL_HOSTID"] = f"nccl-ep-emulated-host-{torch.distributed.get_rank()}"
    return check_hostid(case_name, seed)


@pytest.mark.skipif(GPUS < gpus_needed(2, 1),
                    reason=f"2 emulated hosts need {gpus_needed(2, 1)} CUDA device(s), found {GPUS}")
@pytest.mark.parametrize("case_name", ["t4096_e64_fp16_masked_align16",
                                       "zero_token_rank_one_expert_top8",
                                       "one_expert_capacity_align16_h7168"])
def test_nccl_hostid_per_rank_bitwise(case_name, seed, summary_line):
    runs = dist.run_isolated(2, hostid_rank, case_name, seed, backend="gloo", gpus=True,
                             timeout=240)
    for r in runs:
        assert r.error is None and not r.hung, f"rank {r.rank}: {r.outcome()}\n{r.error}"
    summary_line(runs[0].value)


# -- what the rail carries (docs/internode.md: a node gets only what it needs) ---------------------
# E = 64 experts in 8 groups of 8; node-limited routing picks 4 of the 8 groups per token.
RAIL_SHAPE = dict(num_experts=64, hidden=7168 // 8, max_tokens=1024, topk=8, groups=8,
                  groups_per_token=4)


def rail_inputs(kind: str, seed: int, world: int):
    """Every rank's routing (uneven token counts, a masked slot per 5th token), the same on every
    rank (seeded by rank)."""
    s = RAIL_SHAPE
    routing = []
    for r in range(world):
        gen = torch.Generator().manual_seed(seed * 131 + r)
        tokens = s["max_tokens"] - 101 * r
        if kind == "uniform":
            idx = ep_cases.uniform_routing(gen, tokens, s["num_experts"], s["topk"])
        else:
            idx = ep_cases.group_limited_routing(gen, tokens, s["num_experts"], s["groups"],
                                                 s["groups_per_token"], s["topk"])
        idx[::5, -1] = -1
        routing.append(idx)
    return routing


def check_rail_messages(kind: str, ranks_per_node: int, recv_mode: str, dense_probs: bool,
                        seed: int, budget_below: int = 0) -> tuple:
    """The cuda group against the reference (same G) on one dispatch with probs, combine and
    combine_probs: outputs bitwise equal, and Group.info()'s rail counters equal the reference's
    and the messages counted token by token. Capacity mode: rail_capacity = the largest pair's
    count (at the bound), or ``budget_below`` under it (an overflow: every rank raises)."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    s, G = RAIL_SHAPE, ranks_per_node
    E, H, K = s["num_experts"], s["hidden"], s["topk"]
    routing = rail_inputs(kind, seed, world)
    counts = ep_cases.rail_counts_by_token(routing, G, E // (world // G))
    fields = dict(num_experts=E, hidden=H, max_tokens_per_rank=s["max_tokens"], max_topk=K,
                  dtype=torch.bfloat16, ranks_per_node=G, device=device)
    budget = None
    if recv_mode == "capacity":
        budget = max(max(row) for row in counts) - budget_below
        fields.update(recv_mode="capacity", max_recv_tokens_per_rank=world * s["max_tokens"] * K,
                      rail_capacity=budget)
    ref, cuda = ep.Group(backend="torch", **fields), ep.Group(backend="cuda", **fields)
    idx = routing[rank].to(device)
    gen = torch.Generator(device=device).manual_seed(seed * 7 + rank)
    x = dense.wide_values(gen, (idx.shape[0], H), torch.bfloat16)
    probs = torch.rand((idx.shape[0], E if dense_probs else K), generator=gen, device=device)
    if budget_below:
        # Every rank names the first pair over the budget in (source, node) order, counted here.
        s0, n0, c0 = next((s, n, c) for s, row in enumerate(counts) for n, c in enumerate(row)
                          if c > budget)
        message = re.escape(f"rail capacity overflow: rank {s0} has {c0} tokens with a slot on "
                            f"node {n0} but rail_capacity={budget} ")
        with pytest.raises(ep.NcclEpError, match=message):
            h_cuda = cuda.create_handle(idx)
            h_cuda.dispatch(x, probs, dense=dense_probs)
            cuda.check_errors()
        with pytest.raises(ep.NcclEpError, match=message):
            ref.create_handle(idx)
        cuda.destroy()
        ref.destroy()
        return "overflow raised"
    h_ref, h_cuda = ref.create_handle(idx), cuda.create_handle(idx)
    poison_allocator(device)
    results = []
    for h in (h_ref, h_cuda):
        recv_x, recv_probs = h.dispatch(x, probs, dense=dense_probs)
        y = h.combine(recv_x)
        grad = h.combine_probs(recv_probs, dense=dense_probs)
        results.append((recv_x, recv_probs, y, grad))
    torch.cuda.synchronize(device)
    for name, want, got in zip(("recv_x", "recv_probs", "y", "combine_probs"), *results):
        dense.assert_bitwise_equal(got, want, f"{kind} G={G} {recv_mode}: {name}")
    rows = ep_cases.rail_rows_sent(counts, rank, G, budget)
    want_rows = {"dispatch": rows[0], "combine": rows[1], "combine_probs": rows[1]}
    want_bytes = ep_cases.rail_bytes_sent(rows, H * 2, K, True)
    for group in (ref, cuda):
        info = group.info()
        assert info["rail_rows_sent"] == want_rows, (group.backend_name, info, want_rows)
        assert info["rail_bytes_sent"] == want_bytes, (group.backend_name, info, want_bytes)
    for h in (h_ref, h_cuda):
        h.destroy()
    ref.destroy()
    cuda.destroy()
    return rows[0], idx.shape[0] * (world // G - 1)


@pytest.mark.parametrize("world_size,ranks_per_node", world_and_nodes())
@pytest.mark.parametrize("recv_mode", ["exact", "capacity"])
@pytest.mark.parametrize("kind,dense_probs", [("uniform", False), ("group_limited", True)])
def test_rail_carries_only_needed_tokens(kind, dense_probs, recv_mode, world_size,
                                         ranks_per_node, seed, summary_line):
    per_rank = dist.run(world_size, check_rail_messages, kind, ranks_per_node, recv_mode,
                        dense_probs, seed, backend="nccl")
    sent, possible = (sum(v) for v in zip(*per_rank))
    summary_line(f"{kind} x{world_size} G={ranks_per_node} {recv_mode}: dispatch rail rows "
                 f"{sent} of {possible} tokens x remote nodes ({sent / possible:.3f}); outputs "
                 f"bitwise the reference's, counters equal")


@pytest.mark.parametrize("world_size,ranks_per_node", world_and_nodes())
def test_rail_overflow_raises_on_every_rank(world_size, ranks_per_node, seed):
    per_rank = dist.run(world_size, check_rail_messages, "group_limited", ranks_per_node,
                        "capacity", False, seed, 1, backend="nccl")
    assert per_rank == ["overflow raised"] * world_size
