"""``register()``: makes Megatron-Core accept ``--moe-token-dispatcher-type nccl_ep``.

Megatron is patched in memory only (its files on disk are never touched), by the patches of
``PATCHES``: each names what it replaces, what the replacement does and the megatron-core
versions it was checked against. ``register()`` refuses any other version (a ``RuntimeError``
naming the installed one and the checked ones) before it patches anything: the patches reach
into Megatron's internals (its ``__init__`` order, private methods, module globals), which
change between versions without notice. Each patch also checks the shape of what it replaces
and refuses one it does not recognise. ``unregister()`` puts Megatron's own back.

What the patches do, in short:

* ``TransformerConfig.moe_token_dispatcher_type``'s Literal gains ``"nccl_ep"``; Megatron's
  argparse builds the flag's choices from that annotation;
* ``TransformerConfig.__post_init__`` admits ``moe_shared_expert_overlap`` and
  ``overlap_moe_expert_parallel_comm`` with ``nccl_ep``, and in Megatron training refuses CUDA
  graphs that hold ``token_dispatch`` in exact mode (``dispatcher.check_graph_settings``); the
  1F1B schedule's ``should_free_input`` keeps the stage inputs our backward needs;
* ``MoELayer.__init__``'s dispatcher chain gains an ``nccl_ep`` branch that builds
  ``NcclEpTokenDispatcher`` (its source rewritten: ``_patch_moe_layer`` says why; the config is
  never modified);
* ``megatron.training.arguments`` gets the ``--nccl-ep-*`` flags; the dispatcher reads their
  values from the parsed training arguments (``options.get_options``);
* ``megatron.training.training.train_step`` runs its ``forward_backward_func`` inside
  ``overflow.RedoOverflowedSteps`` (capacity mode, ``--nccl-ep-capacity-overflow redo``) and is
  followed by ``dispatcher.check_budgets()`` (capacity mode's budgets under ``error`` and the
  groups' device-side errors, after every step);
* ``LocalSpecProvider.grouped_mlp_modules`` builds ``experts.GroupedExperts`` for
  ``moe_grouped_gemm`` (Megatron's local spec builds SequentialMLP either way);
* inference (``transformer_impl="inference_optimized"``):
  ``TransformerConfig.inference_moe_token_dispatcher_type``'s Literal gains ``"nccl_ep"``,
  ``MoELayer._setup_inference_mode`` builds ``NcclEpInferenceDispatcher`` for it, and
  ``DynamicInferenceContext.__init__`` records its per-rank token budget for that dispatcher.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import typing
import weakref
from typing import Callable, Tuple

from .dispatcher import (NcclEpTokenDispatcher, check_budgets, check_graph_settings,
                         check_group_errors)
from .dispatcher_common import layer_options
from .experts import GroupedExperts
from .inference import NcclEpInferenceDispatcher
from .options import add_arguments, get_options, training_args
from .overflow import RedoOverflowedSteps

DISPATCHER_TYPE = "nccl_ep"

_registered = False
# What the patches replaced, in order: (owner, name, Megatron's own) with ``owner`` an object
# whose attribute, or a dict whose item, was replaced; unregister() puts them back.
_replaced: list = []
_ABSENT = object()  # (an attribute or item that was not there)


def _replace(owner, name: str, value) -> None:
    """``owner.name = value`` (``owner[name]`` for a dict), Megatron's own kept for
    unregister(). A class's own attribute only: an inherited one is shadowed, then unshadowed."""
    if isinstance(owner, dict):
        original = owner.get(name, _ABSENT)
        owner[name] = value
    else:
        original = (vars(owner).get(name, _ABSENT) if isinstance(owner, type)
                    else getattr(owner, name, _ABSENT))
        setattr(owner, name, value)
    _replaced.append((owner, name, original))


def _put_back() -> None:
    """Every replaced attribute and item back to Megatron's own, the last replaced first."""
    while _replaced:
        owner, name, original = _replaced.pop()
        if isinstance(owner, dict):
            if original is _ABSENT:
                owner.pop(name, None)
            else:
                owner[name] = original
        elif original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def literal_choices(hint, name: str = "moe_token_dispatcher_type") -> tuple:
    """The values of ``Literal[...]`` or ``Optional[Literal[...]]`` (the annotation of
    TransformerConfig's field ``name``)."""
    for h in (hint, *typing.get_args(hint)):
        if typing.get_origin(h) is typing.Literal:
            return typing.get_args(h)
    raise RuntimeError(
        f"megatron_nccl_ep.register(): TransformerConfig.{name} is annotated "
        f"{hint!r}, not a Literal of dispatcher names; this Megatron-Core version is not "
        "supported")


