"""The Markdown helpers every section's `render` uses: numbers, seconds, milliseconds, ratios, tables."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def num(value: Any, digits: int = 2, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:.{digits}f}"


def s(value: Any) -> str:
    return num(value, 2)


def ms(value: Any) -> str:
    return num(value, 1, 1000.0)


def x(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def columns(spec: list[tuple[Any, ...]], rows: Iterable[dict[str, Any]]) -> str:
    """A table given column by column, each header beside what fills it: (header, the row's key, dotted for a
    nested one, and a format such as `s` or `ms` where the value is not shown as it is)."""

    def cell(row: dict[str, Any], key: str, fmt: Any = str) -> Any:
        for part in key.split("."):
            row = row[part]
        return fmt(row)

    return table([col[0] for col in spec], [[cell(row, *col[1:]) for col in spec] for row in rows])


def failed(section: dict[str, Any] | None) -> str | None:
    """What a section's table says instead when the section did not run or failed; None when it is ok."""
    if section is None:
        return "not run"
    if section.get("status") != "ok":
        return f"**failed**: {section.get('error', 'unknown error')}"
    return None
