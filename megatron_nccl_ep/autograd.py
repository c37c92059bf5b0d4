"""Autograd over a Handle (docs/design.md §5): the backward pass reuses the forward's routing.

* dispatch: grad x = combine(grad recv_x); grad probs = combine_probs(grad recv_probs), in the
  layout the probs came in ([T, K] slot order, or a router's dense [T, E]);
* combine: grad expert_out = dispatch(grad y).

The outputs' grad_fn holds the Handle, so the handle lives exactly as long as the autograd graph
that needs it: on the cuda backend a node that the binding attaches in the op's own call
(csrc/bindings/py_backward.h: it spares the forward a torch.autograd.Function's host time),
elsewhere a Function's context. Every rank runs the same collectives in the same order:
gradients are materialized (zeros) rather than skipped, so no rank skips a collective its peers
enter. A local team's backward must run on the thread of its forward (``run_local_team``
arranges it): autograd's worker thread, shared by every rank of a GPU, would make the ranks'
calls wait for each other.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from .api import Handle


def _check_backward_thread(handle: Handle, thread: int) -> None:
    """A local team's backward on another thread than its forward: refused, naming the fix,
    before any rank waits at the team's gate for calls that the shared thread never makes."""
    if handle.group.is_local_team and threading.get_ident() != thread:
        raise RuntimeError(
            "the backward of a local team's dispatch or combine runs on another thread than its "
            "forward (autograd's worker thread, which every rank of the GPU shares, so the "
            "ranks' collective calls would wait for each other there): run backward() inside "
            "run_local_team, or on each rank's thread under "
            "torch.autograd.set_multithreading_enabled(False)")


# The backward of each op, for both ways of recording it (a backend that records_grad_fn calls
# them from the outputs' grad_fn; else the Functions below do).
def _dispatch_backward(handle: Handle, thread: int, has_probs: bool, dense: bool,
                       grad_recv_x: torch.Tensor, grad_recv_probs: Optional[torch.Tensor]):
    _check_backward_thread(handle, thread)
    grad_x = handle.combine(grad_recv_x)
    grad_probs = None
    if has_probs:  # [T, K], or [T, E] (zero where unrouted) for dense probs
        grad_probs = handle.combine_probs(grad_recv_probs, dense=dense)
    return grad_x, grad_probs


def _combine_backward(handle: Handle, thread: int, grad_y: torch.Tensor):
    _check_backward_thread(handle, thread)
    grad_expert_out, _ = handle.dispatch(grad_y.contiguous(), None)
    return (grad_expert_out,)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle: Handle, x: torch.Tensor, probs: Optional[torch.Tensor],
                dense: bool):
        ctx.handle, ctx.thread = handle, threading.get_ident()
        ctx.has_probs, ctx.dense = probs is not None, dense
        return handle._dispatch(x, probs, dense, None)

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_probs):
        return (None, *_dispatch_backward(ctx.handle, ctx.thread, ctx.has_probs, ctx.dense,
                                          grad_recv_x, grad_recv_probs), None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle: Handle, expert_out: torch.Tensor):
        ctx.handle, ctx.thread = handle, threading.get_ident()
        return handle._combine(expert_out, None)

    @staticmethod
    def backward(ctx, grad_y):
        return (None, *_combine_backward(ctx.handle, ctx.thread, grad_y))


def _records_grad_fn(handle: Handle) -> bool:
    """Whether the handle's backend attaches the backward itself (None: a destroyed group, whose
    op raises)."""
    return getattr(handle.group._backend, "records_grad_fn", False)


def dispatch(handle: Handle, x: torch.Tensor, probs: Optional[torch.Tensor] = None, *,
             dense: Optional[bool] = None):
    """Differentiable ``handle.dispatch`` (its backward: a combine of the rows' gradient and
    the probs' reverse gather, reusing the handle).

    Args:
        handle: the layer's ``Handle``.
        x: ``[T, H]``, the group's dtype.
        probs: optional ``[T, K]`` (slot order) or ``[T, E]`` (a router's dense probs).
        dense: as in ``Handle.dispatch``.

    Returns:
        ``(recv_x [N, H], recv_probs [N] or None)``.
    """
    if not (torch.is_grad_enabled() and (getattr(x, "requires_grad", False)
                                         or getattr(probs, "requires_grad", False))):
        return handle.dispatch(x, probs, dense=dense)  # no graph to record: the plain op
    dense = handle._settle_dense(probs, dense)
    if _records_grad_fn(handle):
        return handle._dispatch(x, probs, dense, functools.partial(
            _dispatch_backward, handle, threading.get_ident(), probs is not None, dense))
    return _Dispatch.apply(handle, x, probs, dense)


def combine(handle: Handle, expert_out: torch.Tensor) -> torch.Tensor:
    """Differentiable ``handle.combine`` (its backward: a dispatch of ``y``'s gradient).

    Args:
        handle: the ``Handle`` of the dispatch.
        expert_out: ``[N, H]`` in the dispatch's layout.

    Returns:
        ``y [T, H]``, the unweighted sum of docs/design.md §4.
    """
    if not (torch.is_grad_enabled() and getattr(expert_out, "requires_grad", False)):
        return handle.combine(expert_out)  # no graph to record: the plain op
    if _records_grad_fn(handle):
        return handle._combine(expert_out, functools.partial(_combine_backward, handle,
                                                             threading.get_ident()))
    return _Combine.apply(handle, expert_out)
