"""Build of megatron_nccl_ep.

The package itself is pure Python. The CUDA backend is the C library ``libmegatron_nccl_ep.so``
(csrc/: the C/CUDA library behind csrc/include/nccl_ep.h) and the Python module
``megatron_nccl_ep._C`` over it (a torch extension: pybind11 and the tensors from torch's own
headers and libraries, the venv's torch), both built into the package directory with nvcc wherever nvcc,
the CUDA toolkit and the NCCL headers are found (compiling needs no GPU); otherwise a
reference-only package is installed. Either way the outcome, and the reason when the library was
not built, is recorded in megatron_nccl_ep/_build_status.json (megatron_nccl_ep/build_info.py
reads it: scripts/setup_venv.sh prints it, the tests that need the library skip with it).

    pip install --no-build-isolation -e .     # from the project venv (scripts/setup_venv.sh)
    python setup.py build_ext --inplace       # compile only (tests/gpu/run.sh)

NCCL comes from the ``nvidia-nccl-cu13`` wheel next to torch (site-packages/nvidia/nccl/{include,
lib}); the library links that libnccl.so.2 with an rpath to its directory, so the process uses
the NCCL torch already loaded. CUDA runtime: linked statically into the library (which needs
no libtorch and no libcudart.so; only ``_C`` links torch).

The library's file name and soname are its own: ``libnccl_ep.so`` is NVIDIA's NCCL EP library,
whose ``ncclEp*`` functions have our names with other signatures. Our library binds its own calls
to its own definitions (-Bsymbolic) and exports each function a second time under a private name
(``megatron_nccl_ep_ncclEpCreateGroup``, ...), which is the only name ``_C`` references: NVIDIA's
library loaded into the process first, even into the global scope (RTLD_GLOBAL), cannot stand in
for ours (tests/test_library_soname.py).

Environment knobs: NCCL_EP_BUILD_EXT (auto (default): build where nvcc, the CUDA toolkit and the
NCCL headers are found, else install without the library, and also without it if the compile
fails; 1: build or fail the install; 0: never build), NCCL_EP_CUDA_ARCHS (default "90"; e.g.
"90;100"), NCCL_INCLUDE_DIR / NCCL_LIB_DIR (override the wheel), CUDA_HOME, NCCL_EP_WERROR=1
(warnings are errors), NCCL_EP_PTXAS_VERBOSE=1 (register/smem report), NCCL_EP_TRACE=1 (per-role
timers printed by the op kernels, csrc/kernels/exchange.cuh; rebuild with --force when
toggling), MAX_JOBS.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
HEADER = os.path.join(CSRC, "include", "nccl_ep.h")
PACKAGE = "megatron_nccl_ep"
LIBRARY = "libmegatron_nccl_ep.so"  # the C library's file name and soname, next to the module
NVIDIA_LIBRARY = "libnccl_ep.so"  # NVIDIA's NCCL EP library: never a file of this package
PRIVATE_PREFIX = "megatron_nccl_ep_"  # the private second name of every API function
STATUS_FILE = "_build_status.json"  # megatron_nccl_ep/build_info.py reads it
RERUN = "rerun scripts/setup_venv.sh"


class NotBuildable(Exception):
    """Why the CUDA library cannot be built here (``reason``) and what builds it (``remedy``)."""

    def __init__(self, reason, remedy):
        super().__init__(reason)
        self.reason, self.remedy = reason, remedy


def _build_mode():
    mode = os.environ.get("NCCL_EP_BUILD_EXT", "auto")
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"NCCL_EP_BUILD_EXT must be auto, 0 or 1, got {mode!r}")
    return mode


def _nvcc():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_home(nvcc):
    """The toolkit root: CUDA_HOME, else nvcc's grandparent (nvcc may be a wrapper script, so
    also try /usr/local/cuda*), the first that has include/cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            return c
    return None


def _cudart_static_dir(cuda_home, nccl_lib):
    dirs = [os.path.join(cuda_home, "lib64"),
            os.path.join(cuda_home, "targets", "x86_64-linux", "lib"),
            os.path.join(cuda_home, "lib"),
            os.path.join(os.path.dirname(nccl_lib), "..", "cu13", "lib")]
    return next((d for d in dirs if os.path.exists(os.path.join(d, "libcudart_static.a"))), None)


