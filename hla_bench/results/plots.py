"""What every plot of the report shares (the formats, a headless pyplot, the sequence-length
axis, log axes with readable ticks, legends outside the panels, a plot's path (`plot_path`:
a name read from a results file must be one plain file-name component), saving a figure
(never through a symbolic link)) and the speed figures of bench files (`write_bench_plots`;
docs/figures.md)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from hla_bench.results.tables import format_seq_len
from hla_bench.safe_files import (UnsafeNameError, name_problem, path_in, plain_name,
                                  replace_atomically)

PLOT_FORMATS = ("png", "svg", "pdf")
# The recall plots' file-name stems: accuracy against state, against d_model.
RECALL_PLOT_NAMES = ("recall_accuracy_vs_state", "recall_accuracy_vs_d_model")


def save_figure(figure: Any, path: Path, dpi: int = 110, tight: bool = False) -> Path:
    """Lay out (unless the figure has a layout engine of its own, or `tight` grows the saved
    area to hold what lies outside the axes), write and close a matplotlib figure; returns
    `path`. The figure is drawn in memory and written with `safe_files.replace_atomically`
    (never through a symbolic link at `path`; a reader sees the old plot or the whole new
    one); its format is `path`'s suffix."""
    import io

    import matplotlib.pyplot as plt

    if figure.get_layout_engine() is None and not tight:
        figure.tight_layout()
    drawn = io.BytesIO()
    try:
        figure.savefig(drawn, dpi=dpi, format=Path(path).suffix.lstrip(".") or None,
                       bbox_inches="tight" if tight else None)
    finally:
        plt.close(figure)
    return replace_atomically(path, drawn.getvalue(), what="plot")


def plot_path(out_dir: str | Path, stem: object, fmt: str) -> Path:
    """`out_dir/<stem>.<fmt>`, once `stem` (a sweep's name and a mode, read from a results
    file) is one plain file-name component: UnsafeNameError naming it otherwise, so that no
    plot is written outside `out_dir`."""
    plain_name(stem, "plot name")
    return path_in(out_dir, stem, "plot name", f".{fmt}")


def _stems(kind: str, data: dict) -> list[object]:
    """The file-name stems of a results file's plots, as `report --plots` writes them."""
    if kind == "recall":
        return list(RECALL_PLOT_NAMES)
    return list(dict.fromkeys(f"{p.get('sweep')}-{p.get('mode')}"
                              for p in data.get("points", [])))


def planned_plots_problem(loaded: list[tuple[str, str, dict]], out_dir: str | Path, fmt: str,
                          compare: bool = False) -> str | None:
    """Why `report --plots out_dir` cannot write the plots of the `loaded` (path, kind,
    data) results files, found before any output: a bench file's sweep name that is not one
    plain file-name component (its plot would leave the folder), or a plot path that is a
    symbolic link; None when every plot can be written. The layout is the report's: with
    `compare`, `compare-MODE` in `out_dir`; else, with several files, each file's plots in
    the subfolder named after it."""
    planned: list[tuple[str, Path, object]] = []
    if compare:
        modes = dict.fromkeys(p.get("mode") for _, _, data in loaded
                              for p in data.get("points", []))
        planned = [(loaded[0][0], Path(out_dir), f"compare-{mode}") for mode in modes]
    else:
        for path, kind, data in loaded:
            folder = Path(out_dir) / Path(path).stem if len(loaded) > 1 else Path(out_dir)
            if kind == "bench":
                for point in data.get("points", []):
                    problem = name_problem(point.get("sweep"))
                    if problem:
                        return (f"{path}: sweep name {point.get('sweep')!r} cannot be part "
                                f"of a plot's file name: {problem}")
            planned += [(path, folder, stem) for stem in _stems(kind, data)]
    for path, folder, stem in planned:
        try:
            target = plot_path(folder, stem, fmt)
        except UnsafeNameError as error:
            return f"{path}: {error}"
        if target.is_symlink():
            return (f"{target}: the plot is a symbolic link; refusing to write through it "
                    "or to replace it (remove the link, or give another --plots folder)")
    return None


