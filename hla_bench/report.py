"""Tables and plots of results files, and the `hla-bench report` command (its `--compare`
of two bench files is `hla_bench.speed.compare`).

Files are dispatched on their top-level `kind`: `bench` is rendered here, `recall` by
`hla_bench.recall.report.render_recall`. Every file given is checked before anything is
printed; a file that is not a results file, is cut short or breaks its schema is a usage
error (exit 2).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hla_bench.results import store
from hla_bench.results.records import iter_groups
from hla_bench.results.checked import load_checked
from hla_bench.results.plots import PLOT_FORMATS, planned_plots_problem, plots_dir_problem, select
from hla_bench.recall.report import RECALL_TABLES, render_recall
from hla_bench.results.tables import (STATUS_LABELS, fit, format_seq_len, format_value, pack,
                                     print_table, wrap)

METRICS = {
    # metric -> (point field, column unit, higher is better)
    "time": ("median_ms", "median ms", False),
    "memory": ("peak_memory_bytes", "peak memory above inputs", False),
    "tflops": ("tflops", "TFLOP/s", True),
    "state": ("state_bytes", "state held (KV cache or fixed state)", False),
}
def _format_ratio(ratio: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a 200x gap is not `0.00x`)."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


SPREAD_LIMIT = 0.10  # a time whose spread exceeds this share of its median is flagged


def spread(point: dict[str, Any]) -> tuple[float | None, bool]:
    """(spread of the point's time over its median, whether it comes from the samples):
    the record's `spread` (interquartile range / median of `samples_ms`), else that of its
    `samples_ms`, else (p80 - p20) / median for files without samples; (None, False) for a
    point that did not run or lacks them."""
    if point["status"] != "ok" or not point.get("median_ms"):
        return None, False
    if point.get("spread") is not None:
        return float(point["spread"]), True
    if point.get("samples_ms"):
        low, middle, high = np.percentile(point["samples_ms"], [25, 50, 75])
        return (float((high - low) / middle) if middle else None), True
    if point.get("p20_ms") is not None and point.get("p80_ms") is not None:
        return (point["p80_ms"] - point["p20_ms"]) / point["median_ms"], False
    return None, False


def _spread_rule(points: list[dict[str, Any]]) -> str:
    """How the spreads of `points` were measured, for captions and notes."""
    sources = {spread(p)[1] for p in points if spread(p)[0] is not None}
    if sources == {True}:
        return "IQR / median of the samples"
    if sources == {False}:
        return "p80 - p20 over the median, no samples in the file"
    return "IQR / median of the samples, p80 - p20 over the median where none"


def spread_note(points: list[dict[str, Any]]) -> str | None:
    """The warning line listing the points whose spread exceeds SPREAD_LIMIT, or None."""
    wide = [(p, value) for p in points if (value := spread(p)[0]) is not None
            and value > SPREAD_LIMIT]
    if not wide:
        return None
    listed = ", ".join(f"{p['mixer']} T={format_seq_len(p['seq_len'])} {value:.0%}"
                       for p, value in wide)
    return (f"spread above {SPREAD_LIMIT:.0%} at {len(wide)} of "
            f"{sum(p['status'] == 'ok' for p in points)} points ({_spread_rule(points)}): "
            f"{listed}")


def _value(point: dict[str, Any], metric: str) -> float | None:
    if point["status"] != "ok":
        return None
    return point.get(METRICS[metric][0])


def _group_title(points: list[dict[str, Any]], sweep: str, mode: str) -> str:
    first = points[0]
    dims = f"H={first['heads']} D={first['head_dim']}"
    if first["value_dim"] != first["head_dim"]:
        dims += f" Dv={first['value_dim']}"
    if mode == "decode":  # times are per token; runs of decode_steps tokens were timed
        graph = ", CUDA graph" if first.get("decode_graph") else ""
        mode += f" (per token, runs of {first.get('decode_steps') or 1}{graph})"
    return f"{sweep} · {mode} · {dims} · {first['dtype']} on {first['device']}"


def bench_cells(points: list[dict[str, Any]], metric: str = "time",
                baseline: str | None = None) -> tuple[list[str], list[tuple[int, int, list]]]:
    """(mixer labels, rows): a row is (T, batch, cells), a cell is None (no point), a status
    label, or (text, is_best); text carries the ratio to `baseline` when given."""
    higher_better = METRICS[metric][2]
    labels = list(dict.fromkeys(p["mixer"] for p in points))
    by_row: dict[int, dict[str, dict]] = {}
    for point in points:
        by_row.setdefault(point["seq_len"], {})[point["mixer"]] = point
    rows = []
    for seq_len in sorted(by_row):
        row = by_row[seq_len]
        values = {label: _value(row[label], metric) for label in labels if label in row}
        present = [v for v in values.values() if v is not None]
        best = (max if higher_better else min)(present) if present else None
        base = values.get(baseline) if baseline in labels else None
        cells: list = []
        for label in labels:
            point, value = row.get(label), values.get(label)
            if point is None:
                cells.append(None)
            elif value is None:
                cells.append(STATUS_LABELS.get(point["status"], point["status"]))
            else:
                text = format_value(metric, value)
                if base and label != baseline:
                    text += f" ({_format_ratio(value / base)})"
                wide = spread(point)[0] if metric == "time" else None
                if wide is not None and wide > SPREAD_LIMIT:
                    text += f" ±{wide:.0%}"
                cells.append((text, value == best and len(present) > 1))
        rows.append((seq_len, next(iter(row.values()))["batch"], cells))
    return labels, rows


def _caption(points: list[dict[str, Any]], metric: str, labels: list[str],
             baseline: str | None, sep: str) -> str:
    parts = [METRICS[metric][1], "best in bold"]
    if baseline in labels:
        parts.append(f"(x) = ratio to {baseline}")
    if metric == "time":
        parts.append(f"±: spread above {SPREAD_LIMIT:.0%}, {_spread_rule(points)}")
    return sep.join(parts)


def bench_table(points: list[dict[str, Any]], title: str, metric: str = "time",
                baseline: str | None = None, labels: list[str] | None = None) -> Table:
    """Rows: T (with batch); columns: mixer labels (`labels`, default all); best value per
    row in bold, over all the mixers. A mixer's column is never narrower than its label;
    its values wrap between words."""
    every, rows = bench_cells(points, metric, baseline)
    shown = [every.index(label) for label in (labels or every)]
    # labels, sweep names and reasons are the user's text: shown as written, never as markup
    table = Table(title=escape(title), caption=escape(_caption(points, metric, every, baseline, "; ")))
    table.add_column("T", justify="right", no_wrap=True)
    table.add_column("batch", justify="right", no_wrap=True)
    for index in shown:
        table.add_column(escape(every[index]), justify="right", overflow="fold",
                         min_width=len(every[index]))
    for seq_len, batch, cells in rows:
        texts = ["" if cell is None else f"[dim]{cell}[/dim]" if isinstance(cell, str)
                 else f"[bold]{cell[0]}[/bold]" if cell[1] else cell[0]
                 for cell in (cells[index] for index in shown)]
        table.add_row(format_seq_len(seq_len), str(batch), *texts)
    return table


def bench_tables(points: list[dict[str, Any]], title: str, metric: str, baseline: str | None,
                 console: Console) -> list[Table]:
    """The bench table of `points` sized to the console (see `hla_bench.results.tables.fit`): one
    table when it fits, else the mixer columns in consecutive groups, each table with T and
    batch: as few tables as fit, their columns shared out evenly where that fits too; []
    when not even one mixer column fits."""
    whole = bench_table(points, title, metric, baseline)
    if fit(whole, console):
        return [whole]
    labels = list(dict.fromkeys(p["mixer"] for p in points))

    def part(start: int, end: int) -> Table | None:
        which = f"mixer {end}" if end == start + 1 else f"mixers {start + 1}–{end}"
        table = bench_table(points, f"{title} · {which} of {len(labels)}", metric, baseline,
                            labels[start:end])
        return table if fit(table, console) else None

    greedy: list[Table] = []
    start = 0
    while start < len(labels):
        end, table = start + 1, part(start, start + 1)
        if table is None:
            return []
        while end < len(labels) and (wider := part(start, end + 1)) is not None:
            end, table = end + 1, wider
        greedy.append(table)
        start = end
    size = -(-len(labels) // len(greedy))
    even = [part(start, min(start + size, len(labels))) for start in range(0, len(labels), size)]
    return even if len(even) == len(greedy) and all(even) else greedy


def bench_lines(points: list[dict[str, Any]], title: str, metric: str = "time",
                baseline: str | None = None) -> list[str]:
    """The bench table as plain lines, for a console too narrow for any table: a line per
    (T, mixer)."""
    labels, rows = bench_cells(points, metric, baseline)
    lines = [title, _caption(points, metric, labels, baseline, "; ")]
    for seq_len, batch, cells in rows:
        for label, cell in zip(labels, cells):
            if cell is not None:
                text = cell if isinstance(cell, str) else cell[0] + (" (best)" if cell[1] else "")
                lines.append(f"  T={format_seq_len(seq_len)} batch={batch} {label}: {text}")
    return lines


def bench_markdown(points: list[dict[str, Any]], title: str, metric: str = "time",
                   baseline: str | None = None) -> str:
    """The same table as GitHub markdown (best in bold), for READMEs and issue notes; for
    time, its title counts the points whose spread exceeds SPREAD_LIMIT (marked ±)."""
    labels, rows = bench_cells(points, metric, baseline)
    wide = [p for p in points if (spread(p)[0] or 0) > SPREAD_LIMIT] if metric == "time" else []
    warning = (f" **spread above {SPREAD_LIMIT:.0%} at {len(wide)} of "
               f"{sum(p['status'] == 'ok' for p in points)} points**" if wide else "")
    lines = [f"**{title}** ({_caption(points, metric, labels, baseline, ', ')}){warning}", "",
             "| T | batch | " + " | ".join(labels) + " |", "|" + " ---: |" * (len(labels) + 2)]
    for seq_len, batch, cells in rows:
        texts = ["" if cell is None else cell if isinstance(cell, str)
                 else f"**{cell[0]}**" if cell[1] else cell[0] for cell in cells]
        lines.append(f"| {format_seq_len(seq_len)} | {batch} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def _failure_notes(points: list[dict[str, Any]]) -> list[str]:
    """One line per (mixer, status, reason), for the points that did not run."""
    seen: dict[tuple[str, str, str], list[int]] = {}
    for p in points:
        if p["status"] != "ok":
            seen.setdefault((p["mixer"], p["status"], p.get("reason") or ""), []).append(p["seq_len"])
    return [f"{mixer} {status} at T={','.join(format_seq_len(t) for t in sorted(ts))}: {reason}"
            for (mixer, status, reason), ts in seen.items()]


def render_bench(data: dict[str, Any], console: Console, metrics: Iterable[str] = ("time",),
                 baseline: str | None = None, markdown: bool = False) -> None:
    """A table per (sweep, mode) and metric, then the reasons points failed and the points
    whose time spread exceeds SPREAD_LIMIT; with `markdown`, GitHub markdown tables printed
    as plain text."""
    env = data.get("environment", {})
    fields = [f"bench {data.get('created', '')}", f"host {env.get('hostname')}",
              f"gpu {env.get('gpu') or 'none'}", f"torch {env.get('torch')}",
              f"commit {str(env.get('git_commit', ''))[:12]}"]
    if markdown:  # a paragraph of its own
        console.print("  ".join(fields) + "\n", markup=False, highlight=False, soft_wrap=True)
    else:  # the fields whole, as many to a line as the console's width takes
        for line in pack(fields, console.width):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    baselines = {s.get("name"): s.get("baseline") for s in data.get("sweeps", [])}
    for (sweep, mode), points in iter_groups(data["points"]):
        for metric in metrics:
            base = baseline or baselines.get(sweep)
            title = _group_title(points, sweep, mode)
            if markdown:
                console.print(bench_markdown(points, title, metric, base), markup=False,
                              highlight=False, soft_wrap=True)
            else:
                tables = bench_tables(points, title, metric, base, console)
                for table in tables:
                    console.print(table)
                for line in [] if tables else bench_lines(points, title, metric, base):
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
        wide = None if markdown else spread_note(points)  # markdown: in the table's title
        notes = _failure_notes(points) + ([wide] if wide else [])
        for note in notes:
            if markdown:
                console.print(f"- {note}", markup=False, highlight=False, soft_wrap=True)
            else:
                console.print(f"  [yellow]{escape(note)}[/yellow]", highlight=False)
        if markdown and notes:  # ends the list: a paragraph right after it would join it
            console.print()


def _batch_label(points: list[dict[str, Any]]) -> str:
    """The x label: T, and the batch each T ran at (fixed tokens per batch implies it)."""
    batches = {p["seq_len"]: p["batch"] for p in points}
    if len(set(batches.values())) == 1:
        return f"sequence length T (batch {next(iter(batches.values()))})"
    tokens = {t * b for t, b in batches.items()}
    if len(tokens) == 1:
        return f"sequence length T (batch = {tokens.pop()} tokens / T)"
    return "sequence length T (batch per T in the tables)"




def write_plots(data: dict[str, Any], out_dir: str | Path, fmt: str = "png",
                baseline: str | None = None, mixers: str | None = None) -> list[Path]:
    """The speed figures of a bench file (`hla_bench.results.plots.write_bench_plots`): per
    (sweep, mode), time, the ratio to `baseline` and memory (decode: the state held) against
    T; `mixers` (comma-separated globs) chooses the mixers drawn."""
    from hla_bench.results.plots import write_bench_plots

    return write_bench_plots(data, out_dir, fmt, _group_title, _batch_label, baseline, mixers)


def recall_run_key(run: dict) -> str:
    """What identifies a recall run (`hla_bench.recall.plan.run_key`, imported only once a
    recall file is checked: the recall wing imports torch)."""
    from hla_bench.recall.plan import run_key

    return run_key(run)


def load_any(path: str) -> tuple[str, str, dict[str, Any]]:
    """(path, kind, data) of a results file of any kind (`load_checked`); any problem is a
    usage error naming the file."""
    try:
        data = load_checked(path, recall_run_key)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    return path, data["kind"], data


def _percent(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A PCT option: a finite number of percent, at least 0."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise click.BadParameter(f"expected a percentage of at least 0, got {value}")
    return value


@click.command()
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--compare", "compare_files", is_flag=True,
              help="Two bench files OLD NEW: per point, the time ratio new/old with a "
                   "bootstrap interval and a Mann-Whitney test on the stored samples, the "
                   "memory ratio and status changes (docs/comparing.md).")
@click.option("--plots", type=click.Path(file_okay=False), help="Write plots to this folder.")
@click.option("--format", "plot_format", type=click.Choice(PLOT_FORMATS), default="png",
              show_default=True, help="File format of the plots.")
@click.option("--metric", type=click.Choice(sorted(METRICS)), default="time", show_default=True)
@click.option("--baseline", help="Mixer label to show ratios against (tables: default the "
              "sweep's baseline; plots: default the fastest linear-attention mixer).")
@click.option("--control", metavar="MIXER",
              help="With --compare: a mixer label measured in both files; every ratio is "
                   "taken relative to its ratio at the same mode and shape (cancels a "
                   "machine's drift between the runs).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=0.01, show_default=True,
              help="With --compare: significance level (false-discovery rate over the tested "
                   "points); the intervals are at 1 - alpha.")
@click.option("--fail-on-regression", "fail_percent", type=float, metavar="PCT",
              callback=_percent,
              help="With --compare: exit 1 when a point is significantly slower by more than "
                   "PCT percent, grew its peak memory by more than PCT percent (and the "
                   "memory tolerance), or no longer runs.")
@click.option("--memory-tolerance", "memory_percent", type=float, metavar="PCT", default=5.0,
              show_default=True, callback=_percent,
              help="With --compare: peak memory changes within PCT percent are not listed.")
@click.option("--min-change", "min_change_percent", type=float, metavar="PCT", default=2.0,
              show_default=True, callback=_percent,
              help="With --compare: a time change is significant only when its whole "
                   "interval lies beyond ±PCT percent (above the method's noise floor).")
@click.option("-k", "--mixers", "pattern", metavar="PATTERN",
              help="With --compare: only points whose mixer label, mixer name, sweep or mode "
                   "matches PATTERN (a glob; a plain word matches as a substring). Else: only "
                   "the mixers whose label or name matches one of the comma-separated "
                   "PATTERNs, in bench tables and in plots (one figure per sweep and mode); "
                   "without it a figure of more than 8 mixers is split into an overview "
                   "and one figure per family (docs/figures.md).")
@click.option("--markdown", is_flag=True, help="Print GitHub markdown tables (for READMEs).")
@click.option("--sweep", "only", multiple=True, metavar="NAME",
              help="Bench files: show only this sweep (repeatable; default: all).")
@click.option("--mode", "modes", multiple=True, metavar="MODE",
              help="Bench files: show only this mode, e.g. fwdbwd (repeatable; default: all).")
@click.option("--recall-tables", type=click.Choice(RECALL_TABLES), default="all",
              show_default=True,
              help="Recall files: every table, only the per-setting tables, or only the "
                   "published-reference views (Zoology's Figure 2, MAD-lab's scores).")
@click.option("--index", "index_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Write DIR/README.md, the index of every results file below DIR (kind, "
                   "config, device, date, git commit, completeness, read from each file); "
                   "takes no FILE.")
def report(files: tuple[str, ...], compare_files: bool, plots: str | None, plot_format: str,
           metric: str, baseline: str | None, control: str | None, alpha: float,
           fail_percent: float | None, memory_percent: float, min_change_percent: float,
           pattern: str | None, markdown: bool, only: tuple[str, ...], modes: tuple[str, ...],
           recall_tables: str,
           index_dir: str | None) -> None:
    """Re-render results FILE(s): tables, comparisons (--compare) and plots (--plots).

    With --index DIR, write the index of a results folder instead. Exit status: 0, 2 for
    a usage error, 1 when --fail-on-regression finds a regression."""
    console = Console()
    context = click.get_current_context()
    given = [param.opts[0] for param in context.command.params
             if context.get_parameter_source(param.name) == click.core.ParameterSource.COMMANDLINE]
    if index_dir is not None:
        if files:
            raise click.UsageError("--index DIR takes no FILE: it reads every results file "
                                   "below DIR")
        others = [name for name in given if name != "--index"]
        if others:
            raise click.UsageError(f"--index DIR takes no other option (given: "
                                   f"{', '.join(others)})")
        write_folder_index(index_dir, console)
        return
    if not files:
        raise click.UsageError("give one or more results FILEs (or --index DIR)")
    for name in ("--control", "--fail-on-regression", "--alpha", "--memory-tolerance",
                 "--min-change"):
        if name in given and not compare_files:
            raise click.UsageError(f"{name} applies to --compare")
    if "--format" in given and plots is None:
        raise click.UsageError("--format applies to --plots")
    loaded = [load_any(path) for path in files]  # every file checked before any output
    for name in ("--metric", "--baseline"):
        if name in given and (compare_files or all(kind != "bench" for _, kind, _ in loaded)):
            raise click.UsageError(f"{name} applies to the tables of bench files, not to "
                                   + ("--compare" if compare_files else "recall files"))
    if "--recall-tables" in given and (compare_files
                                       or all(kind != "recall" for _, kind, _ in loaded)):
        raise click.UsageError("--recall-tables applies to the tables of recall files")
    if only:
        loaded = [(path, kind, _only_points(path, kind, data, "--sweep", "sweep", only))
                  for path, kind, data in loaded]
    if modes:
        if compare_files:
            raise click.UsageError("--mode applies to the tables of bench files; with "
                                   "--compare, -k MODE keeps a mode's points")
        loaded = [(path, kind, _only_points(path, kind, data, "--mode", "mode", modes))
                  for path, kind, data in loaded]
    if baseline is not None:
        for path, kind, data in loaded:
            labels = {p["mixer"] for p in data["points"]} if kind == "bench" else set()
            if kind == "bench" and baseline not in labels:
                raise click.UsageError(f"--baseline {baseline!r} is not a mixer label of "
                                       f"{path} ({', '.join(sorted(labels)) or 'no points'})")
    if pattern is not None and not compare_files:
        chosen = []
        for path, kind, data in loaded:
            labels = _mixer_labels(kind, data)
            kept = select(labels, _mixer_names(kind, data), pattern)
            if not kept:
                raise click.UsageError(f"-k {pattern!r} matches no mixer of {path} "
                                       f"({', '.join(labels) or 'no mixers'})")
            if kind == "bench":  # the tables show the chosen mixers only
                data = {**data, "points": [p for p in data["points"] if p["mixer"] in kept]}
            chosen.append((path, kind, data))
        loaded = chosen
    problem = plots_dir_problem(plots) if plots is not None else None
    if plots is not None and not problem:  # names from the files, links where plots go
        problem = planned_plots_problem(loaded, plots, plot_format, bool(compare_files))
    if problem:  # the check leaves no folder behind, so its place among the checks is free
        raise click.UsageError(problem)
    if compare_files:
        if len(loaded) != 2 or any(kind != "bench" for _, kind, _ in loaded):
            raise click.UsageError("--compare takes exactly two bench results files")
        if control is not None:
            for path, _, data in loaded:
                labels = {p["mixer"] for p in data["points"]}
                if control not in labels:
                    raise click.UsageError(
                        f"--control {control!r} is not a mixer label of {path} "
                        f"({', '.join(sorted(labels)) or 'no points'})")
        failed = render_comparison(loaded, console, alpha=alpha, control=control,
                                   pattern=pattern, memory_tolerance=memory_percent / 100,
                                   fail_percent=fail_percent, markdown=markdown, plots=plots,
                                   plot_format=plot_format,
                                   min_change=min_change_percent / 100)
        if failed:
            click.get_current_context().exit(1)
        return
    for path, kind, data in loaded:
        if markdown:
            console.print(f"<!-- {path} -->", markup=False, highlight=False, soft_wrap=True)
        else:
            console.rule(str(path))
        plot_dir = Path(plots) / Path(path).stem if plots and len(loaded) > 1 else (
            Path(plots) if plots else None)
        if kind == "bench":
            render_bench(data, console, (metric,), baseline, markdown)
            if plot_dir is not None:
                for written in write_plots(data, plot_dir, plot_format, baseline, pattern):
                    console.print(f"wrote {written}")
        else:
            render_recall(data, console, plots_dir=plot_dir, markdown=markdown, fmt=plot_format,
                          tables=recall_tables, mixers=pattern)
        if data.get("complete") is False:
            note = incomplete_note(path)
            console.print(f"[yellow]{escape(note)}[/yellow]" if not markdown else f"\n_{note}_",
                          markup=not markdown, highlight=False, soft_wrap=True)


def incomplete_note(path: str | Path) -> str:
    """What a results file without `complete: true` is: still being written (its lock names
    a live process on this host), perhaps being written on another host, or stopped before
    the end of its plan."""
    holder = store.lock_holder(path)
    if holder is not None:
        pid, host, alive = holder
        if alive:
            return (f"{path} is incomplete: it is still being written (its lock names pid "
                    f"{pid}, running on this host); these are the records written so far")
        if alive is None:
            return (f"{path} is incomplete: its lock names pid {pid} on {host}, so it may "
                    "still be written there, or its run was stopped before the end of its "
                    "plan (continue it with --resume)")
    return (f"{path} is incomplete: its run was stopped before the end of its plan "
            "(continue it with --resume)")


def render_comparison(loaded: list[tuple[str, str, dict[str, Any]]], console: Console,
                      alpha: float, control: str | None, pattern: str | None,
                      memory_tolerance: float, fail_percent: float | None, markdown: bool,
                      plots: str | None, plot_format: str,
                      min_change: float) -> bool:
    """`report --compare`: the comparison of two loaded bench files (`hla_bench.speed.compare`)
    as a table (plain lines where it does not fit; markdown with `markdown`), its summary,
    and its plots; True when `fail_percent` is given and some point fails it."""
    from hla_bench.speed import compare

    (old_path, _, old), (new_path, _, new) = loaded
    names = Path(old_path).name, Path(new_path).name
    if names[0] == names[1]:
        names = old_path, new_path
    result = compare.compare(old, new, alpha, control, pattern, memory_tolerance, min_change)
    plain = {"markup": False, "highlight": False, "soft_wrap": True}
    if not result["rows"]:
        if pattern:
            raise click.UsageError(f"-k {pattern!r} matches no point the two files share")
        console.print("no points in common", **plain)
        if fail_percent is not None:
            console.print("--fail-on-regression: nothing was compared, which fails the gate",
                          **plain)
            return True
    elif markdown:
        console.print(compare.comparison_markdown(result, *names), **plain)
    else:
        print_table(console, compare.comparison_table(result, *names),
                    lambda: compare.comparison_lines(result, *names))

    def say(line: str) -> None:  # a list item in markdown, else lines of the console's width
        for text in [f"- {line}"] if markdown else wrap(line, console.width):
            console.print(text, **plain)

    for line in compare.summary(result, *names):
        say(line)
    if plots and result["rows"]:
        for written in compare.write_plots(result, plots, plot_format):
            console.print(f"wrote {written}", **plain)
    if fail_percent is None:
        return False
    failing = compare.regressions(result, fail_percent)
    verdict = (f"FAIL: {len(failing)} regression(s) beyond {fail_percent:g}%: "
               + ", ".join(map(compare.why, failing)) if failing
               else f"no regression beyond {fail_percent:g}%")
    say(verdict)
    return bool(failing)


def _mixer_labels(kind: str, data: dict[str, Any]) -> list[str]:
    """The mixer labels of a loaded results file, in first-seen order."""
    records = data["points"] if kind == "bench" else data["runs"]
    return list(dict.fromkeys(str(record["mixer"]) for record in records))


def _mixer_names(kind: str, data: dict[str, Any]) -> dict[str, str]:
    """{label: mixer name} of a bench file's points (a recall run's mixer is its name)."""
    if kind != "bench":
        return {}
    return {p["mixer"]: p.get("name") or p["mixer"] for p in data["points"]}


def _only_points(path: str, kind: str, data: dict[str, Any], option: str, key: str,
                 wanted: tuple[str, ...]) -> dict[str, Any]:
    """`data` with the points whose `key` ("sweep" or "mode") is among `wanted` (for sweeps,
    their configs too); a usage error for a recall file or a value the file has not."""
    if kind != "bench":
        raise click.UsageError(f"{option} applies to bench files; {path} is a {kind} file")
    configured = [s.get("name") for s in data.get("sweeps", [])] if key == "sweep" else []
    found = list(dict.fromkeys(configured + [p[key] for p in data["points"]]))
    unknown = [value for value in wanted if value not in found]
    if unknown:
        raise click.UsageError(f"{option} {unknown[0]!r} is not a {key} of {path} "
                               f"({', '.join(map(str, found)) or 'no points'})")
    kept = {**data, "points": [p for p in data["points"] if p[key] in wanted]}
    if key == "sweep":
        kept["sweeps"] = [s for s in data.get("sweeps", []) if s.get("name") in wanted]
    return kept


def write_folder_index(folder: str, console: Console) -> None:
    """`report --index DIR`: write DIR/README.md (`hla_bench.results.index`)."""
    from hla_bench.results import index

    try:
        path, count = index.write_index(folder, recall_run_key)
    except index.IndexWriteError as error:
        raise click.UsageError(str(error)) from None
    except OSError as error:
        raise click.ClickException(f"cannot write the index of {folder}: {error}") from None
    console.print(f"wrote {path} ({count} results files)", markup=False, highlight=False,
                  soft_wrap=True)


commands = [report]
