"""The library's defaults, bounds and the numbers of its contract that both languages use, read
from its header ``nccl_ep_limits.h`` (the one place they are written): the Python checks, the
reference backend and the plugin's defaults use the values the C library is built with. No torch
import (the launcher's ``--help`` reads the defaults).

The header sits in the package (``include/``, where setup.py installs the public headers) or,
in a source checkout, in ``csrc/include/``.
"""

from __future__ import annotations

import os
import re

_HERE = os.path.dirname(os.path.abspath(__file__))
HEADER_PLACES = (os.path.join(_HERE, "include", "nccl_ep_limits.h"),
                 os.path.join(os.path.dirname(_HERE), "csrc", "include", "nccl_ep_limits.h"))

_INTEGER = r"\d+"
_HEX_FLOAT = r"0x[0-9a-fA-F]+\.[0-9a-fA-F]*p[+-]?\d+"  # C's hex-float literal, f suffix apart


def read_header(path: str) -> dict:
    """``NCCL_EP_<NAME> <value>`` macros of ``path``: {"NAME": value}, an int for an integer
    literal, a float for a hex-float literal (``0x1.8p3f``: read exactly, as C reads it)."""
    with open(path) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    values = {}
    for name, value in re.findall(rf"^#define\s+NCCL_EP_([A-Z0-9_]+)\s+({_HEX_FLOAT}f?|{_INTEGER})"
                                  rf"\s*$", text, re.M):
        values[name] = (float.fromhex(value.rstrip("f")) if value.lower().startswith("0x")
                        else int(value))
    return values


def _load() -> dict:
    for path in HEADER_PLACES:
        if os.path.exists(path):
            return read_header(path)
    raise ImportError(f"megatron_nccl_ep: nccl_ep_limits.h not found in {HEADER_PLACES}; "
                      "reinstall the package (pip install .) from its source tree")


_VALUES = _load()
# Defaults.
DEFAULT_NUM_SMS: int = _VALUES["DEFAULT_NUM_SMS"]
DEFAULT_TIMEOUT_S: float = _VALUES["DEFAULT_TIMEOUT_MS"] / 1000.0
# Bounds of a group configuration that Python checks (the reference backend; the cuda backend's
# checks are the library's own, config.py).
MAX_NUM_SMS: int = _VALUES["MAX_NUM_SMS"]
MIN_STAGING_DEPTH: int = _VALUES["MIN_STAGING_DEPTH"]
MAX_STAGING_DEPTH: int = _VALUES["MAX_STAGING_DEPTH"]
MAX_STAGING_CHUNK_TOKENS: int = _VALUES["MAX_STAGING_CHUNK_TOKENS"]
LL_MAX_TOKENS: int = _VALUES["LL_MAX_TOKENS"]
LL_MAX_TOPK: int = _VALUES["LL_MAX_TOPK"]
LL_MAX_EXPERTS: int = _VALUES["LL_MAX_EXPERTS"]
# The LL protocol (docs/design.md §9).
LL_PACK_ELEMS: int = _VALUES["LL_PACK_ELEMS"]
LL_BUFFER_SETS: int = _VALUES["LL_BUFFER_SETS"]
# The FP8 payload's cast (fp8.py).
FP8_BLOCK: int = _VALUES["FP8_BLOCK"]
FP8_MAX: int = _VALUES["FP8_MAX"]
FP8_AMAX_FLOOR: float = _VALUES["FP8_AMAX_FLOOR"]  # a float32 value, exactly
