"""``GroupedExperts`` (``--moe-grouped-gemm`` under Megatron's local spec, after ``register()``)
on CPU, against Megatron's own ``SequentialMLP`` with the same weights: outputs and every gradient
bitwise equal in float64 (the same matmul per expert), within float32 rounding on grouped_mm's
CPU path; rows past the counts unread, the same checkpoints, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

import dist
import megatron_nccl_ep
from megatron_nccl_ep.experts import GroupedExperts, grouped_linear

megatron_nccl_ep.register()

HIDDEN, FFN, EXPERTS = 16, 24, 4

ACTIVATIONS = {
    "gelu": {},
    "swiglu_fused": dict(gated_linear_unit=True, activation_func=F.silu,
                         bias_activation_fusion=True),
    "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
    "glu_clamped": dict(gated_linear_unit=True, activation_func=F.silu,
                        activation_func_clamp_value=0.5, glu_linear_offset=1.0),
}


def experts_of(grouped: bool, dtype: torch.dtype, seed: int, **fields):
    """The experts Megatron's local MoE spec builds, with or without moe_grouped_gemm."""
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
        num_moe_experts=EXPERTS, moe_router_topk=2, use_cpu_initialization=True,
        params_dtype=dtype, add_bias_linear=fields.pop("add_bias_linear", False),
        hidden_dropout=0.0, attention_dropout=0.0, moe_grouped_gemm=grouped, **fields)
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=grouped)
    torch.manual_seed(seed)
    return spec.keywords["submodules"].experts(EXPERTS, config,
                                               pg_collection=get_default_pg_collection())


def run(experts, x, counts, probs, used: int):
    """Forward and backward (of the first ``used`` rows' sum, weighted); the results."""
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    out, bias = experts(x, counts, probs)
    assert bias is None
    weights = torch.linspace(-1, 1, used * out.shape[1], dtype=out.dtype).view(used, -1)
    (out[:used] * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in experts.named_parameters()}
    return out[:used].detach(), x.grad[:used], probs.grad[:used], grads


def same_weights(a, b) -> bool:
    """Whether two expert modules hold the same parameters (names and values)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


def check_equal(got, want, what: str, bitwise: bool = True) -> None:
    """Every result equal: bit for bit, or (``bitwise=False``) within float32 rounding."""
    out, gx, gp, grads = got
    w_out, w_gx, w_gp, w_grads = want
    for name, a, b in (("output", out, w_out), ("input grad", gx, w_gx), ("probs grad", gp, w_gp),
                       *((f"{n} grad", grads[n], w_grads[n]) for n in w_grads)):
        assert torch.isfinite(a).all(), f"{what}: {name} not finite"
        if bitwise:
            assert torch.equal(a, b), f"{what}: {name} differs, by up to {(a - b).abs().max()}"
        else:
            torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {name}: {m}")
    assert grads.keys() == w_grads.keys()


def in_group(fn, *args):
    """``fn(*args)`` inside Megatron's model-parallel state of one gloo rank (the pool's)."""
    from test_megatron_dispatcher import megatron_on_cpu

    with megatron_on_cpu(1):
        return fn(*args)


def equality_case(dtype: torch.dtype, activation: str, seed: int) -> str:
    seq = experts_of(False, dtype, seed, **ACTIVATIONS[activation])
    grouped = experts_of(True, dtype, seed, **ACTIVATIONS[activation])
    assert type(seq) is SequentialMLP and type(grouped) is GroupedExperts
    # The same initialization: one module's state is the other's.
    assert same_weights(seq, grouped)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor([5, 0, 9, 3])  # an expert without rows
    used = int(counts.sum())
    x = torch.randn(used + 6, HIDDEN, generator=gen, dtype=torch.float64).to(dtype)
    probs = torch.rand(used + 6, generator=gen)
    x[used:] = float("nan")  # rows past the counts: whatever reads them turns NaN
    probs[used:] = float("nan")
    # float64: the same matmul per expert, bit for bit; float32: grouped_mm's CPU path, whose
    # matmuls may block the sums otherwise than SequentialMLP's for some values.
    bitwise = dtype == torch.float64
    want = run(seq, x[:used], counts, probs[:used], used)
    check_equal(run(grouped, x, counts, probs, used), want, f"{dtype} {activation}", bitwise)
    # Counts past the rows given (capacity mode's dropped overflow): each block clamped at the
    # rows, as SequentialMLP on the blocks that fit.
    rows = used - 4  # the last block and one row of the third past the rows
    check_equal(run(grouped, x[:rows], counts, probs[:rows], rows),
                run(seq, x[:rows], torch.tensor([5, 0, rows - 5, 0]), probs[:rows], rows),
                f"{dtype} {activation}, counts past the rows", bitwise)
    return "equal"


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_grouped_experts_equal_sequential_mlp(dtype, activation, seed):
    """float32 takes grouped_mm's CPU path (within rounding), float64 the matmuls per expert
    (bitwise)."""
    assert dist.run(1, in_group, equality_case, dtype, activation, seed) == ["equal"]


def bias_case(seed: int) -> bool:
    """Expert biases (Megatron's SequentialMLP cannot run them here: its RowParallelLinear hands
    MLP a view it then adds to in place), against the experts' MLP written out in float64: fc1's
    bias before the activation, fc2's scaled by the probs; the rows past the counts (NaN) reach
    no bias gradient."""
    grouped = experts_of(True, torch.float64, seed, add_bias_linear=True)
    gen = torch.Generator().manual_seed(seed)
    for expert in grouped.local_experts:
        for p in (expert.linear_fc1.bias, expert.linear_fc2.bias):
            p.data.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    counts = torch.tensor([4, 7, 0, 2])
    used = int(counts.sum())
    x = torch.randn(used + 3, HIDDEN, generator=gen, dtype=torch.float64)
    probs = torch.rand(used + 3, generator=gen, dtype=torch.float64).float()
    x[used:] = float("nan")
    probs[used:] = float("nan")
    out, gx, gp, grads = run(grouped, x, counts, probs, used)
    want, start = [], 0
    for l, n in enumerate(counts.tolist()):
        e = grouped.local_experts[l]
        h = x[start:start + n] @ e.linear_fc1.weight.detach().t() + e.linear_fc1.bias.detach()
        a = (F.gelu(h) * probs[start:start + n, None]).to(torch.float64)
        want.append(a @ e.linear_fc2.weight.detach().t()
                    + e.linear_fc2.bias.detach() * probs[start:start + n, None])
        start += n
    torch.testing.assert_close(out, torch.cat(want), rtol=0, atol=1e-12)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert grads["local_experts.2.linear_fc1.bias"].abs().sum() == 0  # an expert with no rows
    return True


def test_expert_biases(seed):
    assert dist.run(1, in_group, bias_case, seed) == [True]


def test_grouped_linear_is_a_matmul_per_expert():
    """The building block, on grouped_mm's CPU path and the per-expert matmuls: the rows of each
    block times its expert's weights; rows from the last end on are not computed."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(12, 8, generator=gen)
    weights = torch.randn(3, 4, 8, generator=gen)
    ends = torch.tensor([2, 2, 9], dtype=torch.int32)
    for dtype in (torch.float32, torch.float64):
        r, w = rows.to(dtype), weights.to(dtype)
        want = torch.cat([r[:2] @ w[0].t(), r[2:9] @ w[2].t()])
        assert torch.equal(grouped_linear(r, w, ends)[:9], want), dtype


