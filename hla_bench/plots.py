"""What every plot of the report shares: the formats, a headless pyplot, the sequence-length
axis, a plot's path (`plot_path`: a name read from a results file must be one plain file-name
component) and saving a figure (never through a symbolic link)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from hla_bench.engine.config import format_seq_len
from hla_bench.safe_files import (UnsafeNameError, name_problem, path_in, plain_name,
                                  replace_atomically)

PLOT_FORMATS = ("png", "svg", "pdf")


def save_figure(figure: Any, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close a matplotlib figure; returns `path`. The figure is drawn in
    memory and written with `safe_files.replace_atomically` (never through a symbolic link
    at `path`; a reader sees the old plot or the whole new one); its format is `path`'s
    suffix."""
    import io

    import matplotlib.pyplot as plt

    figure.tight_layout()
    drawn = io.BytesIO()
    try:
        figure.savefig(drawn, dpi=dpi, format=Path(path).suffix.lstrip(".") or None)
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
        from hla_bench.recall_report import PLOT_NAMES

        return list(PLOT_NAMES)
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
    """A log2 x axis ticked at each sequence length, labelled as configs write them."""
    import matplotlib.ticker

    seq_lens = sorted(seq_lens)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [format_seq_len(t) for t in seq_lens])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
