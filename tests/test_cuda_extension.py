"""The compiled extension on a machine without a GPU: it loads, speaks the header's API version,
runs on the same NCCL that torch loaded (one NCCL per process), and turns a C error code into a
Python exception carrying the library's reason. Skipped where nvcc is absent (no extension)."""

import os
import re
import shutil

import pytest
import torch

HAS_NVCC = shutil.which("nvcc") is not None or os.path.exists(
    os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"))
pytestmark = pytest.mark.skipif(not HAS_NVCC, reason="no nvcc here: the CUDA extension is not built")

HEADER = os.path.join(os.path.dirname(__file__), "..", "csrc", "include", "nccl_ep.h")


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


def test_error_code_becomes_exception_with_reason(ext):
    bf16 = ext.DTYPES["bfloat16"]
    with pytest.raises(ValueError, match="ncclEpCreateGroup: comm is NULL"):
        ext.create_group(0, 8, 128, 16, 2, bf16, 0, 0, 1, 24, 1000, 0)
    assert "comm is NULL" in ext.get_last_error()
