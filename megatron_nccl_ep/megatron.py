"""``register()``: makes Megatron-Core 0.19 accept ``--moe-token-dispatcher-type nccl_ep``.

Megatron is patched in memory only (its files on disk are never touched):

* ``TransformerConfig.moe_token_dispatcher_type``'s Literal gains ``"nccl_ep"``; Megatron's
  argparse builds the flag's choices from that annotation;
* ``TransformerConfig.__post_init__`` admits ``moe_shared_expert_overlap`` with ``nccl_ep``;
* ``MoELayer.__init__`` builds ``NcclEpTokenDispatcher`` when the config asks for ``nccl_ep``;
* ``megatron.training.arguments`` gets the ``--nccl-ep-*`` flags; the dispatcher reads their
  values from the parsed training arguments (``dispatcher.get_options``).
"""

from __future__ import annotations

import functools
import inspect
import typing

from .dispatcher import NcclEpTokenDispatcher
from .options import add_arguments

DISPATCHER_TYPE = "nccl_ep"

_registered = False


def literal_choices(hint) -> tuple:
    """The values of ``Literal[...]`` or ``Optional[Literal[...]]``."""
    for h in (hint, *typing.get_args(hint)):
        if typing.get_origin(h) is typing.Literal:
            return typing.get_args(h)
    raise RuntimeError(
        "megatron_nccl_ep.register(): TransformerConfig.moe_token_dispatcher_type is annotated "
        f"{hint!r}, not a Literal of dispatcher names; this Megatron-Core version is not "
        "supported")


def _allow_dispatcher_type() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Subclasses (MLA, heterogeneous configs) share this Field object. The annotation may be a
    # string (postponed evaluation) or wrap the Literal in Optional[...]: resolve both.
    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    hint = field.type
    if isinstance(hint, str):
        hint = typing.get_type_hints(TransformerConfig)["moe_token_dispatcher_type"]
    choices = literal_choices(hint)
    if DISPATCHER_TYPE not in choices:
        field.type = typing.Literal[choices + (DISPATCHER_TYPE,)]
        TransformerConfig.__annotations__["moe_token_dispatcher_type"] = field.type


def _allow_shared_expert_overlap() -> None:
    """TransformerConfig admits moe_shared_expert_overlap for the alltoall and flex dispatchers
    only; nccl_ep drives the same shared-expert hooks, so such a config is validated as an
    alltoall one (its other checks included), then given its type back."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__

    @functools.wraps(original)
    def post_init(self):
        if self.moe_token_dispatcher_type != DISPATCHER_TYPE or not self.moe_shared_expert_overlap:
            return original(self)
        self.moe_token_dispatcher_type = "alltoall"
        try:
            original(self)
        finally:
            self.moe_token_dispatcher_type = DISPATCHER_TYPE

    TransformerConfig.__post_init__ = post_init


def _patch_moe_layer() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original_init = MoELayer.__init__
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init(self, config, *args, **kwargs):
        if config.moe_token_dispatcher_type != DISPATCHER_TYPE:
            return original_init(self, config, *args, **kwargs)
        # MoELayer picks its dispatcher in an if/elif chain inside __init__: let it build the
        # cheap, communication-free allgather one, then replace it.
        config.moe_token_dispatcher_type = "allgather"
        try:
            original_init(self, config, *args, **kwargs)
        finally:
            config.moe_token_dispatcher_type = DISPATCHER_TYPE
        bound = signature.bind(self, config, *args, **kwargs)
        # None: the dispatcher takes Megatron's default groups, as MoELayer did.
        self.token_dispatcher = NcclEpTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=bound.arguments.get("pg_collection"))
        if self.shared_expert_overlap:  # MoELayer handed the shared expert to the stand-in
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        # inference_optimized layers keep the training dispatcher aside and swap it back in at
        # each training forward: that must be ours, not the stand-in built above.
        if getattr(self, "_training_token_dispatcher", None) is not None:
            self._training_token_dispatcher = self.token_dispatcher

    MoELayer.__init__ = init


def _patch_arguments() -> None:
    from megatron.training import arguments

    add_megatron_arguments = arguments.add_megatron_arguments

    @functools.wraps(add_megatron_arguments)
    def add_all_arguments(parser):
        return add_arguments(add_megatron_arguments(parser))

    # parse_args looks add_megatron_arguments up in its module at call time, so a parse_args
    # imported before register() sees the flags too; the dispatcher reads their values from the
    # parsed arguments (get_args), so parse_args itself is left alone.
    arguments.add_megatron_arguments = add_all_arguments


def register() -> None:
    """Idempotent. Patches Megatron-Core (in memory) to know ``nccl_ep``; ``megatron.training``
    is patched too when it can be imported (it is optional for users of megatron.core alone)."""
    global _registered
    if _registered:
        return
    _allow_dispatcher_type()
    _allow_shared_expert_overlap()
    _patch_moe_layer()
    try:
        import megatron.training.arguments  # noqa: F401
    except ImportError:
        pass
    else:
        _patch_arguments()
    _registered = True
