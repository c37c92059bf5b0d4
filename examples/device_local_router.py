"""A ``TopKRouter`` that runs where its weight lives.

Megatron-Core 0.19's ``Router.gating`` moves a CPU weight to ``torch.cuda.current_device()`` on
every forward, which fails on machines without a GPU. This subclass computes the same logits with
the weight left in place; everything else (score function, top-k, aux losses) is Megatron's.
Use it through ``MoESubmodules(router=DeviceLocalTopKRouter, ...)``. A stand-in of the examples
and the tests (examples/train_moe.py, tests/test_megatron_dispatcher.py), not part of the package.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import router_gating_linear
from megatron.core.transformer.moe.router import TopKRouter

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class DeviceLocalTopKRouter(TopKRouter):
    def gating(self, input: torch.Tensor) -> torch.Tensor:
        router_dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, router_dtype)
