"""The library's defaults and bounds, read from its header ``nccl_ep_limits.h`` (the one place
they are written): the Python checks, the reference backend and the plugin's defaults use the
values the C library is built with. No torch import (the launcher's ``--help`` reads the
defaults).

The header sits in the package (``include/``, where setup.py installs the public headers) or,
in a source checkout, in ``csrc/include/``.
"""

from __future__ import annotations

import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
HEADER_PLACES = (os.path.join(_HERE, "include", "nccl_ep_limits.h"),
                 os.path.join(os.path.dirname(_HERE), "csrc", "include", "nccl_ep_limits.h"))


def read_header(path: str) -> dict:
    """``NCCL_EP_<NAME> <integer>`` macros of ``path``: {"NAME": value}."""
    with open(path) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    return {name: int(value) for name, value in
            re.findall(r"^#define\s+NCCL_EP_([A-Z0-9_]+)\s+(\d+)\s*$", text, re.M)}


def _load() -> dict:
    for path in HEADER_PLACES:
        if os.path.exists(path):
            return read_header(path)
    raise ImportError(f"megatron_nccl_ep: nccl_ep_limits.h not found in {HEADER_PLACES}; "
                      "reinstall the package (pip install .) from its source tree")


_VALUES = _load()
DEFAULT_NUM_SMS: int = _VALUES["DEFAULT_NUM_SMS"]
DEFAULT_TIMEOUT_S: float = _VALUES["DEFAULT_TIMEOUT_MS"] / 1000.0
MAX_SLOTS_PER_RANK: int = _VALUES["MAX_SLOTS_PER_RANK"]
LL_MAX_TOKENS: int = _VALUES["LL_MAX_TOKENS"]
LL_MAX_TOPK: int = _VALUES["LL_MAX_TOPK"]
LL_MAX_EXPERTS: int = _VALUES["LL_MAX_EXPERTS"]
FP8_BLOCK: int = _VALUES["FP8_BLOCK"]
