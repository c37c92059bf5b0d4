"""The standalone microbenchmarks (benchmarks/micro/*.cu) still compile against the library's
kernel headers they include, with the GPU script's nvcc line: a change of a device helper's
signature otherwise shows only on the GPU machine, as a lost micro stage. Skipped where nvcc is
absent."""

import glob
import os
import shutil
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICROS = sorted(glob.glob(os.path.join(REPO_ROOT, "benchmarks", "micro", "*.cu")))


def _nvcc():
    cuda_nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return shutil.which("nvcc") or (cuda_nvcc if os.path.exists(cuda_nvcc) else None)


def _nccl_include():
    import nvidia

    found = [d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, "nccl", "include"))]
    return found[0] if found else None


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc here: the microbenchmarks are not compiled")
@pytest.mark.parametrize("path", MICROS, ids=[os.path.basename(p) for p in MICROS])
def test_micro_compiles(path, tmp_path):
    cmd = [_nvcc(), "-c", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
           "-o", str(tmp_path / "micro.o"), path]
    include = _nccl_include()
    if include:
        cmd[1:1] = ["-I", include]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
