"""Drop-and-pad (``moe_pad_expert_input_to_capacity`` with ``moe_expert_capacity_factor``)
through the nccl_ep dispatcher inside Megatron-Core's MoELayer, on gloo with the reference
backend, float64.

The baseline is Megatron's own ``alltoall`` dispatcher: with drop-and-pad it needs no host read
and its all-to-all has equal splits, so it runs on CPU over gloo (given stand-in CUDA streams).
Each case checks, on the same weights and tokens:
- outputs and every gradient within 1e-12 of alltoall's;
- the experts' input: rows, probs and tokens_per_expert bitwise equal to alltoall's (ETP: the
  same runs, in the TP x EP group's rank order rather than alltoall's TP-major order);
- the same rows against an oracle that uses no dispatcher: for every local expert and source
  rank, the tokens of the router's capacity-limited map in token order, C = get_capacity(...)
  rows per run, zero rows after them;
- the router's drops themselves, from Megatron's helper functions on the router's logits: each
  expert keeps min(C, routed) of the tokens routed to it (under the ``probs`` policy the most
  probable ones) and is padded to C with zero-probability tokens.
Where alltoall cannot run (capacity above the token count) the baseline is ``allgather``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import (get_capacity,
                                                     topk_routing_with_score_function)
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

import dist
from megatron_nccl_ep.dispatcher import NcclEpTokenDispatcher
from megatron_nccl_ep.options import NcclEpOptions
from test_megatron_dispatcher import (BATCH, HIDDEN, SEQ, cuda_streams_on_cpu, megatron_on_cpu,
                                      megatron_parallel, moe_layer, parity_case, run_layer)


def drop_and_pad(factor: float, policy: str = "probs") -> dict:
    return dict(moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=True,
                moe_router_load_balancing_type="aux_loss", moe_token_drop_policy=policy)


def record(layer) -> dict:
    """What the router hands the layer's dispatcher (routing map, dense probs) and what the
    dispatcher hands the experts (rows, tokens_per_expert, row probs), at each forward."""
    seen = {}
    dispatcher = layer.token_dispatcher
    preprocess, postprocess = dispatcher.dispatch_preprocess, dispatcher.dispatch_postprocess

    def recording_preprocess(hidden_states, routing_map, probs):
        seen.update(map=routing_map.clone(), probs=probs.detach().clone())
        return preprocess(hidden_states, routing_map, probs)

    def recording_postprocess(*args):
        rows, tokens_per_expert, row_probs = postprocess(*args)
        seen.update(rows=rows.detach().clone(), tokens_per_expert=tokens_per_expert.clone(),
                    row_probs=row_probs.detach().clone())
        return rows, tokens_per_expert, row_probs

    dispatcher.dispatch_preprocess = recording_preprocess
    dispatcher.dispatch_postprocess = recording_postprocess
    return seen


def gather(t: torch.Tensor, group) -> list:
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def skew(layer, x: torch.Tensor) -> None:
    """Every token prefers expert 0 (its capacity overflows: tokens are dropped) and avoids the
    last expert (its capacity is filled with zero-probability padding tokens)."""
    with torch.no_grad():
        layer.router.weight[0, 0] += 4.0
        layer.router.weight[-1, 0] -= 4.0
        x[..., 0] = x[..., 0].abs() + 2.0


def check_router_drops(layer, x: torch.Tensor, seen: dict, capacity: int, policy: str) -> tuple:
    """The router's capacity-limited map against its top-k routing before the drop (Megatron's
    helpers on the router's logits). Returns (dropped, padded) entries of this rank."""
    config = layer.config
    with torch.no_grad():
        logits = layer.router.gating(x.reshape(-1, HIDDEN))
    probs, routed = topk_routing_with_score_function(
        logits, config.moe_router_topk, use_pre_softmax=config.moe_router_pre_softmax,
        score_function=config.moe_router_score_function)
    kept, kept_probs = seen["map"], seen["probs"]
    tokens = kept.shape[0]
    assert kept.sum(0).tolist() == [min(capacity, tokens)] * kept.shape[1], \
        "every expert's column holds exactly its capacity (all tokens when C > T)"
    assert bool((kept_probs[~kept] == 0).all())
    padding = kept & ~routed
    assert bool((kept_probs[padding] == 0).all()), "padding entries carry probability 0"
    assert torch.equal(kept_probs[kept & routed], probs[kept & routed])
    dropped = routed & ~kept
    for e in range(kept.shape[1]):
        n_routed = int(routed[:, e].sum())
        assert int((kept & routed)[:, e].sum()) == min(capacity, n_routed), e
        if policy == "probs" and bool(dropped[:, e].any()):
            assert probs[kept[:, e] & routed[:, e], e].min() >= probs[dropped[:, e], e].max()
    return int(dropped.sum()), int(padding.sum())


