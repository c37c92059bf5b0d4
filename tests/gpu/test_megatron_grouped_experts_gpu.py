"""nccl_ep's GroupedExperts on a GPU (bf16, torch's grouped_mm on sm90+), against Megatron's
SequentialMLP with the same weights: outputs and gradients within the GEMMs' reduction-order
difference (printed: docs/megatron.md quotes it), reruns and CUDA-graph replays bitwise equal to
eager steps, rows past the device counts (NaN) never read, Megatron's deterministic mode, and a
torch_dist checkpoint of GroupedExperts loaded into SequentialMLP."""

from __future__ import annotations

import math
import tempfile

import torch

import dist
from gpu_common import requires_gpus
from test_megatron_dispatcher import megatron_parallel

pytestmark = requires_gpus

# GRAPH_MODEL's experts (examples/check_training.py): hidden 1024, ffn 1024, 32 experts, top-4
# of 4096 tokens.
HIDDEN, FFN, EXPERTS, TOKENS, TOPK = 1024, 1024, 32, 4096, 4


def experts_of(grouped: bool, seed: int, **fields):
    import megatron_nccl_ep
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    megatron_nccl_ep.register()
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=16,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, params_dtype=torch.bfloat16, bf16=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        moe_grouped_gemm=grouped, use_cpu_initialization=True, **fields)
    spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=grouped)
    torch.manual_seed(seed)
    return spec.keywords["submodules"].experts(
        EXPERTS, config, pg_collection=get_default_pg_collection()).cuda()


