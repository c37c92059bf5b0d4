"""What the machine is, read once in the parent: the JSON's ``meta`` and the GPU's SM count
(``--sweep-sms all``, the team section's limits) come from ``machine_info``."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from typing import Optional


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> Optional[str]:
    """The NVIDIA driver's version as nvidia-smi reports it; None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


@functools.lru_cache(maxsize=None)
def machine_info(device: str) -> dict:
    """The machine's facts (read once; do not change the dict): GPU 0 and the visible GPUs on
    cuda (this initialises CUDA in the calling process), the CPU on cpu (no CUDA)."""
    if device != "cuda":
        return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "device_name": "cpu",
                "gpu_count": 0}
    import torch

    props = torch.cuda.get_device_properties(0)
    version = torch.cuda.nccl.version()
    return {"device_name": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
            "sm_count": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "cuda_runtime": torch.version.cuda,
            "nccl": ".".join(map(str, version)) if isinstance(version, tuple) else version,
            "driver": _driver_version()}
