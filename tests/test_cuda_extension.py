"""The compiled extension on a machine without a GPU: it loads, speaks the header's API version,
runs on the same NCCL that torch loaded (one NCCL per process), and turns a C error code into a
Python exception carrying the library's reason. Skipped where setup did not build the library
(the reason says why and how to build it: megatron_nccl_ep/build_info.py)."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import elf_dynamic
from megatron_nccl_ep import build_info

NOT_BUILT = build_info.not_built_reason()
if NOT_BUILT is not None:  # the whole file, in one line of the skip summary
    pytest.skip(NOT_BUILT, allow_module_level=True)

HEADER = os.path.join(os.path.dirname(__file__), "..", "csrc", "include", "nccl_ep.h")
CALL_CHECKS = os.path.join(os.path.dirname(__file__), "..", "csrc", "runtime", "call_checks.h")


@pytest.fixture(scope="module")
def ext():
    from megatron_nccl_ep import _C

    return _C


def test_api_version_matches_header(ext):
    with open(HEADER) as f:
        declared = int(re.search(r"#define NCCL_EP_API_VERSION (\d+)", f.read()).group(1))
    assert ext.API_VERSION == declared


def test_runs_on_the_nccl_torch_loaded(ext):
    major, minor, patch = torch.cuda.nccl.version()
    torch_nccl = major * 10000 + minor * 100 + patch
    assert ext.nccl_version() == torch_nccl, "the extension loaded another libnccl than torch"
    assert ext.NCCL_BUILD_VERSION // 100 == torch_nccl // 100, (
        "built against other NCCL headers than the NCCL torch ships")


def group_config(ext, **changes):
    """The bindings' group configuration, valid unless changed (mode "ll": LL's)."""
    config = ext.GroupConfig()
    fields = dict(num_experts=8, hidden=128, max_tokens_per_rank=16, max_topk=2,
                  token_dtype=torch.bfloat16, num_sms=24, timeout_ms=1000)
    fields.update(changes)
    if fields.get("mode") == "ll":
        fields["mode"] = ext.MODE_LOW_LATENCY
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def test_error_code_becomes_exception_with_reason(ext):
    with pytest.raises(ValueError, match="ncclEpCreateGroup: comm is NULL"):
        ext.create_group(0, group_config(ext), 0)
    assert "comm is NULL" in ext.get_last_error()


@pytest.mark.parametrize("change, message", [
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be >= 1, got 0"),
    (dict(num_experts=7), r"num_experts \(7\) must be > 0 and a multiple of the group size \(2\)"),
    (dict(staging_depth=-1), "staging_depth 0 or in \\[2, 64\\]"),
    (dict(staging_depth=1), r"staging_depth 0 or in \[2, 64\] \(0 = default\), got 0 and 1"),
    (dict(num_sms=1025), r"num_sms must be in \[0, 1024\]"),
    (dict(max_topk=9, num_experts=8), r"max_topk must be in \[1, num_experts=8\], got 9"),
    (dict(max_topk=34, num_experts=66), r"a token may have min\(max_topk=34, local experts=33\) "
                                        r"slots on one rank, at most 32 .*drop-and-pad"),
    (dict(mode="ll", hidden=100), "LL moves rows in packs of 8 elements: hidden must be a multiple "
                               "of 8, got 100"),
    (dict(mode="ll", hidden=136, payload_dtype=torch.float8_e4m3fn),
     "payload_dtype float8_e4m3 casts blocks of 128 columns: hidden must be a multiple of 128"),
    (dict(payload_dtype=torch.float8_e4m3fn), "layout and payload_dtype are LL options"),
])
def test_local_team_config_errors_name_the_field(ext, change, message):
    """Configuration checks run before any CUDA call, so they are exercised here without a GPU."""
    with pytest.raises(ValueError, match=message):
        ext.create_local_team(2, group_config(ext, **change), 0)


def test_local_team_size_is_checked(ext):
    with pytest.raises(ValueError, match=r"nranks must be in \[1, 64\], got 65"):
        ext.create_local_team(65, group_config(ext), 0)


def test_shared_library_exports_only_the_c_api():
    """libmegatron_nccl_ep.so (next to the module) is the C product: its dynamic symbols are the
    public header's functions, each also under its private name (megatron_nccl_ep_ncclEp*, what
    _C calls), the ops' argument checks that _C runs on host tensors (call_checks.h,
    megatron_nccl_ep_check_*), and nothing else (no CUDA runtime, no C++ internals)."""
    lib = os.path.join(build_info.PACKAGE_DIR, "libmegatron_nccl_ep.so")
    assert os.path.exists(lib), f"{lib} was not built"
    symbols = elf_dynamic.read(lib).symbols
    exported = sorted(s.name for s in symbols if s.defined and s.name)
    with open(HEADER) as f:
        declared = sorted(set(re.findall(r"\b(ncclEp[A-Za-z]+)\(", f.read())))
    with open(CALL_CHECKS) as f:
        checks = sorted(set(re.findall(r"\b(megatron_nccl_ep_check_[a-z_]+)\(", f.read())))
    assert checks, f"{CALL_CHECKS} declares no check"
    assert exported == sorted(declared + ["megatron_nccl_ep_" + d for d in declared] + checks), (
        f"exported {exported}, header declares {declared}, call_checks.h {checks}")
    # nvcc compiles a host call into a __device__-only function (legal in a template) to
    # exit(1): the library must never end the caller's process.
    imported = {s.name for s in symbols if not s.defined}
    assert not {"exit", "_exit", "abort"} & imported, (
        "libmegatron_nccl_ep.so imports exit/_exit/abort")


def test_c_example_builds_against_the_library(tmp_path):
    """examples/c_api/dispatch_combine.c compiles (-Wall -Wextra -Werror) and links against
    libmegatron_nccl_ep.so and the public header alone; tests/gpu runs it."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) here")
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "c_api", "build.sh")
    binary = tmp_path / "dispatch_combine"
    done = subprocess.run(["bash", script, str(binary)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout + done.stderr
    assert binary.exists()


def test_op_bindings_refuse_a_tensor_off_the_group_device(ext):
    """Every op binding takes torch tensors and refuses one that is not on the group's CUDA
    device (the one check the C library cannot make), naming it, before anything reaches the
    library or allocates; a non-tensor is a TypeError. (tests/gpu: the C library's own checks
    of each call.)"""
    x, idx = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
    outputs = ext.LLOutputs([("x", ((4, 8), torch.bfloat16)), ("count", ((1,), torch.int32)),
                             ("scales", None), ("src", None),
                             ("topk_idx", ((4, 2), torch.int32)), ("topk_weights", None)])
    calls = {
        "topk_idx": lambda: ext.create_handle(0, idx, False, 0),
        "routing_map": lambda: ext.create_handle(0, idx.bool(), True, 0),
        "x": lambda: ext.dispatch(0, x, None, False, 0),
        "expert_out": lambda: ext.combine(0, x, 4, x.dtype, 0),
        "expert_out ": lambda: ext.ll_combine(0, x, None, False, None, 4, x.dtype, 0),
        "grad_recv_probs": lambda: ext.combine_topk_weights(0, x[:, 0].float(), 4, 2, False, 0),
        "x ": lambda: ext.ll_dispatch(0, x, None, False, outputs, None, 0),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"^{name.strip()} must be on cuda:0, got cpu$"):
            call()
    with pytest.raises(TypeError):
        ext.combine(0, x.tolist(), 4, torch.float32, 0)


def test_op_bindings_refuse_a_backward_they_cannot_record(ext):
    """HT's dispatch and combine record a given ``backward`` as their outputs' grad_fn
    (csrc/bindings/py_backward.h) where autograd records: they refuse, before anything reaches the
    library, forward-mode AD; without grad mode, or with no input that requires grad, the
    backward is ignored and the call goes on (here to the device check). LL's combine (``out``,
    ``send_only``, weights) is a binding of its own, which takes no backward."""
    x = torch.zeros(4, 8, dtype=torch.bfloat16, requires_grad=True)

    def backward(*grads):
        return grads

    with pytest.raises(TypeError):
        ext.ll_combine(0, x, None, False, x.detach(), 4, x.dtype, 0, backward)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        with pytest.raises(ValueError, match="forward-mode AD"):
            ext.dispatch(0, dual, None, False, 0, backward)
    with torch.no_grad():
        with pytest.raises(ValueError, match="^expert_out must be on cuda:0, got cpu$"):
            ext.combine(0, x, 4, x.dtype, 0, backward)
    with pytest.raises(ValueError, match="^x must be on cuda:0, got cpu$"):
        ext.dispatch(0, x.detach(), None, False, 0, backward)


def test_op_bindings_show_in_torch_profiler(ext):
    """Each op binding is a span of its own in torch.profiler's trace (named nccl_ep::<op>), as
    torch's ops are: profiles of a step attribute the binding's host time to it (here calls
    refused at the device check, which the span covers too)."""
    from torch.profiler import ProfilerActivity, profile

    x, idx = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
    calls = {
        "create_handle": lambda: ext.create_handle(0, idx, False, 0),
        "dispatch": lambda: ext.dispatch(0, x, None, False, 0),
        "combine": lambda: ext.combine(0, x, 4, x.dtype, 0),
        "ll_combine": lambda: ext.ll_combine(0, x, None, False, None, 4, x.dtype, 0),
        "combine_topk_weights": lambda: ext.combine_topk_weights(0, x[:, 0].float(), 4, 2,
                                                                 False, 0),
    }
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for call in calls.values():
            with pytest.raises(ValueError, match="must be on cuda:0"):
                call()
    names = {event.key for event in prof.key_averages()}
    assert {f"nccl_ep::{op}" for op in calls} <= names, names
