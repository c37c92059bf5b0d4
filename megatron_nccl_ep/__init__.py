"""megatron_nccl_ep: deterministic expert-parallel dispatch/combine for Megatron-Core MoE training.

The API (``__all__``):

- ``Group``, ``GroupConfig``, ``Handle``: an expert-parallel group, its parameters, and one
  dispatch's layout, which its combine reuses.
- ``dispatch``, ``combine``: the differentiable dispatch and combine (autograd).
- ``run_local_team``: every rank of a group as a thread of one process (one GPU).
- ``LLHandle``, ``LLDispatchOutput``, ``ll_memory_size``: the low-latency (LL) mode for decoding.
- ``NcclEpError``: what a failed collective call raises.
- ``NcclEpTokenDispatcher``, ``register``: the Megatron-Core token dispatcher
  (``--moe-token-dispatcher-type nccl_ep``) and the call that registers it with Megatron.

Every name is imported on first use, so that tools which need neither torch nor Megatron
(``python -m megatron_nccl_ep.launch --help``) start at once; ``dir()`` lists them, and
``help()`` imports them to document them.
"""

import importlib
import logging

# name -> the submodule that defines it
_WHERE = {"Group": "api", "GroupConfig": "config", "Handle": "api", "run_local_team": "api",
          "NcclEpError": "errors", "LLHandle": "ll", "LLDispatchOutput": "outputs",
          "ll_memory_size": "cuda_backend",
          "dispatch": "autograd", "combine": "autograd",
          "NcclEpTokenDispatcher": "dispatcher", "register": "megatron"}

__all__ = list(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'megatron_nccl_ep' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# torch.utils.cpp_extension, which megatron.core imports, logs "No CUDA runtime is found, using
# CUDA_HOME=..." in every process that sees no CUDA GPU but finds a CUDA toolkit (CUDA_HOME, nvcc
# on the PATH): every Megatron training rank on a CPU machine with nvcc. Nothing here builds an
# extension at run time (setup.py does, and keeps the notice), so that one notice is dropped;
# the logger's other records pass. A filter on the logger's name needs no torch import, and
# stays when torch sets its loggers up.
_NO_CUDA_RUNTIME_NOTICE = "No CUDA runtime is found"


class _DropNoCudaRuntimeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_NO_CUDA_RUNTIME_NOTICE)


logging.getLogger("torch.utils.cpp_extension").addFilter(_DropNoCudaRuntimeNotice())
