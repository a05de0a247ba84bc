"""The Markdown table the benchmark scripts print (`from md_table import md_table`, same folder).

    md_table(["model", "ms"], [["0.5B", "78.4"]], align="l r")
    -> '| model | ms |\n|---|---:|\n| 0.5B | 78.4 |'

head: the column names; rows: one list of cells (already formatted strings) per row; align: one
letter a column, "l" (---) or "r" (---:), space-separated; None leaves every column "l".
md_row(cells) is one row alone (a progress line printed as rows arrive).
"""
from __future__ import annotations


def md_row(cells: list[str]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    marks = align.split() if align else ["l"] * len(head)
    if len(marks) != len(head) or set(marks) - {"l", "r"}:
        raise ValueError(f"align {align!r}: give one of l / r for each of the {len(head)} columns")
    bad = [r for r in rows if len(r) != len(head)]
    if bad:
        raise ValueError(f"row {bad[0]!r} has {len(bad[0])} cells for {len(head)} columns")
    sep = "|" + "".join("---:|" if m == "r" else "---|" for m in marks)
    return "\n".join([md_row(head), sep] + [md_row(r) for r in rows])
