"""``python -m megatron_nccl_ep.launch SCRIPT [ARGS...]``: runs a Megatron training script
unchanged, with ``nccl_ep`` registered (``--moe-token-dispatcher-type nccl_ep`` and the
``--nccl-ep-*`` flags). Works under torchrun: ``torchrun ... -m megatron_nccl_ep.launch SCRIPT``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from .options import add_arguments

COMMAND = "python -m megatron_nccl_ep.launch SCRIPT [ARGS...]"
USAGE = f"usage: {COMMAND}"
ABOUT = """Runs SCRIPT, a Megatron training script, with the nccl_ep token dispatcher registered:
SCRIPT then accepts --moe-token-dispatcher-type nccl_ep and the flags below, next to Megatron's
own. Megatron-LM's scripts (pretrain_gpt.py, ...) come from its repository
(https://github.com/NVIDIA/Megatron-LM), not from the megatron-core wheel; SCRIPT --help lists
Megatron's flags."""


def help_text() -> str:
    """The usage, what the launcher does, and the --nccl-ep-* flags (no torch or Megatron import)."""
    parser = argparse.ArgumentParser(usage=COMMAND,
                                     description=ABOUT, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(parser).format_help()


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text() if argv else USAGE)
        raise SystemExit(0 if argv else 2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"{USAGE}\nno such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    from .megatron import register

    register()
    # The script sees itself as argv[0] and its directory first on sys.path, as with `python`.
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
