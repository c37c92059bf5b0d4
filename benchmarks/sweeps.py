"""Sweeps: the kernels section once more per tokens-per-rank value and per SM budget.

Each point is a fresh run of the kernels section in its own processes with its own deadline, so
one that fails costs only itself. The kernels section of the run itself is the point
(--tokens, --num-sms) of both sweeps (``series``).
"""

from __future__ import annotations

import argparse

from .kernels import section as kernels_section
from .cli import sweep_points
from .runner import kernel_mode, run_into


def point_label(tokens: int, num_sms) -> str:
    return f"kernels({tokens} tokens" + (f", {num_sms} SMs)" if num_sms else ")")


def run(result: dict, args: argparse.Namespace, budget_end: float) -> None:
    """Appends one ``{tokens, num_sms, items, checks}`` to ``result['sweeps']`` per point."""
    for tokens, num_sms in sweep_points(args):
        point = argparse.Namespace(**{**vars(args), "tokens": tokens, "num_sms": num_sms})
        items, checks, _ = run_into(result, point_label(tokens, num_sms), kernels_section, point,
                                 budget_end)
        result["sweeps"].append({"tokens": tokens, "num_sms": num_sms, "items": items,
                                 "checks": checks})


def sweep_mode(result: dict) -> str:
    """The timing mode of the sweeps' rows: device time where the device has it."""
    return kernel_mode(result["meta"]["device"])


def series(result: dict) -> list:
    """The plot's panels: (x label, [(x, kernels items)] in x order) for the tokens sweep and/or
    the SMs sweep, the kernels section's own point included."""
    shape, args = result["shape"], result["args"]
    base = [(shape["tokens"], shape["num_sms"], result["kernels"])] if result.get("kernels") else []
    points = base + [(p["tokens"], p["num_sms"], p["items"]) for p in result["sweeps"]]
    panels = []
    if args["sweep_tokens"]:
        by_tokens = {t: items for t, sms, items in points if sms == shape["num_sms"]}
        panels.append(("tokens per rank", sorted(by_tokens.items())))
    if args["sweep_sms"]:
        by_sms = {sms: items for t, sms, items in points if t == shape["tokens"]}
        panels.append(("SMs", sorted(by_sms.items())))
    return panels