def problem(seed: int, spare: int):
    """Counts of a random top-4 routing of TOKENS tokens, rows for them and ``spare`` more rows
    (NaN), probs (NaN past the counts), and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(TOKENS, EXPERTS, generator=gen).argsort(1)[:, :TOPK]
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    used = int(counts.sum())
    x = torch.randn(used + spare, HIDDEN, generator=gen).to(torch.bfloat16)
    probs = torch.rand(used + spare, generator=gen)
    x[used:], probs[used:] = math.nan, math.nan
    grad = torch.randn(used, HIDDEN, generator=gen).to(torch.bfloat16)
    return counts, x.cuda(), probs.cuda(), grad.cuda()


def run(experts, counts, x, probs, grad, used: int):
    xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, _ = experts(xg, counts, pg)
    out[:used].backward(grad)
    results = {"output": out[:used], "input grad": xg.grad[:used], "probs grad": pg.grad[:used]}
    results.update({f"{n} grad": p.grad for n, p in experts.named_parameters()})
    experts.zero_grad()
    return {k: v.detach().clone() for k, v in results.items()}


def compare_case(seed: int) -> dict:
    """The largest difference from SequentialMLP per result, relative to its largest value;
    reruns, graph replays and deterministic mode bitwise equal to the first eager run."""
    with megatron_parallel(1):
        seq, grouped = experts_of(False, seed), experts_of(True, seed)
        counts, x, probs, grad = problem(seed, spare=777)
        used = int(counts.sum())
        want = run(seq, counts, x[:used], probs[:used], grad, used)
        got = run(grouped, counts.cuda(), x, probs, grad, used)
        differences = {}
        for name, w in want.items():
            g = got[name]
            assert torch.isfinite(g).all(), f"{name}: not finite (a row past the counts read?)"
            scale = float(w.abs().max())
            differences[name] = float((g.float() - w.float()).abs().max()) / scale
        again = run(grouped, counts.cuda(), x, probs, grad, used)
        assert all(torch.equal(again[n], got[n]) for n in got), "a rerun differs"
        host = run(grouped, counts, x, probs, grad, used)  # host counts: the same rows
        assert all(torch.equal(host[n], got[n]) for n in got), "host counts differ"
        torch.use_deterministic_algorithms(True)
        try:
            deterministic = run(grouped, counts.cuda(), x, probs, grad, used)
        finally:
            torch.use_deterministic_algorithms(False)
        assert all(torch.equal(deterministic[n], got[n]) for n in got), "deterministic differs"

        # A CUDA graph of forward and backward, replayed with new counts and rows.
        static = [counts.cuda(), x.clone(), probs.clone(), grad.clone()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(grouped, *static, used)
            xg, pg = static[1].requires_grad_(), static[2].requires_grad_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out, _ = grouped(xg, static[0], pg)
                out[:used].backward(static[3])
        torch.cuda.current_stream().wait_stream(stream)
        held = {"output": out, "input grad": xg.grad, "probs grad": pg.grad,
                **{f"{n} grad": p.grad for n, p in grouped.named_parameters()}}
        # New rows, probs and gradient, and other blocks of the same total (the graph's
        # backward is of the first `used` rows).
        _, x2, probs2, grad2 = problem(seed + 1, spare=777)
        with torch.no_grad():
            static[0].copy_(counts[torch.randperm(EXPERTS)])
            xg.copy_(x2[:xg.shape[0]])
            pg.copy_(probs2[:pg.shape[0]])
            static[3].copy_(grad2[:used])
            for t in held.values():
                t.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        grouped.zero_grad()
        want2 = run(grouped, static[0].clone(), xg.detach().clone(), pg.detach().clone(),
                    static[3].clone(), used)
        for name, t in held.items():
            w = want2[name]
            g = t[:w.shape[0]] if name in ("output", "input grad", "probs grad") else t
            assert torch.equal(g, w), f"graph replay: {name} differs from its eager step"
    return differences


def test_grouped_experts_against_sequential_mlp_on_a_gpu(seed, summary_line):
    [differences] = dist.run(1, compare_case, seed, backend="nccl", timeout=300)
    worst = max(differences, key=differences.get)
    summary_line("GroupedExperts (grouped_mm) against SequentialMLP (cuBLAS per expert), bf16, "
                 f"hidden {HIDDEN}, ffn {FFN}, {EXPERTS} experts, {TOKENS} tokens x top-{TOPK}: "
                 f"largest difference / largest value {differences[worst]:.2e} ({worst}); "
                 f"output {differences['output']:.2e}, input grad "
                 f"{differences['input grad']:.2e}; reruns, host counts, deterministic mode "
                 "and graph replays bitwise equal")
    # Each element is the same fp32-accumulated dot product in another order, rounded to bf16:
    # a few units of bf16's last place of the tensor's largest values.
    assert all(d < 2 ** -5 for d in differences.values()), differences


def checkpoint_case(seed: int) -> bool:
    from megatron.core import dist_checkpointing

    with megatron_parallel(1):
        grouped, seq = experts_of(True, seed), experts_of(False, seed + 1)
        path = tempfile.mkdtemp(prefix="grouped_experts_ckpt_")  # (the same on every rank)
        dist_checkpointing.save(grouped.sharded_state_dict(), path)
        seq.load_state_dict(dist_checkpointing.load(seq.sharded_state_dict(), path))
        same = all(torch.equal(a, b) for a, b in zip(grouped.parameters(), seq.parameters()))
        back = experts_of(True, seed + 2)
        path2 = tempfile.mkdtemp(prefix="sequential_mlp_ckpt_")
        dist_checkpointing.save(seq.sharded_state_dict(), path2)
        back.load_state_dict(dist_checkpointing.load(back.sharded_state_dict(), path2))
        same_back = all(torch.equal(a, b) for a, b in zip(back.parameters(), seq.parameters()))
    return same and same_back


def test_torch_dist_checkpoints_load_into_sequential_mlp_and_back(seed, tmp_path):
    """In the pytest process, one rank of its own (torch_dist's writer starts a manager process,
    which the pools' daemonic ranks may not), torn down afterwards."""
    assert not torch.distributed.is_initialized()
    torch.distributed.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous",
                                         rank=0, world_size=1)
    try:
        assert checkpoint_case(seed)
    finally:
        torch.distributed.destroy_process_group()
