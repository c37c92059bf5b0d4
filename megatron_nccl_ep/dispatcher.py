"""``NcclEpTokenDispatcher``: Megatron-Core's ``MoETokenDispatcher`` interface over a ``Handle``.

Dispatch writes the expert-major layout of docs/design.md §3 directly, so there is no permute
step: ``dispatch_postprocess`` hands the received rows to Megatron's experts as they are, and
combine is the unweighted sum of docs/design.md §4 (Megatron's experts apply the probs themselves).

Plugin options (``NcclEpOptions``) come from ``config.nccl_ep_options`` when a TransformerConfig
carries one, else from ``options.get_options()`` (``set_options()``'s, the ``--nccl-ep-*``
flags, the defaults; re-exported here).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from megatron.core.transformer.moe.moe_utils import (get_align_size_for_quantization,
                                                     get_capacity, get_default_pg_collection)
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .api import Group
from .autograd import combine, dispatch
from .dispatcher_common import GroupCache, check_owned_experts, layer_options
from .options import NcclEpOptions, get_options, set_options, training_args  # noqa: F401

# One Group per EP process group and shape class, shared by every layer of that class.
_groups = GroupCache()


def _training_tokens_per_rank() -> Optional[int]:
    """Tokens per rank entering an MoE layer in Megatron training, when its arguments are parsed:
    the same on every rank, so every rank picks the same group without communicating."""
    args = training_args()
    if args is None:
        return None
    tokens = args.seq_length * args.micro_batch_size
    if getattr(args, "sequence_parallel", False):
        tokens = -(-tokens // args.tensor_model_parallel_size)
    return tokens


def _group_for(ep_group, num_experts: int, topk: int, tokens: torch.Tensor,
               options: NcclEpOptions, alignment: int, expert_capacity: int = 0) -> Group:
    num_tokens = tokens.shape[0]
    max_tokens = (options.max_tokens_per_rank or _training_tokens_per_rank()
                  or 1 << max(num_tokens - 1, 0).bit_length())
    key = (ep_group, num_experts, topk, tokens.shape[1], tokens.dtype, tokens.device, max_tokens,
           options, alignment, expert_capacity)
    return _groups.get(key, lambda: Group(
        ep_group, num_experts=num_experts, hidden=tokens.shape[1], max_tokens_per_rank=max_tokens,
        max_topk=topk, dtype=tokens.dtype, backend=options.backend, device=tokens.device,
        recv_mode=options.recv_mode,
        capacity_factor=options.capacity_factor if options.recv_mode == "capacity" else None,
        expert_alignment=alignment, num_sms=options.num_sms,
        ranks_per_node=options.ranks_per_node, expert_capacity=expert_capacity,
        timeout_s=options.timeout_s))


destroy_groups = _groups.destroy


class NcclEpTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher for ``--moe-token-dispatcher-type nccl_ep``.

    Each forward creates one Handle (one routing exchange); the autograd functions keep it for the
    backward pass, and the dispatcher drops its own reference at combine, so nothing accumulates
    across steps.

    With ``moe_pad_expert_input_to_capacity`` (``drop_and_pad``, the attribute Megatron's
    inference utilities toggle) the handle uses the library's fixed-capacity layout: each local
    expert gets one run of C rows per source rank, Megatron alltoall's static layout.

    With ``overlap_moe_expert_parallel_comm`` Megatron's 1F1B schedule calls token_dispatch and
    token_combine (and autograd their backwards) on its communication stream: every library call
    goes on the current stream, so they all do.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        # Drop-and-pad: the fixed-capacity layout (see expert_capacity).
        self.drop_and_pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
        if self.drop_and_pad and config.moe_expert_capacity_factor is None:
            raise ValueError("nccl_ep dispatcher: moe_pad_expert_input_to_capacity needs "
                             "moe_expert_capacity_factor")
        # dispatch_preprocess is local (no communication, no host read), so the moe_router and
        # moe_preprocess scopes can be captured; the routing exchange and, in exact mode, the
        # host read of the receive count happen in token_dispatch, which a graph of the whole
        # layer would replay with the handle of the captured step. (An empty module list
        # captures whole layers.)
        graph_impl = getattr(config, "cuda_graph_impl", "none")
        modules = {getattr(m, "name", str(m)) for m in getattr(config, "cuda_graph_modules", [])}
        if graph_impl == "full_iteration" or (graph_impl != "none" and (
                not modules or "moe" in modules)):
            raise NotImplementedError(
                f"nccl_ep dispatcher: CUDA graph capture of whole MoE layers is not supported "
                f"(cuda_graph_impl={graph_impl!r}, cuda_graph_modules={sorted(modules)}): each "
                "step's routing needs its own handle. Capture attn, moe_router and "
                "moe_preprocess instead")
        num_experts = config.num_moe_experts
        check_owned_experts("nccl_ep dispatcher", self.ep_rank, self.ep_size, num_local_experts,
                            local_expert_indices, num_experts)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.num_experts = num_experts
        self.topk = config.moe_router_topk
        # Expert tensor parallelism folds TP x EP into one group (as Megatron's flex dispatcher
        # does): each expert is tp_size virtual experts, one per rank of its TP group (rank
        # ep_rank * tp_size + tp_rank of the TP x EP group), which receive the same tokens and
        # hold the expert's weight shards; combine's sum over ranks completes the shards'
        # partial outputs, dispatch's backward sums their partial input gradients.
        self.comm_group = self.tp_ep_group if self.tp_size > 1 else self.ep_group
        self.hidden_shape = None
        self.routing_map = None
        self.shared_experts = None  # set by MoELayer with moe_shared_expert_overlap
        self._handle = None
        # What dispatch_preprocess leaves for token_dispatch: a graph of the moe_preprocess scope
        # returns it as an output and sets it back on replay.
        self.cudagraph_attrs = ["routing_map"]

    def set_shared_experts(self, shared_experts) -> None:
        """``moe_shared_expert_overlap``: the shared expert runs on its own stream, its steps
        placed around ours as Megatron's alltoall dispatcher places them (input gather in
        dispatch_preprocess, fc1 after dispatch, fc2 and the output scatter after combine, the
        sum in combine_postprocess)."""
        super().set_shared_experts(shared_experts)
        if shared_experts.use_shared_expert_gate:
            self.cudagraph_attrs.append("shared_experts.gate_score")
        self.cudagraph_attrs.append("shared_experts.cached_fc1_input")

    def options(self) -> NcclEpOptions:
        return layer_options(self.config)

    def expert_alignment(self) -> int:
        """Rows per local expert are padded to a multiple of this (the layout's alignment
        padding: zero rows with prob 0, which combine never reads). With
        ``moe_router_padding_for_quantization`` it is Megatron's FP8/FP4 GEMM alignment, so the
        experts, which then skip their own padding, get aligned counts without a padding copy
        or a routing-map edit; else 1."""
        if not getattr(self.config, "moe_router_padding_for_quantization", False):
            return 1
        return max(1, get_align_size_for_quantization(self.config))

    def expert_capacity(self, num_tokens: int) -> int:
        """Drop-and-pad: the rows each source rank gets in each expert, Megatron's capacity for
        this rank's ``num_tokens`` (as its alltoall dispatcher computes it: every rank of the EP
        group must have the same token count); 0 otherwise."""
        if not self.drop_and_pad:
            return 0
        return get_capacity(num_tokens=num_tokens * self.topk, num_experts=self.num_experts,
                            capacity_factor=self.config.moe_expert_capacity_factor)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        """[S, B, H] -> [T, H], and the dense routing map kept for token_dispatch. Local: no
        communication, no host read (CUDA-graph capturable). The router's dense probs [T, E] go
        to dispatch as they are: the kernels pick each routed expert's column, and the gradient
        comes back dense, zero where a token is not routed."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = self._over_tp(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        return hidden_states.reshape(-1, self.hidden_shape[-1]), self._over_tp(probs)

    def _over_tp(self, per_expert: torch.Tensor) -> torch.Tensor:
        """[..., E] -> [T, tp_size * E]: each expert's column repeated for the ranks of its TP
        group, in the order of the TP x EP group (a view's copy; autograd sums the repeats)."""
        if per_expert.dim() != 2:  # the router's [T, E] is taken as it is (a reshape costs us)
            per_expert = per_expert.reshape(-1, self.num_experts)
        if self.tp_size == 1:
            return per_expert
        tokens = per_expert.shape[0]
        return (per_expert.reshape(tokens, self.ep_size, 1, self.num_local_experts)
                .expand(-1, -1, self.tp_size, -1).reshape(tokens, -1))

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Creates this forward's Handle straight from the routing map (the routing exchange,
        enqueued on the stream) and dispatches tokens and probs with it (exact mode: the
        handle's receive count is read here, the layer's one host read)."""
        if self.shared_experts is not None:  # its fc1 may not start before our inputs exist
            self.shared_experts.wait_current_stream()
        # Drop-and-pad: Megatron's router pads every expert's column to its capacity with
        # zero-probability tokens, so a token may be routed to every expert (max_topk = E).
        topk = self.num_experts if self.drop_and_pad else self.topk
        group = _group_for(self.comm_group, self.tp_size * self.num_experts,
                           self.tp_size * topk, hidden_states, self.options(),
                           self.expert_alignment(), self.expert_capacity(hidden_states.shape[0]))
        routing_map, self.routing_map = self.routing_map, None
        self._handle = group.create_handle(routing_map=routing_map)
        try:
            # The router's probs are dense [T, E] (said explicitly: with E == K they would be
            # read in slot order).
            recv_x, recv_probs = dispatch(self._handle, hidden_states, probs, dense=True)
        finally:
            if routing_map.is_cuda and not self._handle.routing_released:
                # Under the 1F1B EP overlap this runs on the communication stream while the
                # routing map came from the compute stream: keep its memory until the handle's
                # kernels ran. (Exact mode's count read has seen them run: no stream to build.)
                routing_map.record_stream(torch.cuda.current_stream())
        if self.shared_experts is not None:  # overlaps the routed experts' work
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The rows are already expert-major: (rows, tokens_per_expert, 1-D probs).

        Capacity mode: the counts stay on the device, and the buffer's unused tail (zero rows with
        prob 0, ignored by combine) is counted as part of the last local expert, so that experts
        which split their input by the counts (Megatron's SequentialMLP, grouped GEMMs) cover the
        whole fixed-size buffer. Those rows contribute nothing to outputs or gradients.

        Drop-and-pad: every local expert has R runs of C rows (one per source rank of the group,
        in rank order; a run's unused rows are zero, prob 0), so the counts are the constant
        R * C (rounded up to the FP8 alignment with ``moe_router_padding_for_quantization``), a
        host tensor built here without reading the device, as Megatron's alltoall returns."""
        if self.drop_and_pad:
            config = self._handle.group.config
            block = config.expert_block_rows(self._handle.group.world_size)
            return hidden_states, torch.full((self.num_local_experts,), block,
                                             dtype=torch.long), probs
        tokens_per_expert = self._handle.tokens_per_expert
        if self._handle.group.config.recv_mode == "capacity":
            unused_rows = hidden_states.shape[0] - tokens_per_expert.sum()
            tokens_per_expert = tokens_per_expert.clone()
            tokens_per_expert[-1] += unused_rows
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        """Unweighted combine; from here on only the autograd graph holds the Handle."""
        handle, self._handle = self._handle, None
        if self.shared_experts is not None:  # fc2 after the routed experts' work is queued
            self.shared_experts.wait_current_stream()
        y = combine(handle, hidden_states)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(y)
            self.shared_experts.post_forward_comm()
        return y

    def combine_postprocess(self, hidden_states: torch.Tensor):
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

