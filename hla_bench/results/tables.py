"""Terminal tables that never cut an identifier, at any width, piped or not, and the cell
values (times, bytes, statuses) the report's tables and comparisons show.

A rich table squeezed into fewer columns than it needs breaks or ellipsizes its cells.
`fit` sizes a table's columns so that it fits the console width while every column keeps
its narrowest whole form: a `no_wrap` column (identifiers: mixer names and labels, form
pairs) its widest cell, any other column its longest word (numbers, lists and prose wrap
between words, never inside one). When no sizing does that, `fit` says so and the caller
prints another layout: fewer columns per table, or plain lines (`print_table`).

Piped or redirected output has the console's width (80 columns unless COLUMNS says
otherwise), so the same rule holds there.
"""

from __future__ import annotations

from typing import Callable, Iterable

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def _chrome(table: Table) -> int:
    """The width a table adds to its columns' contents: cell padding and borders."""
    _, right, _, left = table.padding
    count = len(table.columns)
    padding = count * (left + right)
    if not table.pad_edge and count:
        padding -= left + right
    borders = (2 if table.box and table.show_edge else 0) + (count - 1 if table.box else 0)
    return padding + borders


def _longest_word(console: Console, text: str | Text | None) -> int:
    if not text:
        return 0
    plain = text.plain if isinstance(text, Text) else console.render_str(str(text)).plain
    return max((len(word) for word in plain.split()), default=0)


def column_ranges(table: Table, console: Console) -> list[tuple[int, int]]:
    """(narrowest, widest) content width of each column, as `fit` counts them."""
    options = console.options
    ranges = []
    for column in table.columns:
        cells = [column.header, *column.cells]
        measured = [Measurement.get(console, options, cell) for cell in cells]
        widest = max((m.maximum for m in measured), default=1)
        narrowest = widest if column.no_wrap else max((m.minimum for m in measured), default=1)
        if column.min_width is not None:
            narrowest, widest = max(narrowest, column.min_width), max(widest, column.min_width)
        ranges.append((narrowest, widest))
    return ranges


def fit(table: Table, console: Console, width: int | None = None) -> bool:
    """Fix the width of each column of `table` so that it fits `width` (default: the
    console's) with every identifier and every word whole, and its title and caption too;
    False, leaving the table as it was, when that cannot be done. Space is taken from the
    widest columns first, as rich does."""
    width = console.width if width is None else width
    ranges = column_ranges(table, console)
    room = width - _chrome(table)
    if sum(low for low, _ in ranges) > room:
        return False
    widths = [high for _, high in ranges]
    while sum(widths) > room:
        shrinkable = [i for i, (low, _) in enumerate(ranges) if widths[i] > low]
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
    words = max(_longest_word(console, table.title), _longest_word(console, table.caption))
    if words > width:
        return False
    for column, column_width in zip(table.columns, widths):
        column.width = column_width
    if sum(widths) + _chrome(table) < words:
        table.min_width = words
    return True


def print_table(console: Console, table: Table,
                plain: Callable[[], Iterable[str | list[str]]]) -> None:
    """`table` when it fits the console (see `fit`), else the lines `plain()` gives, as
    plain text (no markup) in the console's width: a string breaks only at spaces, a list
    of items only between items (for items with spaces inside, such as a form pair);
    continued lines are indented four more than the line's own indent."""
    if fit(table, console):
        console.print(table)
        return
    for line in plain():
        items = [line] if isinstance(line, str) else list(line)
        indent = " " * (len(items[0]) - len(items[0].lstrip(" ")))
        items[0] = items[0].lstrip(" ")
        if isinstance(line, str):
            wrapped = wrap(items[0], console.width, indent)
        else:
            wrapped = pack(items, console.width, " ", indent, "    ")
        for text in wrapped:
            console.print(text, markup=False, highlight=False, soft_wrap=True)


def table_lines(table: Table, console: Console) -> list[str | list[str]]:
    """Any table as `print_table`'s plain lines: its title, then a line of items per row
    (the first column's value, then `header value` for each non-empty cell), then its
    caption; markup is dropped and a cell's line breaks become spaces."""
    def plain(value) -> str:
        text = value.plain if isinstance(value, Text) else console.render_str(str(value)).plain
        return " ".join(text.split())

    headers = [plain(column.header) for column in table.columns]
    columns = [[plain(cell) for cell in column.cells] for column in table.columns]
    lines: list[str | list[str]] = [plain(table.title)] if table.title else []
    for row in range(table.row_count):
        values = [column[row] for column in columns]
        lines.append([values[0], *(f"{header} {value}" for header, value
                                   in zip(headers[1:], values[1:]) if value)])
    if table.caption:
        lines.append(plain(table.caption))
    return lines


def wrap(text: str, width: int, indent: str = "", hang: str = "    ") -> list[str]:
    """`text` as lines of at most `width` columns broken only at spaces (a word longer than
    the width gets a line of its own, whole): the first line after `indent`, the others
    after `indent + hang`."""
    return pack([word for word in text.split(" ") if word], width, " ", indent, hang)


def pack(items: list[str], width: int, sep: str = "  ", indent: str = "",
         hang: str = "") -> list[str]:
    """`items` joined by `sep` into lines of at most `width` columns, each item whole on
    one line (an item longer than the width gets a line of its own)."""
    lines: list[str] = []
    line = ""
    for item in items:
        if line and len(f"{line}{sep}{item}") > width:
            lines.append(line)
            line = ""
        line = f"{line}{sep}{item}" if line else (indent if not lines else indent + hang) + item
    lines.append(line)
    return lines


# ---------------------------------------------------------------- cell values

STATUS_LABELS = {"oom": "OOM", "error": "error", "unavailable": "n/a", "unsupported": "—",
                 "timeout": "timeout"}


def format_seq_len(value: int) -> str:
    """A sequence length for display, as the sweeps' lengths are written: 65536 -> `64k`
    (the inverse of `hla_bench.speed.sweeps.parse_seq_len`)."""
    for suffix, size in (("m", 1024 ** 2), ("k", 1024)):
        if value % size == 0:
            return f"{value // size}{suffix}"
    return str(value)


def format_value(metric: str, value: float) -> str:
    """A time (ms), byte count or TFLOP/s figure as the tables show it."""
    if metric in ("memory", "state"):
        return format_bytes(value)
    if metric == "tflops":
        return f"{value:.3g}"
    return f"{value:.3f}" if value < 10 else f"{value:,.1f}"


def format_bytes(value: float) -> str:
    """Bytes in the largest binary unit that keeps the value at least 1."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"
