"""Groups that span nodes on the cuda backend (docs/design.md §4, docs/internode.md): tokens
cross between nodes over NCCL send/receive on the rail communicator and fan out over NVLink in the
node; combine sums node by node. Every output and gradient BITWISE equal to the reference
backend with the same ranks per node G (whose G = 1 is bitwise its flat result:
tests/test_reference_hierarchy.py). The GPU soak (test_cuda_soak.py) draws G too, with dense
[T, E] probs among its random calls.

Emulated nodes on one machine, two ways (docs/design.md §7):
- the group option: ``ranks_per_node=G`` over the normal communicator (NVLink carries the rail);
- ``NCCL_HOSTID`` set per rank: NCCL sees one host per rank, so its LSA team is one rank and the
  default G resolves to 1; NCCL's own transport between "hosts" carries the rail.
"""

import os

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
