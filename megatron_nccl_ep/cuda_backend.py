"""The ``cuda`` backend: our CUDA kernels behind the C API (csrc/include/nccl_ep.h), through the
pybind11 module ``megatron_nccl_ep._C``. Implements ``backend.Backend``.

The library runs on its own NCCL communicator (same ranks as the torch process group): rank 0
creates the unique id, the process group broadcasts it, every rank calls ``ncclCommInitRank``.
``CudaBackend.local_team`` makes every rank of a group inside one process instead (no NCCL).
Each op is one binding call: it takes the tensors as they are, with the group's device index,
allocates the outputs (from the caching allocator on that device, so they stay
stream-ordered) and launches on the device's current stream. The bindings check each call's
tensors against the handle before enqueueing anything (``checks_calls``): the front end runs its
own checks only on a call they refused, for its messages. A group's configuration is checked by
the library alone (``CudaBackend.check``: its rules and messages, config.cc), after the fields
only Python has (``GroupConfig.check_fields``).

Errors, raised by the bindings themselves: ``ValueError`` for bad arguments or routing (the
library's ncclInvalidArgument / ncclInvalidUsage), ``errors.NcclEpError`` for runtime failures
(device-side timeouts, capacity overflow, CUDA/NCCL errors). In capacity mode nothing
synchronizes the host, so routing errors and overflow are raised by the next call (or by
``check_errors()``); in exact mode by the first read of the receive count
(``num_recv_tokens``, ``tokens_per_expert`` or the handle's first dispatch).
"""

from __future__ import annotations

import math
from sys import is_finalizing as _is_finalizing  # bound now: late in shutdown sys may be gone
from typing import Optional

import torch
import torch.distributed as dist

from . import build_info
from .config import GroupConfig
from .outputs import FIELDS, LLDispatchOutput, ll_dispatch_fields

try:
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Optional[str] = None
except (ImportError, OSError) as exc:  # not built, or libnccl.so.2 / CUDA not loadable
    _C = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def available() -> bool:
    """True when the extension imported (it may still fail at runtime without a GPU)."""
    return _C is not None


def unavailable_reason() -> str:
    """'' when the extension imported; else why not: the build's reason when setup did not build
    the library (build_info), the import's error when it did."""
    if _C is not None:
        return ""
    not_built = build_info.not_built_reason()
    if not_built is not None:
        return not_built
    return (f"megatron_nccl_ep._C could not be imported ({_IMPORT_ERROR}), although setup built "
            "it; rerun scripts/setup_venv.sh")


