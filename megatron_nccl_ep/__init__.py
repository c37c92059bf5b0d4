"""megatron_nccl_ep: deterministic expert-parallel dispatch/combine for Megatron-Core MoE training.

``Group``/``Handle``/``run_local_team`` (api), differentiable ``dispatch``/``combine``
(autograd), the Megatron dispatcher ``NcclEpTokenDispatcher`` and ``register()``. Every name
is imported on first use, so that tools which need neither torch nor Megatron
(``python -m megatron_nccl_ep.launch --help``) start at once.
"""

import importlib

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
