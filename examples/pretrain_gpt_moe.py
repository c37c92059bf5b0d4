"""Pretrains a small MoE GPT with Megatron's own training loop, ``megatron.training.pretrain()``
(its GPT model builder, mock data, optimizer and checkpointing), with the nccl_ep dispatcher.

    torchrun --standalone --nproc-per-node 2 examples/pretrain_gpt_moe.py     # EP=2, nccl_ep
    torchrun --standalone --nproc-per-node 2 examples/pretrain_gpt_moe.py \
        --moe-token-dispatcher-type alltoall --deterministic-mode --save ckpt --save-interval 50

Any Megatron flag may be given: the example's own (``default_arguments``: 2 layers, 4 experts
top-2, expert parallelism over all processes, Megatron's mock data, 100 iterations) come first on
the command line, so that later flags win. The layers are Megatron's local ones
(``--transformer-impl local``) and no fused kernel of Transformer Engine or Apex is asked for:
neither needs to be installed. Expert and data parallelism only (tensor, context and pipeline
parallel sizes 1): every rank reads whole micro-batches of its own.

After every iteration the last rank prints one line (``step_line``) with the loss, averaged over
the data-parallel ranks as Megatron logs it, and the gradient norm, both as ``float.hex()``: exact
bits, which examples/check_training.py compares between runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

# Runs from a checkout whether or not the package is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_nccl_ep  # noqa: E402
from megatron.core.datasets import utils as datasets_utils  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, training  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import is_last_rank  # noqa: E402


def default_arguments(world_size: int) -> list:
    """The example's Megatron flags, for ``world_size`` processes (EP over all of them)."""
    return [
        "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512",
        "--num-attention-heads", "4", "--seq-length", "256", "--max-position-embeddings", "256",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
        "--moe-token-dispatcher-type", "nccl_ep",
        "--expert-model-parallel-size", str(world_size),
        # No dropout: runs differ only by what the checks look at (dispatcher, resumption).
        "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0",
        # Megatron's local layers; the fusions below would need Apex's or TE's kernels (and the
        # torch LayerNorm that stands in for Apex's refuses persist_layer_norm).
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
        "--no-bias-gelu-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
        "--micro-batch-size", "4", "--train-iters", "100", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--log-interval", "10",
        # No validation; pretrain() divides by --eval-interval all the same.
        "--eval-iters", "0", "--eval-interval", "100",
    ]


def parse_arguments(argv: list) -> object:
    """Megatron's parsed and validated arguments: the example's defaults, then ``argv``."""
    megatron_nccl_ep.register()
    sys.argv = [sys.argv[0], *default_arguments(int(os.environ.get("WORLD_SIZE", "1"))), *argv]
    args = parse_and_validate_args()
    sizes = (args.tensor_model_parallel_size, args.context_parallel_size,
             args.pipeline_model_parallel_size)
    if sizes != (1, 1, 1):
        raise SystemExit(f"tensor, context and pipeline parallel sizes must be 1, not {sizes}")
    return args


def datasets_provider(num_samples: list) -> tuple:
    """Megatron's mock GPT datasets (train, validation, test) of ``num_samples`` samples."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, tokenizer=get_tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)  # the local attention applies its causal mask itself
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True,
                                        config).build()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """Megatron's per-token convention: the micro-batch's summed loss, its token count, and the
    same pair for the log, which train_step sums over micro-batches and data-parallel ranks."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model) -> tuple:
    batch = {name: tensor.cuda(non_blocking=True) for name, tensor in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def step_line(iteration: int, loss: float, grad_norm: float) -> str:
    """One iteration's exact record, as examples/check_training.py reads it (its STEP)."""
    return f"exact_step iteration={iteration} loss={loss.hex()} grad_norm={grad_norm.hex()}"


def print_exact_steps() -> None:
    """train() hands training_log, once per iteration, the loss averaged over the data-parallel
    ranks and the gradient norm, and prints them rounded; this wrapper prints them exactly first,
    on the last rank (which holds the last pipeline stage, where the loss is)."""
    megatron_training_log = training.training_log

    @functools.wraps(megatron_training_log)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                     report_memory_flag, skipped_iter, grad_norm, *args, **kwargs):
        # No loss on other pipeline stages; no grad norm when fp16 loss scaling skipped the step.
        if is_last_rank() and "lm loss" in loss_dict and grad_norm is not None:
            print(step_line(iteration, float(loss_dict["lm loss"]), float(grad_norm)), flush=True)
        return megatron_training_log(loss_dict, total_loss_dict, learning_rate, iteration,
                                     loss_scale, report_memory_flag, skipped_iter, grad_norm,
                                     *args, **kwargs)

    training.training_log = training_log


