"""``NcclEpTokenDispatcher``: Megatron-Core's ``MoETokenDispatcher`` interface over a ``Handle``.

Dispatch writes the expert-major layout of docs/design.md §3 directly, so there is no permute
step: ``dispatch_postprocess`` hands the received rows to Megatron's experts as they are, and
combine is the unweighted sum of docs/design.md §4 (Megatron's experts apply the probs themselves).

Plugin options (``NcclEpOptions``) come from ``config.nccl_ep_options`` when a TransformerConfig
carries one, else from ``options.get_options()`` (``set_options()``'s, the ``--nccl-ep-*``
flags, the defaults; re-exported here).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import List, Optional

import torch
from megatron.core.transformer.moe.moe_utils import (get_align_size_for_quantization,
                                                     get_capacity, get_default_pg_collection)
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

try:  # CUDA graphs warm a layer up on made-up inputs before capturing it
    from megatron.core.transformer.cuda_graphs import is_graph_capturing, is_graph_warmup
except ImportError:  # pragma: no cover - a Megatron-Core without local graphs
    def is_graph_warmup() -> bool:
        return False

    def is_graph_capturing() -> bool:
        return False

from .autograd import combine, dispatch
from .config import capacity_from_factor
from .dispatcher_common import GROUPS, LayerMemo, check_owned_experts, group_spec, layer_options
from .errors import NcclEpError
from .options import NcclEpOptions, get_options, set_options, training_args  # noqa: F401

# Capacity-mode dispatchers (weak references, in the order of their first dispatch: the same on
# every rank), whose budgets check_budgets() and budgets_over() read.
_budgeted: list = []
# Budgets grown after an overflow (grow_budgets), by the layer's shape class (_Route.base_key):
# rows per rank (packed layout) or per (expert, source rank) (fixed layout).
_grown: dict = {}
# A grown budget is this many times the rows the overflowing step needed.
GROWTH = 1.125
# Inside exact_mode(): every dispatcher runs in exact mode (the redo of an overflowed step).
_exact_redo = False


@contextlib.contextmanager
def exact_mode():
    """Every nccl_ep dispatcher in exact mode meanwhile (capacity mode's budgets unused): how
    an overflowed step is redone (megatron_nccl_ep.overflow)."""
    global _exact_redo
    before, _exact_redo = _exact_redo, True
    try:
        yield
    finally:
        _exact_redo = before


def _graph_modules(config) -> list:
    """The names of Megatron's ``cuda_graph_modules``, sorted."""
    return sorted(getattr(m, "name", str(m))
                  for m in getattr(config, "cuda_graph_modules", None) or [])


def graph_captures_dispatch(config) -> bool:
    """Whether Megatron's CUDA graph settings put token_dispatch inside a graph: the whole
    iteration, whole layers (an empty module list) or the ``moe`` module."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        return True
    modules = _graph_modules(config)
    return impl != "none" and (not modules or "moe" in modules)


def check_graph_settings(config, options: NcclEpOptions) -> None:
    """A graph that holds token_dispatch replays it without the host: exact mode, which reads
    each handle's receive count on the host, is refused there; drop-and-pad and capacity mode
    (static layouts) are captured. In Megatron training, capacity mode's redo of an overflowed
    step recaptures the full-iteration graph only: per-layer graphs holding token_dispatch
    need ``--nccl-ep-capacity-overflow error``."""
    if not graph_captures_dispatch(config) or getattr(
            config, "moe_pad_expert_input_to_capacity", False):
        return
    if options.recv_mode == "capacity":
        impl = getattr(config, "cuda_graph_impl", "none")
        if impl != "full_iteration" and options.capacity_overflow == "redo" and \
                training_args() is not None:
            raise ValueError(
                f"nccl_ep dispatcher: cuda_graph_impl={impl!r} with cuda_graph_modules="
                f"{_graph_modules(config)} captures token_dispatch in per-layer graphs, which "
                "--nccl-ep-capacity-overflow redo cannot recapture after growing a budget: use "
                "--cuda-graph-impl full_iteration, or --nccl-ep-capacity-overflow error (an "
                "overflow then raises after the step)")
        return
    raise ValueError(
        f"nccl_ep dispatcher: cuda_graph_impl={config.cuda_graph_impl!r} with "
        f"cuda_graph_modules={_graph_modules(config)} captures token_dispatch, and the exact "
        "receive mode reads each layer's receive count on the host, which a graph cannot "
        "replay. Use drop-and-pad (--moe-expert-capacity-factor with "
        "--moe-pad-expert-input-to-capacity; "
        "any graph scope), or --nccl-ep-recv-mode capacity (dropless within a static budget "
        "per expert, --nccl-ep-capacity-factor; whole layers or full_iteration: Megatron "
        "allows the moe scope with drop-and-pad only), or capture only attn, moe_router and "
        "moe_preprocess")


def _graph_warmup(tokens: torch.Tensor) -> bool:
    """Whether this forward is a CUDA-graph warm-up on made-up inputs (every token on the same
    experts), which no step's routing is: Megatron's local graphs flag theirs; Transformer
    Engine's (``--cuda-graph-impl transformer_engine``) run eagerly while Megatron's capture flag
    is up (a forward being captured runs nothing until its replays, which count)."""
    return is_graph_warmup() or (is_graph_capturing() and not (
        tokens.is_cuda and torch.cuda.is_current_stream_capturing()))


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


def _max_tokens(options: NcclEpOptions, num_tokens: int) -> int:
    """Tokens per rank a layer's group is sized for."""
    return (options.max_tokens_per_rank or _training_tokens_per_rank()
            or 1 << max(num_tokens - 1, 0).bit_length())


def destroy_groups() -> None:
    """Destroys the cached groups of the training dispatcher (collective over each group's
    ranks), e.g. before ``torch.distributed.destroy_process_group`` (the inference dispatcher's:
    ``inference.destroy_inference_groups``; both: ``dispatcher_common.GROUPS.destroy``)."""
    GROUPS.destroy_where(lambda group: group.config.mode == "ht")


def destroy_exact_groups() -> None:
    """Destroys the cached groups of exact mode (collective over each group's ranks): after the
    redo of an overflowed step, whose groups the capacity-mode steps do not use."""
    GROUPS.destroy_where(lambda group: group.config.mode == "ht"
                         and group.config.recv_mode == "exact")


def _stacked_needs(layers: list) -> torch.Tensor:
    """Each layer's most rows needed since the last check (int64 [n] on their device)."""
    if any(d._needed.is_cuda for d in layers):
        torch.cuda.synchronize()  # the maxima may come from another stream (1F1B EP overlap)
    return torch.stack([d._needed.amax() for d in layers])


def budgets_over(process_group=None) -> list:
    """Capacity mode: ``(dispatcher, rows needed)`` of every layer of this rank that needed more
    than its budget since the last check (the maximum over its communication group, the same on
    each of its ranks), and the counts reset; with ``process_group`` (the default group: every
    rank of the job) the list is empty on every rank of it unless some rank's is not (a layer of
    another rank overflowed: this rank must redo the step too), else each rank's own. One
    all-reduce per communication group (and one over ``process_group``), one host wait."""
    layers = [d for d in (ref() for ref in _budgeted) if d is not None and d._needed is not None]
    _budgeted[:] = [ref for ref in _budgeted if ref() is not None]
    by_group: dict = {}
    for d in layers:
        by_group.setdefault(d.comm_group, []).append(d)
    over = []
    for comm_group, members in by_group.items():
        needed = _stacked_needs(members)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(
                comm_group) > 1:
            torch.distributed.all_reduce(needed, op=torch.distributed.ReduceOp.MAX,
                                         group=comm_group)
        for d, n in zip(members, needed.tolist()):
            d._needed.zero_()
            d.high_water = max(d.high_water, n)
            if n > d._budget.rows:
                over.append((d, n))
    if process_group is not None and torch.distributed.is_initialized():
        device = layers[0]._needed.device if layers else (
            torch.device("cuda", torch.cuda.current_device())
            if torch.distributed.get_backend(process_group) == "nccl" else torch.device("cpu"))
        flag = torch.tensor([len(over)], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=process_group)
        if int(flag) > 0 and not over:
            return [(None, 0)]  # (another rank's layer: redo, nothing of this rank's to grow)
    return over


def budget_high_water() -> List[str]:
    """Capacity mode: per layer of this rank, the most rows it needed in any step checked so far
    (the maximum over its communication group) against its budget now, e.g. "layer 2: 16384 of
    20480 rows per rank"."""
    lines = []
    for d in (ref() for ref in _budgeted):
        if d is not None and d._budget is not None:
            lines.append(f"layer {d.layer_number()}: {d.high_water} of {d._budget.rows} "
                         f"{d._budget.unit}")
    return lines


def grow_budgets(over: list) -> List[str]:
    """Grows the budget of each overflowed layer's shape class to ``GROWTH`` x the rows it
    needed and destroys its capacity-mode groups (collective over their ranks; call it where
    no CUDA graph holds them), so that the next step makes new ones. Returns one description
    per shape class grown ("layer 3 needed 2134 rows of 2048 ..."), for the log line."""
    grown: dict = {}
    for d, needed in over:
        if d is None:
            continue
        budget = d._budget
        rows = max(budget.rows + 1, math.ceil(needed * GROWTH))
        if budget.packed:
            rows = -(-rows // budget.alignment) * budget.alignment
        key = budget.base_key
        if rows > _grown.get(key, 0):
            _grown[key] = rows
        grown.setdefault(key, []).append((d, needed))
    if grown:
        doomed = {d._budget.group for members in grown.values() for d, _ in members}
        GROUPS.destroy_where(lambda group: group in doomed)
    lines = []
    for key, members in grown.items():
        budget = members[0][0]._budget
        layers = ", ".join(f"layer {d.layer_number()} needed {n}" for d, n in members)
        lines.append(f"{layers} ({budget.unit}; budget {budget.rows}); budget now {_grown[key]} "
                     f"{budget.unit} (--nccl-ep-capacity-factor "
                     f"{budget.factor_for(_grown[key]):.3g})")
    return lines


def check_group_errors() -> None:
    """Raises the pending device-side errors of the groups in capacity receive mode (capacity
    mode, drop-and-pad), which no call of theirs reads on the host (non-blocking)."""
    for group in GROUPS.cached("ht"):
        if group.config.recv_mode == "capacity":
            group.check_errors()


def check_budgets() -> None:
    """Capacity mode: raises ``NcclEpError`` on every rank when, since the last check, a layer
    needed more than its static budget (the rows past it were dropped), naming the layer, the
    rows needed and the capacity factor that would hold them; also raises the pending
    device-side errors of the groups in capacity receive mode (capacity mode, drop-and-pad),
    which no call of theirs reads on the host. Collective over each communication group (one
    all-reduce of every layer's count), with one host wait: after a step, where the host waits
    for the GPU anyway (``register()`` calls it after each Megatron ``train_step`` under
    ``--nccl-ep-capacity-overflow error``), also when CUDA graphs replayed the step."""
    check_group_errors()
    over = budgets_over()
    if over:
        raise NcclEpError("; ".join(d._over_budget_message(n) for d, n in over))


class _Budget:
    """A capacity-mode layer's budget: ``rows`` per rank (``packed``: the packed layout of
    grouped experts) or per (expert, source rank) (the fixed layout), the factor and tokens
    it came from, the group it sized, and ``base_key``, its shape class (what growth is kept
    by)."""

    def __init__(self, rows: int, packed: bool, factor: float, tokens: int, topk: int,
                 num_experts: int, alignment: int, num_local: int, base_key, group=None):
        self.rows, self.packed, self.factor, self.tokens = rows, packed, factor, tokens
        self.topk, self.num_experts, self.alignment = topk, num_experts, alignment
        self.num_local, self.base_key, self.group = num_local, base_key, group

    @property
    def unit(self) -> str:
        """What ``rows`` counts."""
        return "rows per rank" if self.packed else "rows per expert and source rank"

    def factor_for(self, rows: int) -> float:
        """The capacity factor whose budget holds ``rows``."""
        if self.packed:  # capacity_from_factor's worst-case alignment padding left out
            return (rows - self.num_local * (self.alignment - 1)) / (self.tokens * self.topk)
        return rows * self.num_experts / (self.tokens * self.topk)


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
        # dispatch_preprocess is local (no communication, no host read): the moe_router and
        # moe_preprocess scopes capture it. Graphs that hold token_dispatch (the moe module,
        # whole layers, the whole iteration) need a static layout (docs/megatron.md).
        check_graph_settings(config, self.options())
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
        self._route_memo = LayerMemo()  # _route's last answer and what it depended on
        # Capacity mode: the most rows needed in one step since the last check, on the device
        # (also updated by graph replays): per expert, the tokens this rank sent it ([E], the
        # fixed layout), or the rows this rank received ([], the packed layout); and the budget
        # it is held to (_Budget). check_budgets() / budgets_over() read them. The MoELayer
        # (weakly), for the layer number.
        self._needed: Optional[torch.Tensor] = None
        self._budget: Optional[_Budget] = None
        self.high_water = 0  # the most rows needed in a step checked so far (budgets_over)
        self._device_counts: Optional[bool] = None  # whether the experts read device counts
        self.moe_layer = None
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

    def takes_device_counts(self) -> bool:
        """Whether this layer's experts read ``tokens_per_expert`` on the device (nccl_ep's
        ``GroupedExperts``, ``--moe-grouped-gemm`` under the local spec): capacity mode then
        hands them the packed layout, else the fixed one (experts that split their rows on the
        host, SequentialMLP, read constant counts)."""
        if self._device_counts is None:
            experts = getattr(self.moe_layer() if self.moe_layer else None, "experts", None)
            if experts is None:  # not built yet: asked again at the next forward
                return False
            self._device_counts = bool(getattr(experts, "takes_device_counts", False))
        return self._device_counts

    def expert_capacity(self, num_tokens: int, options: Optional[NcclEpOptions] = None) -> int:
        """The rows each source rank gets in each local expert's block of the fixed layout
        (docs/design.md §3), computed as Megatron's alltoall computes its capacity for this
        rank's ``num_tokens`` (every rank of the EP group must have the same token count).
        Drop-and-pad: Megatron's capacity (its router drops the rest). Capacity mode with
        experts that split their rows on the host: the static budget ``--nccl-ep-capacity-
        factor`` x tokens x top-k / experts, dropless within it (an overflow is redone or
        raised after the step); 0 otherwise (exact mode, or capacity mode's packed layout:
        ``recv_rows``)."""
        options = options or self.options()
        if self.drop_and_pad:
            factor = self.config.moe_expert_capacity_factor
        elif options.recv_mode == "capacity" and not _exact_redo and \
                not self.takes_device_counts():
            factor = options.capacity_factor
        else:
            return 0
        return get_capacity(num_tokens=num_tokens * self.topk, num_experts=self.num_experts,
                            capacity_factor=factor)

    def recv_rows(self, num_tokens: int, options: Optional[NcclEpOptions] = None) -> int:
        """Capacity mode's packed layout (experts that read device counts): the rows of every
        dispatch output, ``--nccl-ep-capacity-factor`` x tokens x top-k plus the worst-case
        alignment padding (``config.capacity_from_factor``); the experts compute the rows the
        routing filled, and the rows past the budget are dropped (an overflow is redone or
        raised after the step). 0 otherwise."""
        options = options or self.options()
        if self.drop_and_pad or options.recv_mode != "capacity" or _exact_redo or \
                not self.takes_device_counts():
            return 0
        return capacity_from_factor(options.capacity_factor, num_tokens, self.topk,
                                    self.num_local_experts, self.expert_alignment())

    def layer_number(self):
        """The MoE layer's number (Megatron's), or '?'."""
        layer = getattr(self.moe_layer() if self.moe_layer else None, "layer_number", None)
        return layer if layer is not None else "?"

    def check_over_budget(self) -> Optional[torch.Tensor]:
        """Capacity mode: whether this rank needed more rows than the budget since the last
        check (one expert from one rank in the fixed layout, this rank's received rows in the
        packed one; a device bool, no host read; Megatron's name for the question); None
        otherwise."""
        if self._needed is None:
            return None
        return self._needed.amax() > self._budget.rows

    def _over_budget_message(self, needed: int) -> str:
        b = self._budget
        what = ("rows on one rank" if b.packed
                else "rows for one expert from one rank")
        share = (f"{b.factor:g} x {b.tokens} tokens x top-{b.topk}" if b.packed else
                 f"{b.factor:g} x {b.tokens} tokens x top-{b.topk} / {b.num_experts} experts")
        return (f"nccl_ep capacity mode: MoE layer {self.layer_number()} needed {needed} {what}, "
                f"over its static budget of {b.rows} rows (--nccl-ep-capacity-factor {share}); "
                "the rows past it were dropped in that step. Raise --nccl-ep-capacity-factor to "
                f"at least {b.factor_for(needed):.3g} and resume from the last checkpoint (or "
                "use --nccl-ep-capacity-overflow redo, which redoes such a step)")

    def _route(self, hidden_states: torch.Tensor) -> tuple:
        """``(options, budget or None, group)`` of this forward: the last forward's when the
        options and everything else the group's spec and the budget come from (the tokens'
        shape, dtype and device, the layout, the capacity factor, the alignment, the training
        arguments' token count, an exact-mode redo) are the same and no group was destroyed
        since (a few compares: a per-layer host path), else worked out and looked up."""
        options = self.options()
        signature = (hidden_states.shape, hidden_states.dtype, hidden_states.device,
                     self.drop_and_pad, self.config.moe_expert_capacity_factor,
                     self.expert_alignment(),
                     options.max_tokens_per_rank or _training_tokens_per_rank(), _exact_redo)
        route = self._route_memo.get(options, signature)
        if route is not None:
            return route
        # Drop-and-pad: Megatron's router pads every expert's column to its capacity with
        # zero-probability tokens, so a token may be routed to every expert (max_topk = E).
        topk = self.num_experts if self.drop_and_pad else self.topk
        alignment, tokens = signature[5], hidden_states.shape[0]
        max_tokens = _max_tokens(options, tokens)
        capacity = self.expert_capacity(tokens, options)
        rows = self.recv_rows(tokens, options)
        budget = None
        if (capacity or rows) and not self.drop_and_pad:  # capacity mode: its budget
            base_key = (self.comm_group, self.num_experts, self.topk, hidden_states.shape[1],
                        hidden_states.dtype, hidden_states.device, max_tokens, options,
                        alignment, bool(rows))
            grown = _grown.get(base_key, 0)  # a budget grown after an overflow
            if rows:
                rows = max(rows, grown)
            else:
                capacity = max(capacity, grown)
            budget = _Budget(rows or capacity, bool(rows), options.capacity_factor, tokens,
                             self.topk, self.num_experts, alignment, self.num_local_experts,
                             base_key)
        # With expert_capacity (drop-and-pad, capacity mode's fixed layout) every dispatch output
        # has the same fixed layout; with recv_rows (the packed layout) that many rows, the rows
        # past them dropped: either way capacity receive mode, nothing read on the host.
        group = GROUPS.get(group_spec(
            options, self.comm_group, hidden_states, num_experts=self.tp_size * self.num_experts,
            max_topk=self.tp_size * topk, max_tokens_per_rank=max_tokens,
            expert_alignment=alignment, expert_capacity=capacity, recv_rows=rows))
        if budget is not None:
            budget.group = group
        route = (options, budget, group)
        if self.moe_layer is None or self._device_counts is not None:  # (else: asked again)
            self._route_memo.keep(options, signature, route)
        return route

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
        options, budget, group = self._route(hidden_states)
        routing_map, self.routing_map = self.routing_map, None
        # The budget's use, on the device, two launches a layer (graph warm-ups left out).
        counted = budget is not None and not _graph_warmup(hidden_states)
        if counted and not budget.packed:  # per expert: the tokens this rank sends it
            self._count_needed(routing_map.sum(0), budget)
        self._handle = group.create_handle(routing_map=routing_map)
        if counted and budget.packed:  # the rows this rank receives, every block whole
            self._count_needed(self._handle.tokens_per_expert.sum(), budget)
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

    def _count_needed(self, needed: torch.Tensor, budget: _Budget) -> None:
        """Keeps the most rows needed (``needed``, on the device) since the last check."""
        if self._needed is None or self._needed.shape != needed.shape:
            self._needed = torch.zeros_like(needed)
            _budgeted[:] = [ref for ref in _budgeted if ref() is not self]
            _budgeted.append(weakref.ref(self))
        self._budget = budget
        torch.maximum(self._needed, needed, out=self._needed)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The rows are already expert-major: (rows, tokens_per_expert, 1-D probs).

        Drop-and-pad and capacity mode (the fixed layout): every local expert has R runs of C rows
        (one per source rank of the group, in rank order; a run's unused rows are zero, prob 0,
        and combine never reads them), so the counts are the constant R * C (rounded up to the
        FP8 alignment with ``moe_router_padding_for_quantization``), a host tensor built here
        without reading the device, as Megatron's alltoall returns with drop-and-pad: experts
        that split their input on the host (SequentialMLP) make no host read either, so whole
        layers and iterations can be captured. Capacity mode's packed layout (experts that read
        device counts): the blocks' sizes on the device, every block whole (their running sum
        clamped at the rows is where each expert's kept rows end: docs/design.md §3). Exact
        mode: the counts read at dispatch."""
        config = self._handle.group.config
        if config.expert_capacity:
            block = config.expert_block_rows(self._handle.group.world_size)
            return hidden_states, torch.full((self.num_local_experts,), block,
                                             dtype=torch.long), probs
        return hidden_states, self._handle.tokens_per_expert, probs

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

