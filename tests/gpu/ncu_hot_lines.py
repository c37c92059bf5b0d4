"""The hottest source lines of an Nsight Compute source page (``ncu --import R --page source
--csv --print-source cuda``, or ``sass``: instructions by address): the lines with the most
warp-stall samples, with their share, or, where the page has no sampling column, the lines that
executed the most instructions.

    python tests/gpu/ncu_hot_lines.py source.csv [lines]

The page holds one block per kernel; each block's top lines are printed under its header."""
import csv
import sys


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


# The columns a line is ranked by, in order of preference: (name part, what it counts).
RANKINGS = (("Sampling (All", "warp-stall samples"), ("Instructions Executed", "instructions executed"))


def _ranking(row: list):
    """(column index, what it counts) of the first RANKINGS column this header row holds."""
    for part, what in RANKINGS:
        for i, cell in enumerate(row):
            if part in cell:
                return i, what
    return None


def hot_lines(rows: list, top: int) -> list:
    """Printable lines: for every header row naming a ranking column, the top rows below it
    (until the next header) by that column."""
    out, header, block = [], None, []

    def flush():
        if header is None or not block:
            return
        column, what = _ranking(header)
        total = sum(_number(r[column]) for r in block if len(r) > column) or 1.0
        source = next((i for i, name in enumerate(header) if name.strip() == "Source"), -1)
        # Where a row is: a source line ("#", "Line") or, on a SASS page, an instruction address.
        line = next((i for i, name in enumerate(header)
                     if name.strip() in ("#", "Line") or "Address" in name), 0)
        where = "address" if "Address" in header[line] else "line"
        ranked = sorted((r for r in block if len(r) > column), key=lambda r: -_number(r[column]))
        out.append(f"-- {total:.0f} {what}; top {min(top, len(ranked))} lines")
        for r in ranked[:top]:
            text = r[source].strip() if source >= 0 else ""
            out.append(f"{100 * _number(r[column]) / total:6.2f}%  {where} {r[line]:>5}  {text[:110]}")

    for row in rows:
        if _ranking(row) is not None:
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
    if lines:
        print("\n".join(lines))
    else:  # say what the page holds instead, so that the next run can ask for the right thing
        print("no sampling or instruction column in the source page; its first rows:")
        for row in rows[:3]:
            print(" | ".join(row)[:400])


if __name__ == "__main__":
    main()
