"""What both Megatron dispatchers share (``dispatcher.NcclEpTokenDispatcher`` for training,
``inference.NcclEpInferenceDispatcher`` for decode): their options, the check that a rank owns
the experts the library gives it, and the cache of groups every layer of a shape shares."""

from __future__ import annotations

from typing import Callable, List

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


class GroupCache:
    """Groups by a key of everything that sets their configuration (process group, shapes,
    options): one per key, made on first use and shared by every layer with that key."""

    def __init__(self):
        self.groups: dict = {}
        # Counts destroy() calls: a layer that kept its group from a lookup keeps it while this
        # is unchanged (the dispatchers' per-layer memo).
        self.generation = 0

    def get(self, key, make: Callable):
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = make()
        return group

    def destroy_where(self, doomed: Callable) -> None:
        """Destroys the cached Groups for which ``doomed(group)`` holds (collective over each
        group's ranks: every rank must choose the same)."""
        self.generation += 1
        for key in [k for k, group in self.groups.items() if doomed(group)]:
            self.groups.pop(key).destroy()

    def destroy(self) -> None:
        """Destroys every cached Group (collective over each group's ranks), e.g. before
        ``torch.distributed.destroy_process_group``."""
        self.generation += 1
        while self.groups:
            self.groups.popitem()[1].destroy()