def _allow_dispatcher_type(name: str = "moe_token_dispatcher_type") -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Subclasses (MLA, heterogeneous configs) share this Field object. The annotation may be a
    # string (postponed evaluation) or wrap the Literal in Optional[...]: resolve both.
    field = TransformerConfig.__dataclass_fields__[name]
    hint = field.type
    if isinstance(hint, str):
        hint = typing.get_type_hints(TransformerConfig)[name]
    choices = literal_choices(hint, name)
    if DISPATCHER_TYPE not in choices:
        allowed = typing.Literal[choices + (DISPATCHER_TYPE,)]
        _replace(field, "type", allowed)
        _replace(TransformerConfig.__annotations__, name, allowed)


def _allow_overlaps() -> None:
    """TransformerConfig admits moe_shared_expert_overlap and overlap_moe_expert_parallel_comm
    (the fine-grained 1F1B schedule) for the alltoall and flex dispatchers only. nccl_ep drives
    the same shared-expert hooks and the same MoELayer stages (preprocess, dispatch,
    routed_experts_compute, combine, postprocess) as alltoall, so such a config is validated as
    an alltoall one (every other check of the overlaps included), then given its type back."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__

    @functools.wraps(original)
    def post_init(self):
        if self.moe_token_dispatcher_type != DISPATCHER_TYPE:
            return original(self)
        if self.moe_shared_expert_overlap or self.overlap_moe_expert_parallel_comm:
            self.moe_token_dispatcher_type = "alltoall"
            try:
                original(self)
            finally:
                self.moe_token_dispatcher_type = DISPATCHER_TYPE
        else:
            original(self)
        # Megatron training: the --nccl-ep-* flags are parsed, so graph settings that need a
        # static layout are refused here, with the arguments (the dispatcher checks again).
        if training_args() is not None:
            check_graph_settings(self, layer_options(self))

    _replace(TransformerConfig, "__post_init__", post_init)


def _patch_free_input_policy() -> None:
    """The 1F1B schedule frees a stage's inputs after its forward unless should_free_input says
    they are needed by backward. For nccl_ep they are, as for flex's ncclep/hybridep backends:
    the dispatch stage's inputs are views of what the router and layernorm saved, and the mlp
    stage's input (dispatch_postprocess is an identity) is what the experts save, unless FP8/FP4
    casts made their own copies. The schedule looks the function up in its module at call time."""
    from megatron.core.models.common import utils

    original = getattr(utils, "should_free_input", None)
    if original is None:
        raise RuntimeError("megatron_nccl_ep.register(): megatron.core.models.common.utils has no "
                           "should_free_input; this Megatron-Core version is not supported")

    @functools.wraps(original)
    def should_free_input(name, is_moe, config, num_local_experts):
        if not is_moe or config.moe_token_dispatcher_type != DISPATCHER_TYPE:
            return original(name, is_moe, config, num_local_experts)
        quantized = config.fp8 is not None or config.fp4 is not None
        return {"mlp": quantized, "moe_combine": True, "moe_dispatch": False}.get(name, False)

    _replace(utils, "should_free_input", should_free_input)


def _build_dispatcher(layer, config, pg_collection):
    """The ``nccl_ep`` branch of MoELayer.__init__'s dispatcher choice (see _patch_moe_layer)."""
    dispatcher = NcclEpTokenDispatcher(layer.num_local_experts, layer.local_expert_indices,
                                       config=layer.config, pg_collection=pg_collection)
    dispatcher.moe_layer = weakref.ref(layer)  # its layer number names it in budget errors
    return dispatcher


def _is_dispatcher_test(node, value: str) -> bool:
    """``config.moe_token_dispatcher_type == value``."""
    return (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Eq)
            and isinstance(node.left, ast.Attribute)
            and node.left.attr == "moe_token_dispatcher_type"
            and isinstance(node.left.value, ast.Name) and node.left.value.id == "config"
            and len(node.comparators) == 1 and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == value)