def expected_rows(xs: list, maps: list, probs: list, experts, capacity: int) -> tuple:
    """The experts' input without any dispatcher: for each local expert, one run of C rows per
    source (in the order given), holding that source's tokens of the expert's column in token
    order, zero rows (prob 0) after them."""
    rows, row_probs = [], []
    for e in experts:
        for x, m, p in zip(xs, maps, probs):
            tokens = m[:, e].nonzero().flatten()
            assert len(tokens) <= capacity
            run = torch.zeros(capacity, x.shape[1], dtype=x.dtype)
            run_p = torch.zeros(capacity, dtype=p.dtype)
            run[:len(tokens)], run_p[:len(tokens)] = x[tokens], p[tokens, e]
            rows.append(run)
            row_probs.append(run_p)
    return torch.cat(rows), torch.cat(row_probs)


def assert_grads_close(got: tuple, want: tuple, atol: float = 1e-12) -> None:
    """``atol``: 1e-12 in float64 on CPU; float32 on a GPU, where alltoall's unpermute adds a
    token's rows with atomics (in any order), a few float32 ulps."""
    got_out, got_dx, got_grads = got
    want_out, want_dx, want_grads = want
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=atol)
    torch.testing.assert_close(got_dx, want_dx, rtol=0, atol=atol)
    assert got_grads.keys() == want_grads.keys() and "router.weight" in got_grads
    # The router and some expert weights get a gradient, checked over all ranks: for some seeds
    # one rank's kept slots all sit where the skewed router's softmax saturates (no gradient
    # there), and a rank's local experts may see only zero-probability padding, while the
    # skewed expert 0 always keeps tokens.
    expert_grad = torch.stack([g.abs().sum() for n, g in want_grads.items() if "experts" in n])
    nonzero = torch.stack([want_grads["router.weight"].abs().sum(), expert_grad.sum()])
    torch.distributed.all_reduce(nonzero)
    assert nonzero[0].item() > 0 and nonzero[1].item() > 0, nonzero
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def alltoall_case(num_experts: int, topk: int, factor: float, seed: int, policy: str = "probs",
                  recv_mode: str = "exact", ep: int = 0, etp: int = 1, tp: int = 1,
                  skewed: bool = False, baseline_type: str = "alltoall",
                  backend: str = "torch") -> dict:
    """``backend="cuda"``: on this rank's GPU over NCCL, Megatron's real streams, float32 (the
    cuda backend's dtypes); the layout checks stay bitwise, outputs and gradients within
    float32's rounding (tests/gpu/test_megatron_fixed_capacity.py)."""
    rank = torch.distributed.get_rank()
    ep = ep or torch.distributed.get_world_size() // max(tp, etp)
    fields = drop_and_pad(factor, policy)
    if tp > 1:
        fields.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if etp > 1:
        fields.update(expert_tensor_parallel_size=etp)
    on_gpu = backend == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.float32 if on_gpu else torch.float64
    with contextlib.ExitStack() as stack:
        if on_gpu:
            stack.enter_context(megatron_parallel(ep, etp=etp, tp=tp))
        else:
            stack.enter_context(megatron_on_cpu(ep, etp=etp, tp=tp))
            stack.enter_context(cuda_streams_on_cpu())
        try:
            torch.manual_seed(seed)  # same weights on every rank and in both layers
            baseline = moe_layer(baseline_type, num_experts, topk, params_dtype=dtype,
                                 **fields).to(device)
            ours = moe_layer("nccl_ep", num_experts, topk, params_dtype=dtype,
                             **fields).to(device)
            ours.config.nccl_ep_options = NcclEpOptions(backend=backend, recv_mode=recv_mode)
            assert isinstance(ours.token_dispatcher, NcclEpTokenDispatcher)
            torch.manual_seed(seed + rank + 1)  # each rank has its own tokens
            x = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype).to(device)
            grad_out = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype).to(device)
            if skewed:
                skew(baseline, x)
            ours.load_state_dict(baseline.state_dict())
            seen_base, seen = record(baseline), record(ours)
            want = run_layer(baseline, x, grad_out)
            got = run_layer(ours, x, grad_out)
            assert_grads_close(got, want, atol=1e-5 if on_gpu else 1e-12)
            report = check_layout(ours, x, seen, seen_base, policy, ep, etp, baseline_type)

            # Rerun: bitwise the same.
            again = run_layer(ours, x, grad_out)
            assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])
            assert all(torch.equal(again[2][n], got[2][n]) for n in got[2])
        finally:
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # a stand-in stream
    return report


