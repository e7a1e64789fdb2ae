"""Plain-text tables for the command line: left-aligned columns under a dashed header rule."""

from __future__ import annotations


def format_table(header: list[str], rows: list[list[str]]) -> str:
    cells = [header, *rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
