"""Our C library next to NVIDIA's in one process. NVIDIA's NCCL EP library is libnccl_ep.so
(soname libnccl_ep.so.0), and its ncclEp* functions have our functions' names with other
signatures. Ours has a file name and soname of its own (libmegatron_nccl_ep.so), binds its own
calls to its own definitions (-Bsymbolic), and exports every function also under a private name,
the only name _C references. So a libnccl_ep.so loaded before _C, locally (ctypes' default) or
into the global scope (RTLD_GLOBAL, as NVIDIA's nccl4py loads it), does not stand in for ours: a
stub of that name, compiled here with the system C compiler, checks it. No GPU needed; skipped
where the library was not built."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import elf_dynamic
from megatron_nccl_ep import build_info

NOT_BUILT = build_info.not_built_reason()
if NOT_BUILT is not None:  # the whole file, in one line of the skip summary
    pytest.skip(NOT_BUILT, allow_module_level=True)

HEADER = os.path.join(os.path.dirname(__file__), "..", "csrc", "include", "nccl_ep.h")
PACKAGE_DIR = build_info.PACKAGE_DIR
LIBRARY = os.path.join(PACKAGE_DIR, "libmegatron_nccl_ep.so")
PRIVATE_PREFIX = "megatron_nccl_ep_"
NVIDIA_NAME = "libnccl_ep.so"
STUB_VERSION = 100  # what NVIDIA's ncclEpGetVersion reports for its 0.1.0


def _declared():
    with open(HEADER) as f:
        code = re.sub(r"/\*.*?\*/|//[^\n]*", "", f.read(), flags=re.S)
    return sorted(set(re.findall(r"\b(ncclEp[A-Za-z0-9_]+)\s*\(", code)))


def _module():
    found = glob.glob(os.path.join(PACKAGE_DIR, "_C.*so"))
    assert len(found) == 1, f"expected one _C module in {PACKAGE_DIR}, found {found}"
    return found[0]


def test_library_has_a_file_name_and_soname_of_its_own():
    info = elf_dynamic.read(LIBRARY)
    assert info.soname == "libmegatron_nccl_ep.so"
    assert not os.path.exists(os.path.join(PACKAGE_DIR, NVIDIA_NAME)), (
        f"{NVIDIA_NAME}, NVIDIA's library's name, is in the package directory")


def test_module_needs_our_library_by_private_names_only():
    info = elf_dynamic.read(_module())
    assert "libmegatron_nccl_ep.so" in info.needed, info.needed
    assert not [n for n in info.needed if n.startswith(NVIDIA_NAME)], info.needed
    wanted = {s.name for s in info.symbols if not s.defined}
    assert not sorted(n for n in wanted if n.startswith("ncclEp")), (
        "_C references public ncclEp* names, which another loaded library may define")
    assert {PRIVATE_PREFIX + "ncclEpCreateGroup", PRIVATE_PREFIX + "ncclEpGetLastError"} <= wanted


def test_library_binds_its_own_calls_and_aliases_every_function():
    info = elf_dynamic.read(LIBRARY)
    assert info.symbolic, "libmegatron_nccl_ep.so is not linked with -Bsymbolic"
    api = [n for n in info.relocated if n.startswith(("ncclEp", PRIVATE_PREFIX))]
    assert not api, f"calls the loader may bind elsewhere: {sorted(api)}"
    address = {s.name: s.value for s in info.symbols if s.defined}
    for name in _declared():
        assert address.get(PRIVATE_PREFIX + name) == address[name], (
            f"{PRIVATE_PREFIX}{name} is not an alias of {name}")


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    """A libnccl_ep.so (soname libnccl_ep.so) that defines every function of our header's names:
    each fails with ncclInternalError and a message of its own; ncclEpGetVersion says 100."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc or gcc) here to build the stand-in libnccl_ep.so")
    directory = tmp_path_factory.mktemp("nvidia")
    source = directory / "stub.c"
    lines = ['const char* ncclEpGetLastError(void) { return "stub libnccl_ep.so"; }',
             f"int ncclEpGetVersion(int* v) {{ *v = {STUB_VERSION}; return 0; }}"]
    lines += [f"int {name}(void) {{ return 3; }}" for name in _declared()
              if name not in ("ncclEpGetLastError", "ncclEpGetVersion")]
    source.write_text("\n".join(lines) + "\n")
    library = directory / NVIDIA_NAME
    done = subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source),
                           f"-Wl,-soname,{NVIDIA_NAME}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(library)


PROBE = textwrap.dedent("""
    import ctypes, json, sys
    stub = ctypes.CDLL(sys.argv[1], mode=getattr(ctypes, sys.argv[2]))
    import torch
    from megatron_nccl_ep import _C
    config = _C.GroupConfig()
    for name, value in dict(num_experts=8, hidden=128, max_tokens_per_rank=16, max_topk=2,
                            token_dtype=torch.bfloat16, num_sms=24,
                            timeout_ms=1000).items():
        setattr(config, name, value)
    try:
        _C.create_group(0, config, 0)
        error = "create_group(comm=0) succeeded"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    version = ctypes.c_int()
    stub.ncclEpGetVersion(ctypes.byref(version))
    maps = open("/proc/self/maps").read()
    print(json.dumps(dict(error=error, last_error=_C.get_last_error(), stub_version=version.value,
                          ours_mapped="libmegatron_nccl_ep.so" in maps)))
""")


@pytest.mark.parametrize("mode", ["RTLD_LOCAL", "RTLD_GLOBAL"])
def test_a_libnccl_ep_loaded_first_does_not_stand_in_for_ours(stub, mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(PACKAGE_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-c", PROBE, stub, mode], capture_output=True,
                          text=True, env=env, cwd=os.path.dirname(PACKAGE_DIR), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["ours_mapped"], "libmegatron_nccl_ep.so was not loaded"
    assert seen["error"].startswith("ValueError: ncclEpCreateGroup: comm is NULL"), seen
    assert "comm is NULL" in seen["last_error"], seen
    assert seen["stub_version"] == STUB_VERSION, "the stand-in lost its own ncclEpGetVersion"
