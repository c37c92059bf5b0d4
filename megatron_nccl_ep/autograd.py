"""Autograd over a Handle (docs/design.md §5): the backward pass reuses the forward's routing.

* dispatch: grad x = combine(grad recv_x); grad probs = combine_probs(grad recv_probs), in the
  layout the probs came in ([T, K] slot order, or a router's dense [T, E]);
* combine: grad expert_out = dispatch(grad y).

The Function's context holds the Handle, so the handle lives exactly as long as the autograd graph
that needs it. Every rank runs the same collectives in the same order: gradients are materialized
(zeros) rather than skipped, so no rank skips a collective its peers enter. A local team's
backward must run on the thread of its forward (``run_local_team`` arranges it): autograd's
worker thread, shared by every rank of a GPU, would make the ranks' calls wait for each other.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from .api import Handle


def _check_backward_thread(ctx) -> None:
    """A local team's backward on another thread than its forward: refused, naming the fix,
    before any rank waits at the team's gate for calls that the shared thread never makes."""
    if ctx.handle.group.is_local_team and threading.get_ident() != ctx.thread:
        raise RuntimeError(
            "the backward of a local team's dispatch or combine runs on another thread than its "
            "forward (autograd's worker thread, which every rank of the GPU shares, so the "
            "ranks' collective calls would wait for each other there): run backward() inside "
            "run_local_team, or on each rank's thread under "
            "torch.autograd.set_multithreading_enabled(False)")


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle: Handle, x: torch.Tensor, probs: Optional[torch.Tensor],
                dense: Optional[bool]):
        ctx.handle, ctx.thread = handle, threading.get_ident()
        ctx.has_probs = probs is not None
        if dense is None:
            dense = probs is not None and handle.probs_are_dense(probs)
        ctx.dense = bool(dense) and probs is not None
        recv_x, recv_probs = handle.dispatch(x, probs, dense=ctx.dense)
        return recv_x, recv_probs

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_probs):
        _check_backward_thread(ctx)
        grad_x = ctx.handle.combine(grad_recv_x)
        grad_probs = None
        if ctx.has_probs:  # [T, K], or [T, E] (zero where unrouted) for dense probs
            grad_probs = ctx.handle.combine_probs(grad_recv_probs, dense=ctx.dense)
        return None, grad_x, grad_probs, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, handle: Handle, expert_out: torch.Tensor):
        ctx.handle, ctx.thread = handle, threading.get_ident()
        return handle.combine(expert_out)

    @staticmethod
    def backward(ctx, grad_y):
        _check_backward_thread(ctx)
        grad_expert_out, _ = ctx.handle.dispatch(grad_y.contiguous(), None)
        return None, grad_expert_out


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
    return _Combine.apply(handle, expert_out)