def _patch_moe_layer() -> None:
    """MoELayer.__init__ picks its dispatcher in an if/elif chain on
    ``config.moe_token_dispatcher_type`` with no registry, in the middle of __init__ (after the
    router, before the experts and the shared-expert hand-over that read it). Its source gets
    one more branch in front, ``if ... == "nccl_ep": self.token_dispatcher =
    _build_dispatcher(...)``, compiled in Megatron's module with the original file name and line
    numbers. The rest of __init__ (the shared-expert hand-over, inference_optimized's training
    dispatcher) then runs with ours, exactly as with Megatron's own; the config is never
    modified. A Megatron whose __init__ has no such chain is refused here, at register().

    Why a rewrite and no wrapper: a wrapper reaches the middle of __init__ only by writing the
    config's type for the call (or by building a stand-in dispatcher and replacing it after),
    which docs/decisions.md rules out (tests/test_megatron_dispatcher.py checks it)."""
    from megatron.core.transformer.moe import moe_layer

    init = moe_layer.MoELayer.__init__
    filename = inspect.getsourcefile(init)
    lines, first_line = inspect.getsourcelines(init)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first_line - 1)
    function = tree.body[0]
    chains = [node for node in ast.walk(function) if isinstance(node, ast.If)
              and _is_dispatcher_test(node.test, "allgather")]
    # Compiled outside the class body, a zero-argument super() would find no __class__ cell.
    bare_super = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                     and n.func.id == "super" and not n.args for n in ast.walk(function))
    if len(chains) != 1 or len(function.args.args) < 2 or function.args.args[1].arg != "config" \
            or "pg_collection" not in [a.arg for a in function.args.args] or bare_super:
        raise RuntimeError(
            "megatron_nccl_ep.register(): MoELayer.__init__ of this Megatron-Core version does "
            "not choose its dispatcher in one `if config.moe_token_dispatcher_type == "
            "\"allgather\"` chain with `config` and `pg_collection` arguments and an explicit "
            "super(MoELayer, self); this version is not supported")
    chain = chains[0]
    ours = ast.parse(
        f"if config.moe_token_dispatcher_type == {DISPATCHER_TYPE!r}:\n"
        "    self.token_dispatcher = _nccl_ep_build_dispatcher(self, config, pg_collection)\n"
    ).body[0]
    for node in ast.walk(ours):  # tracebacks of our branch point at the chain's first line
        ast.copy_location(node, chain)
    theirs = ast.copy_location(ast.If(test=chain.test, body=chain.body, orelse=chain.orelse),
                               chain)
    chain.test, chain.body, chain.orelse = ours.test, ours.body, [theirs]
    # Compiled in Megatron's own module namespace (its globals stay live), which gains the one
    # name our branch calls.
    _replace(moe_layer, "_nccl_ep_build_dispatcher", _build_dispatcher)
    namespace: dict = {}
    exec(compile(tree, filename, "exec"), vars(moe_layer), namespace)
    _replace(moe_layer.MoELayer, "__init__", functools.wraps(init)(namespace[function.name]))


def _patch_inference_setup() -> None:
    """MoELayer._setup_inference_mode (inference_optimized layers) keeps the training dispatcher
    and builds the inference one, NVLS for 'nvls' and NCCL all-gather for anything else. For
    'nccl_ep' it does the same with ours: the training dispatcher kept, ours built from the
    same arguments, no shared-expert overlap (as for 'nccl'), the latent-MoE overlap slot
    cleared; every other type goes to Megatron's own method."""
    from megatron.core.transformer.moe import moe_layer

    original = getattr(moe_layer.MoELayer, "_setup_inference_mode", None)
    if original is None:
        raise RuntimeError("megatron_nccl_ep.register(): MoELayer has no _setup_inference_mode; "
                           "this Megatron-Core version is not supported")

    @functools.wraps(original)
    def setup_inference_mode(self, pg_collection):
        if self.config.inference_moe_token_dispatcher_type != DISPATCHER_TYPE:
            return original(self, pg_collection)
        self._training_token_dispatcher = self.token_dispatcher
        self._inference_token_dispatcher = NcclEpInferenceDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection)
        self._latent_shared_expert_output = None
        return None

    _replace(moe_layer.MoELayer, "_setup_inference_mode", setup_inference_mode)


