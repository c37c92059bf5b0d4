"""The CUDA backend against the reference backend on the same GPUs and the same NCCL process group:
every output and every gradient must be BITWISE equal (docs/design.md §3/§4 fix both the layout and the
order of arithmetic, and the reference runs the same elementwise IEEE operations on the GPU).

Each case runs both backends on identical inputs in one spawned 2-rank (and 4-rank, when 4 GPUs
exist) NCCL group. The CUDA outputs are fresh allocations from a NaN-poisoned caching allocator,
and the comparison covers every row including alignment padding and the capacity tail, so a row the
kernels do not write fails the test. Incoming gradients and expert outputs carry NaN in their
padding rows: the kernels must not read them.
"""

import pytest
import torch
import torch.distributed as tdist

import dense
import dist
import ep_cases
import megatron_nccl_ep as ep
from ep_cases import rank_inputs, tokens_of
from gpu_common import nan_outside, poison_allocator, requires_gpus, routing_map_of, world_sizes

pytestmark = requires_gpus

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# Not the full product: each required value appears at least once (hidden 128/2048/7168, top-k
# 1/2/8, experts 2/8/64/256, tokens per rank 0/1/17/4096/16384, bf16/fp16/fp32, masked slots, all
# tokens to one expert, alignment 16, exact and capacity). ``tokens`` cycles over ranks.
CASES = {
    "bench_shape_4096x7168_top8_e256": dict(tokens=4096, hidden=7168, topk=8, experts=256,
                                            dtype=BF16, routing="random"),
    "t16384_e64_top2_capacity": dict(tokens=16384, hidden=2048, topk=2, experts=64, dtype=BF16,
                                     routing="random", capacity=True),
    "t17_e2_top1_fp32_align16_masked_int32": dict(tokens=17, hidden=128, topk=1, experts=2,
                                                  dtype=FP32, routing="masked", alignment=16,
                                                  idx_dtype=torch.int32),
    "t1_e8_fp16_capacity_align16_probs_bf16": dict(tokens=1, hidden=2048, topk=2, experts=8,
                                                   dtype=FP16, routing="random", capacity=True,
                                                   alignment=16, probs_dtype=BF16),
    "zero_token_rank_one_expert_top8": dict(tokens=(0, 33), hidden=128, topk=8, experts=8,
                                            dtype=FP32, routing="one_expert"),
    "t4096_e64_fp16_masked_align16": dict(tokens=4096, hidden=128, topk=8, experts=64,
                                          dtype=FP16, routing="masked", alignment=16,
                                          idx_dtype=torch.int32),
    "t17_h7168_e256_fp32_capacity_masked": dict(tokens=17, hidden=7168, topk=2, experts=256,
                                                dtype=FP32, routing="masked", capacity=True),
    "t4096_one_expert_top1": dict(tokens=4096, hidden=2048, topk=1, experts=8, dtype=BF16,
                                  routing="one_expert"),
    "t16384_e256_top8_masked": dict(tokens=16384, hidden=128, topk=8, experts=256, dtype=BF16,
                                    routing="masked"),
    "all_ranks_zero_tokens": dict(tokens=0, hidden=2048, topk=2, experts=8, dtype=BF16,
                                  routing="random"),
    "one_expert_capacity_align16_h7168": dict(tokens=(17, 1), hidden=7168, topk=2, experts=256,
                                              dtype=BF16, routing="one_expert", capacity=True,
                                              alignment=16),
    "no_probs_fp16_top8_e64": dict(tokens=17, hidden=2048, topk=8, experts=64, dtype=FP16,
                                   routing="random", probs_dtype=None),
    # fp32 at top-8: on one rank, the combine's wide staging with 4-float packs.
    "t300_fp32_top8_e16_h2048": dict(tokens=300, hidden=2048, topk=8, experts=16, dtype=FP32,
                                     routing="random"),
    # 200-byte rows are not a multiple of 16: the kernels' element path (no 16-byte packs).
    "h100_rows_not_16_byte_multiple": dict(tokens=300, hidden=100, topk=4, experts=8,
                                           dtype=BF16, routing="masked", alignment=16),
    # 40 experts: the routing-map kernel's last group of 32 experts is partial.
    "e40_top3_masked": dict(tokens=300, hidden=256, topk=3, experts=40, dtype=BF16,
                            routing="masked"),
    # Capacity mode that drops its overflow: the bound ~1000 rows short of what the fullest rank
    # needs, so the last experts' rows are dropped (no row, not combined, 0 probs' gradient).
    "t4096_e64_top8_capacity_drop_align16": dict(tokens=4096, hidden=2048, topk=8, experts=64,
                                                 dtype=BF16, routing="random", capacity="drop",
                                                 alignment=16),
    "one_expert_capacity_drop_fp16": dict(tokens=(300, 17), hidden=256, topk=2, experts=8,
                                          dtype=FP16, routing="one_expert", capacity="drop"),
    # The fixed-capacity (drop-and-pad) layout: C rows per (expert, source), later slots dropped
    # (~4% of them at the bench shape), empty rows zero; capacity mode at its fixed size.
    "fixed_capacity_bench_shape_c128_align16": dict(tokens=4096, hidden=7168, topk=8,
                                                    experts=256, dtype=BF16, routing="random",
                                                    expert_capacity=128, alignment=16),
    "fixed_capacity_one_expert_capacity_mode": dict(tokens=(300, 17), hidden=2048, topk=2,
                                                    experts=8, dtype=FP16, routing="one_expert",
                                                    capacity=True, expert_capacity=40,
                                                    probs_dtype=BF16),
    # Top-k above 32 (every expert of every token, as a drop-and-pad routing map may name): at
    # most 32 slots of a token on one rank, so from 2 ranks of 32 experts (min_world).
    "wide_every_expert_e64_fixed_capacity": dict(tokens=(128, 77), hidden=256, topk=64,
                                                 experts=64, dtype=BF16, routing="random",
                                                 expert_capacity=40, min_world=2),
}


