"""The test suite on a machine without a CUDA GPU (CUDA_VISIBLE_DEVICES empty, so that a GPU
machine checks it too): ``pytest tests`` does not collect tests/gpu/ and says so in one line; a
file of tests/gpu/ named on the command line (as tests/gpu/run.sh names them) is collected."""

import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
GPU_FILES = sorted(f for f in os.listdir(os.path.join(TESTS_DIR, "gpu"))
                   if f.startswith("test_") and f.endswith(".py"))


def collect(*paths: str) -> tuple:
    """The node ids ``pytest --collect-only`` lists for ``paths``, and its other lines."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", *paths], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    return [x for x in lines if "::" in x], [x for x in lines if "::" not in x]


def test_gpu_files_are_left_out_without_a_gpu_in_one_line():
    ids, others = collect("tests")
    assert len(GPU_FILES) >= 10 and ids
    assert not [i for i in ids if i.startswith("tests/gpu/")]
    assert any(i.startswith("tests/test_gpu_collection.py::") for i in ids)
    said = [x for x in others if x.startswith("tests/gpu:")]
    assert said == [f"tests/gpu: {len(GPU_FILES)} files not collected: no CUDA GPU "
                    "(torch.cuda.is_available() is False); on a GPU machine: "
                    "bash tests/gpu/run.sh (docs/gpu_tests.md)"], others


def test_gpu_file_named_on_the_command_line_is_collected():
    ids, others = collect("tests/gpu/test_cuda_lean_path.py", "tests/test_gpu_collection.py")
    assert any(i.startswith("tests/gpu/test_cuda_lean_path.py::") for i in ids), ids
    assert not [x for x in others if x.startswith("tests/gpu:")], others
