"""What both Megatron dispatchers share (``dispatcher.NcclEpTokenDispatcher`` for training,
``inference.NcclEpInferenceDispatcher`` for decode): their options, the check that a rank owns
the experts the library gives it, what Group a layer needs (``GroupSpec``, from the options by
``group_spec``, the one mapping of options to a Group), the one cache of Groups every layer with
the same spec shares (``GROUPS``), and a layer's memo of its last lookup (``LayerMemo``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional

import torch

from .api import Group
from .options import NcclEpOptions, get_options


def layer_options(config) -> NcclEpOptions:
    """A layer's options: ``config.nccl_ep_options`` when its TransformerConfig carries one,
    else the process-wide ones (``options.get_options``)."""
    return getattr(config, "nccl_ep_options", None) or get_options()


def check_owned_experts(who: str, ep_rank: int, ep_size: int, num_local_experts: int,
                        local_expert_indices: List[int], num_experts: int) -> None:
    """The library places experts [r * L, (r + 1) * L) on rank r: Megatron's local experts must
    be those."""
    first = ep_rank * num_local_experts
    if num_local_experts * ep_size != num_experts or list(local_expert_indices) != list(
            range(first, first + num_local_experts)):
        raise ValueError(
            f"{who}: rank {ep_rank} of {ep_size} must own experts [{first}, "
            f"{first + num_local_experts}) of {num_experts}, got {list(local_expert_indices)}")


def ll_num_sms(options: NcclEpOptions, device: torch.device) -> int:
    """The LL group's SM budget: ``options.ll_num_sms``, or with 0 every SM of a CUDA device (on
    other devices the reference backend, which has no SM budget: ``options.num_sms``)."""
    if options.ll_num_sms:
        return options.ll_num_sms
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return options.num_sms


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What Group a layer needs: every argument of the Group, nothing else. Layers whose specs
    are equal (training or inference, any options that do not reach the Group) share one Group.
    The fields past ``device`` are ``GroupConfig``'s, by the same names."""

    process_group: Any  # the EP (or TP x EP) process group, by identity
    backend: str
    device: torch.device
    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    max_topk: int
    dtype: torch.dtype
    num_sms: int
    timeout_s: float
    mode: str = "ht"  # "ht": the training dispatcher's; "ll": the inference dispatcher's
    ll_layout: str = "expert_major"  # "rank_major": the inference dispatcher's gathered layout
    recv_mode: str = "exact"
    expert_alignment: int = 1
    ranks_per_node: int = 0
    expert_capacity: int = 0  # the fixed layout (drop-and-pad, capacity mode's fixed budget)
    max_recv_tokens_per_rank: Optional[int] = None  # capacity mode's packed layout
    capacity_overflow: str = "error"  # "drop" with the packed layout (found after the step)

    def make(self) -> Group:
        """The Group (collective over ``process_group``). Refused inside a CUDA graph capture:
        group creation is collective and allocates."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"nccl_ep dispatcher: this layer's {self.mode.upper()} communication group would "
                "be created inside a CUDA graph capture (group creation is collective and "
                "allocates): run at least one step eagerly before capturing (Megatron's graph "
                "warm-up, --cuda-graph-warmup-steps >= 1)")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["process_group"], fields["backend"], fields["device"]
        return Group(self.process_group, backend=self.backend, device=self.device, **fields)


def group_spec(options: NcclEpOptions, process_group, tokens: torch.Tensor, *, num_experts: int,
               max_topk: int, max_tokens_per_rank: int, dtype: Optional[torch.dtype] = None,
               ll: bool = False, expert_alignment: int = 1, expert_capacity: int = 0,
               recv_rows: int = 0) -> GroupSpec:
    """The Group a layer needs for ``tokens`` ([T, H]): the one place the plugin's options
    become a Group's arguments (a ``--nccl-ep-*`` flag that shapes the Group is read here).

    Args:
        options: the layer's ``NcclEpOptions`` (``layer_options``).
        process_group: the layer's communication group.
        tokens: the layer's tokens: their hidden size and device (and dtype, unless ``dtype``).
        num_experts: experts of the group (training with expert TP: the virtual ones).
        max_topk: slots per token.
        max_tokens_per_rank: tokens per rank the group is sized for (each dispatcher's rule).
        dtype: the payload's dtype (default: the tokens').
        ll: the inference dispatcher's LL group (rank-major layout, ``options.ll_num_sms``), else
            the training dispatcher's HT group.
        expert_alignment: HT: rows per local expert padded to a multiple of this.
        expert_capacity: HT: the fixed layout's rows per (expert, source rank); 0: off.
        recv_rows: HT: capacity mode's packed layout, the rows of every dispatch output (the
            rows past them dropped, an overflow found after the step); 0: off.

    Returns:
        The spec (``GROUPS.get(spec)`` gives its Group).
    """
    common = dict(process_group=process_group, backend=options.backend, device=tokens.device,
                  num_experts=num_experts, hidden=tokens.shape[1],
                  max_tokens_per_rank=max_tokens_per_rank, max_topk=max_topk,
                  dtype=dtype or tokens.dtype, timeout_s=options.timeout_s)
    if ll:  # LL groups run on one node with their own layouts (docs/design.md §9)
        return GroupSpec(**common, mode="ll", ll_layout="rank_major",
                         num_sms=ll_num_sms(options, tokens.device))
    packed = dict(max_recv_tokens_per_rank=recv_rows, capacity_overflow="drop") \
        if recv_rows else {}
    return GroupSpec(**common, num_sms=options.num_sms, ranks_per_node=options.ranks_per_node,
                     recv_mode="capacity" if expert_capacity or recv_rows else "exact",
                     expert_alignment=expert_alignment, expert_capacity=expert_capacity,
                     **packed)


class GroupCache:
    """One Group per ``GroupSpec``, made on first use and shared by every layer, training or
    inference, whose spec is that one."""

    def __init__(self):
        self.groups: dict = {}
        # Counts the destroy calls: a layer that kept its group from a lookup keeps it while
        # this is unchanged (LayerMemo).
        self.generation = 0
        # Called with each Group destroyed, before it is (what a dispatcher keeps per group).
        self.on_destroy: List[Callable[[Group], None]] = []

    def get(self, spec: GroupSpec) -> Group:
        group = self.groups.get(spec)
        if group is None:
            group = self.groups[spec] = spec.make()
        return group

    def cached(self, mode: Optional[str] = None) -> List[Group]:
        """The cached Groups (of ``mode``, "ht" or "ll", when given)."""
        return [g for g in self.groups.values() if mode is None or g.config.mode == mode]

    def destroy_where(self, doomed: Callable[[Group], bool]) -> None:
        """Destroys the cached Groups for which ``doomed(group)`` holds (collective over each
        group's ranks: every rank must choose the same)."""
        self.generation += 1
        for spec in [s for s, group in self.groups.items() if doomed(group)]:
            group = self.groups.pop(spec)
            for forget in self.on_destroy:
                forget(group)
            group.destroy()

    def destroy(self) -> None:
        """Destroys every cached Group (collective over each group's ranks), e.g. before
        ``torch.distributed.destroy_process_group``."""
        self.destroy_where(lambda group: True)


# The Groups of both dispatchers.
GROUPS = GroupCache()


class LayerMemo:
    """A layer's last lookup and what it depended on: the options object (by identity), a
    signature (a few compares: the per-layer host path) and the cache's generation (a destroyed
    group is looked up again)."""

    __slots__ = ("_options", "_signature", "_generation", "value")

    def __init__(self):
        self._options = self._signature = self._generation = self.value = None

    def get(self, options: NcclEpOptions, signature: tuple):
        """The value kept for these options and signature, or None."""
        if self._options is options and self._generation == GROUPS.generation and \
                self._signature == signature:
            return self.value
        return None

    def keep(self, options: NcclEpOptions, signature: tuple, value) -> None:
        self._options, self._signature, self.value = options, signature, value
        self._generation = GROUPS.generation
