"""The hottest source lines of an Nsight Compute source page (``ncu --import R --page source
--csv --print-source cuda``): the lines with the most warp-stall samples, with their share.

    python tests/gpu/ncu_hot_lines.py source.csv [lines]

The page holds one block per kernel; each block's top lines are printed under its header."""
import csv
import sys


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def hot_lines(rows: list, top: int) -> list:
    """Printable lines: for every header row naming a stall-sampling column, the top rows below
    it (until the next header) by that column."""
    out, header, block = [], None, []

    def flush():
        if header is None or not block:
            return
        samples = next(i for i, name in enumerate(header) if "Sampling (All" in name)
        total = sum(_number(r[samples]) for r in block if len(r) > samples) or 1.0
        source = next((i for i, name in enumerate(header) if name.strip() == "Source"), -1)
        line = next((i for i, name in enumerate(header) if name.strip() in ("#", "Line")), 0)
        ranked = sorted((r for r in block if len(r) > samples), key=lambda r: -_number(r[samples]))
        out.append(f"-- {total:.0f} warp-stall samples; top {min(top, len(ranked))} lines")
        for r in ranked[:top]:
            text = r[source].strip() if source >= 0 else ""
            out.append(f"{100 * _number(r[samples]) / total:6.2f}%  line {r[line]:>5}  {text[:110]}")

    for row in rows:
        if any("Sampling (All" in cell for cell in row):
            flush()
            header, block = row, []
        elif header is not None:
            block.append(row)
    flush()
    return out


def main() -> None:
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.reader(f))
    lines = hot_lines(rows, top)
    print("\n".join(lines) if lines else "no warp-stall sampling column in the source page")


if __name__ == "__main__":
    main()
