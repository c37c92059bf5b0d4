"""``--nccl-ep-capacity-overflow redo`` on a GPU (cuda backend, EP 1): a MoE layer in capacity mode
(the fixed layout, SequentialMLP) trained by steps run through Megatron's own
``FullCudaGraphWrapper`` (warm-up, capture, replays) inside ``RedoOverflowedSteps``, as
``register()``'s train_step runs them. A replay whose routing overflows the budget (every token
to the same two experts) is redone: its losses and gradients are bitwise those of the same step
run eagerly in exact mode, one log line names the layer, the rows needed and the new budget, the
graph is reset, and training goes on: Megatron's warm-up and capture again, and the skewed step
now fits the grown budget (no redo)."""

from __future__ import annotations

import io
import weakref
from contextlib import redirect_stdout

import torch

import dist
from gpu_common import requires_gpus
from megatron_nccl_ep.options import NcclEpOptions
from test_megatron_dispatcher import BATCH, HIDDEN, SEQ, megatron_parallel, moe_layer

pytestmark = requires_gpus

EXPERTS, TOPK, MICRO_BATCHES = 8, 2, 2


class Chunk(torch.nn.Module):
    """A model chunk as Megatron's loop holds it: one layer, and gradients accumulated into
    buffers of their own (Megatron's main_grad), which a captured backward writes on replay."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.main_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    def zero_grad_buffer(self):
        for g in self.main_grads:
            g.zero_()


def schedule(*, data_iterator, model, num_microbatches, **_):
    """Megatron's forward_backward_func, reduced: each micro-batch forward, backward into the
    chunk's gradient buffers; the losses."""
    chunk = model[0]
    if isinstance(data_iterator, list):  # (one model chunk: Megatron's schedules unwrap it)
        data_iterator = data_iterator[0]
    losses = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        out, _ = chunk.layer(batch["x"])
        loss = (out.float() * batch["w"]).sum()
        grads = torch.autograd.grad(loss, chunk.params, allow_unused=True)
        for buf, g in zip(chunk.main_grads, grads):
            if g is not None:
                buf.add_(g)
        losses.append(loss.detach())
    return losses


def redo_case(seed: int) -> list:
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_nccl_ep import dispatcher as dispatcher_module
    from megatron_nccl_ep.overflow import RedoOverflowedSteps

    problems = []
    with megatron_parallel(1):
        # Graph-safe RNG states, as Megatron training sets them up with CUDA graphs (the
        # full-iteration wrapper registers them with its graph).
        model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
        chunks = {}
        for mode in ("capacity", "exact"):
            torch.manual_seed(seed)
            layer = moe_layer("nccl_ep", EXPERTS, TOPK, params_dtype=torch.float32,
                              moe_router_load_balancing_type="none").cuda()
            layer.layer_number = 3
            layer.token_dispatcher.moe_layer = weakref.ref(layer)
            layer.config.nccl_ep_options = NcclEpOptions(backend="cuda", recv_mode=mode,
                                                         capacity_factor=3.0)
            with torch.no_grad():  # routing = the top-2 of the tokens' first 8 features
                layer.router.weight.zero_()
                layer.router.weight[:, :EXPERTS] = torch.eye(EXPERTS)
            chunks[mode] = [Chunk(layer)]
        gen = torch.Generator().manual_seed(seed)

        def batches(skewed: bool) -> list:
            out = []
            for _ in range(MICRO_BATCHES):
                x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
                if skewed:  # every token to experts 0 and 1
                    x[..., :2] += 100.0
                out.append({"x": x.cuda(), "w": torch.randn(SEQ, BATCH, HIDDEN,
                                                             generator=gen).cuda()})
            return out

        class Optimizer:
            def zero_grad(self):
                pass

        wrapper = FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=1)
        FullCudaGraphWrapper.cuda_graph["training"] = None
        FullCudaGraphWrapper.curr_iteration["training"] = 0

        def step(model, fbf, data, iteration=None):
            model[0].zero_grad_buffer()
            log = io.StringIO()
            runner = RedoOverflowedSteps(fbf, model, Optimizer(), iteration)
            with redirect_stdout(log):
                losses = runner(forward_step_func=None, data_iterator=iter(data), model=model,
                                num_microbatches=MICRO_BATCHES, seq_length=SEQ,
                                forward_only=False)
            torch.cuda.synchronize()
            return ([float(l) for l in losses], [g.clone() for g in model[0].main_grads],
                    log.getvalue())

        def exact(data):
            return step(chunks["exact"], schedule, data)

        def same(got, want) -> bool:
            return got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))

        plan = [(False, "warm-up"), (False, "capture"), (False, "replay"), (True, "replay"),
                (True, "warm-up again"), (False, "capture again"), (True, "replay again")]
        for i, (skewed, what) in enumerate(plan):
            data = batches(skewed)
            got = step(chunks["capacity"], wrapper, data, iteration=i)
            captured = FullCudaGraphWrapper.cuda_graph["training"] is not None
            redone = "nccl_ep capacity overflow" in got[2]
            if i == 3:  # the overflowing replay: redone, exact mode's bits, the graph reset
                if not redone or captured:
                    problems.append(f"step {i}: redone {redone}, graph kept {captured}")
                if not same(got, exact(data)):
                    problems.append(f"step {i}: the redone step differs from exact mode")
                if not got[2].startswith(f"nccl_ep capacity overflow in iteration {i + 1}: "
                                         f"layer 3 needed {SEQ * BATCH} (rows per expert and "
                                         "source rank; budget 14); budget now 21 "):
                    problems.append(f"step {i}: log {got[2]!r}")
            elif redone:
                problems.append(f"step {i} ({what}) was redone: {got[2]!r}")
            if not all(torch.isfinite(torch.tensor(got[0]))):
                problems.append(f"step {i} ({what}): losses {got[0]}")
            if what.startswith("replay") and not captured and i != 3:
                problems.append(f"step {i} ({what}): no graph")
        FullCudaGraphWrapper.cuda_graph["training"] = None
        FullCudaGraphWrapper.curr_iteration["training"] = 0
        dispatcher_module._grown.clear()
    return problems


def test_overflow_in_a_replayed_full_iteration_graph_is_redone(seed):
    assert dist.run(1, redo_case, seed, backend="nccl", timeout=300) == [[]]
