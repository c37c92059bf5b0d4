"""The C API as a product surface: examples/c_api/dispatch_combine.c, built against
libmegatron_nccl_ep.so (examples/c_api/build.sh), runs on the GPU machine: a local team of 2 and
of 4 ranks on GPU 0, and one rank per visible GPU over NCCL. It checks its own results (receive
counts, combine(dispatch(x)))."""

import os
import subprocess
import sys

import pytest
import torch

from gpu_common import requires_gpus

pytestmark = requires_gpus

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    binary = tmp_path_factory.mktemp("c_api") / "dispatch_combine"
    done = subprocess.run(["bash", os.path.join(ROOT, "examples", "c_api", "build.sh"),
                           str(binary)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout + done.stderr
    return str(binary)


@pytest.mark.parametrize("args", [["--local-team", "2"], ["--local-team", "4"], []],
                         ids=["local_team_2", "local_team_4", "nccl_one_rank_per_gpu"])
def test_c_example_runs(example, args, summary_line):
    done = subprocess.run([example] + args, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("PASSED"), (
        done.stdout + done.stderr)
    summary_line(f"{' '.join(args) or f'{torch.cuda.device_count()} GPU(s) over NCCL'}: "
                 f"{lines[0]}")