def _patch_inference_context() -> None:
    """Megatron's DynamicInferenceContext sizes its own dispatchers' buffers in __init__ (the NVLS
    one with round_up_tokens(max_tokens) // tp_size tokens per rank). For 'nccl_ep' the same
    budget becomes the LL groups' T_max (NcclEpInferenceDispatcher.set_token_budget)."""
    from megatron.core.inference.contexts import dynamic_context

    cls = dynamic_context.DynamicInferenceContext
    original = cls.__init__

    @functools.wraps(original)
    def init(self, model_config, inference_config, *args, **kwargs):
        original(self, model_config, inference_config, *args, **kwargs)
        if getattr(model_config, "inference_moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return
        pg_collection = getattr(inference_config, "pg_collection", None)
        if pg_collection is not None:
            tp_size = pg_collection.tp.size()
        else:
            tp_size = model_config.tensor_model_parallel_size
        NcclEpInferenceDispatcher.set_token_budget(
            cls.round_up_tokens(self.max_tokens, tp_size=tp_size) // tp_size)

    _replace(cls, "__init__", init)


def _patch_arguments() -> None:
    from megatron.training import arguments

    add_megatron_arguments = arguments.add_megatron_arguments

    @functools.wraps(add_megatron_arguments)
    def add_all_arguments(parser):
        return add_arguments(add_megatron_arguments(parser))

    # parse_args looks add_megatron_arguments up in its module at call time, so a parse_args
    # imported before register() sees the flags too; the dispatcher reads their values from the
    # parsed arguments (get_args), so parse_args itself is left alone.
    _replace(arguments, "add_megatron_arguments", add_all_arguments)


def _patch_train_step() -> None:
    """Capacity mode in Megatron training: with ``--nccl-ep-capacity-overflow redo`` the step's
    ``forward_backward_func`` runs inside ``overflow.RedoOverflowedSteps`` (an overflowed step
    redone in exact mode before the optimizer step, the budget grown); after each step the
    budgets (``error``) and the groups' device-side errors are checked
    (dispatcher.check_budgets): where the host waits for the GPU anyway, also when CUDA graphs
    replayed the step, and before the step's checkpoint could be saved. train() looks
    train_step up in its module at call time."""
    from megatron.training import training

    original = training.train_step
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train_step(*args, **kwargs):
        options = get_options()
        redo = options.recv_mode == "capacity" and options.capacity_overflow == "redo"
        if redo:
            bound = signature.bind(*args, **kwargs)
            call = bound.arguments
            call["forward_backward_func"] = RedoOverflowedSteps(
                call["forward_backward_func"], call["model"], call["optimizer"],
                call.get("iteration"))
            args, kwargs = bound.args, bound.kwargs
        result = original(*args, **kwargs)
        if redo:  # the budgets were checked before the optimizer step
            check_group_errors()
        else:
            check_budgets()
        return result

    _replace(training, "train_step", train_step)


def _patch_local_experts() -> None:
    """Megatron-Core 0.19's local spec builds SequentialMLP whether or not
    ``moe_grouped_gemm`` is set; with it set, the spec builds ``experts.GroupedExperts`` (the
    same modules and checkpoints, grouped GEMMs over device-side counts) instead."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe.experts import SequentialMLP

    original = LocalSpecProvider.grouped_mlp_modules

    @functools.wraps(original)
    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        spec = original(self, moe_use_grouped_gemm)
        if not moe_use_grouped_gemm:
            return spec
        if not (isinstance(spec, functools.partial) and spec.func is SequentialMLP):
            raise RuntimeError(
                "megatron_nccl_ep.register(): LocalSpecProvider.grouped_mlp_modules of this "
                f"Megatron-Core version returns {spec!r}, not a partial of SequentialMLP; this "
                "version is not supported")
        return functools.partial(GroupedExperts, *spec.args, **spec.keywords)

    _replace(LocalSpecProvider, "grouped_mlp_modules", grouped_mlp_modules)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change ``register()`` makes to Megatron, in memory."""

    target: str  # what it replaces, by its dotted path
    does: str  # what the replacement does
    checked: Tuple[str, ...]  # the megatron-core versions it was checked against
    apply: Callable[[], None]
    training: bool = False  # in megatron.training: applied where that imports (it is optional)


# Every patch register() applies, in order. After checking a new megatron-core version against
# a patch (read the Megatron code it replaces; the CPU suite and tests/gpu pass), add the
# version to that patch's `checked`.
PATCHES: Tuple[Patch, ...] = (
    Patch("megatron.core.transformer.transformer_config.TransformerConfig"
          ".moe_token_dispatcher_type",
          "its Literal gains nccl_ep (Megatron's argparse builds the flag's choices from it)",
          ("0.19.2",), _allow_dispatcher_type),
    Patch("megatron.core.transformer.transformer_config.TransformerConfig.__post_init__",
          "admits shared-expert and 1F1B EP overlap with nccl_ep (validated as alltoall); in "
          "training refuses CUDA graphs holding token_dispatch in exact mode",
          ("0.19.2",), _allow_overlaps),
    Patch("megatron.core.transformer.moe.moe_layer.MoELayer.__init__",
          "its dispatcher chain gains an nccl_ep branch building NcclEpTokenDispatcher (source "
          "rewritten: no wrapper reaches the chain without writing the config)",
          ("0.19.2",), _patch_moe_layer),
    Patch("megatron.core.models.common.utils.should_free_input",
          "the 1F1B schedule keeps the stage inputs nccl_ep's backward needs",
          ("0.19.2",), _patch_free_input_policy),
    Patch("megatron.core.transformer.transformer_config.TransformerConfig"
          ".inference_moe_token_dispatcher_type",
          "its Literal gains nccl_ep",
          ("0.19.2",), functools.partial(_allow_dispatcher_type,
                                         "inference_moe_token_dispatcher_type")),
    Patch("megatron.core.transformer.moe.moe_layer.MoELayer._setup_inference_mode",
          "builds NcclEpInferenceDispatcher for inference_moe_token_dispatcher_type nccl_ep",
          ("0.19.2",), _patch_inference_setup),
    Patch("megatron.core.inference.contexts.dynamic_context.DynamicInferenceContext.__init__",
          "records the inference dispatcher's token budget per rank",
          ("0.19.2",), _patch_inference_context),
    Patch("megatron.core.models.backends.LocalSpecProvider.grouped_mlp_modules",
          "builds nccl_ep's GroupedExperts for --moe-grouped-gemm under the local spec",
          ("0.19.2",), _patch_local_experts),
    Patch("megatron.training.arguments.add_megatron_arguments",
          "adds the --nccl-ep-* flags",
          ("0.19.2",), _patch_arguments, training=True),
    Patch("megatron.training.training.train_step",
          "capacity mode: the redo of an overflowed step, the budgets checked after each step",
          ("0.19.2",), _patch_train_step, training=True),
)


def megatron_core_version() -> str:
    """The imported megatron-core's version (e.g. ``"0.19.2"``), without the ``+commit``
    suffix Megatron appends where its files sit in a git checkout."""
    import megatron.core

    return str(getattr(megatron.core, "__version__", "unknown")).split("+")[0]


def _training_imports() -> bool:
    """Whether ``megatron.training`` (optional for users of megatron.core alone) imports."""
    try:
        import megatron.training.arguments  # noqa: F401
        import megatron.training.training  # noqa: F401
    except ImportError:
        return False
    return True


def register() -> None:
    """Idempotent. Patches Megatron-Core (in memory) to know ``nccl_ep``: every patch of
    ``PATCHES`` (those of ``megatron.training`` when it can be imported), all or none.

    Raises:
        RuntimeError: the installed megatron-core is not a version every patch was checked
            against (naming it and the checked ones), or a patch does not recognise what it
            replaces; nothing is patched then.
    """
    global _registered
    if _registered:
        return
    version = megatron_core_version()
    training = _training_imports()
    patches = [p for p in PATCHES if training or not p.training]
    unchecked = [p for p in patches if version not in p.checked]
    if unchecked:
        raise RuntimeError(
            f"megatron_nccl_ep.register(): megatron-core {version} is installed, and the "
            "Megatron code these patches replace was checked against other versions only: "
            + "; ".join(f"{p.target} ({', '.join(p.checked)})" for p in unchecked)
            + ". Install a checked version (requirements.txt), or check the patches against "
            f"{version} and add it to their versions (megatron_nccl_ep.megatron.PATCHES)")
    try:
        for patch in patches:
            patch.apply()
    except BaseException:
        _put_back()
        raise
    _registered = True


def unregister() -> None:
    """Undoes ``register()``: everything it replaced gets Megatron's own back (configs, layers
    and dispatchers made meanwhile keep what they were made with), so that a later
    ``register()`` patches anew. For tests and tools that need Megatron unpatched in the same
    process."""
    global _registered
    _put_back()
    _registered = False
