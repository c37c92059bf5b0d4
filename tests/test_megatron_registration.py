"""register(): Megatron's own argparse and TransformerConfig accept ``nccl_ep``; the launcher runs a
training script unchanged with it registered. Subprocesses: registration patches Megatron for the
whole process, and the "before" half needs a process where it has not happened."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
import typing

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Stands for a user's Megatron training script: it knows nothing about megatron_nccl_ep.
TRAINING_SCRIPT = textwrap.dedent("""
    import sys
    from megatron.training import arguments

    args = arguments.parse_args()
    print("PARSED", args.moe_token_dispatcher_type, args.num_experts, args.nccl_ep_recv_mode,
          args.nccl_ep_capacity_factor, sys.argv[0].endswith("train_stub.py"))
""")

MEGATRON_ARGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                 "--num-experts", "4", "--moe-token-dispatcher-type", "nccl_ep"]


def run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def training_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "train_stub.py"
    path.write_text(TRAINING_SCRIPT)
    return str(path)


def test_megatron_rejects_nccl_ep_without_registration(training_script):
    result = run_python(training_script, *MEGATRON_ARGS)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "invalid choice: 'nccl_ep'" in result.stderr


def test_launcher_registers_and_runs_the_script(training_script):
    result = run_python("-m", "megatron_nccl_ep.launch", training_script, *MEGATRON_ARGS,
                        "--nccl-ep-recv-mode", "capacity", "--nccl-ep-capacity-factor", "1.5")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PARSED nccl_ep 4 capacity 1.5 True" in result.stdout
    # torch's notice, which megatron.core's import would log on a machine without a CUDA GPU.
    assert "No CUDA runtime is found" not in result.stderr, result.stderr


def test_launcher_help_lists_our_flags_without_importing_torch_or_megatron():
    code = textwrap.dedent("""
        import sys
        from megatron_nccl_ep import launch
        try:
            launch.main(["--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
        print("IMPORTED", heavy)
    """)
    result = run_python("-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    for flag in ("--nccl-ep-backend", "--nccl-ep-recv-mode", "--nccl-ep-capacity-factor",
                 "--nccl-ep-num-sms", "--nccl-ep-ll-num-sms", "--nccl-ep-max-tokens-per-rank",
                 "--nccl-ep-ranks-per-node", "--nccl-ep-timeout-s"):
        assert flag in result.stdout, flag
    assert "github.com/NVIDIA/Megatron-LM" in result.stdout
    assert "IMPORTED []" in result.stdout, result.stdout


def test_register_is_idempotent_and_sets_options_from_flags():
    code = textwrap.dedent(f"""
        import sys
        import megatron_nccl_ep
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.training import arguments
        from megatron_nccl_ep.options import get_options

        parse_args = arguments.parse_args  # imported before register(): still sees our flags
        megatron_nccl_ep.register()
        init, add = MoELayer.__init__, arguments.add_megatron_arguments
        megatron_nccl_ep.register()
        assert MoELayer.__init__ is init and arguments.add_megatron_arguments is add, \
            "patched twice"
        field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
        assert str(field.type).count("nccl_ep") == 1, field.type

        sys.argv = ["train"] + {MEGATRON_ARGS!r} + ["--nccl-ep-backend", "torch",
                                                    "--nccl-ep-num-sms", "16",
                                                    "--nccl-ep-timeout-s", "12.5"]
        args = parse_args()
        from megatron.training.global_vars import set_args

        set_args(args)  # what initialize_megatron does with them
        options = get_options()
        assert (options.backend, options.num_sms, options.recv_mode, options.timeout_s) == (
            "torch", 16, "exact", 12.5), options
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                   num_moe_experts=4, moe_token_dispatcher_type="nccl_ep")
        print("OK", args.moe_token_dispatcher_type, config.moe_token_dispatcher_type)
    """)
    result = run_python("-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK nccl_ep nccl_ep" in result.stdout


def test_bad_flag_value_is_rejected(training_script):
    result = run_python("-m", "megatron_nccl_ep.launch", training_script, *MEGATRON_ARGS,
                        "--nccl-ep-backend", "nvshmem")
    assert result.returncode == 2
    assert "--nccl-ep-backend: invalid choice: 'nvshmem'" in result.stderr


def test_dispatcher_choices_from_plain_and_optional_literals():
    from megatron_nccl_ep.megatron import literal_choices

    assert literal_choices(typing.Literal["a", "b"]) == ("a", "b")
    assert literal_choices(typing.Optional[typing.Literal["a", "b"]]) == ("a", "b")
    with pytest.raises(RuntimeError, match="not a Literal of dispatcher names"):
        literal_choices(str)


def test_options_from_yaml_style_namespace():
    # Megatron's --yaml-cfg path returns a SimpleNamespace of the file's keys: ours may be absent.
    from megatron_nccl_ep.options import NcclEpOptions, options_from_args

    assert options_from_args(types.SimpleNamespace(seq_length=8)) == NcclEpOptions()
    assert options_from_args(types.SimpleNamespace(nccl_ep_recv_mode="capacity",
                                                   nccl_ep_num_sms=16)) == NcclEpOptions(
        recv_mode="capacity", num_sms=16)


def test_moe_layer_without_a_dispatcher_chain_is_refused(monkeypatch):
    """register()'s MoELayer patch needs Megatron's dispatcher if/elif chain; an __init__
    without one (another Megatron-Core version) is refused with the reason, not half-patched."""
    from megatron.core.transformer.moe import moe_layer

    from megatron_nccl_ep import megatron as registration

    def init(self, config, submodules=None, pg_collection=None):
        self.token_dispatcher = None if config is None else pg_collection

    monkeypatch.setattr(moe_layer.MoELayer, "__init__", init)
    with pytest.raises(RuntimeError, match=r"does not choose its dispatcher in one `if "
                                           r"config.moe_token_dispatcher_type == \"allgather\"`"):
        registration._patch_moe_layer()
    assert moe_layer.MoELayer.__init__ is init


def test_options_follow_each_new_training_arguments_object(monkeypatch):
    # get_options() reads the flags once per arguments object (every forward of every layer asks):
    # the same object gives the same options, a new one (Megatron parsing again) its own.
    import argparse

    from megatron.training.global_vars import set_args

    from megatron_nccl_ep import options
    from megatron_nccl_ep.options import NcclEpOptions

    monkeypatch.setattr(options, "_options", None)  # no set_options() in force
    try:
        set_args(argparse.Namespace(nccl_ep_num_sms=16))
        first = options.get_options()
        assert first.num_sms == 16 and options.get_options() is first
        set_args(argparse.Namespace(nccl_ep_num_sms=32, nccl_ep_recv_mode="capacity"))
        second = options.get_options()
        assert (second.num_sms, second.recv_mode) == (32, "capacity"), second
    finally:
        set_args(None)
    assert options.get_options() == NcclEpOptions()  # arguments gone: the defaults


def test_documented_flags_and_defaults_are_the_launchers():
    """docs/megatron.md's options table lists every --nccl-ep-* flag with the default that
    `python -m megatron_nccl_ep.launch --help` shows (NcclEpOptions')."""
    import argparse
    import re

    from megatron_nccl_ep.options import add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    defaults = {a.option_strings[0]: a.default for a in parser._actions
                if a.option_strings and a.option_strings[0].startswith("--nccl-ep-")}
    with open(os.path.join(REPO_ROOT, "docs", "megatron.md")) as f:
        rows = re.findall(r"^\| `(--nccl-ep-[a-z-]+)` \| ([^|]+) \|", f.read(), re.MULTILINE)
    documented = dict(rows)
    assert set(documented) == set(defaults)
    for flag, default in defaults.items():
        shown = re.match(r"`([^`]+)`", documented[flag].strip())
        if default is None:  # derived from the training arguments: documented in words
            assert shown is None, flag
        else:
            assert shown is not None and shown.group(1) == str(default), (flag, documented[flag])
    help_text = parser.format_help()
    for flag, default in defaults.items():
        if default is not None:
            assert f"default: {default}" in " ".join(help_text.split()), flag


def test_graph_settings_refused_with_the_arguments_and_budgets_checked_after_each_step():
    """In Megatron training (arguments parsed), a TransformerConfig whose CUDA graphs hold
    token_dispatch is refused in exact mode and accepted in capacity mode; Megatron's train_step
    is followed by check_budgets() (stand-ins for both, called through Megatron's module)."""
    code = textwrap.dedent(f"""
        import sys
        from megatron.training import training
        training.train_step = lambda *args, **kwargs: ("train_step's result", args, kwargs)
        import megatron_nccl_ep
        from megatron_nccl_ep import megatron as registration
        from megatron.core.transformer import TransformerConfig
        from megatron.training import arguments
        from megatron.training.global_vars import set_args

        megatron_nccl_ep.register()
        checked = []
        registration.check_budgets = lambda: checked.append("check_budgets")
        assert training.train_step(1, x=2) == ("train_step's result", (1,), {{"x": 2}})
        assert checked == ["check_budgets"], checked

        def config():
            return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                     num_moe_experts=4, moe_token_dispatcher_type="nccl_ep",
                                     cuda_graph_impl="full_iteration")

        for mode in ("exact", "capacity"):
            sys.argv = ["train"] + {MEGATRON_ARGS!r} + ["--nccl-ep-recv-mode", mode]
            set_args(arguments.parse_args())
            try:
                config()
            except ValueError as e:
                print("REFUSED", mode, e)
            else:
                print("ACCEPTED", mode)
    """)
    result = run_python("-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("REFUSED exact nccl_ep dispatcher: cuda_graph_impl='full_iteration' with "
            "cuda_graph_modules=[] captures token_dispatch") in result.stdout, result.stdout
    assert "ACCEPTED capacity" in result.stdout, result.stdout


def test_train_step_redoes_overflowed_steps_in_capacity_mode():
    """Capacity mode with --nccl-ep-capacity-overflow redo (the default): Megatron's train_step
    gets its forward_backward_func inside RedoOverflowedSteps (with the step's model, optimizer
    and iteration) and checks only the groups' errors after the step (the budgets were checked
    before the optimizer step); with error, the function is Megatron's and check_budgets
    follows."""
    code = textwrap.dedent("""
        from megatron.training import training

        def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                       config, forward_backward_func, iteration=None):
            return forward_backward_func

        training.train_step = train_step
        import megatron_nccl_ep
        from megatron_nccl_ep import megatron as registration
        from megatron_nccl_ep.options import set_options
        from megatron_nccl_ep.overflow import RedoOverflowedSteps

        megatron_nccl_ep.register()
        checked = []
        registration.check_budgets = lambda: checked.append("check_budgets")
        registration.check_group_errors = lambda: checked.append("check_group_errors")
        schedule = object()
        for overflow in ("redo", "error"):
            set_options(recv_mode="capacity", capacity_overflow=overflow)
            got = training.train_step(None, None, ["model"], "optimizer", None, None, schedule,
                                      iteration=41)
            if overflow == "redo":
                assert isinstance(got, RedoOverflowedSteps), got
                assert (got.forward_backward_func, got.model, got.optimizer, got.iteration) == (
                    schedule, ["model"], "optimizer", 41)
            else:
                assert got is schedule, got
        assert checked == ["check_group_errors", "check_budgets"], checked
        print("OK")
    """)
    result = run_python("-c", code)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_per_layer_graphs_refused_with_redo_in_training():
    """Capacity mode in Megatron training: per-layer graphs that hold token_dispatch (local,
    whole layers) cannot be recaptured by the redo of an overflowed step: refused with
    --nccl-ep-capacity-overflow redo (naming both ways out), accepted with error; the
    full-iteration graph is accepted with redo."""
    code = textwrap.dedent(f"""
        import sys
        import megatron_nccl_ep
        from megatron.core.transformer import TransformerConfig
        from megatron.training import arguments
        from megatron.training.global_vars import set_args

        megatron_nccl_ep.register()
        for impl, overflow in (("local", "redo"), ("local", "error"),
                               ("full_iteration", "redo")):
            sys.argv = ["train"] + {MEGATRON_ARGS!r} + [
                "--nccl-ep-recv-mode", "capacity", "--nccl-ep-capacity-overflow", overflow]
            set_args(arguments.parse_args())
            try:
                TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                  num_moe_experts=4, moe_token_dispatcher_type="nccl_ep",
                                  cuda_graph_impl=impl)
            except ValueError as e:
                print("REFUSED", impl, overflow, e)
            else:
                print("ACCEPTED", impl, overflow)
    """)
    result = run_python("-c", code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("REFUSED local redo nccl_ep dispatcher: cuda_graph_impl='local' with "
            "cuda_graph_modules=[] captures token_dispatch in per-layer graphs, which "
            "--nccl-ep-capacity-overflow redo cannot recapture") in result.stdout, result.stdout
    assert "--cuda-graph-impl full_iteration, or --nccl-ep-capacity-overflow error" in \
        result.stdout, result.stdout
    assert "ACCEPTED local error" in result.stdout and "ACCEPTED full_iteration redo" in \
        result.stdout, result.stdout


def test_unchecked_megatron_version_is_refused_before_anything_is_patched(monkeypatch):
    """register() on a megatron-core version outside PATCHES' checked ones raises, naming the
    installed version and each patch with the versions it was checked against, and patches
    nothing; Megatron's +commit suffix (a git checkout) is not part of the version."""
    import megatron.core
    from megatron.core.transformer.moe import moe_layer

    from megatron_nccl_ep import megatron as registration

    monkeypatch.setattr(megatron.core, "__version__", "0.20.0rc1+1a2b3c4")
    monkeypatch.setattr(registration, "_registered", False)
    init, replaced = moe_layer.MoELayer.__init__, list(registration._replaced)
    with pytest.raises(RuntimeError) as refused:
        registration.register()
    message = str(refused.value)
    assert "megatron-core 0.20.0rc1 is installed" in message, message
    for patch in registration.PATCHES:
        assert f"{patch.target} ({', '.join(patch.checked)})" in message, patch.target
    assert moe_layer.MoELayer.__init__ is init and registration._replaced == replaced
    assert not registration._registered
    monkeypatch.setattr(megatron.core, "__version__", "0.19.2+1a2b3c4")
    assert registration.megatron_core_version() == "0.19.2"
    assert all("0.19.2" in patch.checked for patch in registration.PATCHES)


def test_register_patches_once_all_or_none_and_unregister_puts_megatrons_back():
    """Every patch of PATCHES replaces its target once (register() again changes nothing);
    unregister() puts back Megatron's own objects (Megatron's argparse refuses nccl_ep again)
    and a later register() patches anew; a patch that fails leaves nothing patched."""
    code = textwrap.dedent(f"""
        import sys
        from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.models.common import utils
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe import moe_layer
        from megatron.training import arguments, training
        from megatron_nccl_ep import megatron as registration

        def state():
            fields = TransformerConfig.__dataclass_fields__
            annotations = TransformerConfig.__annotations__
            return {{
                "type": fields["moe_token_dispatcher_type"].type,
                "type annotation": annotations["moe_token_dispatcher_type"],
                "inference type": fields["inference_moe_token_dispatcher_type"].type,
                "inference annotation": annotations["inference_moe_token_dispatcher_type"],
                "post_init": vars(TransformerConfig)["__post_init__"],
                "init": vars(moe_layer.MoELayer)["__init__"],
                "builder": getattr(moe_layer, "_nccl_ep_build_dispatcher", None),
                "setup": vars(moe_layer.MoELayer)["_setup_inference_mode"],
                "free": utils.should_free_input,
                "context": vars(DynamicInferenceContext)["__init__"],
                "experts": vars(LocalSpecProvider)["grouped_mlp_modules"],
                "arguments": arguments.add_megatron_arguments,
                "train_step": training.train_step,
            }}

        def same(a, b):
            return sorted(k for k in a if a[k] is b[k])

        def parses_nccl_ep():
            sys.argv = ["train"] + {MEGATRON_ARGS!r}
            try:
                return arguments.parse_args().moe_token_dispatcher_type == "nccl_ep"
            except SystemExit:
                return False

        megatrons = state()
        assert not parses_nccl_ep()
        registration.register()
        patched = state()
        assert same(megatrons, patched) == [], same(megatrons, patched)
        assert len(registration._replaced) == len(patched)
        registration.register()
        assert same(patched, state()) == sorted(patched) and \\
            len(registration._replaced) == len(patched)
        assert parses_nccl_ep()

        registration.unregister()
        assert same(megatrons, state()) == sorted(megatrons), same(megatrons, state())
        assert not registration._replaced and not parses_nccl_ep()
        registration.register()
        again = state()
        assert same(megatrons, again) == [] and again["init"] is not patched["init"]
        assert parses_nccl_ep()
        registration.unregister()

        def fails():
            raise RuntimeError("this patch does not recognise its target")

        registration.PATCHES += (registration.Patch("megatron.core.x", "fails", ("0.19.2",),
                                                    fails),)
        try:
            registration.register()
        except RuntimeError as e:
            assert "does not recognise" in str(e), e
        else:
            raise AssertionError("a failing patch was not raised")
        assert same(megatrons, state()) == sorted(megatrons) and not registration._registered
        print("OK")
    """)
    result = run_python("-c", code)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def test_documented_patches_are_the_table():
    """docs/megatron.md's table of what register() patches is PATCHES: each target, in order,
    with the megatron-core versions it was checked against."""
    import re

    from megatron_nccl_ep.megatron import PATCHES

    with open(os.path.join(REPO_ROOT, "docs", "megatron.md")) as f:
        rows = re.findall(r"^\| `(megatron\.[\w.]+)` \| [^|]+ \| ([^|]+) \|$", f.read(),
                          re.MULTILINE)
    assert rows == [(p.target, ", ".join(p.checked)) for p in PATCHES], rows


def test_every_plugin_option_is_read_where_megatron_runs():
    # A --nccl-ep-* flag whose NcclEpOptions field no dispatcher reads would be accepted and
    # ignored: each field is read as ``options.<field>`` (or ``options().<field>``) by the
    # modules that run inside Megatron (docs/design.md §1, "a Megatron plugin flag":
    # dispatcher_common.group_spec where it reaches a Group, else where it is used).
    import dataclasses
    import pathlib
    import re

    import megatron_nccl_ep
    from megatron_nccl_ep.options import NcclEpOptions

    package = pathlib.Path(megatron_nccl_ep.__file__).parent
    text = "\n".join((package / f"{name}.py").read_text() for name in (
        "dispatcher", "dispatcher_common", "inference", "megatron", "overflow", "experts"))
    unread = [f.name for f in dataclasses.fields(NcclEpOptions)
              if not re.search(rf"\boptions(\(\))?\.{f.name}\b", text)]
    assert not unread, f"NcclEpOptions fields no dispatcher reads: {unread}"