def use_built_dataset_helpers() -> None:
    """pretrain() runs ``make`` in megatron/core/datasets on rank 0 to build the dataset index
    helpers; the megatron-core wheel ships them built but without the Makefile, so make fails and
    rank 0 exits. Helpers that are built are used as they are."""
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        datasets_utils.compile_helpers = lambda: None


def moe_layers_for_local_graphs(model_config) -> None:
    """Megatron-Core 0.19's GPT specs build every layer as a TransformerLayer, whose local CUDA
    graph manager knows whole layers, attn and mlp only: the moe, moe_router and moe_preprocess
    scopes would capture nothing. Under --cuda-graph-impl local the MoE layers are built as
    MoETransformerLayer instead, Megatron's class for those scopes (its hybrid models' spec)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import MoETransformerLayer
    from megatron.training.models.gpt import default_layer_spec

    def is_moe(spec) -> bool:  # the mlp's spec: a ModuleSpec, or a partial of the class
        mlp = getattr(spec.submodules, "mlp", None)
        return MoELayer in (getattr(mlp, "module", None), getattr(mlp, "func", None))

    def layer_spec(config, vp_stage=None):
        block = default_layer_spec(config, vp_stage)
        block.layer_specs = [
            ModuleSpec(module=MoETransformerLayer, params=spec.params, submodules=spec.submodules)
            if is_moe(spec) else spec for spec in block.layer_specs]
        return block

    model_config.transformer_layer_spec = layer_spec


def gpt_config(args):
    """The GPT model configuration of ``args``: Megatron's, with MoETransformerLayer for the MoE
    layers under --cuda-graph-impl local."""
    model_config = gpt_config_from_args(args)
    if args.cuda_graph_impl == "local":
        moe_layers_for_local_graphs(model_config)
    return model_config


GRAPHS_LINE = "cuda_graphs captured:"  # examples/check_training.py looks for it in graphed runs


def print_graph_captures() -> None:
    """One line (last rank) when Megatron captures its CUDA graphs: the local implementation's
    per-layer graphs at the end of the first step, the full-iteration graph after its warm-up."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    create = _CudagraphGlobalRecord.create_cudagraphs.__func__

    def create_cudagraphs(cls):
        count = len(cls.cudagraph_record)
        result = create(cls)
        if count and is_last_rank():
            print(f"{GRAPHS_LINE} {count} local graphs", flush=True)
        return result

    _CudagraphGlobalRecord.create_cudagraphs = classmethod(create_cudagraphs)
    call = FullCudaGraphWrapper.__call__

    @functools.wraps(call)
    def full_iteration(self, *args, **kwargs):
        before = FullCudaGraphWrapper.cuda_graph["training"]
        result = call(self, *args, **kwargs)
        if before is None and FullCudaGraphWrapper.cuda_graph["training"] is not None \
                and is_last_rank():
            print(f"{GRAPHS_LINE} 1 full-iteration graph", flush=True)
        return result

    FullCudaGraphWrapper.__call__ = full_iteration


def prepare_run() -> None:
    """What every run of the example (or of a Megatron-LM script, examples/run_megatron_lm.py)
    sets up before Megatron trains: the step and graph lines, the built dataset helpers."""
    print_exact_steps()
    print_graph_captures()
    use_built_dataset_helpers()


def main() -> None:
    args = parse_arguments(sys.argv[1:])
    prepare_run()
    config = pretrain_cfg_container_from_args(args, gpt_config(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    print_budget_high_water()


HIGH_WATER_LINE = "nccl_ep budget high-water mark:"  # examples/check_training.py reads it


def print_budget_high_water() -> None:
    """Capacity mode: the most rows each MoE layer needed in any step against its budget (last
    rank), one line."""
    from megatron_nccl_ep.dispatcher import budget_high_water

    lines = budget_high_water()
    if lines and is_last_rank():
        print(f"{HIGH_WATER_LINE} {'; '.join(lines)}", flush=True)


if __name__ == "__main__":
    main()
