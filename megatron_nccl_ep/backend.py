"""The interface every backend implements (``reference.ReferenceBackend``, the ``torch``
reference, and ``cuda_backend.CudaBackend``, our kernels), as typing Protocols.

The front end (``api.Group`` / ``api.Handle``) checks shapes, dtypes and devices and then calls
these methods; the backends check routing *values* (expert out of range, duplicate expert,
capacity overflow) themselves, the CUDA one on the device so that capacity mode never
synchronizes the host. ``state`` is a backend's own handle object (``HandleState``).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from .config import GroupConfig
from .outputs import LLDispatchOutput


class HandleState(Protocol):
    """One handle's backend state: the routing of one forward pass (one layer, one micro-batch)."""

    #: Rows of this rank's dispatch output: N_d in exact mode (the cuda backend reads it from
    #: the device at first use), the capacity in capacity mode.
    num_recv_tokens: int
    #: int64 ``[L]``: a CPU tensor in exact mode, on the group's device in capacity mode.
    tokens_per_expert: torch.Tensor
    #: No queued device work reads the routing tensor any more (the host has seen the handle's
    #: layout finish), so it may be freed on any stream.
    routing_released: bool


class Backend(Protocol):
    """One rank's share of one EP group."""

    #: ``"torch"`` or ``"cuda"``: ``Group.backend_name``.
    name: str
    #: Whether every op refuses, before enqueueing anything, a call whose tensors do not fit the
    #: handle (``checked_call``).
    checks_calls: bool
    #: Whether ``dispatch`` and ``combine`` take a ``backward`` to attach to their outputs as
    #: their grad_fn (autograd.py; else autograd wraps the ops in a torch.autograd.Function).
    records_grad_fn: bool

    @staticmethod
    def check(config: GroupConfig, world_size: int, device: Optional[torch.device]) -> None:
        """The backend's local checks of a configuration whose fields passed
        ``GroupConfig.check_fields``: the configuration's rules (the library's own for the cuda
        backend, ``GroupConfig.check_rules`` for the reference), no communication; every rank
        runs them before group creation's rendezvous, so that a rank that fails is named by its
        peers instead of leaving them in a collective. Raises ValueError / RuntimeError."""

    def __init__(self, config: GroupConfig, process_group, device: Optional[torch.device]):
        """Collective over ``process_group`` (None: one rank); every rank passed ``check``."""

    @classmethod
    def local_team(cls, config: GroupConfig, world_size: int,
                   device: Optional[torch.device]) -> "list[Backend]":
        """``world_size`` ranks of one group inside this process (element r is rank r), or
        RuntimeError where the backend has none (the reference backend)."""

    def info(self) -> dict:
        """What the backend allocated and chose (the cuda backend: staging bytes, channels,
        chunk, depth, ranks per node); empty where there is nothing to say."""

    def agree_on_arguments(self, op: str, error: Optional[Exception]) -> None:
        """Settles one call's argument check (``error``: this rank's, or None) with the peers
        before ``op`` communicates; raises where this rank (or, for the reference backend, any
        rank) failed."""

    def create_handle(self, routing: torch.Tensor, from_map: bool) -> HandleState:
        """Collective. ``routing`` is ``topk_idx [T, K]`` or, with ``from_map``, a routing map
        ``[T, E]`` (bool) whose routed experts fill ``max_topk`` slots in ascending order."""

    def topk_idx(self, state: HandleState) -> torch.Tensor:
        """``[T, K]`` int64 on the group's device: the routing as top-k ids (-1 = masked)."""

    def dispatch(self, state: HandleState, x: torch.Tensor, probs: Optional[torch.Tensor],
                 dense: bool, backward: Optional[Callable] = None
                 ) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
        """Collective: ``x [T, H]``, ``probs`` ``[T, K]`` in slot order (``[T, E]`` when
        ``dense``) or None -> ``(recv_x [N, H], recv_probs [N] or None)`` in the expert-major
        layout (docs/design.md §3). ``backward`` (only where ``records_grad_fn``):
        ``(grad recv_x, grad recv_probs or None) -> (grad x, grad probs or None)``, the outputs'
        grad_fn."""

    def combine(self, state: HandleState, expert_out: torch.Tensor,
                backward: Optional[Callable] = None) -> torch.Tensor:
        """Collective: ``expert_out [N, H]`` -> ``y [T, H]``, each token's ordered sum
        (docs/design.md §4). ``backward`` (only where ``records_grad_fn``): ``grad y ->
        (grad expert_out,)``, y's grad_fn."""

    def combine_probs(self, state: HandleState, grad_recv_probs: torch.Tensor,
                      dense: bool) -> torch.Tensor:
        """Collective: ``[N]`` -> ``[T, K]`` (``[T, E]`` when ``dense``), zero where unrouted."""

    def stop_after_local_error(self, op: str, error: Exception) -> None:
        """A call that raised on this rank alone, with no collective to agree in (an LL handle's
        host-side check): the reference backend stops the group so that its peers' next
        collective raises naming this rank; the cuda backend's peers time out naming it."""

    # -- LL (docs/design.md §9): groups of mode "ll" ---------------------------------------------
    def ll_create_handle(self, topk_idx: torch.Tensor) -> HandleState:
        """No communication: ``topk_idx [T, K]`` (bounds checked by the front end)."""

    def ll_new_output(self, with_weights: bool, given: dict) -> "LLDispatchOutput":
        """A new dispatch's outputs (``outputs.ll_dispatch_fields`` of the group's layout,
        ``with_weights`` or not), for ``ll_dispatch``'s ``out``: the tensors ``given`` by field
        name, new ones for the others."""

    def ll_dispatch(self, state: HandleState, x: torch.Tensor,
                    topk_weights: Optional[torch.Tensor], send_only: bool,
                    out: Optional["LLDispatchOutput"] = None) -> "LLDispatchOutput":
        """Collective: ``x [T, H]``, ``topk_weights [T, K]`` fp32 or None -> the outputs of the
        group's layout (written by ``ll_complete`` when ``send_only``), into ``out`` when given
        (its fields checked by the front end against ``outputs.ll_dispatch_fields``)."""

    def ll_combine(self, state: HandleState, expert_out: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], send_only: bool,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Collective: expert outputs in the layout (and, expert-major, the weights ``[T, K]``
        fp32) -> ``y [T, H]`` (written by ``ll_complete`` when ``send_only``), into ``out`` when
        given (checked by the front end)."""

    def ll_complete(self, state: HandleState) -> None:
        """Receives the handle's op sent with ``send_only``."""

    def check_errors(self) -> None:
        """Raises a pending device-side error, synchronizing the current stream first."""

    def destroy_handle(self, state: HandleState) -> None:
        """Frees one handle (its device buffers return to the group's pool)."""

    def destroy(self) -> None:
        """Frees the group's resources, live handles included."""


