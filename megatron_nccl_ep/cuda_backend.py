"""The ``cuda`` backend: our CUDA kernels behind the C API (csrc/include/nccl_ep.h), through the
pybind11 module ``megatron_nccl_ep._C``. Implements the backend protocol of ``api.py``.

The library runs on its own NCCL communicator (same ranks as the torch process group): rank 0
creates the unique id, the process group broadcasts it, every rank calls ``ncclCommInitRank``.
Tensors travel as ``data_ptr()`` with ``torch.cuda.current_stream().cuda_stream``; outputs are
``torch.empty`` on the current device, so the caching allocator keeps them stream-ordered.

Errors: ``ValueError`` for bad arguments or routing (the library's ncclInvalidArgument /
ncclInvalidUsage), ``NcclEpError`` for runtime failures (device-side timeouts, capacity overflow,
CUDA/NCCL errors). In capacity mode nothing synchronizes the host, so routing errors and overflow
are raised by the next call (or by ``check_errors()``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from .api import GroupConfig, NcclEpError

try:
    from . import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Optional[str] = None
except (ImportError, OSError) as exc:  # not built, or libnccl.so.2 / CUDA not loadable
    _C = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

TOKEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MODE_EXACT, _MODE_CAPACITY = 0, 1


def available() -> bool:
    """True when the extension imported (it may still fail at runtime without a GPU)."""
    return _C is not None


def unavailable_reason() -> str:
    if _C is not None:
        return ""
    return (f"megatron_nccl_ep._C could not be imported ({_IMPORT_ERROR}); build it with "
            "`pip install --no-build-isolation -e .` on a machine with nvcc")


def _dtype_code(dtype: torch.dtype) -> int:
    name = str(dtype).replace("torch.", "")
    return _C.DTYPES[name]


def _call(fn, *args):
    """Runs one binding; RuntimeError from the library becomes NcclEpError."""
    try:
        return fn(*args)
    except ValueError:
        raise
    except RuntimeError as exc:
        raise NcclEpError(str(exc)) from None


@dataclasses.dataclass
class CudaHandleState:
    ptr: int
    num_recv_tokens: int
    tokens_per_expert: torch.Tensor  # [L] int64: CPU (exact) or device (capacity)
    num_tokens: int
    topk: int


class CudaBackend:
    name = "cuda"

    def __init__(self, config: GroupConfig, process_group):
        if _C is None:
            raise RuntimeError(unavailable_reason())
        if config.dtype not in TOKEN_DTYPES:
            raise ValueError(f"GroupConfig: dtype {config.dtype} is not supported by the cuda "
                             "backend, which supports bfloat16, float16 and float32 tokens "
                             "(use backend='torch' for float64)")
        self.config = config
        self.group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.num_local_experts = config.num_experts // self.world_size
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._comm = 0
        self._group = 0
        self._handles = set()

        unique_id = _C.get_unique_id() if self.rank == 0 else None
        if self.world_size > 1:
            box = [unique_id]
            dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0),
                                       group=process_group)
            unique_id = box[0]
        with torch.cuda.device(self.device):
            self._comm = _call(_C.comm_init_rank, self.world_size, unique_id, self.rank)
            capacity = config.max_recv_tokens_per_rank if config.recv_mode == "capacity" else 0
            try:
                self._group = _call(
                    _C.create_group, self._comm, config.num_experts, config.hidden,
                    config.max_tokens_per_rank, config.max_topk, _dtype_code(config.dtype),
                    _MODE_CAPACITY if config.recv_mode == "capacity" else _MODE_EXACT,
                    int(capacity or 0), config.expert_alignment, config.num_sms,
                    max(1, int(math.ceil(config.timeout_s * 1000))), self._stream())
            except BaseException:
                _C.comm_destroy(self._comm)
                self._comm = 0
                raise

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # -- handles -------------------------------------------------------------------------------
    def create_handle(self, routing: torch.Tensor, from_map: bool) -> CudaHandleState:
        tokens, cols = routing.shape
        topk = self.config.max_topk if from_map else cols
        ptr = _call(_C.create_handle, self._group, routing.data_ptr(), tokens, cols,
                    _dtype_code(routing.dtype), from_map, self._stream())
        self._handles.add(ptr)
        try:
            num_recv = _call(_C.handle_num_recv_tokens, ptr)
            L = self.num_local_experts
            if self.config.recv_mode == "capacity":
                tpe = torch.empty(L, dtype=torch.int64, device=self.device)
                _call(_C.handle_tokens_per_expert, ptr, tpe.data_ptr(), L, True, self._stream())
            else:
                tpe = torch.empty(L, dtype=torch.int64)
                _call(_C.handle_tokens_per_expert, ptr, tpe.data_ptr(), L, False, 0)
        except BaseException:
            self._handles.discard(ptr)
            _C.handle_destroy(ptr)
            raise
        return CudaHandleState(ptr, int(num_recv), tpe, tokens, topk)

    def topk_idx(self, state: CudaHandleState) -> torch.Tensor:
        out = torch.empty((state.num_tokens, state.topk), dtype=torch.int64, device=self.device)
        _call(_C.handle_topk_idx, state.ptr, out.data_ptr(), state.num_tokens, state.topk,
              _dtype_code(torch.int64), self._stream())
        return out

    def destroy_handle(self, state: CudaHandleState) -> None:
        if state.ptr and state.ptr in self._handles:
            self._handles.discard(state.ptr)
            _C.handle_destroy(state.ptr)
        state.ptr = 0

    # -- operations ----------------------------------------------------------------------------
    def dispatch(self, state: CudaHandleState, x: torch.Tensor, probs: Optional[torch.Tensor]):
        n, hidden = state.num_recv_tokens, x.shape[1]
        recv_x = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
        recv_probs = None
        probs_ptr, probs_code = 0, _dtype_code(torch.float32)
        if probs is not None:
            recv_probs = torch.empty(n, dtype=probs.dtype, device=x.device)
            probs_ptr, probs_code = probs.data_ptr(), _dtype_code(probs.dtype)
        _call(_C.dispatch, state.ptr, x.data_ptr(), state.num_tokens, hidden,
              _dtype_code(x.dtype), probs is not None, probs_ptr, probs_code, state.topk,
              recv_x.data_ptr(), n,
              recv_probs.data_ptr() if recv_probs is not None else 0, self._stream())
        return recv_x, recv_probs

    def combine(self, state: CudaHandleState, expert_out: torch.Tensor) -> torch.Tensor:
        hidden = expert_out.shape[1]
        y = torch.empty((state.num_tokens, hidden), dtype=expert_out.dtype,
                        device=expert_out.device)
        _call(_C.combine, state.ptr, expert_out.data_ptr(), state.num_recv_tokens, hidden,
              _dtype_code(expert_out.dtype), y.data_ptr(), state.num_tokens, self._stream())
        return y

    def combine_probs(self, state: CudaHandleState,
                      grad_recv_probs: torch.Tensor) -> torch.Tensor:
        grad = torch.empty((state.num_tokens, state.topk), dtype=grad_recv_probs.dtype,
                           device=grad_recv_probs.device)
        _call(_C.combine_topk_weights, state.ptr, grad_recv_probs.data_ptr(),
              state.num_recv_tokens, _dtype_code(grad_recv_probs.dtype), grad.data_ptr(),
              state.num_tokens, state.topk, self._stream())
        return grad

    def check_errors(self, synchronize: bool = True) -> None:
        """Raises the group's device-side error, if any (it stays: destroy the group). With
        ``synchronize`` the current stream is synchronized first, so the check is complete."""
        if synchronize:
            torch.cuda.current_stream(self.device).synchronize()
        _call(_C.group_check_errors, self._group)

    def destroy(self) -> None:
        if self._group:
            self._handles.clear()  # the group frees its live handles
            group, self._group = self._group, 0
            _call(_C.group_destroy, group)
        if self._comm:
            comm, self._comm = self._comm, 0
            _call(_C.comm_destroy, comm)

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
