"""What every plot of the report shares: the formats, a headless pyplot, the sequence-length
axis, saving a figure."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from hla_bench.engine.config import format_seq_len

PLOT_FORMATS = ("png", "svg", "pdf")


def save_figure(figure: Any, path: Path, dpi: int = 110) -> Path:
    """Lay out, write and close a matplotlib figure; returns `path`."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


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
