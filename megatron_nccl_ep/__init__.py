"""megatron_nccl_ep: deterministic expert-parallel dispatch/combine for Megatron-Core MoE training.

``Group``/``Handle`` (api), differentiable ``dispatch``/``combine`` (autograd), the Megatron
dispatcher ``NcclEpTokenDispatcher`` and ``register()`` (imported lazily: they import Megatron).
"""

from .api import Group, GroupConfig, Handle, NcclEpError
from .autograd import combine, dispatch

__all__ = ["Group", "GroupConfig", "Handle", "NcclEpError", "dispatch", "combine",
           "NcclEpTokenDispatcher", "register"]


def __getattr__(name):
    if name == "NcclEpTokenDispatcher":
        from .dispatcher import NcclEpTokenDispatcher

        return NcclEpTokenDispatcher
    if name == "register":
        from .megatron import register

        return register
    raise AttributeError(f"module 'megatron_nccl_ep' has no attribute {name!r}")
