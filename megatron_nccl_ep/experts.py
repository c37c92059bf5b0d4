"""``GroupedExperts``: Megatron-Core's local experts computed by grouped GEMMs over device-side
counts, so that a static receive buffer costs GEMMs of the rows it holds, not of the rows it
could hold (the elementwise activation still passes over every row).

Megatron-Core 0.19's local spec (``--transformer-impl local``) builds ``SequentialMLP`` whatever
``--moe-grouped-gemm`` says: one MLP per local expert, its rows split with
``tokens_per_expert.tolist()`` (a host read of device counts, a sync that breaks CUDA-graph
capture), every row it is given computed. ``register()`` makes ``--moe-grouped-gemm`` under the
local spec build this class instead (``LocalSpecProvider.grouped_mlp_modules``), for every
dispatcher. It is a ``SequentialMLP``: the same per-expert MLP modules, parameters,
initialization, ``state_dict`` and ``sharded_state_dict``, so checkpoints of either load into the
other in every format; only ``forward`` differs:

* the experts' fc1 and fc2 weights are stacked (``[L, out, in]``; autograd hands each expert's
  parameter its slice of the gradient) and applied by ``torch.nn.functional.grouped_mm`` with
  ``offs`` = the running sum of ``tokens_per_expert`` clamped at the rows given, as int32 on the
  rows' device: bf16 on sm90+ reads them on the device (no host sync, capturable). Rows past the
  last offset are not computed (their contents are unspecified), and no reduction reads them:
  the weights' gradients come from the offsets' rows only, the bias rows are masked;
* the activation and the probs are Megatron's own: ``MLP.forward`` runs on the grouped fc1's rows
  with fc1 and fc2 stood in for (``_ActivationOnly``), so SwiGLU, GeLU, the fused kernels, the GLU
  clamp and the probs' rounding are exactly ``SequentialMLP``'s, row by row;
* float64 (which ``grouped_mm`` does not take) and shapes whose rows are not 16-byte multiples
  run the same arithmetic as one matmul and one activation per expert over host offsets (the CPU
  tests' models; torch's CPU activations may round an element by its place in a vector, so the
  blocks are SequentialMLP's).

The counts may be a host tensor (exact mode, drop-and-pad's constant blocks) or a device one
(``nccl_ep``'s packed capacity layout: every expert block whole, the sum the rows the routing
needed; the clamp at the buffer's rows drops what did not fit, as the dispatch did).

The arithmetic can differ from ``SequentialMLP``'s only in the GEMMs' reduction order (one
grouped CUTLASS kernel against one cuBLAS GEMM per expert, each output element the same dot
product accumulated in fp32; docs/megatron.md gives what was measured). Reruns are bitwise
identical.

Not supported (refused at construction, naming the setting): expert tensor parallelism
(``--expert-tensor-parallel-size`` > 1), FP8/FP4 experts, ``delay_wgrad_compute``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP

# grouped_mm's dtypes; its operands' rows must be 16-byte multiples.
_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _Given(torch.nn.Module):
    """Stands in for fc1 inside ``MLP.forward``: returns the grouped GEMM's rows and bias rows."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: Optional[torch.Tensor] = None
        self.bias: Optional[torch.Tensor] = None

    def forward(self, _):
        rows, bias, self.rows, self.bias = self.rows, self.bias, None, None
        return rows, bias


class _Passed(torch.nn.Module):
    """Stands in for fc2 inside ``MLP.forward``: hands the activated rows back unchanged."""

    def forward(self, rows):
        return rows, None


class _ActivationOnly:
    """What ``MLP.forward`` reads of its module, fc1 and fc2 stood in for: running it applies
    Megatron's activation and probs (``per_token_scale``) to given fc1 rows and returns them."""

    def __init__(self, expert: MLP) -> None:
        self.config = expert.config
        self.activation_func = expert.activation_func
        self.linear_fc1 = _Given()
        self.linear_fc2 = _Passed()

    def __call__(self, rows: torch.Tensor, bias: Optional[torch.Tensor],
                 probs: torch.Tensor) -> torch.Tensor:
        self.linear_fc1.rows, self.linear_fc1.bias = rows, bias
        activated, _ = MLP.forward(self, rows, per_token_scale=probs)
        return activated


def _offsets(tokens_per_expert: torch.Tensor, rows: int, device: torch.device,
             cache: dict) -> torch.Tensor:
    """int32 ``[L]`` on ``device``: the end of each expert's rows, the running sum of the counts
    clamped at ``rows``. Host counts of equal blocks (drop-and-pad) are cached per shape, so that
    a CUDA graph captured with them reads a tensor that lives on (and nothing is copied)."""
    if tokens_per_expert.device == device:
        ends = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        return ends.clamp_(max=rows)
    counts = tokens_per_expert.tolist()  # a host tensor: no device read
    if len(set(counts)) <= 1:
        key = (len(counts), counts[0] if counts else 0, rows, device)
        if key not in cache:
            block = counts[0] if counts else 0
            cache[key] = torch.tensor([min(block * (i + 1), rows) for i in range(len(counts))],
                                      dtype=torch.int32, device=device)
        return cache[key]
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(min(total, rows))
    return torch.tensor(ends, dtype=torch.int32).to(device)


