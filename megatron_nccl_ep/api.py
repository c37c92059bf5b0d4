"""Pythonic front of the library: ``Group`` (one per EP process group and shape class) and
``Handle`` (one forward pass's routing). Backends (``backend.py`` states their interface)
implement the arithmetic of docs/design.md §3/§4:

* ``torch``: the reference (``reference.py``), over any torch.distributed backend;
* ``cuda``: our CUDA kernels behind the C API (``cuda_backend.py``);
* ``auto``: ``cuda`` when the tensors live on a GPU and the extension is built, else ``torch``.

This module owns what every backend's caller needs: the configuration's cross-rank agreement (a
timed rendezvous, ``rendezvous.py``) and the argument checks on shapes, dtypes and devices.
Checks on routing *values* (expert out of range, duplicate expert, capacity overflow) belong to
the backends: the CUDA one does them on the device so that capacity mode never synchronizes the
host.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from sys import is_finalizing as _is_finalizing  # bound now: late in shutdown sys may be gone
from typing import Optional

import torch
import torch.distributed as dist

from . import rendezvous
from .backend import Backend, checked_call, contiguous_args
from .config import INDEX_DTYPES, PROB_DTYPES, GroupConfig
from .errors import NcclEpError  # noqa: F401  (re-exported: megatron_nccl_ep.NcclEpError)
from .handle_lifetime import BackendHandle
from .ll import LLGroupState, LLHandle, check_ll_routing

def _resolve_device(device) -> torch.device:
    """``None``: the current CUDA device when there is one, else the CPU; ``"cuda"`` without an
    index: the current CUDA device (so that tensors on ``cuda:0`` match ``cuda``)."""
    if device is None:
        return (torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available() else torch.device("cpu"))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _agree_on_config(config: Optional[GroupConfig], error: Optional[Exception], process_group,
                     world_size: int, timeout_s: float) -> None:
    """Group creation's first step, before any collective: every rank posts its configuration
    (or the error its local checks raised) through the timed rendezvous. A rank that never
    arrives, or failed, makes every other rank raise within ``timeout_s``, naming it; then the
    configurations must be equal."""
    if world_size == 1:
        if error is not None:
            raise error
        return
    mine = None
    if config is not None:  # dtypes by name: the store carries JSON
        mine = {key: str(value) if isinstance(value, torch.dtype) else value
                for key, value in dataclasses.asdict(config).items()}
    everyone = rendezvous.exchange(process_group, "Group()", mine, timeout_s, error)
    me = dist.get_rank(process_group)
    mine = everyone[me]  # compared as every rank's went through the store (JSON)
    for rank, theirs in enumerate(everyone):
        for key, value in mine.items():
            if theirs[key] != value:
                raise ValueError(
                    f"inconsistent configuration across ranks: {key}={theirs[key]!r} on rank "
                    f"{rank} but {value!r} on rank {me}; every rank of the EP group must create "
                    "its Group with the same configuration")


def _resolve_backend(name: str, device: torch.device) -> "type[Backend]":
    if name == "torch":
        from .reference import ReferenceBackend

        return ReferenceBackend
    if name in ("cuda", "auto"):
        if device.type == "cuda":
            from . import cuda_backend

            if cuda_backend.available():
                return cuda_backend.CudaBackend
            if name == "cuda":
                raise RuntimeError(
                    f"backend='cuda' but the CUDA extension is not usable: "
                    f"{cuda_backend.unavailable_reason()}")
        elif name == "cuda":
            raise ValueError(f"backend='cuda' needs device of type 'cuda', got {device}")
        from .reference import ReferenceBackend

        return ReferenceBackend
    raise ValueError(f"backend must be 'auto', 'torch' or 'cuda', got {name!r}")


def _group_config(world_size: int, config: Optional[GroupConfig],
                  capacity_factor: Optional[float], fields: dict) -> GroupConfig:
    """``config``, or one built from ``fields``, for a group of ``world_size``, its fields
    checked (``GroupConfig.check_fields``; the backend's ``check`` applies the rules)."""
    if config is None:
        return GroupConfig.build(world_size, capacity_factor=capacity_factor, **fields)
    if not isinstance(config, GroupConfig):
        raise TypeError(f"config must be a GroupConfig, got {type(config).__name__}")
    extra = sorted(fields) + (["capacity_factor"] if capacity_factor is not None else [])
    if extra:
        raise TypeError("give a GroupConfig or its fields (and capacity_factor), not both; got "
                        f"config and {extra}")
    config.check_fields()
    return config


class Group:
    """One EP group: a process group, a configuration, and the backend's shared resources.

    Collective: every rank of ``process_group`` constructs it with the same arguments.
    ``process_group=None`` uses the default group, or a single-rank group when torch.distributed
    is not initialized. ``ranks_per_node`` splits the group into nodes of that many consecutive
    ranks for the hierarchical combine of docs/design.md §4. 0: the torch backend takes one node
    (the flat combine), the cuda backend NCCL's LSA team (the ranks that reach each other over
    NVLink; the whole group on one machine); give G explicitly where both must agree across
    nodes. The cuda backend moves tokens between nodes with NCCL send/receive on a rail
    communicator (docs/internode.md).

    ``expert_capacity=C`` (> 0) selects the fixed-capacity ("drop-and-pad") layout of
    docs/design.md §3, Megatron's ``moe_pad_expert_input_to_capacity``: local expert ``l``'s
    block holds ``R`` sub-blocks of ``C`` rows, one per source rank in rank order; a source's
    slots for an expert fill its sub-block in token order, slots past the ``C``-th are dropped
    (not sent, not combined, zero probability gradient), unused rows are zero with prob 0. Every
    dispatch output has ``L * roundup(R * C, expert_alignment)`` rows and ``tokens_per_expert``
    is that constant per expert, in exact and capacity mode alike, with no host read. Both
    backends implement it (the cuda backend holds at most 32 slots of a token on one rank:
    ``min(max_topk, num_experts // world_size) <= 32``).
    """

    def __init__(self, process_group=None, config: Optional[GroupConfig] = None, *,
                 backend: str = "auto", device=None, capacity_factor: Optional[float] = None,
                 **fields):
        """Collective over ``process_group``.

        Args:
            process_group: the EP group (a ``torch.distributed`` group); None: the default
                group, or one rank without torch.distributed.
            config: a ``GroupConfig``, or None and its fields as keywords (``num_experts``,
                ``hidden``, ``max_tokens_per_rank``, ``max_topk``, and the optional ones).
            backend: ``"cuda"`` (the C library), ``"torch"`` (the reference) or ``"auto"``
                (cuda on a CUDA device when built, else torch).
            device: the tokens' device (default: the current CUDA device, else the CPU).
            capacity_factor: capacity mode without ``max_recv_tokens_per_rank``: rows of every
                dispatch output = factor x ``max_tokens_per_rank`` x ``max_topk``
                (``config.capacity_from_factor``).

        Raises:
            ValueError / TypeError: a bad field, on every rank (naming the field and the
                expected value); NcclEpError: a rank that did not join within ``timeout_s``.
        """
        if dist.is_available() and dist.is_initialized():
            self.process_group = process_group if process_group is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.process_group)
            self.world_size = dist.get_world_size(self.process_group)
        else:
            if process_group is not None:
                raise ValueError("process_group given but torch.distributed is not initialized")
            self.process_group, self.rank, self.world_size = None, 0, 1
        # Local checks first, collectives after the rendezvous: a rank that fails its checks is
        # named by its peers at once instead of leaving them in a collective it never joins.
        built, error = None, None
        try:
            self.device = _resolve_device(device)
            built = _group_config(self.world_size, config, capacity_factor, fields)
            backend_cls = _resolve_backend(backend, self.device)
            backend_cls.check(built, self.world_size, self.device)
        except (ValueError, TypeError, RuntimeError) as exc:
            error = exc
        # The rendezvous waits as long as this rank's configuration asks, even a failed one.
        timeout_s = (built.timeout_s if built is not None
                     else fields.get("timeout_s", getattr(config, "timeout_s", None)))
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            timeout_s = GroupConfig.timeout_s
        _agree_on_config(built, error, self.process_group, self.world_size, timeout_s)
        self._set_up(self.process_group, self.rank, self.world_size, self.device, built,
                     backend_cls(built, self.process_group, self.device))

    def _set_up(self, process_group, rank: int, world_size: int, device: torch.device,
                config: GroupConfig, backend: Backend) -> None:
        """Every member a group has, once its configuration is agreed and its backend made
        (``__init__`` and ``local_team``)."""
        self.process_group, self.rank, self.world_size = process_group, rank, world_size
        self.device, self.config = device, config
        self.num_local_experts = config.num_experts // world_size
        self._backend: Optional[Backend] = backend
        self.backend_name = backend.name
        self._ll = LLGroupState(config, world_size) if config.mode == "ll" else None

    @classmethod
    def local_team(cls, world_size: int, config: Optional[GroupConfig] = None, *, device=None,
                   capacity_factor: Optional[float] = None, **fields) -> "list[Group]":
        """``world_size`` ranks of one EP group inside this process, on one GPU, with the cuda
        backend and no NCCL (the C library's ``ncclEpCreateLocalTeam``): element ``r`` is rank
        ``r``; the configuration as for ``Group`` (one node: ``ranks_per_node`` 0). Every device
        code path of a multi-rank group runs, so one GPU can develop and test it. Use each rank
        from its own thread with its own CUDA stream (every collective call waits at the team's
        gate for the peers' calls): ``run_local_team`` does that. Keep ``world_size * num_sms``
        within the GPU's SM count (every CTA of every rank must be resident at once). Destroy
        every member.

        Args:
            world_size: the ranks of the team (>= 1).
            config, capacity_factor, fields: as for ``Group``.
            device: the CUDA device (default: the current one).

        Returns:
            ``list[Group]``, element ``r`` rank ``r``.
        """
        device = _resolve_device(device)
        if device.type != "cuda":
            raise RuntimeError(f"Group.local_team needs a CUDA device, got {device}")
        config = _group_config(world_size, config, capacity_factor, fields)
        backend_cls = _resolve_backend("cuda", device)
        groups = []
        for rank, backend in enumerate(backend_cls.local_team(config, world_size, device)):
            group = cls.__new__(cls)  # no process group: the members' ranks are given
            group._set_up(None, rank, world_size, device, config, backend)
            groups.append(group)
        return groups

    @property
    def is_local_team(self) -> bool:
        """True for a member of a ``local_team`` of two or more ranks: its collective calls pass
        the team's gate, so every rank's calls must come from that rank's own thread."""
        return self.process_group is None and self.world_size > 1

    def info(self) -> dict:
        """What the backend allocated and chose (the cuda backend: staging bytes, channels,
        chunk, depth, ranks per node), and, for both backends, what this rank handed the rail
        between nodes since the group's creation, per op: ``rail_rows_sent`` and
        ``rail_bytes_sent``, ``{"dispatch", "combine", "combine_probs"}`` (0 on one node;
        docs/internode.md)."""
        self._require_alive()
        return self._backend.info()

    # -- argument checks shared by every backend -------------------------------------------------
    def _check_tensor(self, name: str, t, ndim: int, dtypes, shape=None) -> None:
        if (isinstance(t, torch.Tensor) and t.dim() == ndim and t.dtype in dtypes
                and t.device == self.device
                and (shape is None or all(w is None or n == w for n, w in zip(t.shape, shape)))):
            return  # what a valid call passes: no message to build
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            want = f"dtype {dtypes[0]}" if len(dtypes) == 1 else f"dtype in {tuple(dtypes)}"
            raise TypeError(f"{name} must have {want}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if shape is not None:
            for i, want in enumerate(shape):
                if want is not None and t.shape[i] != want:
                    raise ValueError(
                        f"{name} must have shape {tuple('*' if s is None else s for s in shape)},"
                        f" got {tuple(t.shape)}")

    def _check_agreed(self, op: str, check) -> None:
        """Runs ``check`` (one call's argument checks, raising TypeError / ValueError) and lets
        the backend settle the outcome with the peers: on a multi-rank reference group every rank
        raises when any rank's arguments are wrong, instead of the others waiting in a collective
        until the process group times out. (The cuda backend raises on the failing rank only; its
        peers' device-side waits time out naming that rank.)"""
        error = None
        try:
            check()
        except (TypeError, ValueError) as e:
            error = e
        self._backend.agree_on_arguments(op, error)

    def create_handle(self, topk_idx: Optional[torch.Tensor] = None, *,
                      routing_map: Optional[torch.Tensor] = None) -> "Handle | LLHandle":
        """Collective (HT; an LL group's handle needs no communication): one forward pass's
        routing, exchanged once and reused by dispatch, combine and their backward.

        Args:
            topk_idx: ``[T, K]`` int64/int32 on the group's device, -1 = masked slot,
                ``T <= max_tokens_per_rank``, ``K <= max_topk``.
            routing_map: instead of ``topk_idx`` (HT only): a router's ``[T, E]`` bool; each
                token's routed experts fill its ``max_topk`` slots in ascending order (-1
                after the last; ``Handle.topk_idx`` returns them, the order probs must
                follow); more than ``max_topk`` routed experts is an error.

        Returns:
            ``Handle`` (HT) or ``LLHandle`` (``mode="ll"``).
        """
        self._require_alive()
        if (topk_idx is None) == (routing_map is None):
            raise TypeError("create_handle takes exactly one of topk_idx and routing_map")
        backend, from_map = self._backend, routing_map is not None
        routing = routing_map if from_map else topk_idx
        if self.config.mode == "ll":
            # docs/design.md §9: no communication; routing values are checked by the backend.
            if from_map:
                raise TypeError("an LL group's handles take topk_idx [T, K], not a routing_map")
            state = checked_call(backend.checks_calls, backend.ll_create_handle, (topk_idx,),
                                 self, Group._check_ll_routing, contiguous_args)
            return LLHandle(self, state, topk_idx.shape[0], topk_idx.shape[1])
        # Bounds on T and K are checked by the backends inside the collective (see
        # shape_error), so that every rank raises together instead of leaving peers waiting.
        state = checked_call(backend.checks_calls, backend.create_handle, (routing, from_map),
                             self, Group._check_routing, contiguous_args)
        return Handle(self, state, routing.shape[0],
                      self.config.max_topk if from_map else topk_idx.shape[1])

    def _check_ll_routing(self, topk_idx: torch.Tensor) -> None:
        try:
            check_ll_routing(self, topk_idx)
        except (TypeError, ValueError) as exc:
            # No communication here: the reference backend marks this rank stopped, so its
            # peers' next collective raises at once naming it.
            self._backend.stop_after_local_error("LL create_handle", exc)
            raise

    def _check_routing(self, routing: torch.Tensor, from_map: bool) -> None:
        if from_map:
            self._check_tensor("routing_map", routing, 2, (torch.bool,),
                               (None, self.config.num_experts))
        else:
            self._check_tensor("topk_idx", routing, 2, INDEX_DTYPES)

    def check_errors(self) -> None:
        """Synchronizes the current stream and raises the group's pending device-side error.

        Raises:
            NcclEpError: a timeout, inconsistent calls across ranks, or in capacity mode a
                routing error or an overflow. Such an error stays: destroy the group.
        """
        self._require_alive()
        self._backend.check_errors()

    def destroy(self) -> None:
        """Frees the backend's shared resources. Handles must not be used afterwards."""
        if self._backend is not None:
            self._backend.destroy()
            self._backend = None

    def _require_alive(self) -> None:
        if self._backend is None:
            raise RuntimeError("this Group was destroyed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def __del__(self):
        # At interpreter exit the process frees everything: a collective teardown (NCCL's
        # communicator destroy waits for its peers' teardown) could wait for ranks that exited.
        try:
            if not _is_finalizing():
                self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Handle(BackendHandle):
    """The routing of one forward pass (one layer, one micro-batch); reused by the backward pass.

    ``num_recv_tokens``: rows of this rank's dispatch output. ``tokens_per_expert``: int64 ``[L]``
    (a CPU tensor in exact mode; on the device in capacity mode). In exact mode with the cuda
    backend both are read from the device the first time they (or ``dispatch``) are needed, so
    creating a handle never waits: routing errors are raised there, on every rank.
    """

    def __init__(self, group: Group, state, num_tokens: int, topk: int):
        super().__init__(group, state, num_tokens, topk)
        self._topk_idx = None
        self._num_recv_tokens: Optional[int] = None  # kept once read (also after destroy)
        self._tokens_per_expert: Optional[torch.Tensor] = None

    @property
    def num_recv_tokens(self) -> int:
        if self._num_recv_tokens is None:
            self._require_alive()
            self._num_recv_tokens = int(self._state.num_recv_tokens)
        return self._num_recv_tokens

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        if self._tokens_per_expert is None:
            self._require_alive()
            self._tokens_per_expert = self._state.tokens_per_expert
        return self._tokens_per_expert

    @property
    def topk_idx(self) -> torch.Tensor:
        """This rank's routing as top-k ids, ``[T, K]`` int64 on the group's device (-1 =
        masked): for a handle made from a routing map, the slots its probabilities take. (In
        capacity mode a routing-map row with too many experts, whose error the next call raises,
        holds a value below -1 in its last slot.)"""
        self._require_alive()
        if self._topk_idx is None:
            self._topk_idx = self.group._backend.topk_idx(self._state)
        return self._topk_idx

    @property
    def routing_released(self) -> bool:
        """True when no queued device work still reads the routing tensor this handle was made
        from: the host has seen the handle's layout finish (exact mode, once the receive count
        was read, as every dispatch does), so that tensor may be freed on any stream. False: it
        needs ``record_stream`` on the current stream if another stream may reuse its memory."""
        return self._state is None or self._state.routing_released

    def _check_agreed(self, op: str, check) -> None:
        self.group._check_agreed(op, check)

    def probs_are_dense(self, probs: torch.Tensor) -> bool:
        """Whether ``probs`` is a router's dense ``[T, E]`` (slot k reads the column of its
        expert) rather than ``[T, K]`` in slot order; when E == K the shapes coincide and slot
        order is meant."""
        E = self.group.config.num_experts
        return probs.dim() == 2 and probs.shape[1] == E and E != self.topk

    # Each op is one call of the backend (checked_call): a backend that checks its calls gets
    # the arguments as given, and the front end's checks run only on a call it refused (or on
    # every call of the reference backend), so the same error, naming the argument and the
    # expected value, reaches every rank.
    def dispatch(self, x: torch.Tensor, probs: Optional[torch.Tensor] = None, *,
                 dense: Optional[bool] = None):
        """Collective: this rank's tokens to the ranks of their experts, into the expert-major
        layout of docs/design.md §3. Not differentiable: ``megatron_nccl_ep.dispatch`` is.

        Args:
            x: ``[T, H]`` of the group's dtype.
            probs: optional, any float dtype: ``[T, K]`` in slot order, or a router's dense
                ``[T, E]`` (each slot reads its expert's column).
            dense: which form ``probs`` is; None: ``probs_are_dense`` (``[T, E]`` is read as
                slot order when ``E == K``, as in a drop-and-pad group of ``max_topk = E``:
                pass True for a router's probs there).

        Returns:
            ``(recv_x [N, H], recv_probs [N] or None)``: ``N = num_recv_tokens`` rows, expert
            by expert (``tokens_per_expert``), padding rows zero with prob 0; probs in their
            own dtype.
        """
        return self._dispatch(x, probs, self._settle_dense(probs, dense), None)

    def _settle_dense(self, probs: Optional[torch.Tensor], dense: Optional[bool]) -> bool:
        """``dispatch``'s ``dense`` as the backends take it: resolved, and False without probs."""
        if dense is None:
            dense = isinstance(probs, torch.Tensor) and self.probs_are_dense(probs)
        return bool(dense) and probs is not None

    def _dispatch(self, x: torch.Tensor, probs: Optional[torch.Tensor], dense: bool, backward):
        """``dispatch`` with ``dense`` settled. ``backward``: None, or (autograd.py, on a backend
        that ``records_grad_fn``) what the outputs get as their grad_fn."""
        self._require_alive()
        backend = self.group._backend
        return checked_call(backend.checks_calls, backend.dispatch,
                            (self._state, x, probs, dense, backward), self,
                            Handle._check_dispatch, contiguous_args)

    def _check_dispatch(self, state, x: torch.Tensor, probs: Optional[torch.Tensor],
                        dense: bool, backward) -> None:
        group = self.group

        def check():
            cfg = group.config
            cols = cfg.num_experts if dense else self.topk
            group._check_tensor("x", x, 2, (cfg.dtype,), (self.num_tokens, cfg.hidden))
            if probs is not None:
                group._check_tensor("probs", probs, 2, PROB_DTYPES, (self.num_tokens, cols))

        self._check_agreed("dispatch", check)

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Collective: each token's expert rows summed back at its source, in the fixed order of
        docs/design.md §4 (unweighted: weight the rows first).

        Args:
            expert_out: ``[N, H]`` of the group's dtype, in the dispatch's layout (padding rows
                are never read).

        Returns:
            ``y [T, H]``, the group's dtype.
        """
        return self._combine(expert_out, None)

    def _combine(self, expert_out: torch.Tensor, backward):
        """``combine``; ``backward`` as for ``_dispatch``."""
        self._require_alive()
        backend = self.group._backend
        return checked_call(backend.checks_calls, backend.combine,
                            (self._state, expert_out, backward), self, Handle._check_combine,
                            contiguous_args)

    def _check_combine(self, state, expert_out: torch.Tensor, backward) -> None:
        group = self.group
        self._check_agreed("combine", lambda: group._check_tensor(
            "expert_out", expert_out, 2, (group.config.dtype,),
            (self.num_recv_tokens, group.config.hidden)))

    def combine_probs(self, grad_recv_probs: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """Collective: the reverse of the probs' dispatch (their gradient's path back).

        Args:
            grad_recv_probs: ``[N]``, any float dtype.
            dense: the probs came as a router's ``[T, E]``.

        Returns:
            ``[T, K]`` in slot order (0 at masked slots), or ``[T, E]`` with ``dense`` (0 at
            every unrouted expert), the dtype of ``grad_recv_probs``.
        """
        self._require_alive()
        backend = self.group._backend
        return checked_call(backend.checks_calls, backend.combine_probs,
                            (self._state, grad_recv_probs, dense), self,
                            Handle._check_combine_probs, contiguous_args)

    def _check_combine_probs(self, state, grad_recv_probs: torch.Tensor, dense: bool) -> None:
        group = self.group
        self._check_agreed("combine_probs", lambda: group._check_tensor(
            "grad_recv_probs", grad_recv_probs, 1, PROB_DTYPES, (self.num_recv_tokens,)))


def run_local_team(groups: "list[Group]", fn, *, prepare=None, timeout_s: float = 300.0) -> list:
    """Runs ``fn(rank, group)`` for every member of a ``Group.local_team`` at once, each rank on
    its own thread and CUDA stream, and returns the results by rank.

    The members' collective calls pass the team's gate (docs/cuda_backend.md, local teams): a
    rank's call returns once every rank has enqueued that call, so between calls ``fn`` may do
    anything, including waits for the whole device. Autograd's backward runs on the rank's
    thread (``torch.autograd.set_multithreading_enabled(False)``): autograd's worker thread is
    shared by every rank of the GPU, and the ranks' backward calls would wait there for each
    other.

    Args:
        groups: every member of one ``Group.local_team``, by rank.
        fn: ``fn(rank, group)``, run on the rank's thread and stream.
        prepare: optional ``prepare(rank, group)``, on the rank's stream before the ranks meet
            for their first call (NaN-poisoning its memory, say).
        timeout_s: how long the ranks may run.

    Returns:
        ``fn``'s results, by rank.

    Raises:
        RuntimeError: naming the ranks still running after ``timeout_s``, else the lowest
            failing rank (its exception chained).
    """
    device = groups[0].device
    results, errors = [None] * len(groups), [None] * len(groups)
    meet = threading.Barrier(len(groups))

    def body(rank: int) -> None:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        try:
            with torch.cuda.stream(stream), torch.autograd.set_multithreading_enabled(False):
                if prepare is not None:
                    prepare(rank, groups[rank])
                meet.wait(timeout=timeout_s)
                results[rank] = fn(rank, groups[rank])
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, with its rank
            errors[rank] = exc
            meet.abort()  # the others stop waiting for this rank's first call

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(groups))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise RuntimeError(f"local team: ranks {hung} still running after {timeout_s} s")
    failed = [r for r, exc in enumerate(errors) if exc is not None]
    if failed:
        # A rank's own error before the others' broken meeting (they stopped waiting for it).
        rank = min(failed, key=lambda r: (isinstance(errors[r], threading.BrokenBarrierError), r))
        exc = errors[rank]
        raise RuntimeError(f"local team rank {rank}: {type(exc).__name__}: {exc}") from exc
    return results
