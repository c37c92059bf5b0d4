"""Build of megatron_nccl_ep.

The package itself is pure Python. The CUDA backend is the C library ``libnccl_ep.so`` (csrc/:
the C/CUDA library behind csrc/include/nccl_ep.h) and the pybind11 module ``megatron_nccl_ep._C``
over it, both built into the package directory with nvcc where they can run (a GPU is visible) or
when asked (NCCL_EP_BUILD_EXT=1, as CI does for its compile check), given nvcc and the NCCL
headers; otherwise a reference-only package is installed and a notice says why.

    pip install --no-build-isolation -e .     # from the project venv
    python setup.py build_ext --inplace       # compile check (also used by CI)

NCCL comes from the ``nvidia-nccl-cu13`` wheel next to torch (site-packages/nvidia/nccl/{include,
lib}); the extension links that libnccl.so.2 with an rpath to its directory, so the process uses
the NCCL torch already loaded. CUDA runtime: linked statically (no libtorch, no libcudart.so).

Environment knobs: NCCL_EP_CUDA_ARCHS (default "90"; e.g. "90;100"), NCCL_INCLUDE_DIR /
NCCL_LIB_DIR (override the wheel), CUDA_HOME, NCCL_EP_WERROR=1 (warnings are errors),
NCCL_EP_PTXAS_VERBOSE=1 (register/smem report), NCCL_EP_TRACE=1 (per-role timers printed by the
op kernels, csrc/kernels/exchange.cuh; rebuild with --force when toggling), NCCL_EP_BUILD_EXT (auto: when a GPU is visible
(default); 1: always; 0: never, reference-only), MAX_JOBS.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
LIBRARY = "libnccl_ep.so"  # the C library, next to the Python module


def _nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
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
    raise RuntimeError("CUDA toolkit headers not found: set CUDA_HOME")


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


def _pybind11_include():
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        return None


def _why_no_extension():
    wanted = os.environ.get("NCCL_EP_BUILD_EXT", "auto")
    if wanted not in ("auto", "0", "1"):
        raise SystemExit(f"NCCL_EP_BUILD_EXT must be auto, 0 or 1, got {wanted!r}")
    if wanted == "0":
        return "NCCL_EP_BUILD_EXT=0"
    if wanted == "auto" and not glob.glob("/dev/nvidia[0-9]*"):
        return "no GPU visible on this machine; NCCL_EP_BUILD_EXT=1 compiles it anyway"
    if _nvcc() is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if _nccl_dirs()[0] is None:
        return "NCCL headers/library not found (install nvidia-nccl-cu13 or set NCCL_INCLUDE_DIR " \
               "and NCCL_LIB_DIR)"
    if _pybind11_include() is None:
        return "pybind11 not installed"
    return None


class BuildExt(build_ext):
    """Compiles csrc/ with nvcc (.cu) and the host compiler (.cc), in parallel, links the C
    library ``libnccl_ep.so`` (public header only: ``ncclEp*`` symbols exported) and the pybind11
    module ``_C`` against it (rpath $ORIGIN: both sit in the package directory). Objects are
    reused when newer than their source and every header."""

    def build_extension(self, ext):
        nvcc = _nvcc()
        cuda_home = _cuda_home(nvcc)
        nccl_inc, nccl_lib = _nccl_dirs()
        cxx = os.environ.get("CXX", "g++")
        cuda_inc = os.path.join(cuda_home, "include")
        lib_dirs = [os.path.join(cuda_home, "lib64"),
                    os.path.join(cuda_home, "targets", "x86_64-linux", "lib"),
                    os.path.join(cuda_home, "lib"),
                    os.path.join(os.path.dirname(nccl_lib), "..", "cu13", "lib")]
        cuda_lib = next((d for d in lib_dirs
                         if os.path.exists(os.path.join(d, "libcudart_static.a"))), None)
        if cuda_lib is None:
            raise RuntimeError(f"libcudart_static.a not found under {cuda_home}")
        archs = [a.strip() for a in os.environ.get("NCCL_EP_CUDA_ARCHS", "90").split(";")
                 if a.strip()]
        werror = os.environ.get("NCCL_EP_WERROR") == "1"
        warn = ["-Wall", "-Wextra", "-Wno-missing-field-initializers"] + (["-Werror"] if werror
                                                                          else [])
        includes = ["-I" + os.path.join(CSRC, "include"), "-isystem", nccl_inc, "-isystem",
                    cuda_inc]
        build_dir = os.path.join(os.path.abspath(self.build_temp), "nccl_ep")
        os.makedirs(build_dir, exist_ok=True)
        headers = glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True) + \
            glob.glob(os.path.join(CSRC, "**", "*.cuh"), recursive=True)
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)

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
                cmd = [cxx, "-c", src, "-o", obj, "-std=c++17", "-O2", "-fPIC",
                       "-fvisibility=hidden"] + warn + includes
                if "bindings" in src:
                    cmd += ["-I" + _pybind11_include(), "-I" + sysconfig.get_paths()["include"]]
            fresh = os.path.exists(obj) and \
                os.path.getmtime(obj) > max(os.path.getmtime(src), newest_header)
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
        # The C library: the CUDA runtime linked in statically, libnccl.so.2 found through an
        # rpath to the wheel's lib dir as found now and to its place relative to an installed
        # package (site-packages/megatron_nccl_ep/ -> site-packages/nvidia/nccl/lib).
        lib = os.path.join(out_dir, LIBRARY)
        version_script = os.path.join(build_dir, "exports.map")
        with open(version_script, "w") as f:
            f.write("{ global: ncclEp*; local: *; };\n")
        link = [cxx, "-shared", "-o", lib, f"-Wl,-soname,{LIBRARY}",
                f"-Wl,--version-script={version_script}"] + library_objects + [
            "-L" + nccl_lib, "-l:libnccl.so.2", "-L" + cuda_lib, "-lcudart_static", "-ldl",
            "-lrt", "-lpthread", "-Wl,-rpath," + nccl_lib,
            "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib"]
        print(" ".join(link), flush=True)
        subprocess.check_call(link)
        # The Python module: the bindings over libnccl_ep.so (NCCL's types only, no CUDA calls).
        link = [cxx, "-shared", "-o", out] + binding_objects + [
            "-L" + out_dir, "-l:" + LIBRARY, "-L" + nccl_lib, "-l:libnccl.so.2",
            "-Wl,-rpath,$ORIGIN", "-Wl,-rpath," + nccl_lib,
            "-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib"]
        print(" ".join(link), flush=True)
        subprocess.check_call(link)

    def get_outputs(self):
        outputs = super().get_outputs()
        return outputs + [os.path.join(os.path.dirname(o), LIBRARY) for o in outputs[:1]]

    def copy_extensions_to_source(self):
        # In-place and editable builds: the library goes next to the module it serves.
        built = os.path.join(self.build_lib, "megatron_nccl_ep", LIBRARY)
        super().copy_extensions_to_source()
        package_dir = self.get_finalized_command("build_py").get_package_dir("megatron_nccl_ep")
        # Replaced, not overwritten: a running process may have the old file mapped.
        target = os.path.join(package_dir, LIBRARY)
        shutil.copy2(built, target + ".tmp")
        os.replace(target + ".tmp", target)


def _extensions():
    reason = _why_no_extension()
    if reason is not None:
        print(f"megatron_nccl_ep: building without the CUDA extension ({reason}); only the "
              "reference (torch) backend will be available.", file=sys.stderr)
        return [], {}
    sources = sorted(glob.glob(os.path.join(CSRC, "runtime", "*.cc")) +
                     glob.glob(os.path.join(CSRC, "kernels", "*.cu")) +
                     glob.glob(os.path.join(CSRC, "bindings", "*.cc")))
    return [Extension("megatron_nccl_ep._C", sources=sources)], {"build_ext": BuildExt}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron_nccl_ep",
    version="0.1.0",
    description="Deterministic expert-parallel dispatch/combine (NCCL EP style) for Megatron-Core",
    packages=find_packages(include=["megatron_nccl_ep", "megatron_nccl_ep.*"]),
    python_requires=">=3.12",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
