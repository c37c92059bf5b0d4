"""Capacity mode's overflow in Megatron training, ``--nccl-ep-capacity-overflow redo``: a step
in which a layer needed more rows than its static budget is redone before the optimizer sees it,
and the budget grows for the steps after it.

``register()`` wraps Megatron's ``train_step`` so that its ``forward_backward_func`` (the
schedule, or its full-iteration CUDA graph wrapper) runs inside ``RedoOverflowedSteps``:

1. the step's micro-batches are read first (and kept), the RNG states saved;
2. the step runs as Megatron would run it (a graph replay, or eagerly); the rows past a budget
   are dropped (the packed layout) or never sent (the fixed layout), nothing raises mid-step;
3. ``dispatcher.budgets_over(WORLD)``: one all-reduce per EP group and one over every rank, so
   that every rank takes the same branch (data-parallel replicas redo together);
4. on an overflow: the full-iteration graph is reset (Megatron recaptures it after its warm-up
   steps), the overflowed layers' budgets grow (``dispatcher.grow_budgets``: GROWTH x the rows
   needed; their groups destroyed, made anew by the next step), the gradients are zeroed and
   the RNG states restored, and the same micro-batches run again eagerly in exact mode
   (``dispatcher.exact_mode``): the step's loss and gradients are then those of exact mode,
   bit for bit, which the optimizer step takes. One line per EP group names the layers, the
   rows they needed and the new budget.

Graphs of Megatron's local implementation that hold ``token_dispatch`` cannot be recaptured from
here: that combination is refused (``dispatcher.check_graph_settings``), use ``error`` there.
"""

from __future__ import annotations

import torch

from . import dispatcher


def _read_micro_batches(data_iterator, num_microbatches: int) -> list:
    """The step's micro-batches of each model chunk's iterator (None where a rank reads none),
    as lists, so that a redo reads the same ones."""
    iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    return [None if it is None else [next(it) for _ in range(num_microbatches)]
            for it in iterators]


def _iterators(batches: list, like):
    """Fresh iterators over kept micro-batches, in the form ``like`` had (a list or one)."""
    its = [None if b is None else iter(b) for b in batches]
    return its if isinstance(like, list) else its[0]


def _rng_states() -> list:
    """Copies of the states a forward and backward draw from: torch's CPU and current CUDA
    generators and Megatron's tracked ones (tensors, or generators for CUDA graphs)."""
    saved = [(torch.default_generator, torch.default_generator.get_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.default_generators[torch.cuda.current_device()]
        saved.append((cuda, cuda.get_state()))
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
    except (AssertionError, ImportError, RuntimeError):
        return saved
    for name, state in states.items():
        if isinstance(state, torch.Generator):
            saved.append((state, state.get_state()))
        else:
            saved.append(((tracker, name), state.clone()))
    return saved


def _restore_rng(saved: list) -> None:
    for owner, state in saved:
        if isinstance(owner, torch.Generator):
            owner.set_state(state)
        else:
            tracker, name = owner
            tracker.set_states({**tracker.get_states(), name: state.clone()})


def _log(lines: list, iteration) -> None:
    """One line per EP group (its first rank) that grew a budget."""
    if not lines:
        return
    at = f" in iteration {iteration + 1}" if iteration is not None else ""
    print(f"nccl_ep capacity overflow{at}: {'; '.join(lines)}; the step was redone in exact "
          "mode (no token dropped)", flush=True)


class RedoOverflowedSteps:
    """Megatron's ``forward_backward_func`` for one step, redone in exact mode when a layer
    overflowed its capacity-mode budget (module docstring). Called as Megatron calls the
    function (keywords only)."""

    def __init__(self, forward_backward_func, model, optimizer, iteration=None):
        self.forward_backward_func = forward_backward_func
        self.model, self.optimizer, self.iteration = model, optimizer, iteration

    def __call__(self, **kwargs):
        like = kwargs["data_iterator"]
        batches = _read_micro_batches(like, kwargs["num_microbatches"])
        rng = _rng_states()
        kwargs["data_iterator"] = _iterators(batches, like)
        result = self.forward_backward_func(**kwargs)
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        over = dispatcher.budgets_over(world)
        if not over:
            return result
        eager = self.forward_backward_func
        reset = getattr(eager, "reset_cuda_graph", None)
        if reset is not None:  # Megatron's FullCudaGraphWrapper: recaptured after its warm-up
            reset("training")
            eager = eager.forward_backward_func
        lines = dispatcher.grow_budgets(over)
        first = over[0][0]
        if first is not None and (not torch.distributed.is_initialized()
                                  or torch.distributed.get_rank(first.comm_group) == 0):
            _log(lines, self.iteration)
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        _restore_rng(rng)
        kwargs["data_iterator"] = _iterators(batches, like)
        with dispatcher.exact_mode():
            result = eager(**kwargs)
        dispatcher.destroy_exact_groups()
        return result