def checkpoint_case(seed: int) -> str:
    """GroupedExperts' checkpoints are SequentialMLP's: the same sharded state dict (keys,
    global shapes and offsets, replicas: what a torch_dist checkpoint stores; its writer needs a
    GPU, tests/gpu/test_megatron_grouped_experts_gpu.py saves and loads one) and the same plain
    state dict, which loads either way."""
    grouped = experts_of(True, torch.float32, seed)
    seq = experts_of(False, torch.float32, seed + 1)  # other weights
    g_sd, s_sd = grouped.sharded_state_dict(), seq.sharded_state_dict()
    assert g_sd.keys() == s_sd.keys() and g_sd
    for key in g_sd:
        a, b = g_sd[key], s_sd[key]
        assert (type(a), a.key, a.global_shape, a.global_offset, a.replica_id) == (
            type(b), b.key, b.global_shape, b.global_offset, b.replica_id), key
    assert not same_weights(grouped, seq)
    seq.load_state_dict(grouped.state_dict())
    assert same_weights(grouped, seq)
    other = experts_of(True, torch.float32, seed + 2)
    other.load_state_dict(seq.state_dict())
    assert same_weights(other, seq)
    return "loaded"


def test_checkpoints_are_sequential_mlps(seed):
    assert dist.run(1, in_group, checkpoint_case, seed) == ["loaded"]


def refusal_case(setting: str) -> str:
    from test_megatron_dispatcher import megatron_on_cpu

    etp = 2 if setting == "expert_tensor_parallel" else 1
    with megatron_on_cpu(1, etp=etp):
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=2,
            num_moe_experts=EXPERTS, moe_router_topk=2, use_cpu_initialization=True,
            add_bias_linear=False, moe_grouped_gemm=True, expert_tensor_parallel_size=etp)
        if setting == "fp8":  # TransformerConfig refuses fp8 without transformer-engine
            config.fp8 = "hybrid"
        if setting == "delay_wgrad_compute":
            config.delay_wgrad_compute = True
        spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=True)
        try:
            spec.keywords["submodules"].experts(EXPERTS, config,
                                                pg_collection=get_default_pg_collection())
        except ValueError as e:
            return str(e)
    return "built"


@pytest.mark.parametrize("setting, message", [
    ("expert_tensor_parallel", "expert tensor parallelism is not supported \\(expert TP size 2, "
                               "expected 1\\)"),
    ("fp8", "FP8 and FP4 experts need Transformer Engine's grouped GEMM"),
    ("delay_wgrad_compute", "delay_wgrad_compute is not supported"),
])
def test_unsupported_settings_refused(setting, message):
    import re

    world = 2 if setting == "expert_tensor_parallel" else 1
    for got in dist.run(world, refusal_case, setting):
        assert re.search(message, got), got


def test_local_spec_builds_grouped_experts_only_with_moe_grouped_gemm():
    from megatron.core.models.backends import LocalSpecProvider

    assert LocalSpecProvider().grouped_mlp_modules(True).func is GroupedExperts
    assert LocalSpecProvider().grouped_mlp_modules(False).func is SequentialMLP