class CudaHandleState:
    """One handle of the C library. Exact mode: the receive count and tokens per expert are read
    from the device the first time they are asked for (the library's one host read per handle),
    which also raises the handle's routing errors."""

    def __init__(self, ptr: int, num_tokens: int, topk: int, num_local_experts: int,
                 capacity_rows: Optional[int], device_index: int):
        """``capacity_rows``: capacity mode's count (the group's capacity, no host read); None
        in exact mode."""
        self.ptr, self.num_tokens, self.topk = ptr, num_tokens, topk
        self._num_local, self._device_index = num_local_experts, device_index
        self._num_recv = capacity_rows
        self._tokens_per_expert: Optional[torch.Tensor] = None
        self._capacity_mode = capacity_rows is not None

    @property
    def num_recv_tokens(self) -> int:
        if self._num_recv is None:
            self._num_recv = _C.handle_num_recv_tokens(self.ptr)
        return self._num_recv

    @property
    def routing_released(self) -> bool:
        # Exact mode's reads of the count waited for the layout, which follows the routing's
        # pack.
        return not self._capacity_mode and (self._num_recv is not None
                                            or self._tokens_per_expert is not None)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Exact mode: read to the host; capacity mode: copied on the device, on the current
        stream (after the handle's layout), when first asked for."""
        if self._tokens_per_expert is None:
            self._tokens_per_expert = _C.handle_tokens_per_expert(
                self.ptr, self._num_local, self._capacity_mode, self._device_index)
        return self._tokens_per_expert


def _c_config(config: GroupConfig):
    """The C library's group configuration for ``config`` (its fields checked: the words name
    the C API's enums, whose values the bindings give; ``ll_layout`` is ignored in HT)."""
    c = _C.GroupConfig()
    c.num_experts, c.hidden = config.num_experts, config.hidden
    c.max_tokens_per_rank, c.max_topk = config.max_tokens_per_rank, config.max_topk
    c.token_dtype = config.dtype
    c.recv_count_mode = (_C.RECV_COUNT_EXACT if config.recv_mode != "capacity" else
                         _C.RECV_COUNT_CAPACITY_DROP if config.capacity_overflow == "drop" else
                         _C.RECV_COUNT_CAPACITY)
    if config.recv_mode == "capacity":
        c.max_recv_tokens_per_rank = int(config.max_recv_tokens_per_rank)
    c.expert_alignment, c.num_sms = config.expert_alignment, config.num_sms
    c.timeout_ms = max(1, int(math.ceil(config.timeout_s * 1000)))
    c.staging_chunk_tokens, c.staging_depth = config.staging_chunk_tokens, config.staging_depth
    c.ranks_per_node = config.ranks_per_node
    c.expert_capacity = config.expert_capacity
    c.rail_capacity = config.rail_capacity
    c.mode = _C.MODE_LOW_LATENCY if config.mode == "ll" else _C.MODE_HIGH_THROUGHPUT
    if config.mode == "ll":
        c.layout = (_C.LAYOUT_RANK_MAJOR if config.ll_layout == "rank_major" else
                    _C.LAYOUT_EXPERT_MAJOR)
    c.payload_dtype = config.payload_dtype
    return c


def ll_memory_size(config: GroupConfig, world_size: int) -> dict:
    """The bytes a group of ``config`` allocates on each rank (``ncclEpGetMemorySize``; no
    communicator, no GPU).

    Args:
        config: the group's ``GroupConfig``.
        world_size: its ranks.

    Returns:
        ``{"window_bytes": the symmetric window, "device_bytes": the rest (state and pooled
        handle buffers), "handle_bytes": one handle, "total_bytes": ...}``, ints.
    """
    if _C is None:
        raise RuntimeError(unavailable_reason())
    config.check_fields()
    return dict(_C.memory_size(_c_config(config), world_size))  # the library checks the rest


class CudaLLHandleState:
    """One LL handle of the C library (docs/design.md §9): made without communication; its
    counts stay on the device."""

    routing_released = False  # the handle's kernel reads the routing in stream order

    def __init__(self, ptr: int, num_tokens: int, topk: int):
        self.ptr, self.num_tokens, self.topk = ptr, num_tokens, topk


class CudaBackend:
    name = "cuda"
    #: Every op's binding refuses (ValueError / TypeError) a call whose tensors do not fit the
    #: handle before it enqueues anything, so the front end checks only refused calls.
    checks_calls = True
    #: The bindings attach autograd's backward to an op's outputs (csrc/bindings/py_backward.h).
    records_grad_fn = True

    @staticmethod
    def check(config: GroupConfig, world_size: int, device: Optional[torch.device]) -> None:
        """Group creation's local checks (no communication), in the same order on every rank:
        the library's own checks of the configuration (those of group creation, without a GPU
        or a communicator: its rules and its messages), then the device."""
        if _C is None:
            raise RuntimeError(unavailable_reason())
        _C.check_config(_c_config(config), world_size)
        current = torch.device("cuda", torch.cuda.current_device())
        if device is not None and device != current:
            raise ValueError(f"the cuda backend runs on the current CUDA device ({current}), got "
                             f"device={device}; call torch.cuda.set_device({device.index}) first")

    def __init__(self, config: GroupConfig, process_group, device: Optional[torch.device] = None):
        """Collective; every rank passed ``check`` and the group's rendezvous (api.Group)."""
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self._setup(config, device, self.world_size)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.num_local_experts = config.num_experts // self.world_size

        unique_id = _C.get_unique_id() if self.rank == 0 else None
        if self.world_size > 1:
            box = [unique_id]
            dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0),
                                       group=process_group)
            unique_id = box[0]
        with torch.cuda.device(self.device):
            self._comm = _C.comm_init_rank(self.world_size, unique_id, self.rank)
            try:
                self._group = _C.create_group(self._comm, _c_config(config), self._stream())
            except BaseException:
                _C.comm_destroy(self._comm)
                self._comm = 0
                raise

    def _setup(self, config: GroupConfig, device: Optional[torch.device],
               world_size: int) -> None:
        self.check(config, world_size, device)
        self.config = config
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._comm = 0
        self._group = 0
        self._handles = set()
        self._device_index = self.device.index
        # LL: the dispatch outputs without / with weights (ll_dispatch_fields), made once, by
        # LLDispatchOutput's field names in its order (the order the bindings return them in).
        self._ll_outputs = (tuple(
            _C.LLOutputs(list(zip(FIELDS, ll_dispatch_fields(config, world_size, w))))
            for w in (False, True)) if config.mode == "ll" else None)
        self._capacity_rows: Optional[int] = None  # capacity mode: every handle's count

    @classmethod
    def local_team(cls, config: GroupConfig, world_size: int,
                   device: Optional[torch.device] = None) -> list:
        """``world_size`` backends forming one group inside this process (no NCCL): see
        ``Group.local_team``."""
        leader = cls.__new__(cls)
        leader._setup(config, device, world_size)
        groups = _C.create_local_team(world_size, _c_config(config), leader._stream())
        team = []
        for rank, ptr in enumerate(groups):
            member = leader if rank == 0 else cls.__new__(cls)
            if rank:
                member._setup(config, device, world_size)
            member.group, member.world_size, member.rank = None, world_size, rank
            member.num_local_experts = config.num_experts // world_size
            member._group = ptr
            team.append(member)
        return team

    def info(self) -> dict:
        return dict(_C.group_info(self._group))

    def agree_on_arguments(self, op: str, error: Optional[Exception]) -> None:
        """No host collective on the hot path: the failing rank raises here, before launching;
        its peers' waits in ``op`` time out after timeout_s naming it."""
        if error is not None:
            raise error

    def stop_after_local_error(self, op: str, error: Exception) -> None:
        """Nothing to do on the host: the peers' device-side waits in their next op time out after
        timeout_s naming this rank (docs/design.md §9, errors)."""

    def _stream(self) -> int:
        """The current stream of the group's device (group setup's; ops find it themselves)."""
        return torch.cuda.current_stream(self.device).cuda_stream

    # -- handles -------------------------------------------------------------------------------
    def create_handle(self, routing: torch.Tensor, from_map: bool) -> CudaHandleState:
        ptr = _C.create_handle(self._group, routing, from_map, self._device_index)
        self._handles.add(ptr)
        tokens, cols = routing.shape  # 2-D: the library took it
        topk = self.config.max_topk if from_map else cols
        try:
            rows = self._capacity_rows
            if rows is None and self.config.recv_mode == "capacity":  # the group's, once
                rows = self._capacity_rows = _C.handle_num_recv_tokens(ptr)
            return CudaHandleState(ptr, tokens, topk, self.num_local_experts, rows,
                                   self._device_index)
        except BaseException:
            self._handles.discard(ptr)
            _C.handle_destroy(ptr)
            raise

    def topk_idx(self, state: CudaHandleState) -> torch.Tensor:
        return _C.handle_topk_idx(state.ptr, state.num_tokens, state.topk, self._device_index)

    def destroy_handle(self, state: CudaHandleState) -> None:
        if state.ptr and state.ptr in self._handles:
            self._handles.discard(state.ptr)
            _C.handle_destroy(state.ptr)
        state.ptr = 0

    # -- operations ----------------------------------------------------------------------------
    def dispatch(self, state: CudaHandleState, x: torch.Tensor, probs: Optional[torch.Tensor],
                 dense: bool = False, backward=None):
        recv_x, recv_probs = _C.dispatch(state.ptr, x, probs, dense, self._device_index,
                                         backward)
        if state._num_recv is None:  # exact mode: the binding read the count
            state._num_recv = recv_x.shape[0]
        return recv_x, recv_probs

    def combine(self, state: CudaHandleState, expert_out: torch.Tensor,
                backward=None) -> torch.Tensor:
        return _C.combine(state.ptr, expert_out, state.num_tokens, self.config.dtype,
                          self._device_index, backward)

    def combine_probs(self, state: CudaHandleState, grad_recv_probs: torch.Tensor,
                      dense: bool = False) -> torch.Tensor:
        cols = self.config.num_experts if dense else state.topk
        return _C.combine_topk_weights(state.ptr, grad_recv_probs, state.num_tokens, cols, dense,
                                       self._device_index)

    # -- LL (docs/design.md §9) -----------------------------------------------------------------
    def ll_create_handle(self, topk_idx: torch.Tensor) -> CudaLLHandleState:
        ptr = _C.create_handle(self._group, topk_idx, False, self._device_index)
        self._handles.add(ptr)
        tokens, topk = topk_idx.shape  # 2-D: the library took it
        return CudaLLHandleState(ptr, tokens, topk)

    def ll_new_output(self, with_weights: bool, given: dict) -> LLDispatchOutput:
        """One allocation for the fields not ``given``, as a dispatch allocates its own (the
        given fields' share of it goes unused): one binding call, not a ``torch.empty`` each."""
        made = _C.ll_new_outputs(self._ll_outputs[with_weights], self._device_index)
        return LLDispatchOutput(*[given.get(name, t) for name, t in zip(FIELDS, made)])

    def ll_dispatch(self, state: CudaLLHandleState, x: torch.Tensor,
                    topk_weights: Optional[torch.Tensor], send_only: bool,
                    out: Optional[LLDispatchOutput] = None) -> LLDispatchOutput:
        made = _C.ll_dispatch(state.ptr, x, topk_weights, send_only,
                              self._ll_outputs[topk_weights is not None], out, self._device_index)
        return out if made is None else LLDispatchOutput(*made)

    def ll_combine(self, state: CudaLLHandleState, expert_out: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], send_only: bool,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _C.ll_combine(state.ptr, expert_out, topk_weights, send_only, out,
                             state.num_tokens, self.config.dtype, self._device_index)

    def ll_complete(self, state: CudaLLHandleState) -> None:
        _C.complete(state.ptr, self._device_index)

    def check_errors(self, synchronize: bool = True) -> None:
        """Raises the group's device-side error, if any (it stays: destroy the group). With
        ``synchronize`` the current stream is synchronized first, so the check is complete."""
        if synchronize:
            torch.cuda.current_stream(self.device).synchronize()
        _C.group_check_errors(self._group)

    def destroy(self) -> None:
        if self._group:
            self._handles.clear()  # the group frees its live handles
            group, self._group = self._group, 0
            _C.group_destroy(group)
        if self._comm:
            comm, self._comm = self._comm, 0
            _C.comm_destroy(comm)

    def __del__(self):
        try:
            if not _is_finalizing():  # see Group.__del__: at exit the process frees it all
                self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
