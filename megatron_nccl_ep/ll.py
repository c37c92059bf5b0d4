"""The LL (low-latency) front end: ``LLHandle``, what ``Group.create_handle`` returns on a group of
``mode="ll"`` (docs/design.md §9); its dispatch returns an ``outputs.LLDispatchOutput``.

A handle is made without communication; ``dispatch`` and ``combine`` are collective and
stream-ordered, never read anything back to the host, and with ``send_only=True`` only send:
``complete()`` receives. The rule for ops in flight (``LL_BUFFER_SETS`` buffer sets per kind,
nccl_ep_limits.h) is ``InFlight``'s, checked here on every rank alike before anything is enqueued
(docs/design.md §9). What a group's handles share (``LLGroupState``) is made once per group.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import checked_call
from .config import INDEX_DTYPES, PROB_DTYPES
from .handle_lifetime import BackendHandle
from .limits import LL_BUFFER_SETS
from .outputs import FIELDS, LLDispatchOutput, ll_dispatch_fields

_KINDS = ("dispatch", "combine")
_PLURAL = {"dispatch": "dispatches", "combine": "combines"}


class InFlight:
    """A group's LL ops by kind: how many were issued, and the number of each sent with
    ``send_only`` and not completed. The i-th op of a kind uses buffer set i mod
    ``LL_BUFFER_SETS``, so an op may not be issued while one of its kind issued
    ``LL_BUFFER_SETS`` or more ops before it is pending: it would write the set that op still
    holds (an op while every set is in flight is one such case). The library's copy of the rule
    is ll.cc's ``check_op``."""

    def __init__(self):
        self.issued = {kind: 0 for kind in _KINDS}
        self.pending = {kind: {} for kind in _KINDS}  # handle -> the number of its op

    def check_room(self, kind: str) -> None:
        ops = self.pending[kind]
        if not ops:
            return
        if len(ops) >= LL_BUFFER_SETS:
            raise RuntimeError(
                f"LL {kind}: {LL_BUFFER_SETS} {_PLURAL[kind]} are already in flight on this "
                f"group (sent with send_only=True, not completed); all {LL_BUFFER_SETS} buffer "
                f"sets are taken: call complete() on the oldest handle first")
        behind = [self.issued[kind] - op for op in ops.values()
                  if op + LL_BUFFER_SETS <= self.issued[kind]]
        if behind:
            raise RuntimeError(
                f"LL {kind}: the {kind} sent with send_only=True {behind[0]} {_PLURAL[kind]} "
                f"before this one is not completed, and this one would write the buffer set it "
                f"still holds (the ops of a kind cycle through {LL_BUFFER_SETS}): call "
                f"complete() on that handle first")

    def issue(self, kind: str, handle: "LLHandle", send_only: bool) -> None:
        if send_only:
            self.pending[kind][handle] = self.issued[kind]
        self.issued[kind] += 1

    def finish(self, kind: str, handle: "LLHandle") -> None:
        del self.pending[kind][handle]


class LLGroupState:
    """What the handles of one LL group share: the ops in flight and the shapes of a valid call's
    tensors, worked out once per group."""

    def __init__(self, config, world_size: int):
        self.in_flight = InFlight()
        # ll_dispatch_fields without and with dispatched weights.
        self.fields = tuple(ll_dispatch_fields(config, world_size, w) for w in (False, True))
        # A combine's expert_out: the dispatch's rows, in the group's dtype or fp32.
        self.rows = self.fields[0][0][0]
        self.row_dtypes = tuple(dict.fromkeys((config.dtype, torch.float32)))


