"""NcclEpInferenceDispatcher (``inference_moe_token_dispatcher_type="nccl_ep"``) against
Megatron's own ``NCCLAllGatherDispatcher``, on gloo with the reference backend (EP 1, 2, 4).

(a) What the experts get, on the same routing: the rows with an expert on this rank, ids (other
    ranks' experts -1) and probs (0 there) are NCCLAllGatherDispatcher's gathered rows, bitwise,
    compacted in (source rank, token) order, and the experts' valid-rows tensor holds their
    count. The combine of the same partial rows (the rows past the count NaN) agrees with
    NCCLAllGatherDispatcher's fp32 reduce-scatter: within fp32 rounding before the one rounding
    to bf16 with an fp32 payload; with a bf16 payload each rank's partial is rounded to bf16
    first, and the sum of those is met the same way.
(b) Megatron's fused inference experts (``mcore_fused_moe``, its Triton kernels run by Triton's
    interpreter on CPU, torch's grouped GEMM) on both dispatchers' outputs, then each combine
    (EP 1 and 2).
(c) Reruns are bitwise identical.
(d) ``register()``: the config, Megatron's argparse and ``MoELayer._setup_inference_mode`` take
    ``"nccl_ep"``; the inference context's token budget reaches the dispatcher.

Megatron's inference MoE layer itself (``InferenceGroupedMLP``) needs transformer-engine, so the
dispatchers and experts are driven here as ``MoELayer.forward`` drives them; the GPU variant is
tests/gpu/test_megatron_inference_gpu.py, a full model examples/decode_moe.py.
"""

from __future__ import annotations

import contextlib
import os
import textwrap
import types

import pytest
import torch
import torch.distributed as dist_

import dist
import megatron_nccl_ep
from megatron_nccl_ep.inference import NcclEpInferenceDispatcher, destroy_inference_groups
from megatron_nccl_ep.options import NcclEpOptions
from test_megatron_dispatcher import megatron_on_cpu, megatron_parallel

megatron_nccl_ep.register()

HIDDEN, FFN, T_MAX = 32, 64, 8  # grouped GEMM: rows of 16-byte multiples


def inference_config(num_experts: int, topk: int, backend: str, dispatcher_type="nccl_ep"):
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        num_moe_experts=num_experts, moe_router_topk=topk, use_cpu_initialization=True,
        moe_router_pre_softmax=topk == 1,  # Megatron requires it at top-k 1
        add_bias_linear=False, inference_moe_token_dispatcher_type=dispatcher_type)
    config.nccl_ep_options = NcclEpOptions(backend=backend, max_tokens_per_rank=T_MAX,
                                           timeout_s=30.0)
    return config


