"""Small HTML helpers shared by the report's sections: number formatting and sortable tables."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["fmt", "esc", "table", "Cell"]

Cell = str | tuple[str, Any]
"""A table cell: its HTML, or (HTML, sort key) where the key is a number or a string."""


def fmt(v: Any) -> str:
    """A value for display: None and NaN as a dash, floats with 4 significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else ("∞" if v > 0 else "-∞")
    return str(v)


def esc(v: Any) -> str:
    """``fmt`` then HTML-escape."""
    return html.escape(fmt(v))


def _sort_key(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int | float):
        if math.isnan(v):
            return ""
        return repr(float(v)) if math.isfinite(v) else ("Infinity" if v > 0 else "-Infinity")  # JS Number() reads these
    return "" if v is None else str(v)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, table_id: str, sortable: bool = True) -> str:
    """An HTML table; with ``sortable`` a click on a header sorts by that column (the script is in html.py).

    Each cell is a ``Cell``: (html, key) cells sort by key (numbers numerically, empty keys last), plain cells
    by their text.
    """
    cls = ' class="sortable"' if sortable else ""
    # a header may break after an underscore (adapter_<wbr>params): a metric's name is no wider than its values
    head = "".join(f"<th>{html.escape(h).replace('_', '_<wbr>')}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for c in row:
            if isinstance(c, tuple):
                cells.append(f'<td data-v="{html.escape(_sort_key(c[1]), quote=True)}">{c[0]}</td>')
            else:
                cells.append(f"<td>{c}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table id="{table_id}"{cls}><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')