class LLHandle(BackendHandle):
    """The routing of one LL step (one layer, one micro-batch): ``topk_idx [T, K]``. Its combine
    returns the rows of its latest dispatch (docs/design.md §9, Handle)."""

    def __init__(self, group, state, num_tokens: int, topk: int):
        super().__init__(group, state, num_tokens, topk)
        self._pending: Optional[str] = None  # the kind sent with send_only, not completed
        self._pending_out: list = []  # that op's output tensors, which complete() writes
        self._dispatched = False
        self._shared: LLGroupState = group._ll

    # -- checks ------------------------------------------------------------------------------------
    def _in_flight(self) -> InFlight:
        return self._shared.in_flight

    def _check_ready(self, kind: str) -> None:
        self._require_alive()
        if self._pending is not None:
            raise RuntimeError(f"LL {kind}: this handle's {self._pending} was sent with "
                               "send_only=True and not completed: call complete() first")
        if kind == "combine" and not self._dispatched:
            raise RuntimeError("LL combine: this handle has not dispatched yet (the combine "
                               "returns the rows its dispatch placed)")
        self._in_flight().check_room(kind)

    def _check_weights(self, name: str, w: Optional[torch.Tensor]) -> None:
        if w is not None:
            self.group._check_tensor(name, w, 2, PROB_DTYPES, (self.num_tokens, self.topk))

    def _trusted(self, kind: str, out) -> bool:
        """Whether an op of ``kind`` may go to the backend unchecked (``checked_call``): a backend
        that checks its calls, a live handle and group, no op of this handle pending, no op of
        ``kind`` in flight on the group, and with ``out`` none of either kind (whose outputs
        ``out`` might share: ``_check_not_pending``); else ``_check_ready`` and the front end's
        checks run first."""
        backend, pending = self.group._backend, self._shared.in_flight.pending
        return (backend is not None and backend.checks_calls and self._state is not None
                and self._pending is None and not pending[kind]
                and (out is None or not any(pending.values())))

    def _check_out(self, out, with_weights: bool) -> None:
        """``dispatch(out=...)``'s full check, raising the error that names the field."""
        if not isinstance(out, LLDispatchOutput):
            raise TypeError(f"out must be an LLDispatchOutput (a dispatch's return value), got "
                            f"{type(out).__name__}")
        for name, t, field in zip(FIELDS, _fields(out), self._shared.fields[with_weights]):
            if field is None and t is not None:
                raise ValueError(f"out.{name} must be None for this group's layout and "
                                 "weights (outputs.ll_dispatch_fields)")
            if field is not None:
                if t is None:
                    raise ValueError(f"out.{name} is required for this group's layout and "
                                     "weights (outputs.ll_dispatch_fields), got None")
                self._check_written(f"out.{name}", t, field[1], field[0])

    def _check_written(self, name: str, t, dtype: torch.dtype, shape: tuple) -> None:
        """A tensor given for the library to write: the full check, and contiguous."""
        self.group._check_tensor(name, t, len(shape), (dtype,), shape)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the library writes it row by row)")

    def new_output(self, with_weights: bool = True, **given) -> LLDispatchOutput:
        """A new ``LLDispatchOutput`` for a dispatch of this handle's group (to pass as ``out``):
        the tensors ``given`` by field name, new ones of the group's shapes for the others, as
        the backend allocates a dispatch's own (cuda: one allocation; ``with_weights``: the
        fields of a dispatch that sends weights)."""
        self.group._require_alive()
        for name in given:
            if name not in FIELDS:
                raise TypeError(f"new_output: no LLDispatchOutput field named {name!r} (the "
                                f"fields: {', '.join(FIELDS)})")
        return self.group._backend.ll_new_output(with_weights, given)

    def _check_not_pending(self, op: str, given: list) -> None:
        """No tensor of an output given to ``op`` may share memory with an output that a
        pending op (of either kind) still writes at its ``complete()``."""
        for kind, handles in self._in_flight().pending.items():
            for handle in handles:
                if any(_overlap(t, p) for t in given for p in handle._pending_out):
                    raise ValueError(
                        f"LL {op}: out shares memory with the output of a {kind} sent with "
                        "send_only=True and not completed, which writes it at complete(): call "
                        "complete() on that handle first, or pass another output")

    # -- ops ---------------------------------------------------------------------------------------
    # Each op is one call of the backend (checked_call) once the state allows it (_trusted): a
    # backend that checks its calls gets the arguments as given, and the front end's checks run
    # only on a call it refused (or on every call of the reference backend), with the same
    # errors.
    def dispatch(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, *,
                 send_only: bool = False,
                 out: Optional[LLDispatchOutput] = None) -> LLDispatchOutput:
        """Collective: this rank's tokens to every rank that holds one of their experts.

        Args:
            x: ``[T, H]``, the group's dtype.
            topk_weights: optional ``[T, K]``, any float dtype (sent as fp32; the rank-major
                layout returns them as ``topk_weights``).
            send_only: only send; ``complete()`` receives (the outputs are written then).
            out: optional, an earlier dispatch's ``LLDispatchOutput`` of this group to write
                into instead of new tensors (the same fields: ``topk_weights`` only where this
                dispatch sends weights to a rank-major layout); not one that a pending
                ``send_only`` dispatch still writes. Its earlier contents are overwritten in
                stream order.

        Returns:
            ``LLDispatchOutput`` (``out`` when given; its fields' shapes and dtypes:
            outputs.py): expert-major ``x [L, R*T_max, H]``, ``count [L]``, ``src``; rank-major
            ``x [R*T_max, H]``, ``count [1]``, ``topk_idx`` and ``topk_weights``; FP8 ``scales``.
            The cuda backend's new outputs are separate tensors in one allocation (one call of
            the caching allocator): the memory is freed when none of them is left.
        """
        send_only = bool(send_only)
        trusted = self._trusted("dispatch", out) and (out is None
                                                      or type(out) is LLDispatchOutput)
        if not trusted:
            self._check_ready("dispatch")
        result = checked_call(trusted, self.group._backend.ll_dispatch,
                              (self._state, x, topk_weights, send_only, out), self,
                              LLHandle._check_dispatch, _prepare)
        self._dispatched = True
        self._after_send("dispatch", send_only, result)
        return result

    def _check_dispatch(self, state, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
                        send_only: bool, out: Optional[LLDispatchOutput]) -> None:
        group = self.group

        def check():
            cfg = group.config
            group._check_tensor("x", x, 2, (cfg.dtype,), (self.num_tokens, cfg.hidden))
            self._check_weights("topk_weights", topk_weights)
            if out is not None:
                self._check_out(out, topk_weights is not None)
                self._check_not_pending("dispatch", _tensors(out))

        group._check_agreed("LL dispatch", check)

    def combine(self, expert_out: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, *,
                send_only: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Collective: the expert outputs back to their tokens' ranks, summed in a fixed order.

        Args:
            expert_out: the dispatch's layout: expert-major ``[L, R*T_max, H]``; rank-major
                ``[R*T_max, H]``, each row a rank's weighted partial. The group's dtype, or
                fp32: each element rounded to the group's dtype (nearest even) as the combine
                reads it, the same bits as ``combine(expert_out.to(dtype))`` without the cast's
                kernel.
            topk_weights: expert-major: ``[T, K]``, the weights of the sum (required);
                rank-major: None.
            send_only: only send; ``complete()`` receives (``y`` is written then).
            out: optional ``[T, H]`` of the group's dtype, contiguous, to write ``y`` into (not
                the output of a pending ``send_only`` combine).

        Returns:
            ``y [T, H]`` (``out`` when given), the group's dtype.
        """
        send_only = bool(send_only)
        trusted = self._trusted("combine", out) and self._dispatched
        if not trusted:
            self._check_ready("combine")
        y = checked_call(trusted, self.group._backend.ll_combine,
                         (self._state, expert_out, topk_weights, send_only, out), self,
                         LLHandle._check_combine, _prepare)
        self._after_send("combine", send_only, y)
        return y

    def _check_combine(self, state, expert_out: torch.Tensor,
                       topk_weights: Optional[torch.Tensor], send_only: bool,
                       out: Optional[torch.Tensor]) -> None:
        group = self.group

        def check():
            cfg = group.config
            rows = self._shared.rows
            group._check_tensor("expert_out", expert_out, len(rows), self._shared.row_dtypes,
                                rows)
            if cfg.ll_layout == "expert_major":
                if topk_weights is None:
                    raise TypeError("LL combine (expert_major): topk_weights [T, K] is "
                                    "required (y[t] = sum over k of w[t, k] * out(t, k))")
                self._check_weights("topk_weights", topk_weights)
            elif topk_weights is not None:
                raise TypeError("LL combine (rank_major): topk_weights must be None "
                                "(each rank's partial rows are already weighted)")
            if out is not None:
                self._check_written("out", out, cfg.dtype, (self.num_tokens, cfg.hidden))
                self._check_not_pending("combine", [out])

        group._check_agreed("LL combine", check)

    def complete(self) -> None:
        """Receives this handle's op sent with ``send_only=True`` (stream-ordered)."""
        self._require_alive()
        if self._pending is None:
            raise RuntimeError("LL complete: this handle has no op sent with send_only=True "
                               "pending")
        self.group._backend.ll_complete(self._state)
        self._in_flight().finish(self._pending, self)
        self._pending, self._pending_out = None, []

    def _after_send(self, kind: str, send_only: bool, written) -> None:
        """``written``: the op's output (an ``LLDispatchOutput`` or ``y``), which
        ``complete()`` writes when ``send_only``."""
        if send_only:
            self._pending = kind
            self._pending_out = (_tensors(written) if isinstance(written, LLDispatchOutput)
                                 else [written])
        self._shared.in_flight.issue(kind, self, send_only)

    # -- lifetime ----------------------------------------------------------------------------------
    def _before_destroy(self) -> None:
        if self._pending is not None:
            self._in_flight().finish(self._pending, self)
            self._pending, self._pending_out = None, []