def checked_call(trusted: bool, op: Callable, args: tuple, owner,
                 check: Callable[..., None], prepare: Callable[..., tuple]):
    """How the front end calls one backend op. ``trusted``: the backend checks its calls
    (``checks_calls``: the cuda backend's bindings compare each call's tensors with the handle's
    and refuse a mismatch before enqueueing anything) and nothing but the arguments is in
    question; then ``op(*args)`` runs as given. On its refusal (ValueError / TypeError), and
    always when not ``trusted``, ``check(owner, *args)`` runs the front end's checks, whose
    errors name the argument and the expected value, then ``op(*prepare(owner, *args))`` runs
    with the arguments made what the backend takes (contiguous copies, fp32 weights); a refused
    call that preparing leaves unchanged raises the backend's own error (routing errors,
    misuse). ``check`` and ``prepare`` are plain functions of the owner (the group or handle)
    and the op's arguments: a trusted call makes no closure."""
    refused = None
    if trusted:
        try:
            return op(*args)
        except (TypeError, ValueError) as exc:
            refused = exc
    check(owner, *args)
    prepared = prepare(owner, *args)
    if refused is not None and all(p is a for p, a in zip(prepared, args)):
        raise refused
    return op(*prepared)


def contiguous_args(owner, *args) -> tuple:
    """``checked_call``'s ``prepare`` for an op whose tensors the backend takes contiguous: each
    tensor argument contiguous (itself when it is), the others as they are."""
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