def random_routing(tokens: int, num_experts: int, topk: int, gen) -> torch.Tensor:
    """Distinct experts per token, about one slot in six masked (-1), one token fully masked."""
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:topk]
                       for _ in range(tokens)]) if tokens else torch.empty(0, topk, dtype=torch.long)
    ids[torch.rand(tokens, topk, generator=gen) < 1 / 6] = -1
    if tokens > 2:
        ids[tokens // 2] = -1
    return ids


@contextlib.contextmanager
def dispatchers(num_experts: int, topk: int, payload_fp32: bool, unequal: bool, backend: str,
                device: torch.device):
    """Megatron's NCCLAllGatherDispatcher and ours for this rank, with the class-level state
    both use (the valid-rows tensor, the all-gather-v switch, the payload dtype) restored after."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher_inference import (
        InferenceAllGatherDispatcherBase, NCCLAllGatherDispatcher)

    ep = dist_.get_world_size()
    parallel = megatron_on_cpu(ep) if device.type == "cpu" else megatron_parallel(ep)
    saved = (InferenceAllGatherDispatcherBase._valid_tokens_tensor,
             NCCLAllGatherDispatcher._use_allgather_v, NcclEpInferenceDispatcher.payload_dtype)
    with parallel:
        try:
            pg = ProcessGroupCollection.use_mpu_process_groups()
            config = inference_config(num_experts, topk, backend)
            local = num_experts // ep
            experts = list(range(dist_.get_rank() * local, (dist_.get_rank() + 1) * local))
            InferenceAllGatherDispatcherBase._valid_tokens_tensor = torch.zeros(
                1, dtype=torch.int32, device=device)
            # Megatron's non-graph path gathers variable counts (its graph path needs equal ones).
            NCCLAllGatherDispatcher._use_allgather_v = unequal
            NcclEpInferenceDispatcher.payload_dtype = torch.float32 if payload_fp32 else None
            yield (NCCLAllGatherDispatcher(local, experts, config=config, pg_collection=pg),
                   NcclEpInferenceDispatcher(local, experts, config=config, pg_collection=pg))
        finally:
            destroy_inference_groups()
            (InferenceAllGatherDispatcherBase._valid_tokens_tensor,
             NCCLAllGatherDispatcher._use_allgather_v, NcclEpInferenceDispatcher.payload_dtype) = saved


def dispatch(dispatcher, x, ids, probs, keep: bool = True):
    """MoELayer.forward's calls up to the experts: -> (rows, probs, ids, valid count tensor);
    ``keep``: copies of them (the next dispatch of the group writes ours again: the layers share
    them), else the dispatcher's own."""
    from megatron.core.transformer.moe.token_dispatcher_inference import (
        InferenceAllGatherDispatcherBase)

    hidden, p = dispatcher.dispatch_preprocess(x, ids, probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    hidden, tokens_per_expert, p = dispatcher.dispatch_postprocess(hidden, p)
    assert tokens_per_expert is None
    valid = InferenceAllGatherDispatcherBase._valid_tokens().clone()
    if not keep:
        return hidden, p, dispatcher.routing_map, valid
    return hidden.clone(), p.clone(), dispatcher.routing_map.clone(), valid


def poison_shared_outputs() -> None:
    """The dispatch outputs the groups' layers share, poisoned (all but the valid-rows count):
    the next dispatch must write every part the contract defines."""
    from megatron_nccl_ep import inference
    from megatron_nccl_ep.outputs import FIELDS

    for _, out in inference._shared_outputs.values():
        for name in FIELDS:
            t = getattr(out, name)
            if name != "count" and t is not None:
                t.fill_(float("nan") if t.is_floating_point() else -7)


def combine(dispatcher, expert_out):
    out = dispatcher.token_combine(dispatcher.combine_preprocess(expert_out))
    return dispatcher.combine_postprocess(out)


def all_ranks_rows(t: torch.Tensor) -> list:
    """Every rank's ``t`` (first dimensions may differ), by rank."""
    sizes = [None] * dist_.get_world_size()
    dist_.all_gather_object(sizes, tuple(t.shape))
    padded = torch.zeros((max(s[0] for s in sizes),) + tuple(t.shape[1:]), dtype=t.dtype,
                         device=t.device)
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in sizes]
    dist_.all_gather(out, padded)
    return [o[:s[0]] for o, s in zip(out, sizes)]


def assert_rounded_sum(got: torch.Tensor, partials_by_rank: list, rows: list):
    """``got [T, H]`` (bf16) is the fp32 sum of ``partials_by_rank[q][rows[q]]`` over ranks q,
    rounded once: it lies between the bf16 roundings of the exact sum minus and plus fp32's
    bound for summing R terms (R * eps32 * sum |terms|), rounding being monotone."""
    terms = torch.stack([p[r].double() for p, r in zip(partials_by_rank, rows)])
    exact = terms.sum(0)
    slack = len(rows) * torch.finfo(torch.float32).eps * terms.abs().sum(0) + 1e-30
    low, high = (exact - slack).to(got.dtype), (exact + slack).to(got.dtype)
    assert bool(((low <= got) & (got <= high)).all()), (
        "combine outside fp32 rounding of the exact sum:", (got.double() - exact).abs().max())


def routing_case(seed: int, tokens: list, num_experts: int, topk: int, payload_fp32: bool,
                 backend: str = "torch", experts: str = "synthetic") -> dict:
    """(a) and, with ``experts="fused"``, (b); (c) for both: see the module's docstring."""
    rank, ep = dist_.get_rank(), dist_.get_world_size()
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "cuda"
              else torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    count = tokens[rank]
    x = torch.randn(count, 1, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    ids = random_routing(count, num_experts, topk, gen).to(device)
    probs = torch.rand(count, topk, generator=gen).to(device)
    local = num_experts // ep
    first = rank * local
    with dispatchers(num_experts, topk, payload_fp32, len(set(tokens)) > 1, backend,
                     device) as (theirs, ours):
        h, p, g, valid = dispatch(theirs, x, ids, probs)
        rows = int(valid)
        assert rows == sum(tokens) and tuple(h.shape) == (rows, HIDDEN)
        mine = (g >= first) & (g < first + local)
        has = mine.any(1)
        got = []
        for _ in range(2):  # the second into poisoned outputs: it writes every defined part
            got.append(dispatch(ours, x, ids, probs))
            poison_shared_outputs()
        n = int(has.sum())
        for a, b in zip(got[0], got[1]):  # (c); rows past the count: ids, probs only (§9)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a[:n], b[:n]) if a is got[0][0] else torch.equal(a, b)
        rx, rp, rg, rvalid = got[0]
        # (a) the experts' input
        assert tuple(rx.shape) == (ep * T_MAX, HIDDEN) and rx.dtype == torch.bfloat16
        assert tuple(rg.shape) == (ep * T_MAX, topk) and rg.dtype == torch.int32
        assert tuple(rp.shape) == (ep * T_MAX, topk) and rp.dtype == torch.float32
        assert int(rvalid) == n, (int(rvalid), n)
        assert torch.equal(rx[:n], h[has])
        assert torch.equal(rg[:n], torch.where(mine, g, -1)[has].to(torch.int32))
        assert torch.equal(rp[:n], torch.where(mine, p, 0.0)[has])
        assert bool((rg[n:] == -1).all()) and bool((rp[n:] == 0).all())
        # Each rank's gathered row of token t of rank s: sum(tokens[:s]) + t.
        mine_rows = torch.arange(count, device=device) + sum(tokens[:rank])
        has_by_rank = all_ranks_rows(has.to(torch.int32))
        report = {"rows": n, "gathered": rows}
        if experts == "synthetic":
            # Partials: what any expert computes for the received rows, theirs 0 without a local
            # expert (as the fused experts leave them); ours NaN past the count (never read).
            partial = torch.randn(rows, HIDDEN, generator=gen).to(device) * has[:, None]
            ours_in = torch.full((ep * T_MAX, HIDDEN), float("nan"), device=device)
            ours_in[:n] = partial[has]
            want = combine(theirs, partial.clone())
            ys = []
            for _ in range(2):  # (c): a second dispatch and combine of the same step
                dispatch(ours, x, ids, probs)
                ys.append(combine(ours, ours_in.clone()))
            assert torch.equal(ys[0], ys[1])
            y = ys[0]
            if not payload_fp32:  # the experts' fp32 rows: the bits of the rows cast first
                dispatch(ours, x, ids, probs)
                assert torch.equal(combine(ours, ours_in.to(torch.bfloat16)), y)
            assert y.shape == want.shape == x.shape and y.dtype == want.dtype == torch.bfloat16
            by_rank = all_ranks_rows(partial)
            rounded = [q if payload_fp32 else q.to(torch.bfloat16).float() for q in by_rank]
            where = [mine_rows] * ep
            assert_rounded_sum(want.view(count, HIDDEN), by_rank, where)  # the emulation holds
            assert_rounded_sum(y.view(count, HIDDEN), rounded, where)
            report["max_diff_vs_nccl"] = float((y.double() - want.double()).abs().max()) \
                if count else 0.0
            report["has_by_rank"] = [int(t.sum()) for t in has_by_rank]
            return report
        # (b) Megatron's fused inference experts on both dispatchers' outputs.
        fused = fused_moe()
        wgen = torch.Generator().manual_seed(seed)  # the same experts on every rank
        fc1 = (torch.randn(num_experts, FFN, HIDDEN, generator=wgen) / HIDDEN ** 0.5)
        fc2 = (torch.randn(num_experts, HIDDEN, FFN, generator=wgen) / FFN ** 0.5)
        fc1, fc2 = (w[first:first + local].to(torch.bfloat16).to(device).contiguous()
                    for w in (fc1, fc2))

        def experts_on(hidden, probs_, ids_, valid_):
            from megatron.core.inference.moe.fused_moe import ActivationType

            return fused(hidden, probs_, fc1, fc2, ActivationType.SQUARED_RELU, local, first,
                         valid_, ids_)

        out_theirs = experts_on(h, p, g, valid)
        want = combine(theirs, out_theirs)
        runs = []
        for _ in range(2):  # (c)
            rx, rp, rg, rvalid = dispatch(ours, x, ids, probs)
            out = experts_on(rx, rp, rg, rvalid)
            runs.append((out[:n].clone(), combine(ours, out)))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        out_ours, y = runs[0]
        # Per received row, the fused experts' fp32 output equals theirs for that gathered row
        # (zero there without a local expert), up to the grouped GEMM's rounding at another row
        # position.
        assert bool((out_theirs[~has] == 0).all())
        expert_diff = float((out_ours - out_theirs[has]).abs().max()) if n else 0.0
        torch.testing.assert_close(out_ours, out_theirs[has], rtol=1e-5, atol=1e-6)
        # Our combine is the sum of our partials (as the payload carries them), rounded once.
        partial = torch.zeros(rows, HIDDEN, device=device)
        partial[has] = out_ours
        by_rank = all_ranks_rows(partial)
        rounded = [q if payload_fp32 else q.to(torch.bfloat16).float() for q in by_rank]
        assert_rounded_sum(y.view(count, HIDDEN), rounded, [mine_rows] * ep)
        theirs_by_rank = all_ranks_rows(out_theirs)
        assert_rounded_sum(want.view(count, HIDDEN), theirs_by_rank, [mine_rows] * ep)
        # Against NCCLAllGatherDispatcher's output: both are bf16 roundings (half an ulp each) of
        # sums of the same partials, which differ by the grouped GEMM's fp32 rounding and, with a
        # bf16 payload, by each partial's bf16 rounding (half an ulp of that partial, which can be
        # far larger than the sum's when partials cancel).
        magnitude = torch.stack([q[mine_rows].double() for q in theirs_by_rank]).abs().sum(0)
        per_partial = (torch.finfo(torch.float32).eps * ep if payload_fp32 else 2 ** -8) + 1e-5
        bound = (2 ** -8 * (y.double().abs() + want.double().abs()).view(count, HIDDEN)
                 + per_partial * magnitude + 1e-6 * ep)
        diff = (y.double() - want.double()).view(count, HIDDEN).abs()
        assert bool((diff <= bound).all()), ("combine differs from NCCLAllGatherDispatcher's by more "
                                             "than the partials' rounding:", (diff - bound).max())
        report.update(expert_diff=expert_diff,
                      max_diff_vs_nccl=float((y.double() - want.double()).abs().max())
                      if count else 0.0)
        return report


def fused_moe():
    """``mcore_fused_moe``; on CPU its Triton kernels need Triton's interpreter, which must be on
    before triton is imported (run_interpreted starts such processes)."""
    from megatron.core.inference.moe import fused_moe as module

    return module.mcore_fused_moe


def run_interpreted(world: int, fn, *args):
    """``fn`` in fresh ranks with TRITON_INTERPRET=1 (their triton kernels run on CPU)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        runs = dist.run_isolated(world, fn, *args, timeout=240)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    failed = [r for r in runs if r.error is not None or r.exitcode != 0]
    assert not failed, "\n".join(f"rank {r.rank}: {r.outcome()}\n{r.error}" for r in failed)
    return [r.value for r in runs]


ROUTING_CASES = {
    # name: (tokens per rank, experts, top-k)
    "ep1": ([6], 4, 2),
    "ep2_equal": ([T_MAX, T_MAX], 8, 2),
    "ep2_unequal": ([5, T_MAX], 8, 3),
    "ep4_unequal_one_empty": ([3, T_MAX, 0, 6], 8, 2),
}


@pytest.mark.parametrize("payload_fp32", [False, True], ids=["bf16_payload", "fp32_payload"])
@pytest.mark.parametrize("case", list(ROUTING_CASES))
def test_dispatch_and_combine_match_nccl_allgather(case, payload_fp32, seed, summary_line):
    tokens, num_experts, topk = ROUTING_CASES[case]
    reports = dist.run(len(tokens), routing_case, seed, tokens, num_experts, topk, payload_fp32)
    summary_line(f"{case}: {reports}")


def fused_cases(seed: int, cases: list) -> list:
    return [routing_case(seed, tokens, e, k, fp32, experts="fused")
            for tokens, e, k, fp32 in cases]


# EP 1 and 2: fresh interpreted ranks cost seconds each (EP 4's routing is covered above).
@pytest.mark.parametrize("world", [1, 2])
def test_fused_experts_on_both_dispatchers(world, seed, summary_line):
    cases = {1: [([7], 4, 2, False)],
             2: [([T_MAX, T_MAX], 8, 2, False), ([4, T_MAX], 8, 3, True)]}[world]
    reports = run_interpreted(world, fused_cases, seed, cases)
    summary_line(f"EP {world}: {reports}")


def check_valid_rows_tensor(aligned: bool, seed: int) -> dict:
    """The dispatch writes the count into Megatron's valid-rows tensor itself where the library
    can (int32 [1], contiguous, 16-byte aligned: no copy follows), else the count is copied
    there; either way the experts read the rows this rank received, at the tensor's address."""
    from megatron.core.transformer.moe.token_dispatcher_inference import (
        InferenceAllGatherDispatcherBase)

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T_MAX, 1, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = random_routing(T_MAX, 8, 2, gen)
    probs = torch.rand(T_MAX, 2, generator=gen)
    with dispatchers(8, 2, False, False, "torch", torch.device("cpu")) as (_, ours):
        block = torch.full((8,), -7, dtype=torch.int32)
        valid = block[:1] if aligned else block[1:2]  # 4 bytes past an aligned block
        InferenceAllGatherDispatcherBase._valid_tokens_tensor = valid
        copies = []
        publish = NcclEpInferenceDispatcher._publish_count
        NcclEpInferenceDispatcher._publish_count = classmethod(
            lambda cls, count: (copies.append(count), publish(count)))
        try:
            for _ in range(2):
                dispatch(ours, x, ids, probs)
                assert InferenceAllGatherDispatcherBase._valid_tokens_tensor is valid
                assert int(valid) == int((ids >= 0).any(1).sum())
                combine(ours, torch.zeros(T_MAX, HIDDEN))
        finally:
            NcclEpInferenceDispatcher._publish_count = publish
        return {"copies": len(copies), "block": block.tolist()}


def check_layers_share_outputs(seed: int) -> dict:
    """Two layers of one group dispatch into the same tensors, each layer's rows right when its
    experts read them; a new valid-rows tensor, or destroying the groups, gives new ones."""
    from megatron.core.transformer.moe.token_dispatcher_inference import (
        InferenceAllGatherDispatcherBase)

    gen = torch.Generator().manual_seed(seed)
    with dispatchers(8, 2, False, False, "torch", torch.device("cpu")) as (_, first):
        from megatron.core.process_groups_config import ProcessGroupCollection

        second = NcclEpInferenceDispatcher(
            8, list(range(8)), config=first.config,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups())

        def layer(dispatcher):
            x = torch.randn(T_MAX, 1, HIDDEN, generator=gen).to(torch.bfloat16)
            ids = random_routing(T_MAX, 8, 2, gen)
            hidden, p = dispatcher.token_dispatch(*dispatcher.dispatch_preprocess(
                x, ids, torch.rand(T_MAX, 2, generator=gen)))
            has = (ids >= 0).any(1)
            n = int(has.sum())
            valid = InferenceAllGatherDispatcherBase._valid_tokens()
            assert int(valid) == n and torch.equal(hidden[:n], x.view(T_MAX, HIDDEN)[has])
            combine(dispatcher, torch.zeros(T_MAX, HIDDEN))
            return hidden, p, dispatcher.routing_map

        a, b = layer(first), layer(second)
        assert all(s is t for s, t in zip(a, b)), "the layers' outputs are not shared"
        InferenceAllGatherDispatcherBase._valid_tokens_tensor = torch.zeros(1, dtype=torch.int32)
        c = layer(first)
        assert not any(s is t for s, t in zip(b, c)), "a new valid-rows tensor kept old outputs"
        destroy_inference_groups()
        d = layer(second)
        assert not any(s is t for s, t in zip(c, d)), "destroyed groups' outputs were kept"
        return {"layers": 4}


def test_layers_of_one_group_share_dispatch_outputs(seed):
    assert dist.run(1, check_layers_share_outputs, seed)[0] == {"layers": 4}


@pytest.mark.parametrize("aligned", [True, False], ids=["written_in_place", "copied"])
def test_valid_rows_tensor_written_in_place_or_copied(aligned, seed):
    report = dist.run(1, check_valid_rows_tensor, aligned, seed)[0]
    assert report["copies"] == (0 if aligned else 2), report
    untouched = report["block"][1:] if aligned else [report["block"][0]] + report["block"][2:]
    assert untouched == [-7] * 7, report  # nothing written around it


# -- (d) registration ------------------------------------------------------------------------------
def test_config_and_argparse_take_nccl_ep():
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["inference_moe_token_dispatcher_type"]
    assert str(field.type).count("nccl_ep") == 1 and "nvls" in str(field.type), field.type
    megatron_nccl_ep.register()  # idempotent
    assert str(field.type).count("nccl_ep") == 1
    config = inference_config(4, 2, "torch")
    assert config.inference_moe_token_dispatcher_type == "nccl_ep"

    from test_megatron_registration import MEGATRON_ARGS, run_python

    code = textwrap.dedent("""
        import sys
        from megatron.training import arguments
        import megatron_nccl_ep
        megatron_nccl_ep.register()
        sys.argv = ["serve"] + sys.argv[1:]
        args = arguments.parse_args()
        print("PARSED", args.inference_moe_token_dispatcher_type)
    """)
    result = run_python("-c", code, *MEGATRON_ARGS, "--inference-moe-token-dispatcher-type",
                        "nccl_ep")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PARSED nccl_ep" in result.stdout


def test_ll_sm_budget_option():
    """--nccl-ep-ll-num-sms: the LL group's CTAs; 0 (the default) every SM of a CUDA device (the
    GPU variant checks that branch); off CUDA the reference has no SM budget."""
    from megatron_nccl_ep.dispatcher_common import ll_num_sms

    cpu = torch.device("cpu")
    assert NcclEpOptions().ll_num_sms == 0
    assert ll_num_sms(NcclEpOptions(ll_num_sms=12), cpu) == 12
    assert ll_num_sms(NcclEpOptions(num_sms=20), cpu) == 20
    with pytest.raises(ValueError, match="ll_num_sms must be >= 0"):
        NcclEpOptions(ll_num_sms=-1)


def setup_case(dispatcher_type: str) -> str:
    """MoELayer._setup_inference_mode on a stand-in layer: the inference dispatcher it builds."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_layer import MoELayer

    ep = dist_.get_world_size()
    with megatron_on_cpu(ep):
        config = inference_config(4, 2, "torch", dispatcher_type=dispatcher_type)
        training = object()
        layer = types.SimpleNamespace(
            config=config, num_local_experts=4 // ep, token_dispatcher=training,
            local_expert_indices=[dist_.get_rank() * (4 // ep) + i for i in range(4 // ep)],
            use_shared_expert=False)
        MoELayer._setup_inference_mode(layer, ProcessGroupCollection.use_mpu_process_groups())
        assert layer._training_token_dispatcher is training
        built = layer._inference_token_dispatcher
        assert built.ep_size == ep and built.shared_experts is None
        return type(built).__name__


def test_moe_layer_builds_the_inference_dispatcher():
    assert dist.run(2, setup_case, "nccl_ep") == ["NcclEpInferenceDispatcher"] * 2
    # Megatron's own types still get Megatron's dispatchers.
    assert dist.run(2, setup_case, "nccl") == ["NCCLAllGatherDispatcher"] * 2


def test_inference_context_sets_the_token_budget(monkeypatch):
    """register()'s context hook: after DynamicInferenceContext.__init__, an 'nccl_ep' model's
    budget is round_up_tokens(max_tokens) // tp_size (a stand-in context: the real one needs a
    GPU)."""
    from megatron.core.inference.contexts import dynamic_context

    from megatron_nccl_ep import megatron as registration

    class Context:
        TOKEN_ROUNDER = 64

        def __init__(self, model_config, inference_config):
            self.max_tokens = inference_config.max_tokens

        round_up_tokens = classmethod(dynamic_context.DynamicInferenceContext.round_up_tokens.
                                      __func__)

    monkeypatch.setattr(dynamic_context, "DynamicInferenceContext", Context)
    monkeypatch.setattr(NcclEpInferenceDispatcher, "_token_budget", None)
    registration._patch_inference_context()
    model = types.SimpleNamespace(inference_moe_token_dispatcher_type="nccl",
                                  tensor_model_parallel_size=2)
    Context(model, types.SimpleNamespace(max_tokens=300, pg_collection=None))
    assert NcclEpInferenceDispatcher._token_budget is None  # not ours: untouched
    model.inference_moe_token_dispatcher_type = "nccl_ep"
    Context(model, types.SimpleNamespace(max_tokens=300, pg_collection=None))
    assert NcclEpInferenceDispatcher._token_budget == 320 // 2


def test_missing_and_oversized_token_budget_are_refused(monkeypatch):
    from megatron_nccl_ep.config import LL_MAX_TOKENS

    config = inference_config(4, 2, "torch")
    stand_in = types.SimpleNamespace(config=config, options=lambda: NcclEpOptions())
    monkeypatch.setattr(NcclEpInferenceDispatcher, "_token_budget", None)
    with pytest.raises(RuntimeError, match="no token budget per rank"):
        NcclEpInferenceDispatcher.max_tokens_per_rank(stand_in)
    NcclEpInferenceDispatcher.set_token_budget(LL_MAX_TOKENS + 1)
    with pytest.raises(ValueError, match=f"more than the LL mode's T_max limit {LL_MAX_TOKENS}"):
        NcclEpInferenceDispatcher.max_tokens_per_rank(stand_in)
    with pytest.raises(ValueError, match="tokens_per_rank must be an int >= 1"):
        NcclEpInferenceDispatcher.set_token_budget(0)


def test_decode_example_answers_help_without_transformer_engine():
    """examples/decode_moe.py needs transformer-engine and GPUs to run; its --help parses before
    importing torch or Megatron."""
    from test_megatron_registration import REPO_ROOT, run_python

    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["decode_moe.py", "--help"]
        try:
            runpy.run_path({os.path.join(REPO_ROOT, "examples", "decode_moe.py")!r},
                           run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, e.code
        print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron")))
    """)
    result = run_python("-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--fp32-payload" in result.stdout and "IMPORTED []" in result.stdout, result.stdout