def _prepare(handle, state, x: torch.Tensor, topk_weights: Optional[torch.Tensor],
             send_only: bool, out) -> tuple:
    """An LL op's arguments as the backend takes them (``checked_call``'s ``prepare``): its
    tokens or rows contiguous, the weights fp32; ``out`` as given (written in place)."""
    return state, x.contiguous(), _fp32(topk_weights), send_only, out


def _fp32(w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Routing weights as the library takes them: fp32, contiguous (``w`` itself when so)."""
    return None if w is None else w.to(torch.float32).contiguous()


def _fields(out: LLDispatchOutput) -> list:
    return [getattr(out, name) for name in FIELDS]


def _tensors(out: LLDispatchOutput) -> list:
    return [t for t in _fields(out) if t is not None]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes (on one device)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def check_ll_routing(group, topk_idx: torch.Tensor) -> None:
    """The host's checks of an LL handle's routing: type, dtype, device and shape bounds. Values
    (range, repeats) are the backends' (the cuda one on the device)."""
    cfg = group.config
    group._check_tensor("topk_idx", topk_idx, 2, INDEX_DTYPES)
    tokens, topk = topk_idx.shape
    if tokens > cfg.max_tokens_per_rank:
        raise ValueError(f"topk_idx has {tokens} tokens, more than max_tokens_per_rank (T_max)="
                         f"{cfg.max_tokens_per_rank} of this LL group")
    if not 1 <= topk <= cfg.max_topk:
        raise ValueError(f"topk_idx has top-k {topk}, expected 1 <= top-k <= "
                         f"max_topk={cfg.max_topk}")
