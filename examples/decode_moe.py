"""Decodes with a small inference-optimized MoE GPT whose MoE layers use the nccl_ep inference
dispatcher (``inference_moe_token_dispatcher_type="nccl_ep"``: LL mode, rank-major layout) and
Megatron's own fused inference experts, through Megatron's dynamic inference engine with CUDA
graphs.

    torchrun --standalone --nproc-per-node 2 examples/decode_moe.py            # EP=2
    torchrun --standalone --nproc-per-node 4 examples/decode_moe.py --requests 16 --tokens 32

What it needs: one GPU per process on one node (LL groups do not span nodes); transformer-engine
(Megatron's inference-optimized layer spec, ``get_gpt_layer_with_inference_spec``, and its
``InferenceGroupedMLP`` are built on it); Triton (``mcore_fused_moe``'s kernels); torch with
``torch.nn.functional.grouped_mm``; this package's CUDA library built (``--nccl-ep-backend cuda``,
the default here). The weights are random and the prompts random token ids: the example shows the
decode path running (graphs captured, steps replayed, tokens generated), not a model's quality.
Without transformer-engine, ``--help`` still answers: Megatron is imported after the arguments are
parsed.

Megatron's inference-optimized experts support squared ReLU only and no gated linear unit; their
router runs in fp32; the inference context's per-rank token budget (``round_up_tokens(max_tokens)
// TP``, here ``--max-tokens``) is the LL groups' T_max, at most 4096.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2048, help="each expert's FFN size")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8, help="a multiple of the process count")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=8, help="prompts decoded at once")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="the inference context's tokens per step (T_max of the LL groups)")
    parser.add_argument("--nccl-ep-backend", choices=("cuda", "torch"), default="cuda")
    parser.add_argument("--fp32-payload", action="store_true",
                        help="move fp32 rows both ways (combine sums as Megatron's fp32 "
                             "reduce-scatter does); default: the tokens' bf16")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def build_model(args, torch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_inference_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_nccl_ep.options import NcclEpOptions

    world = torch.distributed.get_world_size()
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_router_pre_softmax=args.topk == 1,
        moe_router_dtype="fp32", moe_grouped_gemm=True,
        expert_model_parallel_size=world, transformer_impl="inference_optimized",
        inference_moe_token_dispatcher_type="nccl_ep", inference_grouped_gemm_backend="torch",
        activation_func=squared_relu(), gated_linear_unit=False, normalization="RMSNorm",
        add_bias_linear=False, add_qkv_bias=False, bf16=True, params_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, cuda_graph_impl="local")
    config.nccl_ep_options = NcclEpOptions(backend=args.nccl_ep_backend)
    spec = get_gpt_layer_with_inference_spec(num_experts=args.experts, moe_grouped_gemm=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.prompt_length + args.tokens + 64,
                     position_embedding_type="rope").cuda()
    return Float16Module(config, model).eval(), config


def squared_relu():
    from megatron.core.activations import squared_relu as activation

    return activation


def main(argv=None) -> None:
    args = parse_arguments(argv)
    import torch

    import megatron_nccl_ep
    from megatron_nccl_ep.inference import NcclEpInferenceDispatcher

    megatron_nccl_ep.register()  # before the model and the inference context are made
    if args.fp32_payload:
        NcclEpInferenceDispatcher.payload_dtype = torch.float32

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl")
    world = torch.distributed.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of the process count "
                         f"({world})")

    from megatron.core import parallel_state
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper)
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(args.seed)
    model, config = build_model(args, torch)

    context = DynamicInferenceContext(config, InferenceConfig(
        max_requests=args.requests, max_tokens=args.max_tokens,
        max_sequence_length=args.prompt_length + args.tokens + 64, buffer_size_gb=2,
        num_cuda_graphs=4))
    wrapped = GPTInferenceWrapper(model, context)
    controller = TextGenerationController(wrapped, tokenizer=None)
    engine = DynamicInferenceEngine(controller, context)

    gen = torch.Generator().manual_seed(args.seed)  # the same prompts on every rank
    prompts = [torch.randint(1, args.vocab, (args.prompt_length,), generator=gen).tolist()
               for _ in range(args.requests)]
    params = SamplingParams(num_tokens_to_generate=args.tokens, termination_id=-1, top_k=1)
    records = engine.generate(prompts, params)
    if torch.distributed.get_rank() == 0:
        budget = NcclEpInferenceDispatcher._token_budget
        for record in records[:4]:
            request = record.merge() if hasattr(record, "merge") else record
            print("request", request.request_id, "generated",
                  list(getattr(request, "generated_tokens", []))[:args.tokens])
        print(f"decoded {len(records)} requests x {args.tokens} tokens on EP {world} with the "
              f"nccl_ep inference dispatcher (T_max {budget}, backend {args.nccl_ep_backend})")
    megatron_nccl_ep.inference.destroy_inference_groups()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
