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