def _nccl_dirs():
    inc, lib = os.environ.get("NCCL_INCLUDE_DIR"), os.environ.get("NCCL_LIB_DIR")
    if inc and lib:
        return inc, lib
    candidates = []
    try:
        import nvidia  # namespace package of the CUDA wheels

        candidates += [os.path.join(p, "nccl") for p in nvidia.__path__]
    except ImportError:
        pass
    candidates += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "nccl"))
    for base in candidates:
        if os.path.exists(os.path.join(base, "include", "nccl.h")) and \
                os.path.exists(os.path.join(base, "lib", "libnccl.so.2")):
            return os.path.join(base, "include"), os.path.join(base, "lib")
    return None, None


def _torch_dirs():
    """(include dirs, lib dir, C++ ABI flag) of the torch this venv has, which the bindings are
    built against (its headers bring pybind11 and the tensor casters); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    root = os.path.dirname(torch.__file__)
    includes = [os.path.join(root, "include"),
                os.path.join(root, "include", "torch", "csrc", "api", "include")]
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    return includes, os.path.join(root, "lib"), abi


def _toolchain():
    """What the build needs, found; raises NotBuildable naming what is missing."""
    if _build_mode() == "0":
        raise NotBuildable("NCCL_EP_BUILD_EXT=0",
                           f"unset NCCL_EP_BUILD_EXT (or set it to 1) and {RERUN}")
    nvcc = _nvcc()
    if nvcc is None:
        raise NotBuildable("nvcc not found (not on PATH, no CUDA_HOME/bin/nvcc)",
                           f"install the CUDA toolkit (nvcc on PATH or CUDA_HOME) and {RERUN}")
    cuda_home = _cuda_home(nvcc)
    if cuda_home is None:
        raise NotBuildable(f"nvcc is {nvcc}, but no CUDA toolkit root with "
                           "include/cuda_runtime.h was found (CUDA_HOME, nvcc's grandparent, "
                           "/usr/local/cuda*)",
                           f"set CUDA_HOME to the toolkit's root and {RERUN}")
    nccl_inc, nccl_lib = _nccl_dirs()
    if nccl_inc is None:
        raise NotBuildable("the NCCL headers and libnccl.so.2 were not found (no nvidia-nccl-cu13 "
                           "wheel beside torch; NCCL_INCLUDE_DIR and NCCL_LIB_DIR unset)",
                           "install requirements.txt (torch brings nvidia-nccl-cu13) or set "
                           f"NCCL_INCLUDE_DIR and NCCL_LIB_DIR, and {RERUN}")
    cudart = _cudart_static_dir(cuda_home, nccl_lib)
    if cudart is None:
        raise NotBuildable(f"libcudart_static.a not found under {cuda_home}",
                           f"install the CUDA toolkit's runtime library and {RERUN}")
    torch_dirs = _torch_dirs()
    if torch_dirs is None:
        raise NotBuildable("torch is not installed (the bindings are a torch extension)",
                           f"install requirements.txt (torch) and {RERUN}")
    return dict(nvcc=nvcc, cuda_home=cuda_home, nccl_inc=nccl_inc, nccl_lib=nccl_lib,
                cudart=cudart, torch=torch_dirs)


def _api_functions():
    """The functions the public header declares (comments stripped first)."""
    with open(HEADER) as f:
        code = re.sub(r"/\*.*?\*/|//[^\n]*", "", f.read(), flags=re.S)
    return sorted(set(re.findall(r"\b(ncclEp[A-Za-z0-9_]+)\s*\(", code)))


def _write_status(package_dirs, built, reason="", remedy=""):
    """Records the outcome in each package directory (replaced, never half-written)."""
    status = {"built": built, "library": LIBRARY, "NCCL_EP_BUILD_EXT": _build_mode(),
              "nvcc": _nvcc(), "reason": reason, "remedy": remedy}
    for d in package_dirs:
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, STATUS_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(status, f, indent=1)
            f.write("\n")
        os.replace(path + ".tmp", path)


def _remove_cuda_outputs(package_dir, keep_ours):
    """Removes NVIDIA's library's name from the package directory and, unless ``keep_ours``, the
    CUDA outputs of an earlier build, so that what the directory holds matches its status."""
    doomed = [os.path.join(package_dir, NVIDIA_LIBRARY)]
    if not keep_ours:
        doomed += [os.path.join(package_dir, LIBRARY)] + \
            glob.glob(os.path.join(package_dir, "_C.*so"))
    for path in doomed:
        if os.path.lexists(path):
            os.remove(path)


def _what_failed(exc):
    """A failed command in a few words: its program and its output file."""
    if isinstance(exc, subprocess.CalledProcessError) and isinstance(exc.cmd, list):
        cmd = exc.cmd
        output = cmd[cmd.index("-o") + 1] if "-o" in cmd[:-1] else "?"
        return (f"{os.path.basename(cmd[0])} exited with status {exc.returncode} making "
                f"{os.path.basename(output)}")
    return str(exc)


def _source_package_dir(command):
    return os.path.join(ROOT, command.get_finalized_command("build_py").get_package_dir(PACKAGE))


class BuildPy(build_py):
    """Installs the public headers into the package's include/ (nccl_ep_limits.h is where
    megatron_nccl_ep/limits.py reads the library's defaults and bounds; an editable install reads
    csrc/include/). Without the CUDA library (no build_ext runs): records why, and clears earlier
    CUDA outputs from the package (the source tree too in editable installs, where it is the
    package)."""

    def run(self):
        super().run()
        include = os.path.join(self.build_lib, PACKAGE, "include")
        os.makedirs(include, exist_ok=True)
        for header in glob.glob(os.path.join(CSRC, "include", "*.h")):
            shutil.copy2(header, include)
        if NOT_BUILT is None:
            return
        dirs = [os.path.join(self.build_lib, PACKAGE)]
        if getattr(self, "editable_mode", False):
            dirs.append(_source_package_dir(self))
        for d in dirs:
            _remove_cuda_outputs(d, keep_ours=False)
        _write_status(dirs, False, NOT_BUILT.reason, NOT_BUILT.remedy)


class BuildExt(build_ext):
    """Compiles csrc/ with nvcc (.cu) and the host compiler (.cc), in parallel, links the C
    library ``libmegatron_nccl_ep.so`` (public header only: the ``ncclEp*`` functions exported,
    each also under its private name) and the module ``_C`` against it and torch (rpath $ORIGIN:
    both sit in the package directory). Objects are reused when newer than their source and
    every header. NCCL_EP_BUILD_EXT=auto: a failed compile installs the package without the
    library and records why."""

    failure = None  # NotBuildable after a failed compile (auto mode)

    def run(self):
        inplace = self.inplace  # build_ext.run leaves it False when the build raises
        try:
            super().run()
        except (subprocess.CalledProcessError, OSError, NotBuildable) as exc:
            if _build_mode() == "1":
                raise
            self.failure = exc if isinstance(exc, NotBuildable) else NotBuildable(
                f"the compile failed ({_what_failed(exc)})",
                "run NCCL_EP_BUILD_EXT=1 scripts/setup_venv.sh to see the compiler's errors")
            print(f"{PACKAGE}: installing without the CUDA library: {self.failure.reason} "
                  "(NCCL_EP_BUILD_EXT=1 makes this an error)", file=sys.stderr)
            dirs = [os.path.join(self.build_lib, PACKAGE)]
            if inplace:
                dirs.append(_source_package_dir(self))
            for d in dirs:
                _remove_cuda_outputs(d, keep_ours=False)
            _write_status(dirs, False, self.failure.reason, self.failure.remedy)

    def build_extension(self, ext):
        tools = TOOLS
        nvcc, nccl_inc, nccl_lib = tools["nvcc"], tools["nccl_inc"], tools["nccl_lib"]
        cxx = os.environ.get("CXX", "g++")
        cuda_inc = os.path.join(tools["cuda_home"], "include")
        archs = [a.strip() for a in os.environ.get("NCCL_EP_CUDA_ARCHS", "90").split(";")
                 if a.strip()]
        werror = os.environ.get("NCCL_EP_WERROR") == "1"
        warn = ["-Wall", "-Wextra", "-Wno-missing-field-initializers"] + (["-Werror"] if werror
                                                                          else [])
        includes = ["-I" + os.path.join(CSRC, "include"), "-isystem", nccl_inc, "-isystem",
                    cuda_inc]
        functions = _api_functions()
        # The bindings call every API function by its private name (the source is unchanged:
        # each name is a macro for the private one, declarations included).
        private_names = [f"-D{name}={PRIVATE_PREFIX}{name}" for name in functions]
        build_dir = os.path.join(os.path.abspath(self.build_temp), "nccl_ep")
        os.makedirs(build_dir, exist_ok=True)
        headers = glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True) + \
            glob.glob(os.path.join(CSRC, "**", "*.cuh"), recursive=True)
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)
        newest_input = max(newest_header, os.path.getmtime(os.path.abspath(__file__)))

        jobs = []
        for src in ext.sources:
            rel = os.path.relpath(src, CSRC).replace(os.sep, "_")
            obj = os.path.join(build_dir, rel + ".o")
            if src.endswith(".cu"):
                cmd = [nvcc, "-c", src, "-o", obj, "-std=c++17", "-O3", "-lineinfo",
                       "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Xcompiler", ",".join(warn),
                       "-Werror=all-warnings" if werror else "-Wno-deprecated-gpu-targets"]
                for a in archs:
                    cmd.append(f"-gencode=arch=compute_{a},code=sm_{a}")
                if os.environ.get("NCCL_EP_PTXAS_VERBOSE") == "1":
                    cmd += ["-Xptxas", "-v"]
                if os.environ.get("NCCL_EP_TRACE") == "1":
                    cmd += ["-DEP_TRACE=1"]
                cmd += includes
            else:
                # The bindings include torch's headers, which need C++20.
                std = "-std=c++20" if "bindings" in src else "-std=c++17"
                cmd = [cxx, "-c", src, "-o", obj, std, "-O2", "-fPIC",
                       "-fvisibility=hidden"] + warn + includes
                if "bindings" in src:
                    torch_includes, _, abi = tools["torch"]
                    cmd += ["-isystem" + d for d in torch_includes]
                    cmd += ["-I" + sysconfig.get_paths()["include"],
                            f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
                    cmd += private_names
            # The bindings' object depends on setup.py too (the private names above).
            newest = newest_input if "bindings" in src else newest_header
            fresh = os.path.exists(obj) and os.path.getmtime(obj) > max(os.path.getmtime(src),
                                                                        newest)
            jobs.append((cmd, obj, fresh, "bindings" in src))

        def run(job):
            cmd, obj, fresh, _ = job
            if fresh and not self.force:
                return obj
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            return obj

        workers = int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            objects = list(pool.map(run, jobs))
        library_objects = [o for o, job in zip(objects, jobs) if not job[3]]
        binding_objects = [o for o, job in zip(objects, jobs) if job[3]]

        out = self.get_ext_fullpath(ext.name)
        out_dir = os.path.dirname(out)
        os.makedirs(out_dir, exist_ok=True)
        _remove_cuda_outputs(out_dir, keep_ours=True)
        # The C library: the CUDA runtime linked in statically, libnccl.so.2 found through an
        # rpath to the wheel's lib dir as found now and to its place relative to an installed
        # package (site-packages/megatron_nccl_ep/ -> site-packages/nvidia/nccl/lib).
        # Exported: the header's functions under their names and their private names (aliases:
        # one address each), and for _C alone the ops' argument checks (csrc/runtime/
        # call_checks.h, megatron_nccl_ep_check_*); -Bsymbolic binds the library's own calls to
        # its own definitions.
        lib = os.path.join(out_dir, LIBRARY)
        version_script = os.path.join(build_dir, "exports.map")
        with open(version_script, "w") as f:
            f.write(f"{{ global: ncclEp*; {PRIVATE_PREFIX}ncclEp*; {PRIVATE_PREFIX}check_*; "
                    "local: *; };\n")
        aliases = [f"-Wl,--defsym={PRIVATE_PREFIX}{name}={name}" for name in functions]
        link = [cxx, "-shared", "-o", lib, f"-Wl,-soname,{LIBRARY}", "-Wl,-Bsymbolic",
                f"-Wl,--version-script={version_script}"] + aliases + library_objects + [
            "-L" + nccl_lib, "-l:libnccl.so.2", "-L" + tools["cudart"], "-lcudart_static",
            "-ldl", "-lrt", "-lpthread", "-Wl,-rpath," + nccl_lib,
            "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib"]
        print(" ".join(link), flush=True)
        subprocess.check_call(link)
        # The Python module: the bindings over the library and torch's libraries (tensors, the
        # current stream), found through rpaths as for NCCL (torch sits beside the package).
        torch_lib = tools["torch"][1]
        link = [cxx, "-shared", "-o", out] + binding_objects + [
            "-L" + out_dir, "-l:" + LIBRARY, "-L" + nccl_lib, "-l:libnccl.so.2",
            "-L" + torch_lib, "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda",
            "-ltorch_python",
            "-Wl,-rpath,$ORIGIN", "-Wl,-rpath," + nccl_lib,
            "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib", "-Wl,-rpath," + torch_lib,
            "-Wl,-rpath,$ORIGIN/../torch/lib"]
        print(" ".join(link), flush=True)
        subprocess.check_call(link)
        _write_status([out_dir], True)

    def get_outputs(self):
        outputs = super().get_outputs()
        if self.failure is not None:
            return []
        return outputs + [os.path.join(os.path.dirname(o), name) for o in outputs[:1]
                          for name in (LIBRARY, STATUS_FILE)]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        return {} if self.failure is not None else mapping

    def copy_extensions_to_source(self):
        # In-place and editable builds: the library and the status go next to the module.
        super().copy_extensions_to_source()
        package_dir = _source_package_dir(self)
        _remove_cuda_outputs(package_dir, keep_ours=True)
        for name in (LIBRARY, STATUS_FILE):
            built = os.path.join(self.build_lib, PACKAGE, name)
            # Replaced, not overwritten: a running process may have the old library mapped.
            target = os.path.join(package_dir, name)
            shutil.copy2(built, target + ".tmp")
            os.replace(target + ".tmp", target)


def _find_toolchain():
    """(the toolchain, None) where the CUDA library is to be built, else (None, NotBuildable);
    NCCL_EP_BUILD_EXT=1 turns NotBuildable into a failed install."""
    try:
        return _toolchain(), None
    except NotBuildable as why:
        if _build_mode() == "1":
            raise SystemExit(f"{PACKAGE}: NCCL_EP_BUILD_EXT=1, but the CUDA library cannot be "
                             f"built: {why.reason}; {why.remedy}") from None
        print(f"{PACKAGE}: installing without the CUDA library ({why.reason}); only the "
              f"reference (torch) backend will be available. To build it: {why.remedy}.",
              file=sys.stderr)
        return None, why


TOOLS, NOT_BUILT = _find_toolchain()
ext_modules = [] if NOT_BUILT is not None else [Extension(
    f"{PACKAGE}._C", sources=sorted(glob.glob(os.path.join(CSRC, "runtime", "*.cc")) +
                                    glob.glob(os.path.join(CSRC, "kernels", "*.cu")) +
                                    glob.glob(os.path.join(CSRC, "bindings", "*.cc"))))]

setup(
    name="megatron_nccl_ep",
    version="0.1.0",
    description="Deterministic expert-parallel dispatch/combine (NCCL EP style) for Megatron-Core",
    packages=find_packages(include=["megatron_nccl_ep", "megatron_nccl_ep.*"]),
    python_requires=">=3.12",
    ext_modules=ext_modules,
    cmdclass={"build_py": BuildPy, "build_ext": BuildExt},
    zip_safe=False,
)