def resolve(case_name: str, world: int) -> dict:
    """The case for this world size: experts rounded up to a multiple of the ranks (2 experts
    cannot be split over 4 ranks)."""
    case = dict(CASES[case_name])
    case["experts"] = max(case["experts"], world)
    return case


def make_groups(case: dict, x, idx, world: int, device, **extra):
    """(reference group, cuda group) with one configuration; capacity mode gets a bound a little
    above what the fullest rank needs, so that a tail of unused rows exists (capacity "drop": a
    bound below it, so that the fullest rank drops rows)."""
    tokens = max(tokens_of(case["tokens"], r) for r in range(world))
    common = dict(num_experts=case["experts"], hidden=case["hidden"],
                  max_tokens_per_rank=max(1, tokens), max_topk=case["topk"],
                  dtype=case["dtype"], device=device,
                  expert_alignment=case.get("alignment", 1),
                  expert_capacity=case.get("expert_capacity", 0), **extra)
    if case.get("capacity") and case.get("expert_capacity"):  # its size is the layout's
        common.update(recv_mode="capacity")
    elif case.get("capacity"):
        probe = ep.Group(backend="torch", **common)
        need = torch.tensor([probe.create_handle(idx).num_recv_tokens], device=device)
        tdist.all_reduce(need, op=tdist.ReduceOp.MAX, group=extra.get("process_group"))
        probe.destroy()
        if case["capacity"] == "drop":
            short = max(1, int(need) // 4)
            common.update(recv_mode="capacity", max_recv_tokens_per_rank=int(need) - short,
                          capacity_overflow="drop")
        else:
            common.update(recv_mode="capacity", max_recv_tokens_per_rank=int(need) + 37)
    return ep.Group(backend="torch", **common), ep.Group(backend="cuda", **common)


def full_pass(handle, x, probs, grads, device):
    """dispatch -> backward, combine -> backward through the autograd functions; every result."""
    poison_allocator(device)
    xg = x.clone().requires_grad_(True)
    pg = None if probs is None else probs.clone().requires_grad_(True)
    recv_x, recv_probs = ep.dispatch(handle, xg, pg)
    outs, grad_outs = [recv_x], [grads["recv_x"]]
    if pg is not None:
        outs.append(recv_probs)
        grad_outs.append(grads["recv_probs"])
    torch.autograd.backward(outs, grad_outs)
    expert_out = grads["expert_out"].clone().requires_grad_(True)
    y = ep.combine(handle, expert_out)
    y.backward(grads["y"])
    grad_probs_direct = None
    if pg is not None:
        grad_probs_direct = handle.combine_probs(grads["recv_probs"])
    torch.cuda.synchronize(device)
    return {"recv_x": recv_x, "recv_probs": recv_probs, "grad_x": xg.grad,
            "grad_probs": None if pg is None else pg.grad, "y": y,
            "grad_expert_out": expert_out.grad, "combine_probs": grad_probs_direct}


def check_parity(case_name: str, seed: int, subgroups=None, from_map: bool = False,
                 ranks_per_node: int = 0) -> str:
    """``subgroups``: member lists partitioning the world; each becomes its own EP group (ranks
    numbered inside it), as Megatron's expert-parallel groups are. ``from_map``: the handles are
    made from the dense routing map of the case's routing (a router's output), whose top-k form
    must agree bitwise too. ``ranks_per_node``: both groups split into nodes of that many ranks
    (docs/design.md §4; the cuda backend's rail transfers, tests/gpu/test_cuda_nodes.py)."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    extra = {"ranks_per_node": ranks_per_node} if ranks_per_node else {}
    if subgroups is not None:
        pgs = [tdist.new_group(members) for members in subgroups]
        which = next(i for i, m in enumerate(subgroups) if rank in m)
        extra["process_group"] = pgs[which]
        rank, world = tdist.get_rank(pgs[which]), len(subgroups[which])
        seed += 1000 * which
    case = resolve(case_name, world)
    x, idx, probs = rank_inputs(case, seed, rank, device)
    ref, cuda = make_groups(case, x, idx, world, device, **extra)
    if from_map:
        routing_map = routing_map_of(idx, case["experts"])
        h_ref = ref.create_handle(routing_map=routing_map)
        h_cuda = cuda.create_handle(routing_map=routing_map)
        dense.assert_bitwise_equal(h_cuda.topk_idx, h_ref.topk_idx, "topk_idx of routing_map")
        # Ascending experts, -1 after the last, K = max_topk slots.
        want = torch.sort(torch.where(idx >= 0, idx, case["experts"]), dim=1).values.long()
        dense.assert_bitwise_equal(h_ref.topk_idx, torch.where(want < case["experts"], want, -1),
                                   "reference topk_idx of routing_map")
    else:
        h_ref, h_cuda = ref.create_handle(idx), cuda.create_handle(idx)
    if ranks_per_node:
        info = cuda.info()
        assert info["ranks_per_node"] == ranks_per_node and info["rail_bytes"] > 0, info

    n = h_ref.num_recv_tokens
    assert h_cuda.num_recv_tokens == n, f"num_recv_tokens {h_cuda.num_recv_tokens}, expected {n}"
    tpe_ref, tpe_cuda = h_ref.tokens_per_expert, h_cuda.tokens_per_expert
    assert tpe_cuda.device == tpe_ref.device, (
        f"tokens_per_expert on {tpe_cuda.device}, expected {tpe_ref.device} ({case})")
    dense.assert_bitwise_equal(tpe_cuda, tpe_ref, "tokens_per_expert")

    # Rows that carry a (token, slot): the reference's recv probs of an all-ones probs tensor.
    ones = torch.ones(idx.shape, dtype=torch.float32, device=device)
    used = h_ref.dispatch(x, ones)[1] != 0
    gen = torch.Generator(device=device).manual_seed(seed * 31 + rank)
    dtype, hidden = case["dtype"], case["hidden"]
    grads = {
        "recv_x": nan_outside(dense.wide_values(gen, (n, hidden), dtype), used),
        "recv_probs": nan_outside(torch.rand(n, generator=gen, device=device)
                                  .to(probs.dtype if probs is not None else torch.float32), used),
        "expert_out": nan_outside(dense.wide_values(gen, (n, hidden), dtype), used),
        "y": dense.wide_values(gen, tuple(x.shape), dtype),
    }
    ref_sent = ref.info()  # (the reference's dispatch of `ones` above went over its rail too)
    want = full_pass(h_ref, x, probs, grads, device)
    got = full_pass(h_cuda, x, probs, grads, device)
    if ranks_per_node:  # the library's rail carried what the reference's messages count
        after = ref.info()
        for key in ("rail_rows_sent", "rail_bytes_sent"):
            ref_delta = {op: n - ref_sent[key][op] for op, n in after[key].items()}
            assert cuda.info()[key] == ref_delta, (key, cuda.info()[key], ref_delta)
    for name, w in want.items():
        if w is None:
            assert got[name] is None, f"{name}: expected None"
            continue
        dense.assert_bitwise_equal(got[name], w, f"{case_name}: {name}")
    assert not torch.isnan(want["y"]).any() and not torch.isnan(want["grad_x"]).any(), (
        "the reference read a NaN padding row")
    for h in (h_ref, h_cuda):
        h.destroy()
    ref.destroy()
    cuda.destroy()
    mode = {None: "exact", True: "capacity", "drop": "capacity (drops)"}[case.get("capacity")]
    if case.get("capacity") == "drop":  # the case does what it is for: rows dropped somewhere
        needed = torch.tensor([int(tpe_ref.sum()) - n], device=device)
        tdist.all_reduce(needed, op=tdist.ReduceOp.MAX, group=extra.get("process_group"))
        assert int(needed) > 0, "no rank dropped a row"
    return (f"{case_name} x{world}: H={hidden} K={case['topk']} E={case['experts']} "
            f"{str(dtype)[6:]} {mode} A={case.get('alignment', 1)}", x.shape[0], n,
            int(used.sum()))


@pytest.mark.parametrize("world_size", world_sizes())
@pytest.mark.parametrize("case_name", list(CASES))
def test_cuda_equals_reference_bitwise(case_name, world_size, seed, summary_line):
    if world_size < CASES[case_name].get("min_world", 1):
        pytest.skip(f"{case_name} has more than 32 slots of a token on one rank below "
                    f"{CASES[case_name]['min_world']} ranks (the cuda backend refuses it)")
    per_rank = dist.run(world_size, check_parity, case_name, seed, backend="nccl")
    summary_line(f"{per_rank[0][0]} T={[r[1] for r in per_rank]} N={[r[2] for r in per_rank]} "
                 f"used={[r[3] for r in per_rank]}: outputs, counts, probs, grads bitwise equal")


@pytest.mark.parametrize("world_size", world_sizes())
@pytest.mark.parametrize("case_name", ["bench_shape_4096x7168_top8_e256",
                                       "t4096_e64_fp16_masked_align16",
                                       "zero_token_rank_one_expert_top8",
                                       "t16384_e64_top2_capacity", "e40_top3_masked",
                                       "fixed_capacity_bench_shape_c128_align16"])
def test_cuda_routing_map_equals_reference_bitwise(case_name, world_size, seed, summary_line):
    per_rank = dist.run(world_size, check_parity, case_name, seed, None, True, backend="nccl")
    summary_line(f"{per_rank[0][0]} from routing_map: N={[r[2] for r in per_rank]}: topk_idx, "
                 "outputs, counts, probs, grads bitwise equal")


SUBGROUPS = {"contiguous": [[0, 1], [2, 3]], "strided": [[0, 2], [1, 3]]}


@pytest.mark.skipif(torch.cuda.device_count() < 4,
                    reason="EP subgroups of a 4-rank world need 4 CUDA devices")
@pytest.mark.parametrize("layout_name", list(SUBGROUPS))
@pytest.mark.parametrize("case_name", ["t4096_e64_fp16_masked_align16",
                                       "one_expert_capacity_align16_h7168"])
def test_cuda_equals_reference_in_ep_subgroups(case_name, layout_name, seed, summary_line):
    per_rank = dist.run(4, check_parity, case_name, seed, SUBGROUPS[layout_name],
                        backend="nccl")
    summary_line(f"{per_rank[0][0]} in {layout_name} subgroups {SUBGROUPS[layout_name]}: "
                 f"N={[r[2] for r in per_rank]}: bitwise equal")


REPEATS = 20


def check_repeats(case_name: str, seed: int) -> str:
    """The same routing and inputs, 20 fresh handles on one group, allocator re-poisoned before
    each: every output bitwise identical to the first run's."""
    rank, world = ep_cases.rank_and_size()
    device = torch.device("cuda", torch.cuda.current_device())
    case = resolve(case_name, world)
    x, idx, probs = rank_inputs(case, seed, rank, device)
    ref, cuda = make_groups(case, x, idx, world, device)
    ref.destroy()
    first = None
    for i in range(REPEATS):
        poison_allocator(device, large_bytes=2 << 30)
        h = cuda.create_handle(idx)
        recv_x, recv_probs = h.dispatch(x, probs)
        gen = torch.Generator(device=device).manual_seed(seed + 5)
        expert_out = dense.wide_values(gen, tuple(recv_x.shape), recv_x.dtype)
        y = h.combine(expert_out)
        grad_probs = h.combine_probs(recv_probs)
        run = [dense.bits(t) for t in (h.tokens_per_expert, recv_x, recv_probs, y, grad_probs)]
        h.destroy()
        if first is None:
            first = run
            continue
        for name, a, b in zip(("tokens_per_expert", "recv_x", "recv_probs", "y", "combine_probs"),
                              run, first):
            assert torch.equal(a, b), f"repeat {i}: {name} differs bitwise from the first run"
    cuda.destroy()
    return f"{case_name} x{world}: {REPEATS} runs bitwise identical"


@pytest.mark.parametrize("world_size", world_sizes())
@pytest.mark.parametrize("case_name", ["bench_shape_4096x7168_top8_e256",
                                       "one_expert_capacity_align16_h7168"])
def test_cuda_repeated_runs_bitwise_identical(case_name, world_size, seed, summary_line):
    summary_line(dist.run(world_size, check_repeats, case_name, seed, backend="nccl")[0])
