"""Runs one of Megatron-LM's own training scripts (its ``pretrain_gpt.py``, unchanged) through
``python -m megatron_nccl_ep.launch``, with examples/pretrain_gpt_moe.py's default flags first
and the lines examples/check_training.py reads: the exact step line after every iteration, the
graph-capture line and the capacity budget's high-water mark at the end.

    torchrun --standalone --nproc-per-node 1 examples/run_megatron_lm.py \\
        Megatron-LM/pretrain_gpt.py --moe-grouped-gemm --nccl-ep-recv-mode capacity

SCRIPT comes from a checkout of https://github.com/NVIDIA/Megatron-LM (the tag of the installed
megatron-core); its imports beside it (``gpt_builders.py``, ``model_provider.py``) must be there
too. Without the checkout's ``megatron/`` folder next to it, Megatron comes from the
megatron-core wheel, whose dataset helpers are built but lack their Makefile: pretrain() would
run ``make`` and stop, so built helpers are used as they are (pretrain_gpt_moe's workaround).
"""

from __future__ import annotations

import os
import sys

import pretrain_gpt_moe  # (this folder is on sys.path when this file runs as a script)

from megatron_nccl_ep.launch import main as launch


def main(argv: list) -> None:
    if not argv:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [FLAGS...]")
    script, flags = argv[0], argv[1:]
    pretrain_gpt_moe.prepare_run()
    launch([script, *pretrain_gpt_moe.default_arguments(int(os.environ.get("WORLD_SIZE", "1"))),
            *flags])
    pretrain_gpt_moe.print_budget_high_water()


if __name__ == "__main__":
    main(sys.argv[1:])
