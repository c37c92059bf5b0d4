"""The training example (examples/train_moe.py) under torchrun with 2 processes on gloo: the loss
goes down, and a rerun gives the same loss bits."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO_ROOT, "examples", "train_moe.py")
FINAL = re.compile(r"loss: first \d+ steps (\S+), last \d+ steps (\S+) \((down|NOT down): by "
                   r"\S+, needs >= 0.25\); final loss \S+ bits (\S+)")


def train(*args: str, steps: int = 30, returncode: int = 0) -> tuple:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", EXAMPLE, "--steps", str(steps), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == returncode, result.stdout + result.stderr
    assert "DEPRECATED" not in result.stdout, result.stdout  # no Megatron noise to read past
    # Nor torch's notice, which megatron.core's import would log in each rank without a GPU.
    assert "No CUDA runtime is found" not in result.stderr, result.stderr
    done = re.findall(rf"step +(\d+)/{steps} +loss (\S+)", result.stdout)
    assert [int(s) for s, _ in done] == list(range(1, steps + 1)), result.stdout
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


def test_example_fails_when_the_loss_does_not_fall(seed):
    # Learning rate 0: the loss moves by batch noise only, which the margin rejects.
    first, last, verdict, _ = train("--lr", "0", "--seed", str(seed), steps=10, returncode=1)
    assert verdict == "NOT down" and abs(first - last) < 0.25, (first, last)