def check_layout(ours, x, seen, seen_base, policy, ep, etp, baseline_type) -> dict:
    dispatcher = ours.token_dispatcher
    tokens = seen["map"].shape[0]
    L, E, K = dispatcher.num_local_experts, dispatcher.num_experts, dispatcher.topk
    capacity = get_capacity(num_tokens=tokens * K, num_experts=E,
                            capacity_factor=ours.config.moe_expert_capacity_factor)
    sources = ep * etp  # every rank of the TP x EP group sends each expert one run
    dropped, padded = check_router_drops(ours, x, seen, capacity, policy)
    # Compared on the host; gathered from the device (NCCL gathers device tensors).
    on_device = seen
    seen, seen_base = ({k: v.cpu() for k, v in d.items()} for d in (seen, seen_base))

    # The library was asked for the fixed-capacity layout (static shapes, no host read): the
    # group the dispatcher used.
    from megatron_nccl_ep.dispatcher_common import GROUPS

    cached = GROUPS.cached("ht")
    assert {g.config.expert_capacity for g in cached} == {capacity}
    # Counts: the constant R * C on the host, as alltoall's.
    tpe = seen["tokens_per_expert"]
    assert tpe.device.type == "cpu" and tpe.dtype == torch.int64
    assert tpe.tolist() == [sources * capacity] * L
    assert seen["rows"].shape[0] == L * sources * capacity
    if baseline_type == "alltoall":
        assert torch.equal(tpe, seen_base["tokens_per_expert"])
    else:  # allgather counts the tokens it received, without the empty rows
        assert tpe.tolist() != seen_base["tokens_per_expert"].tolist()

    # The experts' input against the oracle (sources in the TP x EP group's order).
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    assert group.size() == sources
    xs = [t.cpu() for t in gather(x.reshape(-1, HIDDEN), group)]
    maps = [m.bool().cpu() for m in gather(on_device["map"].to(torch.uint8), group)]
    probs = [t.cpu() for t in gather(on_device["probs"], group)]
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    want_rows, want_probs = expected_rows(xs, maps, probs, range(ep_rank * L, ep_rank * L + L),
                                          capacity)
    assert torch.equal(seen["rows"], want_rows), "rows differ from the oracle"
    assert torch.equal(seen["row_probs"], want_probs), "row probs differ from the oracle"
    empty = (want_rows == 0).all(1) & (want_probs == 0)

    if baseline_type == "alltoall":  # bitwise alltoall's rows, up to the order of the runs
        rows, row_probs = seen["rows"], seen["row_probs"]
        if etp > 1:  # ours: runs in group rank order ep_rank * etp + tp_rank; alltoall: TP-major
            rows = rows.view(L, ep, etp, capacity, HIDDEN).transpose(1, 2).reshape(-1, HIDDEN)
            row_probs = row_probs.view(L, ep, etp, capacity).transpose(1, 2).reshape(-1)
        assert torch.equal(rows, seen_base["rows"]), "rows differ from alltoall's"
        assert torch.equal(row_probs, seen_base["row_probs"]), "row probs differ from alltoall's"
    return dict(capacity=capacity, tokens=tokens, dropped=dropped, padded=padded,
                empty_rows=int(empty.sum()))


