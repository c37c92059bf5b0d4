"""Whether this install's CUDA library (libmegatron_nccl_ep.so and the module ``_C``) was built,
and why not: setup.py records the outcome in ``_build_status.json`` beside this file. The tests
that need the library skip with ``not_built_reason()``, ``cuda_backend.unavailable_reason()``
gives it, and scripts/setup_venv.sh prints the line of ``summary()``:

    python -m megatron_nccl_ep.build_info [--require-built]   # exit status 1 when not built

Standard library only, and no import of the package's other modules (no torch).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Optional

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
STATUS_FILE = os.path.join(PACKAGE_DIR, "_build_status.json")
LIBRARY = "libmegatron_nccl_ep.so"


def status() -> Optional[dict]:
    """The record setup.py wrote (keys: built, reason, remedy, NCCL_EP_BUILD_EXT, nvcc,
    library), or None where there is none."""
    try:
        with open(STATUS_FILE) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def built_files() -> list:
    """The CUDA library and the module _C as they are in the package directory now."""
    return sorted(glob.glob(os.path.join(PACKAGE_DIR, LIBRARY)) +
                  glob.glob(os.path.join(PACKAGE_DIR, "_C.*so")))


def not_built_reason() -> Optional[str]:
    """None where the CUDA library was built; else why not, and what builds it."""
    why = _why_not_built()
    return None if why is None else f"the CUDA library was not built: {why}"


def _why_not_built() -> Optional[str]:
    record = status()
    if record is None:
        if built_files():
            return None  # built by a setup.py that kept no record; its import tells the rest
        return (f"the package directory has neither it nor setup.py's record "
                f"({os.path.basename(STATUS_FILE)}); run scripts/setup_venv.sh")
    if record.get("built"):
        return None
    return (f"{record.get('reason') or 'no reason recorded'} when the package was installed; "
            f"{record.get('remedy') or 'rerun scripts/setup_venv.sh'}")


def summary() -> tuple:
    """(whether the library and _C are there to use, one line saying so or why not)."""
    why = _why_not_built()
    if why is not None:
        return False, (f"CUDA library: NOT built: {why}. Until then only the reference (torch) "
                       "backend is available, and the tests that need the library skip.")
    files = built_files()
    if len(files) < 2:
        return False, (f"CUDA library: recorded as built, but {os.path.basename(PACKAGE_DIR)}/ "
                       f"lacks {LIBRARY} or _C; rerun scripts/setup_venv.sh")
    record = status() or {}
    how = f" (NCCL_EP_BUILD_EXT={record.get('NCCL_EP_BUILD_EXT')}, nvcc {record.get('nvcc')})" \
        if record else ""
    names = ", ".join(os.path.relpath(p, os.path.dirname(PACKAGE_DIR)) for p in files)
    return True, f"CUDA library: built: {names}{how}"


if __name__ == "__main__":
    usable, line = summary()
    print(line)
    sys.exit(1 if "--require-built" in sys.argv[1:] and not usable else 0)
