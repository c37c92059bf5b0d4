"""PNG of the sweeps (``--plot``; needs matplotlib).

On GPUs: kernel-mode time, and the physical and HBM bandwidth of dispatch and combine, against
tokens per rank and/or SMs, with the ceilings of the same run as horizontal lines. On cpu: the
host wall time alone (bandwidth over gloo says nothing about the kernels).
"""

from __future__ import annotations

import math
import os

from .runner import item_name
from .sweeps import series, sweep_mode


def write(result: dict, path: str) -> str:
    """Writes the PNG; returns a line saying what was written, or why nothing was."""
    if not result["sweeps"]:
        return f"no plot: no sweep in this run (--sweep-tokens, --sweep-sms); {path} not written"
    try:
        import matplotlib
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install matplotlib); {path} not written"
    matplotlib.use("Agg")  # benchmark hosts have no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    shape, meta = result["shape"], result["meta"]
    mode = sweep_mode(result)
    cuda = mode == "kernel"
    panels = series(result)
    ceilings = {name: row["phys_GBps"] for name, row in (result.get("ceilings") or {}).items()
                if row.get("phys_GBps")}
    rows = 2 if cuda else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(7 * len(panels), 4 * rows),
                             squeeze=False)
    for col, (xlabel, points) in enumerate(panels):
        time_ax = axes[0][col]
        bw_ax = axes[1][col] if cuda else None
        xs = sorted(x for x, _ in points)
        for op in ("dispatch", "combine"):
            item = item_name(op, mode)
            measured = sorted((x, items[item]) for x, items in points if item in items)
            x_values = [x for x, _ in measured]
            scale = 1e3 if cuda else 1.0
            time_ax.plot(x_values, [row["median_ms"] * scale for _, row in measured], marker="o",
                         label=op)
            if bw_ax is None:
                continue
            line, = bw_ax.plot(x_values, [row.get("phys_GBps") or math.nan for _, row in measured],
                               marker="o", label=f"{op}, physical")
            bw_ax.plot(x_values, [row.get("hbm_GBps", math.nan) for _, row in measured],
                       marker="s", linestyle=":", color=line.get_color(),
                       label=f"{op}, HBM (tokens + rows once)")
        time_ax.set_ylabel("kernel time (us)" if cuda else "host wall time (ms)")
        if bw_ax is not None:
            for i, (name, gbps) in enumerate(ceilings.items()):
                bw_ax.axhline(gbps, color=f"C{2 + i}", linestyle="--", linewidth=1,
                              label=f"{name}: {gbps:.0f}")
            bw_ax.set_ylabel("GB/s per rank")
            # The ceilings span HBM (TB/s) to one link (tens of GB/s).
            bw_ax.set_yscale("log")
        for ax in (time_ax, bw_ax):
            if ax is None:
                continue
            if xlabel == "tokens per rank":
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])  # the swept values, not powers of 2
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    if cuda:
        where = (f"{shape['ranks']} x {meta.get('device_name', '?')}, backend {shape['backend']}, "
                 f"kernel mode")
        fixed = f"{shape['tokens']} tokens/rank and {shape['num_sms']} SMs where not swept"
    else:
        where = (f"cpu, {shape['ranks']} gloo processes, backend {shape['backend']}, host wall "
                 f"time (shows that the code runs, not GPU speed)")
        fixed = f"{shape['tokens']} tokens/rank where not swept"
    fig.suptitle(f"{where}\n{shape['hidden']} hidden, top-{shape['topk']} of "
                 f"{shape['experts']} experts, {shape['dtype']}; {fixed}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
