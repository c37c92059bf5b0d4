"""Trains a small MoE GPT (Megatron-Core's GPTModel with MoE layers) with the nccl_ep dispatcher.

Expert parallelism spans all processes (EP = world size); the dense weights are data-parallel
replicas. Synthetic data: sequences from a fixed random Markov chain, so the loss has a known floor
(the chain's entropy) well below the starting ln(vocab).

    torchrun --standalone --nproc-per-node 2 examples/train_moe.py            # CPU: gloo
    torchrun --standalone --nproc-per-node 8 examples/train_moe.py --experts 16  # GPUs: NCCL

On CPU it runs on gloo with the torch reference backend, deterministically (the last line prints
the final loss's bits); on GPUs it takes NCCL and backend "auto" (the CUDA kernels when built;
``tests/gpu/run.sh example`` runs it twice on every GPU and compares the final-loss bits).

Megatron pieces used as they are: TransformerConfig, parallel_state, GPTModel, the MoE layer,
router, experts and aux loss. Two stand-ins, both because Megatron-Core 0.19 reaches for CUDA
unconditionally: the router is ``DeviceLocalTopKRouter`` and the core attention computes the same
causal softmax attention with ``scaled_dot_product_attention`` (Megatron's DotProductAttention
takes its scratch buffer and dropout RNG from CUDA). Megatron's DistributedDataParallel and
``get_megatron_optimizer`` allocate CUDA buffers too, so the example averages gradients itself and
uses ``torch.optim.AdamW``: one code path for CPU and GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

# Megatron warns, per rank, about each optional package it does without (Transformer Engine,
# Apex, absl); none of them is used here.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
# Megatron-Core 0.19 logs, per rank and on stdout, that GPTModel is deprecated in favour of
# HybridModel; GPTModel is what its MoE examples and recipes still build.
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)

# The run passes when the mean loss of the last steps is this much (nats) below that of the first
# ones: 30 steps at the default learning rate fall by more than 0.5; with --lr 0 the means differ
# by batch noise only (a few hundredths).
MIN_LOSS_DROP = 0.25

# Runs from a checkout whether or not the package is installed, however it is loaded (a script, or
# a module from its path: the router stand-in sits beside it).
EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(EXAMPLES_DIR)
sys.path.insert(0, REPO_ROOT)
if EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, EXAMPLES_DIR)

import megatron_nccl_ep  # noqa: E402
from device_local_router import DeviceLocalTopKRouter  # noqa: E402
from megatron_nccl_ep.dispatcher import NcclEpOptions  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=4, help="a multiple of the number of processes")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--backend", choices=("auto", "torch", "cuda"), default="auto",
                   help="nccl_ep backend")
    p.add_argument("--recv-mode", choices=("exact", "capacity"), default="exact")
    return p.parse_args(argv)


def build_model(args, device: torch.device, **config_fields):
    """The GPTModel of ``args``; ``config_fields`` override or extend its TransformerConfig."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        """DotProductAttention's causal softmax attention without its CUDA-only scratch buffer
        and RNG tracker (dropout is 0 here)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            context = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            seq, batch = context.shape[2], context.shape[0]
            return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    config = TransformerConfig(**{
        **dict(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=2 * args.hidden,
               num_attention_heads=args.heads, num_moe_experts=args.experts,
               moe_router_topk=args.topk, moe_token_dispatcher_type="nccl_ep",
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
               use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0,
               attention_dropout=0.0, params_dtype=torch.float32),
        **config_fields})
    config.nccl_ep_options = NcclEpOptions(backend=args.backend, recv_mode=args.recv_mode)
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    moe = spec.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
    spec.submodules.mlp = functools.partial(
        moe.func, **{**moe.keywords, "submodules": dataclasses.replace(
            moe.keywords["submodules"], router=DeviceLocalTopKRouter)})
    model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq_length)
    return model.to(device)


def is_expert(param) -> bool:
    return not getattr(param, "allreduce", True)  # Megatron's mark on expert weights


