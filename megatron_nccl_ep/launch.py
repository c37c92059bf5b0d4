"""``python -m megatron_nccl_ep.launch SCRIPT [ARGS...]``: runs a Megatron training script
unchanged, with ``nccl_ep`` registered (``--moe-token-dispatcher-type nccl_ep`` and the
``--nccl-ep-*`` flags). Works under torchrun: ``torchrun ... -m megatron_nccl_ep.launch SCRIPT``.
"""

from __future__ import annotations

import os
import runpy
import sys

from .megatron import register

USAGE = "usage: python -m megatron_nccl_ep.launch SCRIPT [ARGS...]"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"{USAGE}\nno such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    register()
    # The script sees itself as argv[0] and its directory first on sys.path, as with `python`.
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
