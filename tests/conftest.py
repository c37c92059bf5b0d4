"""Shared pytest setup: import paths for the test helpers, fresh seeds, and the process pools."""

import os
import secrets
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
EXAMPLES_DIR = os.path.join(REPO_ROOT, "examples")
# The helpers (dist.py, dense.py, ep_cases.py) are imported by plain name from every test module,
# including tests/gpu/, whatever import mode pytest runs with; so are the examples' modules
# (device_local_router.py).
for path in (EXAMPLES_DIR, REPO_ROOT, TESTS_DIR):
    if path not in sys.path:
        sys.path.insert(0, path)

# Before the test modules' megatron.core imports: the package's import drops torch's "No CUDA
# runtime is found" notice (megatron_nccl_ep/__init__.py); tests/dist.py does so in the ranks.
import megatron_nccl_ep  # noqa: E402,F401

GPU_TESTS_DIR = os.path.join(TESTS_DIR, "gpu")
# The GPU test files tests/gpu/ left out of this run (no CUDA GPU), and why.
_GPU_FILES_LEFT_OUT = pytest.StashKey[tuple]()


def _no_cuda_gpu_reason():
    """Why tests/gpu/ cannot run here, or None where a CUDA GPU is visible. A GPU machine whose
    extension is not built still collects them: their skips name what is missing."""
    import torch

    if torch.cuda.is_available():
        return None
    return "no CUDA GPU (torch.cuda.is_available() is False)"


def pytest_ignore_collect(collection_path, config):
    """tests/gpu/ is not collected on a machine without a CUDA GPU when pytest reaches it from a
    folder above (``pytest tests``): every test there needs one. Named on the command line
    (``pytest tests/gpu``, its files, tests/gpu/run.sh), it is collected anyway: pytest does not
    ask this hook about the paths it was given nor their parents; its tests then skip with their
    reasons."""
    if collection_path.name != "gpu" or not os.path.samefile(collection_path, GPU_TESTS_DIR):
        return None
    reason = _no_cuda_gpu_reason()
    if reason is None:
        return None
    # pytest also asks of folders beside a file it was given (``pytest tests/test_x.py``), which
    # it would not collect anyway: only a given folder above tests/gpu/ leaves tests out.
    given = [os.path.join(config.invocation_params.dir, arg.split("::")[0]) for arg in config.args]
    gpu_dir = os.path.realpath(GPU_TESTS_DIR)
    if any(gpu_dir.startswith(os.path.join(os.path.realpath(path), "")) for path in given):
        files = [p for p in os.listdir(GPU_TESTS_DIR)
                 if p.startswith("test_") and p.endswith(".py")]
        config.stash[_GPU_FILES_LEFT_OUT] = (len(files), reason)
    return True


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_GPU_FILES_LEFT_OUT, None)
    if left_out is not None:
        count, reason = left_out
        terminalreporter.write_line(
            f"tests/gpu: {count} files not collected: {reason}; on a GPU machine: "
            "bash tests/gpu/run.sh (docs/gpu_tests.md)")


@pytest.fixture
def seed(request):
    """A fresh random seed per test, printed so that a failure can be replayed."""
    value = int(os.environ.get("NCCL_EP_TEST_SEED", "0")) or secrets.randbelow(2**31 - 1) + 1
    print(f"{request.node.nodeid}: seed={value} (replay: NCCL_EP_TEST_SEED={value})")
    return value


@pytest.fixture(scope="session", autouse=True)
def _shutdown_process_pools():
    yield
    if "dist" in sys.modules:
        sys.modules["dist"].shutdown_all()


@pytest.fixture
def summary_line(request):
    """Prints one summary line for the test, shown even under -q and output capture."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def emit(text: str) -> None:
        print(text)
        if reporter is not None:
            reporter.write_line(f"[{request.node.name}] {text}")

    return emit