# name -> (world size, alltoall_case arguments). T = SEQ * BATCH = 18 tokens per rank.
ALLTOALL_CASES = {
    "ep2_skewed": (2, dict(num_experts=4, topk=2, factor=1.0, skewed=True)),
    "ep2_position_capacity_mode_skewed": (2, dict(num_experts=4, topk=2, factor=0.5,
                                                  policy="position", recv_mode="capacity",
                                                  skewed=True)),
    "ep4_e8_k3": (4, dict(num_experts=8, topk=3, factor=0.75)),
    "ep1_capacity_mode": (1, dict(num_experts=4, topk=2, factor=1.5, recv_mode="capacity")),
    "ep2_tp2": (4, dict(num_experts=4, topk=2, factor=1.0, tp=2, skewed=True)),
    "ep1_etp2": (2, dict(num_experts=4, topk=2, factor=1.0, ep=1, etp=2, skewed=True)),
    "ep2_etp2": (4, dict(num_experts=4, topk=2, factor=1.0, ep=2, etp=2)),
}


@pytest.mark.parametrize("case_name", list(ALLTOALL_CASES))
def test_drop_and_pad_matches_alltoall(case_name, seed):
    world, kwargs = ALLTOALL_CASES[case_name]
    reports = dist.run(world, alltoall_case, seed=seed, **kwargs)
    print(case_name, reports)
    # A skewed router overloads expert 0 and starves the last expert on every rank.
    if kwargs.get("skewed"):
        assert all(r["dropped"] > 0 and r["padded"] > 0 for r in reports), reports
    assert all(r["empty_rows"] == 0 for r in reports), "C <= T: the router fills every row"


def test_drop_and_pad_with_capacity_above_the_tokens(seed):
    # C = ceil(18 * 2 / 4 * 3) = 27 > 18 tokens: the router keeps every token in every column
    # and alltoall cannot run (its permute reshapes 18 rows into 27). Ours: every run has the
    # source's 18 tokens, then 9 zero rows (prob 0); allgather's outputs and gradients.
    reports = dist.run(2, alltoall_case, 4, 2, 3.0, seed, baseline_type="allgather")
    assert all(r["capacity"] == 27 and r["tokens"] == 18 for r in reports), reports
    assert all(r["empty_rows"] == 2 * 2 * 9 for r in reports), reports  # L * R * (C - T)


@pytest.mark.parametrize("variant", ["quantization_padding", "quantization_padding_capacity",
                                     "shared_expert_overlap"])
def test_drop_and_pad_with_other_options(variant, seed):
    # Against allgather (which these options also run on, with the same rows here). With
    # quantization padding each expert's R * C rows are followed by zero rows up to FP8's 16
    # (parity_case checks the aligned counts); alltoall would hand the experts R * C.
    fields = drop_and_pad(1.0)
    if variant == "shared_expert_overlap":
        fields.update(shared_expert_overlap=True, moe_shared_expert_intermediate_size=24)
    else:
        fields.update(quantization_padding=True,
                      recv_mode="capacity" if variant.endswith("capacity") else "exact")
    assert all(dist.run(2, parity_case, 4, 2, seed, **fields))