def _grouped_mm_takes(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` computes ``rows @ weights[l].T`` (and its backward) here."""
    width = rows.element_size()
    return (rows.dtype in _GROUPED_MM_DTYPES and weights.dtype == rows.dtype
            and rows.shape[0] > 0
            and all(n * width % 16 == 0 for n in weights.shape[1:]))


def grouped_linear(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``out[r] = rows[r] @ weights[l].T`` for the rows of expert ``l`` (``ends[l - 1] <= r <
    ends[l]``); ``rows [N, in]``, ``weights [L, out, in]``, ``ends`` int32 ``[L]`` on the rows'
    device. Rows from ``ends[-1]`` on are not computed (unspecified) and get no gradient into
    ``weights``."""
    if _grouped_mm_takes(rows, weights):
        return F.grouped_mm(rows, weights.transpose(1, 2), offs=ends)
    # One matmul per expert over host offsets (float64, odd widths, no rows): the same products.
    bounds = [0, *ends.tolist()]
    parts = [rows[a:b] @ weights[l].t() for l, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    tail = rows.new_zeros((rows.shape[0] - bounds[-1], weights.shape[1]))
    return torch.cat([*parts, tail])


class GroupedExperts(SequentialMLP):
    """``SequentialMLP``'s experts (modules, parameters, checkpoints) run as grouped GEMMs over
    the counts, host or device: ``--moe-grouped-gemm`` under Megatron's local spec once
    ``megatron_nccl_ep.register()`` ran (module docstring)."""

    #: The nccl_ep dispatcher hands experts that read device counts capacity mode's packed
    #: layout (``NcclEpTokenDispatcher.takes_device_counts``).
    takes_device_counts = True

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None,
                 name: Optional[str] = None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection,
                         name=name)
        if self.tp_group is not None and self.tp_group.size() > 1:
            raise ValueError(
                "nccl_ep grouped experts (--moe-grouped-gemm with --transformer-impl local): "
                f"expert tensor parallelism is not supported (expert TP size "
                f"{self.tp_group.size()}, expected 1); use --expert-tensor-parallel-size 1, or "
                "drop --moe-grouped-gemm for Megatron's SequentialMLP")
        if config.fp8 or config.fp4:
            raise ValueError(
                "nccl_ep grouped experts (--moe-grouped-gemm with --transformer-impl local): FP8 "
                "and FP4 experts need Transformer Engine's grouped GEMM (--transformer-impl "
                "transformer_engine); expected fp8=None and fp4=None")
        if getattr(config, "delay_wgrad_compute", False):
            raise ValueError(
                "nccl_ep grouped experts (--moe-grouped-gemm with --transformer-impl local): "
                "delay_wgrad_compute is not supported (autograd computes the weights' gradients "
                "with the rest of the backward); expected delay_wgrad_compute=False")
        # Every expert's activation is the config's (one stand-in serves them all).
        self._activation = _ActivationOnly(self.local_experts[0])
        self._ends_cache: dict = {}

    def _stacked(self, name: str, what: str) -> Optional[torch.Tensor]:
        """The experts' ``name`` ('linear_fc1' / 'linear_fc2') ``what`` ('weight' / 'bias'),
        stacked along a new first dimension (None where there is none)."""
        params = [getattr(getattr(e, name), what, None) for e in self.local_experts]
        return None if params[0] is None else torch.stack(params)

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        """Rows of expert ``l`` are those before the ``l``-th running sum of ``tokens_per_expert``
        (clamped at the rows given); returns ``(output [N, H], None)``, output rows past the last
        block unspecified (nothing reads them: Megatron's combine reads the blocks only)."""
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP
            assert self.config.moe_router_topk == 1, (
                "`moe_apply_probs_on_input` only works with `moe_router_topk`=1.")
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        if (hidden.is_cuda and torch.cuda.is_current_stream_capturing()
                and not (hidden.dtype == torch.bfloat16
                         and torch.cuda.get_device_capability(hidden.device)[0] >= 9)):
            raise RuntimeError(
                "nccl_ep grouped experts inside a CUDA graph capture need bf16 rows on an sm90+ "
                f"GPU (torch's grouped_mm reads its offsets on the device there), got "
                f"{hidden.dtype} on compute capability "
                f"{torch.cuda.get_device_capability(hidden.device)}")
        ends = _offsets(tokens_per_expert, hidden.shape[0], hidden.device, self._ends_cache)
        bias1, bias2 = self._stacked("linear_fc1", "bias"), self._stacked("linear_fc2", "bias")
        valid = expert = None
        if bias1 is not None or bias2 is not None:  # the expert of each row, and the rows used
            row = torch.arange(hidden.shape[0], device=hidden.device)
            expert = torch.searchsorted(ends, row.to(torch.int32), right=True)
            valid = (expert < len(self.local_experts)).unsqueeze(-1)
            expert = expert.clamp_(max=len(self.local_experts) - 1)

        def rows_of(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            # Masked by `where`, whose backward is masked too: no unused row reaches the bias.
            return None if bias is None else torch.where(valid, bias[expert], 0)

        weight1 = self._stacked("linear_fc1", "weight")
        fc1 = grouped_linear(hidden, weight1, ends)
        if _grouped_mm_takes(hidden, weight1):
            activated = self._activation(fc1, rows_of(bias1), probs)
        else:  # per expert, as SequentialMLP: torch's CPU activations round by position
            bounds = [0, *ends.tolist(), hidden.shape[0]]
            rows1 = rows_of(bias1)
            activated = torch.cat([
                self._activation(fc1[a:b], None if rows1 is None else rows1[a:b], probs[a:b])
                for a, b in zip(bounds, bounds[1:])])
        output = grouped_linear(activated, self._stacked("linear_fc2", "weight"), ends)
        if bias2 is not None:  # MLP.forward's expert bias, scaled by the probs
            output = output + rows_of(bias2) * probs.unsqueeze(-1)
        return output.to(hidden.dtype), None
