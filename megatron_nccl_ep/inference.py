"""``NcclEpInferenceDispatcher``: Megatron-Core's inference token dispatcher interface (the one
``NCCLAllGatherDispatcher`` and ``NVLSAllGatherVDispatcher`` implement for
``transformer_impl="inference_optimized"`` MoE layers) over an LL group of the rank-major layout
(docs/design.md §9), for ``inference_moe_token_dispatcher_type="nccl_ep"``.

What Megatron's fused inference experts (``mcore_fused_moe``, the vLLM and FlashInfer kernels)
read from a dispatcher is: gathered rows ``[N, H]`` bf16, top-k probs ``[N, K]`` fp32, top-k
global expert ids ``[N, K]`` (``self.routing_map``; ids outside this rank's experts are skipped),
and the count of valid leading rows in the class-level tensor
``InferenceAllGatherDispatcherBase._valid_tokens_tensor`` (rows past it are never read). The
experts return ``[N, H]`` fp32: each row the probs-weighted sum of its local experts' outputs.

Megatron's all-gather dispatchers hand every rank all ``R x T`` tokens; the rank-major LL
dispatch hands each rank only the tokens with at least one expert there, compacted in (source
rank, token) order into ``R x T_max`` rows, with the ids of other ranks' experts set to -1 and
the count on the device. The experts consume that unchanged; the LL combine then sums each
token's partial rows over the ranks that received it, in rank order. Shapes depend on ``T_max``
only and no count is read by the host, so decode steps can be captured in CUDA graphs, and each
rank may bring its own token count (``T <= T_max``) to a step, as with the NVLS dispatcher.

``T_max`` (the group's ``max_tokens_per_rank``): ``NcclEpOptions.max_tokens_per_rank`` when set,
else the per-rank worst case of Megatron's ``DynamicInferenceContext``
(``round_up_tokens(max_tokens) // tp_size``, recorded by ``register()``'s context hook through
``set_token_budget``).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core.transformer.moe.token_dispatcher_inference import (
    InferenceAllGatherDispatcherBase)

from .api import Group
from .config import LL_MAX_TOKENS
from .dispatcher_common import GROUPS, LayerMemo, check_owned_experts, group_spec, layer_options
from .outputs import FIELDS

# The dispatch outputs the layers of one LL group share: group -> (valid-rows tensor,
# LLDispatchOutput); forgotten when the group is destroyed.
_shared_outputs: dict = {}


def destroy_inference_groups() -> None:
    """Destroys the cached groups of the inference dispatcher (collective over each group's
    ranks) and frees the dispatch outputs their layers shared, e.g. before
    ``torch.distributed.destroy_process_group``."""
    GROUPS.destroy_where(lambda group: group.config.mode == "ll")


def _drop_shared_outputs(group: Group) -> None:
    """Forgets a group's shared outputs, if it has any. Their memory goes back to the caching
    allocator only after the work queued so far on the current stream, which may read them
    (they were allocated on whichever stream ran the first dispatch)."""
    if group not in _shared_outputs:
        return
    _, out = _shared_outputs.pop(group)
    for name in FIELDS:
        t = getattr(out, name)
        if name != "count" and t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


GROUPS.on_destroy.append(_drop_shared_outputs)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call where ``t`` has that dtype already (a ``to`` that
    returns its tensor still costs a call through torch's dispatcher, per layer and step)."""
    return t if t.dtype == dtype else t.to(dtype)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class NcclEpInferenceDispatcher(InferenceAllGatherDispatcherBase):
    """Inference token dispatcher for ``inference_moe_token_dispatcher_type="nccl_ep"``.

    Per layer and step: ``dispatch_preprocess`` keeps the router's top-k ids ``[T, K]``;
    ``token_dispatch`` makes an LL handle from them (no communication) and dispatches, the
    received row count written into the valid-rows tensor the experts read;
    ``dispatch_postprocess`` and ``combine_preprocess`` pass through; ``token_combine`` combines
    the experts' rows and returns ``[T, H]`` bf16, as ``NCCLAllGatherDispatcher`` does.

    The layers of one group dispatch into one set of output tensors (as
    ``NVLSAllGatherVDispatcher``'s layers share its buffers): a layer's rows, probs and ids are
    valid until the next layer's ``token_dispatch`` writes them, in stream order, which in
    Megatron's MoE layer comes after this layer's experts have read them. Sharing them costs no
    allocation per layer and step, and CUDA graphs replay into the same addresses.

    ``payload_dtype`` (class attribute): None moves tokens in their own dtype both ways (each
    rank's fp32 partial is rounded to it before the cross-rank sum); ``torch.float32`` moves
    fp32 both ways, so the combine sums the experts' fp32 rows as Megatron's fp32 reduce-scatter
    does (twice the bytes).
    """

    payload_dtype: Optional[torch.dtype] = None
    # Per-rank token budget of the inference context (set_token_budget); None: not set.
    _token_budget: Optional[int] = None

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None, runs_metadata_sync: bool = True) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(num_local_experts=num_local_experts,
                         local_expert_indices=local_expert_indices, config=config,
                         pg_collection=pg_collection, runs_metadata_sync=runs_metadata_sync)
        if self.tp_size != 1:
            raise ValueError(f"nccl_ep inference dispatcher: expert tensor parallelism is not "
                             f"supported (expert TP size {self.tp_size}, expected 1)")
        num_experts = config.num_moe_experts
        check_owned_experts("nccl_ep inference dispatcher", self.ep_rank, self.ep_size,
                            num_local_experts, local_expert_indices, num_experts)
        self.num_experts = num_experts
        self.topk = config.moe_router_topk
        self._handle = None
        self._group_memo = LayerMemo()  # _remembered_group's
        # (handle, outputs) of each dispatch captured in a CUDA graph: the graph replays their
        # kernels on their buffers and into those outputs, so they live as long as this
        # dispatcher (the group's shared outputs may be replaced meanwhile).
        self._captured: list = []

    # -- configuration -------------------------------------------------------------------------
    @classmethod
    def set_token_budget(cls, tokens_per_rank: Optional[int]) -> None:
        """The most tokens one rank brings to one MoE layer in a step (None: unset). Called by
        ``register()``'s DynamicInferenceContext hook; the same on every rank."""
        if tokens_per_rank is not None and not (isinstance(tokens_per_rank, int)
                                                and tokens_per_rank >= 1):
            raise ValueError(f"tokens_per_rank must be an int >= 1 or None, got "
                             f"{tokens_per_rank!r}")
        cls._token_budget = tokens_per_rank

    def options(self):
        return layer_options(self.config)

    def max_tokens_per_rank(self) -> int:
        """T_max of this dispatcher's groups (see the module's docstring)."""
        tokens = self.options().max_tokens_per_rank or NcclEpInferenceDispatcher._token_budget
        if tokens is None:
            raise RuntimeError(
                "nccl_ep inference dispatcher: no token budget per rank: create Megatron's "
                "DynamicInferenceContext after megatron_nccl_ep.register() (it records "
                "round_up_tokens(max_tokens) // tp_size), or set NcclEpOptions.max_tokens_per_rank "
                "(--nccl-ep-max-tokens-per-rank), or call "
                "NcclEpInferenceDispatcher.set_token_budget(n)")
        if tokens > LL_MAX_TOKENS:
            raise ValueError(
                f"nccl_ep inference dispatcher: {tokens} tokens per rank and step, more than the "
                f"LL mode's T_max limit {LL_MAX_TOKENS}: lower the inference context's max_tokens "
                f"(InferenceConfig.max_tokens, prefill chunks) to at most {LL_MAX_TOKENS} x TP, or "
                f"set --nccl-ep-max-tokens-per-rank")
        return tokens

    def _remembered_group(self, tokens: torch.Tensor, dtype: torch.dtype, device: torch.device):
        """``(group or None, options, signature)``: the last step's group when the options, the
        token budget, the hidden size, dtype and device are the same and no group was destroyed
        since (a few compares: a per-layer host path), else None."""
        options = self.options()
        signature = (NcclEpInferenceDispatcher._token_budget, tokens.shape[1], dtype, device)
        return self._group_memo.get(options, signature), options, signature

    def _outputs(self, handle, group: Group, device: torch.device):
        """The dispatch's outputs: the ones the group's layers share (the class docstring),
        with ``count`` Megatron's valid-tokens tensor itself where the library can write it
        (int32 ``[1]``, contiguous, 16-byte aligned), so no copy follows; None where it cannot
        (``_publish_count`` copies then). Made outside a capture, so that eager steps and
        graphs use the same ones (during a capture, where none was made yet: new ones for that
        capture alone)."""
        valid = self._valid_rows_tensor(device)
        shared = _shared_outputs.get(group)
        if shared is not None:
            if shared[0] is valid:
                return shared[1]
            if not _capturing(device):  # made for another valid-rows tensor
                _drop_shared_outputs(group)
        if not (valid.dtype == torch.int32 and valid.shape == (1,) and valid.is_contiguous()
                and valid.data_ptr() % 16 == 0):
            return None
        out = handle.new_output(count=valid)
        if not _capturing(device):
            _shared_outputs[group] = (valid, out)
        return out

    def _check_budget(self, tokens: int, limit: int) -> None:
        if tokens > limit:
            raise ValueError(f"nccl_ep inference dispatcher: {tokens} tokens on rank "
                             f"{self.ep_rank}, more than the token budget per rank {limit}")

    def _look_up_group(self, tokens: torch.Tensor, dtype: torch.dtype, options) -> Group:
        return GROUPS.get(group_spec(options, self.ep_group, tokens, num_experts=self.num_experts,
                                     max_topk=self.topk,
                                     max_tokens_per_rank=self.max_tokens_per_rank(), dtype=dtype,
                                     ll=True))

    # -- Megatron's inference dispatcher interface -------------------------------------------
    def update_metadata(self, local_tokens: int) -> None:
        """The host's estimate of the rows the experts get (the vLLM backend's size hint)."""
        InferenceAllGatherDispatcherBase._host_valid_tokens_estimate = min(
            local_tokens, self.max_tokens_per_rank()) * self.ep_size

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``[T, H]``, probs ``[T, K]`` -> (``[R*T_max, H]``, ``[R*T_max, K]`` fp32); sets
        ``self.routing_map`` to the received rows' global ids ``[R*T_max, K]`` int32 (-1:
        another rank's expert or no row) and the valid-rows tensor the experts read to this
        dispatch's count. No host read."""
        tokens, device = hidden_states.shape[0], hidden_states.device
        dtype = self.payload_dtype or hidden_states.dtype
        group, options, signature = self._remembered_group(hidden_states, dtype, device)
        # Checked before a group is made (collective, and refused inside a capture).
        self._check_budget(tokens, group.config.max_tokens_per_rank if group is not None
                           else self.max_tokens_per_rank())
        if self.routing_map is None or tuple(self.routing_map.shape) != (tokens, self.topk):
            raise ValueError(
                f"nccl_ep inference dispatcher: expected the router's top-k ids [{tokens}, "
                f"{self.topk}] from dispatch_preprocess, got "
                f"{None if self.routing_map is None else tuple(self.routing_map.shape)}")
        if group is None:
            group = self._look_up_group(hidden_states, dtype, options)
            self._group_memo.keep(options, signature, group)
        handle = group.create_handle(topk_idx=self.routing_map)
        out = handle.dispatch(_as_dtype(hidden_states, dtype), probs,
                              out=None if probs is None else
                              self._outputs(handle, group, device))
        if _capturing(device):
            self._captured.append((handle, out))
        self._handle = handle
        self.routing_map = out.topk_idx
        if out.count is not InferenceAllGatherDispatcherBase._valid_tokens_tensor:
            self._publish_count(out.count)
        if self._runs_metadata_sync:
            self.update_metadata(tokens)
        return _as_dtype(out.x, hidden_states.dtype), out.topk_weights

    @staticmethod
    def _valid_rows_tensor(device: torch.device) -> torch.Tensor:
        """The class-level tensor the experts read the valid rows from, at a fixed address (the
        inference context allocates it; a graph replays reads of that address); made here, on
        ``device``, where none is (outside a capture)."""
        valid = InferenceAllGatherDispatcherBase._valid_tokens_tensor
        if valid is None or valid.device != device:
            if _capturing(device):
                raise RuntimeError(
                    "nccl_ep inference dispatcher: InferenceAllGatherDispatcherBase's valid-tokens "
                    "tensor is not allocated on this device; allocate it before CUDA graph "
                    "capture (DynamicInferenceContext does)")
            valid = torch.zeros(1, dtype=torch.int32, device=device)
            InferenceAllGatherDispatcherBase._valid_tokens_tensor = valid
        return valid

    @classmethod
    def _publish_count(cls, count: torch.Tensor) -> None:
        """The count copied into the valid-tokens tensor, on the stream, before this layer's
        experts run (where the dispatch could not write it there itself)."""
        cls._valid_rows_tensor(count.device).copy_(count)

    def dispatch_postprocess(self, hidden_states, probs):
        """Pass-through: the fused experts permute the received rows themselves."""
        return hidden_states, None, probs

    def combine_preprocess(self, expert_output):
        return expert_output

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' rows ``[R*T_max, H]`` (fp32 from the fused experts) -> ``[T, H]`` bf16:
        each token's rows summed over the ranks that received it, in rank order. fp32 rows
        are rounded to the group's dtype as the combine reads them (the bits of a cast first)."""
        if self._handle is None:
            raise RuntimeError("nccl_ep inference dispatcher: token_combine without a "
                               "token_dispatch before it")
        handle, self._handle = self._handle, None
        # fp32 rows go in as they are: the combine rounds them to the group's dtype as it reads
        # them (no cast kernel per layer and step).
        rows = hidden_states if hidden_states.dtype == torch.float32 else _as_dtype(
            hidden_states, handle.group.config.dtype)
        return _as_dtype(handle.combine(rows), torch.bfloat16)