def plots_dir_problem(out_dir: str | Path) -> str | None:
    """Why plots cannot be written to `out_dir`, found before any work: the folder is made
    (as writing the plots would) and the folders this made are removed again, so a check
    that passes leaves nothing behind; None when they can be written."""
    path = Path(out_dir).absolute()
    missing = [folder for folder in (path, *path.parents) if not folder.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            return f"cannot write plots to {out_dir}: not a writable folder"
    except OSError as error:
        return f"cannot create the plots folder {out_dir}: {error.strerror or error}"
    finally:
        for folder in missing:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                pass
    return None


def pyplot_for(out_dir: str | Path, fmt: str) -> tuple[Any, Path]:
    """(matplotlib.pyplot on the Agg backend, `out_dir` created) for plots in `fmt`; a
    ValueError for a format not in PLOT_FORMATS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if fmt not in PLOT_FORMATS:
        raise ValueError(f"plot format must be one of {', '.join(PLOT_FORMATS)}, got {fmt!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return plt, out_dir


def seq_len_axis(ax: Any, seq_lens: Iterable[int]) -> None:
    """A log2 x axis ticked at each sequence length, labelled as configs write them (with
    fewer than MIN_TICKS lengths, their neighbouring powers of two ticked too)."""
    import matplotlib.ticker

    seq_lens = sorted(set(seq_lens))
    ax.set_xscale("log", base=2)
    while len(seq_lens) < MIN_TICKS:  # too few to read a log axis by: their neighbours too
        seq_lens = sorted({seq_lens[0] // 2 or 1, *seq_lens, seq_lens[-1] * 2})
    ax.set_xticks(seq_lens, [format_seq_len(t) for t in seq_lens])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def save_figure_tight(figure: Any, path: Path, dpi: int = 110) -> Path:
    """`save_figure` of a figure laid out by its own layout engine, the saved area grown to
    hold what lies outside the axes (legends, the notes under the figure)."""
    return save_figure(figure, path, dpi, tight=True)


# --- axes a reader can read: at least three tick labels on any log axis ---------------------

DECIMAL_STEPS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))
BINARY_STEPS = ((1,), (1, 1.5), (1, 1.25, 1.5, 1.75))
MIN_TICKS, MAX_TICKS = 3, 9


def log_ticks(low: float, high: float, base: int = 10,
              most: int = MAX_TICKS) -> tuple[list[float], tuple[float, float]]:
    """(ticks, limits) of a log axis showing values from `low` to `high` (both > 0): the
    limits pad the range a little; the ticks are the coarsest of 1 / 1-2-5 / finer mantissas
    (base 10) or powers of two and their halves and quarters (base 2) that puts at least
    MIN_TICKS inside the limits, thinned to at most MAX_TICKS; a range too narrow for that
    is widened about its geometric centre until it holds MIN_TICKS. `most` (at least
    MIN_TICKS) replaces MAX_TICKS."""
    if not (low > 0 and high >= low):
        raise ValueError(f"a log axis needs 0 < low <= high, got {low}, {high}")
    steps = DECIMAL_STEPS if base == 10 else BINARY_STEPS
    pad = max((high / low) ** 0.06, 1.08)
    low, high = low / pad, high * pad
    while True:
        first = math.floor(math.log(low, base)) - 1
        last = math.ceil(math.log(high, base)) + 1
        for mantissas in steps:
            ticks = [m * float(base) ** k for k in range(first, last + 1) for m in mantissas]
            ticks = [t for t in ticks if low <= t <= high]
            if len(ticks) >= MIN_TICKS:
                stride = math.ceil(len(ticks) / max(most, MIN_TICKS))
                while stride > 1 and len(ticks[::stride]) < MIN_TICKS:
                    stride -= 1
                return ticks[::stride], (low, high)
        centre = math.sqrt(low * high)
        low, high = centre / (high / centre) ** 1.5, centre * (high / centre) ** 1.5


def format_bytes_tick(size: float) -> str:
    """A byte count as a tick label: `512 B`, `64 KiB`, `1.5 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.3g} {unit}"
        size /= 1024
    return f"{size:.3g} TiB"  # unreachable: the loop returns at TiB


def log_axis(ax: Any, which: str, values: Iterable[float], base: int = 10,
             label: Callable[[float], str] = lambda v: f"{v:g}", most: int = MAX_TICKS) -> None:
    """Make `ax`'s `which` ("x" or "y") axis logarithmic over `values`, ticked by
    `log_ticks` and labelled by `label`; no minor tick labels."""
    import matplotlib.ticker

    values = [v for v in values if v and v > 0 and math.isfinite(v)]
    if not values:
        return
    ticks, limits = log_ticks(min(values), max(values), base, most)
    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log", base=base)
    (ax.set_ylim if which == "y" else ax.set_xlim)(*limits)
    axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    axis.set_major_formatter(matplotlib.ticker.FixedFormatter([label(t) for t in ticks]))
    axis.set_minor_locator(matplotlib.ticker.NullLocator())


def legend_outside(figure: Any, axes: list[Any], title: str | None = None,
                   extra: list[tuple[Any, str]] = ()) -> Any:
    """One figure legend right of the panels, outside every axes (the figure must use the
    constrained layout): each label once, in the order the panels first drew it, then
    `extra` entries ((handle, text))."""
    entries: dict[str, Any] = {}
    for ax in axes:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            if not text.startswith("_"):
                entries.setdefault(text, handle)
    for handle, text in extra:
        entries.setdefault(text, handle)
    if not entries:
        return None
    return figure.legend(list(entries.values()), list(entries), loc="outside right upper",
                         fontsize=8, title=title, title_fontsize=8, frameon=False)


def notes_under(figure: Any, lines: list[str], width: int = 150) -> None:
    """`lines` as text under the figure's panels, each wrapped to `width` characters (the
    saved area, `save_figure_tight`, grows to hold them)."""
    import textwrap

    if not lines:
        return
    text = "\n".join(textwrap.fill(line, width, subsequent_indent="    ") for line in lines)
    figure.text(0.01, 0.0, text, ha="left", va="top", fontsize=7.5, family="monospace")


# --- speed figures ------------------------------------------------------------------------

def select(labels: Iterable[str], names: dict[str, str], patterns: str | None) -> list[str]:
    """The labels matching any of the comma-separated `patterns` (a glob; a plain word
    matches as a substring) by label or mixer name; all of them without patterns."""
    import fnmatch

    labels = list(labels)
    if not patterns:
        return labels
    globs = [p if any(c in p for c in "*?[") else f"*{p}*"
             for p in (part.strip() for part in patterns.split(",")) if p]
    return [label for label in labels
            if any(fnmatch.fnmatchcase(text, glob) for glob in globs
                   for text in (label, names.get(label) or label))]


def _times(points: list[dict]) -> dict[str, dict[int, float]]:
    """{label: {T: median ms}} of the points that ran."""
    times: dict[str, dict[int, float]] = {}
    for p in points:
        if p["status"] == "ok" and p.get("median_ms"):
            times.setdefault(p["mixer"], {})[p["seq_len"]] = p["median_ms"]
    return times


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.inf


def fastest(times: dict[str, dict[int, float]], candidates: list[str]) -> str | None:
    """The candidate with the lowest geometric mean time over the T at which every candidate
    ran; with no such T, the one that ran at the most T, then the lowest geometric mean
    over its own."""
    candidates = [c for c in candidates if times.get(c)]
    if not candidates:
        return None
    shared = set.intersection(*(set(times[c]) for c in candidates))
    if shared:
        return min(candidates, key=lambda c: _geomean([times[c][t] for t in shared]))
    return min(candidates, key=lambda c: (-len(times[c]), _geomean(list(times[c].values()))))


def default_baseline(points: list[dict]) -> str | None:
    """The fastest (see `fastest`) linear-attention mixer among `points`, else the fastest
    mixer of any family."""
    from hla_bench.results import styles

    times = _times(points)
    names = {p["mixer"]: p.get("name") for p in points}
    linear = [label for label in times
              if styles.family(styles.base_name(label, names.get(label))) == "linear"]
    return fastest(times, linear) or fastest(times, list(times))


def _ratio_rank(times: dict[str, dict[int, float]], baseline: str | None) -> dict[str, float]:
    """{label: geometric mean over T of its time over the baseline's} (lower is faster)."""
    base = times.get(baseline or "", {})
    rank = {}
    for label, by_t in times.items():
        shared = [t for t in by_t if t in base]
        rank[label] = (_geomean([by_t[t] / base[t] for t in shared]) if shared
                       else _geomean(list(by_t.values())))
    return rank


def _failure_lines(points: list[dict]) -> list[str]:
    """A line per (mixer, status, reason) of the points that did not run."""
    from hla_bench.results.tables import STATUS_LABELS

    seen: dict[tuple[str, str, str], list[int]] = {}
    for p in points:
        if p["status"] != "ok":
            reason = " ".join(str(p.get("reason") or "").split())
            seen.setdefault((p["mixer"], p["status"], reason), []).append(p["seq_len"])
    return [f"{mixer}: {STATUS_LABELS.get(status, status)} at T="
            f"{','.join(format_seq_len(t) for t in sorted(ts))}"
            + (f" ({reason[:110]}{'...' if len(reason) > 110 else ''})" if reason else "")
            for (mixer, status, reason), ts in seen.items()]


def bench_figure(plt: Any, points: list[dict], labels: list[str], baseline: str | None,
                 title: str, xlabel: str, notes: list[str]) -> Any:
    """Three panels over T for the series `labels` (and `baseline`): median time (the
    p20-p80 band shaded), the time over the baseline's at the same T on a log2 axis, and
    peak memory above the inputs (decode: the state held) with byte ticks; the legend
    right of the panels; the points that did not run and `notes` under them."""
    from hla_bench.results import styles

    names = {p["mixer"]: p.get("name") for p in points}
    decode = points[0]["mode"] == "decode"
    memory_key, memory_label = (("state_bytes", "state held: KV cache or fixed state") if decode
                                else ("peak_memory_bytes", "peak memory above inputs"))
    shown = styles.ordered([baseline, *labels] if baseline and baseline not in labels
                           else labels, names)
    mine = [p for p in points if p["mixer"] in shown]
    figure = plt.figure(figsize=(15.5, 4.6), layout="constrained")
    time_ax, ratio_ax, memory_ax = figure.subplots(1, 3)
    times = _times(mine)
    base = times.get(baseline or "", {})
    values: dict[str, list[float]] = {"time": [], "ratio": [], "memory": []}
    for label in shown:
        look = styles.style(label, names.get(label)).line()
        series = sorted((p for p in mine if p["mixer"] == label and p["status"] == "ok"),
                        key=lambda p: p["seq_len"])
        if not series:
            continue
        width = 2.4 if label == baseline else 1.5
        ts = [p["seq_len"] for p in series]
        ms = [p["median_ms"] for p in series]
        time_ax.plot(ts, ms, label=label, linewidth=width, markersize=5, **look)
        values["time"] += ms
        band = [(p["seq_len"], p["p20_ms"], p["p80_ms"]) for p in series
                if p.get("p20_ms") and p.get("p80_ms")]
        if len(band) > 1:
            time_ax.fill_between(*zip(*band), color=look["color"], alpha=0.15, linewidth=0)
            values["time"] += [low for _, low, _ in band] + [high for _, _, high in band]
        ratios = [(t, m / base[t]) for t, m in zip(ts, ms) if t in base]
        if ratios:
            ratio_ax.plot(*zip(*ratios), label=label, linewidth=width, markersize=5, **look)
            values["ratio"] += [r for _, r in ratios]
        used = [(p["seq_len"], p[memory_key]) for p in series if p.get(memory_key)]
        if used:
            memory_ax.plot(*zip(*used), label=label, linewidth=width, markersize=5, **look)
            values["memory"] += [m for _, m in used]
    seq_lens = {p["seq_len"] for p in points}
    log_axis(time_ax, "y", values["time"], 10)
    time_ax.set_ylabel("median time (ms)")
    time_ax.set_title("time", fontsize=9)
    if baseline:
        ratio_ax.axhline(1.0, color=styles.color(styles.base_name(baseline, names.get(baseline))),
                         linestyle="--", linewidth=1)
        log_axis(ratio_ax, "y", values["ratio"] + [1.0], 2, lambda v: f"{v:g}x")
        ratio_ax.set_ylabel(f"time / {baseline}'s time")
        ratio_ax.set_title(f"ratio to {baseline} (lower is faster)", fontsize=9)
    log_axis(memory_ax, "y", values["memory"], 2, format_bytes_tick)
    memory_ax.set_ylabel(memory_label)
    memory_ax.set_title("memory" if not decode else "state", fontsize=9)
    for ax in (time_ax, ratio_ax, memory_ax):
        seq_len_axis(ax, seq_lens)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    legend_outside(figure, [time_ax, ratio_ax, memory_ax])
    figure.suptitle(title, fontsize=10)
    failed = _failure_lines([p for p in points if p["mixer"] in shown])
    notes_under(figure, (["did not run:"] + [f"  {line}" for line in failed] if failed else [])
                + notes)
    return figure


def _family_of(label: str, names: dict[str, str]) -> str:
    from hla_bench.results import styles

    return styles.family(styles.base_name(label, names.get(label)))


def _view_family(suffix: str) -> str:
    """The family of a view's file suffix: "-hla" and "-hla-2" -> "hla"."""
    return suffix[1:].split("-", 1)[0]


def write_bench_plots(data: dict[str, Any], out_dir: str | Path, fmt: str,
                      title: Callable[[list[dict], str, str], str],
                      xlabel: Callable[[list[dict]], str], baseline: str | None = None,
                      patterns: str | None = None) -> list[Path]:
    """The speed figures of a bench file, one per (sweep, mode) and view (`bench_figure`):
    `SWEEP-MODE.FMT`; past styles.MAX_SERIES series, that file is the overview and
    `SWEEP-MODE-FAMILY.FMT` hold each family (`styles.split_views`). The ratio panel's
    baseline: `baseline` where the group has it, else the fastest linear-attention mixer
    (`default_baseline`). `patterns` (`select`) chooses the mixers drawn, all in one figure
    per group; a group none of whose mixers matches is left out."""
    from hla_bench.results import styles
    from hla_bench.results.records import iter_groups

    plt, out_dir = pyplot_for(out_dir, fmt)
    written = []
    for (sweep, mode), points in iter_groups(data["points"]):
        names = {p["mixer"]: p.get("name") for p in points}
        labels = list(dict.fromkeys(p["mixer"] for p in points))
        ran = set(_times(points))
        base = baseline if baseline in ran else default_baseline(points)
        if patterns:
            chosen = select(labels, names, patterns)
            if not chosen:
                continue
            views = [("", chosen)]
        else:
            views = styles.split_views([label for label in labels if label in ran], names,
                                       _ratio_rank(_times(points), base), base)
            # mixers that never ran: listed under the overview and their family's view,
            # never a series
            never = [label for label in labels if label not in ran]
            views = [(suffix, shown + [label for label in never if not suffix
                                       or _family_of(label, names) == _view_family(suffix)])
                     for suffix, shown in views]
        overview_left = ([label for label in ran if label not in views[0][1]]
                         if len(views) > 1 else [])
        for suffix, shown in views:
            group_title = title(points, sweep, mode)
            notes = []
            if suffix:
                family = styles.family_title(_view_family(suffix))
                group_title += f"\n{family}" + (f", beside {base}" if base else "")
            elif overview_left:
                notes.append("overview: the fastest variant of each mixer, "
                             f"{styles.MAX_SERIES} series at most; in the family figures "
                             f"{sweep}-{mode}-FAMILY.{fmt} also: "
                             + ", ".join(styles.ordered(overview_left, names)))
            figure = bench_figure(plt, points, shown, base, group_title, xlabel(points), notes)
            written.append(save_figure_tight(figure, plot_path(out_dir, f"{sweep}-{mode}{suffix}", fmt)))
    return written