def sync_replicas(model) -> None:
    """Dense weights start equal on every data-parallel rank; experts stay rank-specific."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    src = parallel_state.get_data_parallel_src_rank()
    for param in model.parameters():
        if not is_expert(param):
            dist.broadcast(param.data, src=src, group=group)


def average_gradients(model) -> None:
    """What Megatron's DDP does: every gradient is summed over the ranks holding that weight and
    divided by the data-parallel size (an expert's gradient already sums over all ranks' tokens,
    which reached it through dispatch)."""
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    dense_group = parallel_state.get_data_parallel_group()
    expert_group = parallel_state.get_expert_data_parallel_group()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=expert_group if is_expert(param) else dense_group)
            param.grad.div_(dp_size)


class MarkovData:
    """Token sequences from a fixed random Markov chain: each token has a few likely successors.
    Every rank draws its own batches; all draws are seeded, so reruns see the same data."""

    def __init__(self, vocab: int, seed: int, successors: int = 3):
        g = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab), -4.0)
        for token in range(vocab):
            logits[token, torch.randperm(vocab, generator=g)[:successors]] = 2.0
        self.transitions = logits.softmax(dim=1)
        self.vocab, self.seed = vocab, seed

    def entropy(self) -> float:
        p = self.transitions
        return float(-(p * p.log()).sum(dim=1).mean())

    def batch(self, step: int, rank: int, batch: int, length: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        tokens = torch.empty(batch, length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (batch,), generator=g)
        for i in range(length):
            tokens[:, i + 1] = torch.multinomial(self.transitions[tokens[:, i]], 1,
                                                 generator=g).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]


def progress_line(step: int, steps: int, loss: float, seconds: float, width: int = 24) -> str:
    done = width * step // steps
    return (f"[{'#' * done}{'.' * (width - done)}] step {step:>3}/{steps}  loss {loss:.4f}  "
            f"{seconds * 1000:.0f} ms/step")


def main(argv=None) -> bool:
    """Trains; True when the loss went down."""
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if on_gpu:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the number of "
                         f"processes ({world})")

    from megatron.core import parallel_state

    megatron_nccl_ep.register()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    # Experts get rank-specific weights; dense weights are then copied from the first replica.
    torch.manual_seed(args.seed + ep_rank)
    model = build_model(args, device)
    sync_replicas(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    data = MarkovData(args.vocab, args.seed)
    positions = torch.arange(args.seq_length, device=device).expand(args.micro_batch, -1)

    if rank == 0:
        print(f"MoE GPT: {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
              f"top-{args.topk}, EP={world} ({dist.get_backend()}), nccl_ep backend "
              f"{args.backend}, {args.micro_batch}x{args.seq_length} tokens per rank per step; "
              f"loss floor (chain entropy) {data.entropy():.3f}, start ~ln({args.vocab}) = "
              f"{math.log(args.vocab):.3f}", flush=True)
    losses = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        tokens, labels = (t.to(device) for t in data.batch(step, rank, args.micro_batch,
                                                             args.seq_length))
        loss = model(tokens, positions, None, labels=labels).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model)
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        if rank == 0:
            print(progress_line(step, args.steps, losses[-1], time.perf_counter() - start),
                  flush=True)
    # Every rank holds the same (all-reduced) losses, so every rank reaches the same verdict:
    # down by at least MIN_LOSS_DROP between the means of the first and the last steps.
    window = max(1, min(5, args.steps // 2))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    down = last <= first - MIN_LOSS_DROP
    if rank == 0:
        print(f"loss: first {window} steps {first:.4f}, last {window} steps {last:.4f} "
              f"({'down' if down else 'NOT down'}: by {first - last:.4f}, needs "
              f">= {MIN_LOSS_DROP}); final loss {losses[-1]!r} bits {losses[-1].hex()}",
              flush=True)

    from megatron_nccl_ep.dispatcher import destroy_groups

    destroy_groups()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return down


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
