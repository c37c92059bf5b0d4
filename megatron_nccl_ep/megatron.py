"""``register()``: makes Megatron-Core 0.19 accept ``--moe-token-dispatcher-type nccl_ep``.

Megatron is patched in memory only (its files on disk are never touched):

* ``TransformerConfig.moe_token_dispatcher_type``'s Literal gains ``"nccl_ep"``; Megatron's
  argparse builds the flag's choices from that annotation;
* ``TransformerConfig.__post_init__`` admits ``moe_shared_expert_overlap`` and
  ``overlap_moe_expert_parallel_comm`` with ``nccl_ep``, and in Megatron training refuses CUDA
  graphs that hold ``token_dispatch`` in exact mode (``dispatcher.check_graph_settings``); the
  1F1B schedule's ``should_free_input`` keeps the stage inputs our backward needs;
* ``MoELayer.__init__``'s dispatcher chain gains an ``nccl_ep`` branch that builds
  ``NcclEpTokenDispatcher`` (the config is never modified);
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
import functools
import inspect
import textwrap
import typing
import weakref

from .dispatcher import (NcclEpTokenDispatcher, check_budgets, check_graph_settings,
                         check_group_errors)
from .dispatcher_common import layer_options
from .experts import GroupedExperts
from .inference import NcclEpInferenceDispatcher
from .options import add_arguments, get_options, training_args
from .overflow import RedoOverflowedSteps

DISPATCHER_TYPE = "nccl_ep"

_registered = False


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
        field.type = typing.Literal[choices + (DISPATCHER_TYPE,)]
        TransformerConfig.__annotations__[name] = field.type


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

    TransformerConfig.__post_init__ = post_init


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

    utils.should_free_input = should_free_input


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
    ``config.moe_token_dispatcher_type`` with no registry. Its source gets one more branch in
    front, ``if ... == "nccl_ep": self.token_dispatcher = _build_dispatcher(...)``, compiled
    in Megatron's module with the original file name and line numbers. The rest of __init__ (the
    shared-expert hand-over, inference_optimized's training dispatcher) then runs with ours,
    exactly as with Megatron's own; the config is never modified. A Megatron whose __init__ has
    no such chain is refused here, at register()."""
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
    moe_layer._nccl_ep_build_dispatcher = _build_dispatcher
    namespace: dict = {}
    exec(compile(tree, filename, "exec"), vars(moe_layer), namespace)
    patched = functools.wraps(init)(namespace[function.name])
    moe_layer.MoELayer.__init__ = patched


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

    moe_layer.MoELayer._setup_inference_mode = setup_inference_mode


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

    cls.__init__ = init


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

    training.train_step = train_step


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

    LocalSpecProvider.grouped_mlp_modules = grouped_mlp_modules


def register() -> None:
    """Idempotent. Patches Megatron-Core (in memory) to know ``nccl_ep``; ``megatron.training``
    is patched too when it can be imported (it is optional for users of megatron.core alone)."""
    global _registered
    if _registered:
        return
    _allow_dispatcher_type()
    _allow_overlaps()
    _patch_moe_layer()
    _patch_free_input_policy()
    _allow_dispatcher_type("inference_moe_token_dispatcher_type")
    _patch_inference_setup()
    _patch_inference_context()
    _patch_local_experts()
    try:
        import megatron.training.arguments  # noqa: F401
        import megatron.training.training  # noqa: F401
    except ImportError:
        pass
    else:
        _patch_arguments()
        _patch_train_step()
    _registered = True
