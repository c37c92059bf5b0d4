"""The training example (examples/train_moe.py) under torchrun with 2 processes on gloo: the loss
goes down, and a rerun gives the same loss bits."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "train_moe.py")
FINAL = re.compile(r"loss: first \d+ steps (\S+), last \d+ steps (\S+) \((down|NOT down)\); "
                   r"final loss \S+ bits (\S+)")


def train(*args: str) -> tuple:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", EXAMPLE, "--steps", "30", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stdout + result.stderr
    steps = re.findall(r"step +(\d+)/30 +loss (\S+)", result.stdout)
    assert [int(s) for s, _ in steps] == list(range(1, 31)), result.stdout
    found = FINAL.search(result.stdout)
    assert found, result.stdout
    first, last, verdict, bits = found.groups()
    return float(first), float(last), verdict, bits


def test_example_trains_and_is_deterministic(seed):
    first, last, verdict, bits = train("--seed", str(seed))
    assert verdict == "down" and last < first - 0.5, (first, last)
    assert train("--seed", str(seed))[3] == bits, "a rerun gave different loss bits"


def test_example_capacity_mode_trains(seed):
    first, last, verdict, _ = train("--recv-mode", "capacity", "--seed", str(seed))
    assert verdict == "down" and last < first - 0.5, (first, last)
