"""Megatron's 1F1B EP overlap (``overlap_moe_expert_parallel_comm``: the fine-grained schedule
that runs one micro-batch's dispatch and combine on a communication stream while another
micro-batch computes) with the nccl_ep dispatcher, on gloo with the torch reference backend.

Parity: one GPTModel (bf16, as the overlap requires; examples/train_moe.py's model) through
Megatron's ``forward_backward_no_pipelining`` with the overlap off and on gives bitwise equal
losses and gradients, and the overlapped run really interleaved micro-batch 1's dispatch with
micro-batch 0's dispatch backward. Streams are the one CPU stream (stand-ins): what this checks is
the schedule's order of calls and its freeing of stage inputs, not concurrency (a GPU run does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from typing import Optional

import pytest
import torch
from megatron.core.transformer import TransformerConfig

import dist
import megatron_nccl_ep
from test_megatron_dispatcher import cuda_streams_on_cpu, megatron_on_cpu, megatron_parallel

megatron_nccl_ep.register()

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "train_moe.py")
MICRO_BATCH, SEQ, VOCAB = 2, 8, 32


def load_example():
    spec = importlib.util.spec_from_file_location("train_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_order(events: list):
    """Wraps token_dispatch ("F") and the dispatch's backward ("B") to append to ``events``;
    returns the function that undoes it."""
    from megatron_nccl_ep import autograd
    from megatron_nccl_ep.dispatcher import NcclEpTokenDispatcher

    token_dispatch, backward = NcclEpTokenDispatcher.token_dispatch, autograd._dispatch_backward

    def recorded_dispatch(self, *args, **kwargs):
        events.append("F")
        return token_dispatch(self, *args, **kwargs)

    def recorded_backward(*args):  # the dispatch's backward, however it was recorded
        events.append("B")
        return backward(*args)

    NcclEpTokenDispatcher.token_dispatch = recorded_dispatch
    autograd._dispatch_backward = recorded_backward

    def undo():
        NcclEpTokenDispatcher.token_dispatch = token_dispatch
        autograd._dispatch_backward = backward

    return undo


def overlap_case(seed: int, recv_mode: str, layers: int, microbatches: int,
                 backend: str = "torch", timeout_s: Optional[float] = None) -> dict:
    """Both schedules on one model: on CPU (gloo, stand-in streams) for backend "torch", on this
    rank's GPU (NCCL, Megatron's real streams) for "cuda". ``timeout_s``: the groups' wait for
    peers (NcclEpOptions.timeout_s)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    world = torch.distributed.get_world_size()
    on_gpu = backend == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    example = load_example()
    args = example.parse_args(["--layers", str(layers), "--hidden", "16", "--heads", "2",
                               "--vocab", str(VOCAB), "--seq-length", str(SEQ), "--experts", "4",
                               "--backend", backend, "--recv-mode", recv_mode])
    with contextlib.ExitStack() as stack:
        if on_gpu:
            stack.enter_context(megatron_parallel(world))
        else:
            stack.enter_context(megatron_on_cpu(world))
            stack.enter_context(cuda_streams_on_cpu())
        try:
            torch.manual_seed(seed + parallel_state.get_expert_model_parallel_rank())
            model = example.build_model(
                args, device, params_dtype=torch.bfloat16, bf16=True,
                moe_router_dtype="fp32", expert_model_parallel_size=world,
                overlap_moe_expert_parallel_comm=True)
            model = model.to(torch.bfloat16)  # what Megatron's Float16Module does
            config = model.config
            if timeout_s is not None:
                config.nccl_ep_options = dataclasses.replace(config.nccl_ep_options,
                                                             timeout_s=timeout_s)
            example.sync_replicas(model)
            gen = torch.Generator().manual_seed(seed * 31 + torch.distributed.get_rank())
            batches = [(torch.randint(VOCAB, (MICRO_BATCH, SEQ), generator=gen).to(device),
                        torch.randint(VOCAB, (MICRO_BATCH, SEQ), generator=gen).to(device))
                       for _ in range(microbatches)]

            def loss_func(output):
                loss = output.float().mean()
                return loss, {"loss": loss.detach()}

            def forward_step(data_iterator, model, return_schedule_plan=False):
                tokens, labels = next(data_iterator)
                positions = torch.arange(SEQ, device=device).expand(MICRO_BATCH, -1)
                if return_schedule_plan:  # the overlapped schedule asks for the layer stages
                    return model.build_schedule_plan(tokens, positions, None,
                                                     labels=labels), loss_func
                return model(tokens, positions, None, labels=labels), loss_func

            runs = {}
            for overlap in (False, True):
                config.overlap_moe_expert_parallel_comm = overlap
                model.zero_grad(set_to_none=True)
                events: list = []
                undo = record_order(events)
                try:
                    store = schedules.forward_backward_no_pipelining(
                        forward_step_func=forward_step, data_iterator=iter(batches),
                        model=[model], num_microbatches=microbatches, seq_length=SEQ,
                        micro_batch_size=MICRO_BATCH)
                finally:
                    undo()
                runs[overlap] = dict(
                    losses=[d["loss"].item() for d in store], events="".join(events),
                    grads={n: p.grad.cpu() for n, p in model.named_parameters()})
            return runs
        finally:
            destroy_moe_metrics_tracker()  # sized by the first model's layers; the pool reuses us


def check_overlap_runs(runs: dict, layers: int, microbatches: int) -> None:
    plain, overlapped = runs[False], runs[True]
    assert overlapped["losses"] == plain["losses"], (plain["losses"], overlapped["losses"])
    assert plain["grads"].keys() == overlapped["grads"].keys()
    for name, want in plain["grads"].items():
        assert want.any(), f"{name}: no gradient"
        assert torch.equal(overlapped["grads"][name], want), name
    # Plain: each micro-batch's L dispatches, then its L dispatch backwards. Overlapped:
    # micro-batch 1's first dispatch runs before micro-batch 0's first dispatch backward.
    assert plain["events"] == ("F" * layers + "B" * layers) * microbatches, plain["events"]
    assert overlapped["events"].startswith("F" * (layers + 1)), overlapped["events"]
    assert sorted(overlapped["events"]) == sorted(plain["events"])


@pytest.mark.parametrize("recv_mode,layers,microbatches", [("exact", 1, 3), ("capacity", 2, 3)])
def test_ep_overlap_matches_the_plain_schedule_bitwise(recv_mode, layers, microbatches, seed):
    for runs in dist.run(2, overlap_case, seed, recv_mode, layers, microbatches, timeout=600):
        check_overlap_runs(runs, layers, microbatches)


def test_overlap_configs_are_validated_like_alltoall():
    common = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                  moe_router_topk=2, moe_token_dispatcher_type="nccl_ep",
                  expert_model_parallel_size=2, add_bias_linear=False)
    config = TransformerConfig(**common, bf16=True, overlap_moe_expert_parallel_comm=True)
    assert config.moe_token_dispatcher_type == "nccl_ep"  # validated as alltoall, type kept
    # Megatron's own conditions of the overlap still hold for nccl_ep.
    with pytest.raises(AssertionError, match="only supported with bf16 or fp16"):
        TransformerConfig(**common, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(AssertionError, match="disable moe_shared_expert_overlap"):
        TransformerConfig(**common, bf16=True, overlap_moe_expert_parallel_comm=True,
                          moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True)