def methods_case(seed: int) -> bool:
    """The dispatcher's own drop, on hand-made routing maps given straight to both dispatchers'
    methods (no router): a column with more than C tokens keeps its first C in token order, as
    alltoall's permute does; a column with fewer gets zero rows where alltoall repeats other
    (unrouted, probability 0) tokens. Outputs and gradients of x and probs as alltoall's."""
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    tokens, E, K, factor = 12, 2 * world, 2, 0.5
    capacity = get_capacity(num_tokens=tokens * K, num_experts=E, capacity_factor=factor)
    assert capacity == 3
    with megatron_on_cpu(world), cuda_streams_on_cpu():
        try:
            torch.manual_seed(seed)
            layers = {name: moe_layer(name, E, K, **drop_and_pad(factor))
                      for name in ("alltoall", "nccl_ep")}
            layers["nccl_ep"].config.nccl_ep_options = NcclEpOptions(backend="torch")
            gen = torch.Generator().manual_seed(seed * 13 + rank)
            routing_map = torch.rand(tokens, E, generator=gen) < 0.7
            routing_map[:, -1] = False
            routing_map[rank % tokens, -1] = True  # the last expert: one token from each rank
            routing_map[:capacity + 1, 0] = True  # at least one column over C (usually several)
            scores = torch.rand(tokens, E, generator=gen, dtype=torch.float64) + 0.5
            x = torch.randn(tokens, 1, HIDDEN, generator=gen, dtype=torch.float64)
            grad_y = torch.randn(tokens, 1, HIDDEN, generator=gen, dtype=torch.float64)
            results = {}
            for name, layer in layers.items():
                d = layer.token_dispatcher
                xi = x.clone().requires_grad_()
                probs = (scores * routing_map).requires_grad_()
                h, p = d.dispatch_preprocess(xi, routing_map, probs)
                rows, tpe, row_probs = d.dispatch_postprocess(*d.token_dispatch(h, p))
                expert_out = rows * row_probs[:, None] * 1.5 + rows * row_probs[:, None] ** 2
                y = d.combine_postprocess(d.token_combine(d.combine_preprocess(expert_out)))
                y.backward(grad_y)
                results[name] = (rows.detach(), tpe, row_probs.detach(), y.detach(), xi.grad,
                                 probs.grad)
        finally:
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
    rows, tpe, row_probs, y, gx, gp = results["nccl_ep"]
    a_rows, a_tpe, a_probs, a_y, a_gx, a_gp = results["alltoall"]
    assert torch.equal(tpe, a_tpe) and tpe.tolist() == [world * capacity] * 2
    assert torch.equal(row_probs, a_probs)
    routed = row_probs != 0  # alltoall's other rows are repeated tokens of probability 0
    assert torch.equal(rows[routed], a_rows[routed])
    assert bool((rows[~routed] == 0).all())
    if rank == world - 1:  # the last expert's runs: 1 token, then C - 1 such rows
        assert int((~routed).sum()) >= world * (capacity - 1)
        assert bool((a_rows[~routed] != 0).any())
    for got, want in ((y, a_y), (gx, a_gx), (gp[routing_map], a_gp[routing_map])):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # Unrouted entries: alltoall's repeated tokens send gradient there (a router's scatter
    # drops it); ours has no such rows.
    assert bool((gp[~routing_map] == 0).all())
    # The first C tokens of each column, in token order, are the ones kept.
    kept = gp != 0
    for e in range(E):
        first = routing_map[:, e].nonzero().flatten()[:capacity]
        assert kept[:, e].nonzero().flatten().tolist() == first.tolist(), e
    return True


def test_dispatcher_drops_like_alltoall_on_its_own_maps(seed):
    assert all(dist.run(2, methods_case, seed))


def refused_without_factor_case() -> bool:
    with megatron_on_cpu(1):
        layer = moe_layer("nccl_ep", 4, 2, **drop_and_pad(1.0))
        layer.config.moe_expert_capacity_factor = None
        with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity needs "
                                             "moe_expert_capacity_factor"):
            NcclEpTokenDispatcher(4, list(range(4)), layer.config)
    return True


def test_drop_and_pad_needs_a_capacity_factor():
    assert all(dist.run(1, refused_without_factor_case))


def test_dense_probs_when_experts_equal_topk(seed):
    # A group whose top-k equals its expert count (as drop-and-pad groups have, max_topk = E)
    # must still read the router's probs by expert column: here E = K = 2 with token dropping,
    # so a token may keep only expert 1, whose slot 0 then holds expert 1's probability.
    assert all(dist.run(2, parity_case, 2, 2, seed, moe_expert_capacity_factor=0.5,
                        moe_router_load_balancing_type="aux_loss"))
