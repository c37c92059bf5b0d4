"""The LL (low-latency) front end: ``LLHandle``, what ``Group.create_handle`` returns on a group of
``mode="ll"`` (docs/design.md §9); its dispatch returns an ``outputs.LLDispatchOutput``.

A handle is made without communication; ``dispatch`` and ``combine`` are collective and
stream-ordered, never read anything back to the host, and with ``send_only=True`` only send:
``complete()`` receives. The rule for ops in flight (two buffer sets per kind) is ``InFlight``'s,
checked here on every rank alike before anything is enqueued (docs/design.md §9).
"""

from __future__ import annotations

from typing import Optional

import torch

from .config import INDEX_DTYPES, PROB_DTYPES
from .handle_lifetime import BackendHandle
from .outputs import LLDispatchOutput

_KINDS = ("dispatch", "combine")
_PLURAL = {"dispatch": "dispatches", "combine": "combines"}


class InFlight:
    """A group's LL ops by kind: how many were issued, and the number of each sent with
    ``send_only`` and not completed. The i-th op of a kind uses buffer set i mod 2, so an op may
    not be issued while one of its kind issued two or more ops before it is pending: it would
    write the set that op still holds (a third op while two are in flight is one such case)."""

    def __init__(self):
        self.issued = {kind: 0 for kind in _KINDS}
        self.pending = {kind: {} for kind in _KINDS}  # handle -> the number of its op

    def check_room(self, kind: str) -> None:
        ops = self.pending[kind]
        if len(ops) >= 2:
            raise RuntimeError(
                f"LL {kind}: two {_PLURAL[kind]} are already in flight on this group (sent with "
                f"send_only=True, not completed); their two buffer sets are taken: call "
                f"complete() on the older handle first")
        behind = [self.issued[kind] - op for op in ops.values() if op + 2 <= self.issued[kind]]
        if behind:
            raise RuntimeError(
                f"LL {kind}: the {kind} sent with send_only=True {behind[0]} {_PLURAL[kind]} "
                f"before this one is not completed, and this one would write the buffer set it "
                f"still holds (the ops of a kind alternate between two): call complete() on "
                f"that handle first")

    def issue(self, kind: str, handle: "LLHandle", send_only: bool) -> None:
        if send_only:
            self.pending[kind][handle] = self.issued[kind]
        self.issued[kind] += 1

    def finish(self, kind: str, handle: "LLHandle") -> None:
        del self.pending[kind][handle]


class LLHandle(BackendHandle):
    """The routing of one LL step (one layer, one micro-batch): ``topk_idx [T, K]``. Its combine
    returns the rows of its latest dispatch (docs/design.md §9, Handle)."""

    def __init__(self, group, state, num_tokens: int, topk: int):
        super().__init__(group, state, num_tokens, topk)
        self._pending: Optional[str] = None  # the kind sent with send_only, not completed
        self._dispatched = False

    # -- checks ------------------------------------------------------------------------------------
    def _in_flight(self) -> InFlight:
        return self.group._ll_in_flight

    def _check_ready(self, kind: str) -> None:
        self._require_alive()
        if self._pending is not None:
            raise RuntimeError(f"LL {kind}: this handle's {self._pending} was sent with "
                               "send_only=True and not completed: call complete() first")
        if kind == "combine" and not self._dispatched:
            raise RuntimeError("LL combine: this handle has not dispatched yet (the combine "
                               "returns the rows its dispatch placed)")
        self._in_flight().check_room(kind)

    def _weights(self, name: str, w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if w is None:
            return None
        self.group._check_tensor(name, w, 2, PROB_DTYPES, (self.num_tokens, self.topk))
        return w.to(torch.float32).contiguous()

    def _rows_shape(self) -> tuple:
        cfg, R = self.group.config, self.group.world_size
        rows = R * cfg.max_tokens_per_rank
        if cfg.ll_layout == "expert_major":
            return (self.group.num_local_experts, rows, cfg.hidden)
        return (rows, cfg.hidden)

    # -- ops ---------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, *,
                 send_only: bool = False) -> LLDispatchOutput:
        """Collective: this rank's tokens to every rank that holds one of their experts.

        Args:
            x: ``[T, H]``, the group's dtype.
            topk_weights: optional ``[T, K]``, any float dtype (sent as fp32; the rank-major
                layout returns them as ``topk_weights``).
            send_only: only send; ``complete()`` receives (the outputs are written then).

        Returns:
            ``LLDispatchOutput`` (its fields' shapes and dtypes: outputs.py): expert-major
            ``x [L, R*T_max, H]``, ``count [L]``, ``src``; rank-major ``x [R*T_max, H]``,
            ``count [1]``, ``topk_idx`` and ``topk_weights``; FP8 ``scales``.
        """
        cfg = self.group.config
        self._check_ready("dispatch")
        prepared = {}

        def check():
            self.group._check_tensor("x", x, 2, (cfg.dtype,), (self.num_tokens, cfg.hidden))
            prepared["w"] = self._weights("topk_weights", topk_weights)

        self.group._check_agreed("LL dispatch", check)
        out = self.group._backend.ll_dispatch(self._state, x.contiguous(), prepared["w"],
                                              bool(send_only))
        self._dispatched = True
        self._after_send("dispatch", send_only)
        return out

    def combine(self, expert_out: torch.Tensor, topk_weights: Optional[torch.Tensor] = None, *,
                send_only: bool = False) -> torch.Tensor:
        """Collective: the expert outputs back to their tokens' ranks, summed in a fixed order.

        Args:
            expert_out: the dispatch's layout, the group's dtype: expert-major ``[L, R*T_max,
                H]``; rank-major ``[R*T_max, H]``, each row a rank's weighted partial.
            topk_weights: expert-major: ``[T, K]``, the weights of the sum (required);
                rank-major: None.
            send_only: only send; ``complete()`` receives (``y`` is written then).

        Returns:
            ``y [T, H]``, the group's dtype.
        """
        cfg = self.group.config
        self._check_ready("combine")
        prepared = {}

        def check():
            self.group._check_tensor("expert_out", expert_out, len(self._rows_shape()),
                                     (cfg.dtype,), self._rows_shape())
            if cfg.ll_layout == "expert_major":
                if topk_weights is None:
                    raise TypeError("LL combine (expert_major): topk_weights [T, K] is required "
                                    "(y[t] = sum over k of w[t, k] * out(t, k))")
                prepared["w"] = self._weights("topk_weights", topk_weights)
            else:
                if topk_weights is not None:
                    raise TypeError("LL combine (rank_major): topk_weights must be None (each "
                                    "rank's partial rows are already weighted)")
                prepared["w"] = None

        self.group._check_agreed("LL combine", check)
        y = self.group._backend.ll_combine(self._state, expert_out.contiguous(), prepared["w"],
                                           bool(send_only))
        self._after_send("combine", send_only)
        return y

    def complete(self) -> None:
        """Receives this handle's op sent with ``send_only=True`` (stream-ordered)."""
        self._require_alive()
        if self._pending is None:
            raise RuntimeError("LL complete: this handle has no op sent with send_only=True "
                               "pending")
        self.group._backend.ll_complete(self._state)
        self._in_flight().finish(self._pending, self)
        self._pending = None

    def _after_send(self, kind: str, send_only: bool) -> None:
        if send_only:
            self._pending = kind
        self._in_flight().issue(kind, self, send_only)

    # -- lifetime ----------------------------------------------------------------------------------
    def _before_destroy(self) -> None:
        if self._pending is not None:
            self._in_flight().finish(self._pending, self)
            self._pending = None


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
