"""Render recall results (`kind: recall` YAML): a table per task setting and PNG plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tasks.train import summarize


def accuracy_style(score: float | None) -> str:
    if score is None:
        return "red"
    return "bold green" if score > 0.99 else "green" if score > 0.9 else "yellow" if score > 0.5 else "red"


def format_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def _cell_texts(cell: dict | None) -> tuple[str, str, str]:
    """(accuracy with lr, state size, rich style) of one summary cell."""
    if cell is None:
        return "", "", ""
    if cell["score"] is None:
        return cell["status"], "-", "red"
    return (f"{cell['score']:.3f} ({cell['lr']:g})", format_bytes(cell.get("state_bytes")),
            accuracy_style(cell["score"]))


def _widths(by_mixer: dict) -> list[int]:
    return sorted({int(d) for cells in by_mixer.values() for d in cells})


def _cell(cells: dict, width: int) -> dict | None:
    return cells.get(width) or cells.get(str(width))


def setting_table(setting: str, by_mixer: dict) -> Table:
    """Rows: mixers; columns: d_model, each cell the best accuracy over lrs and its lr."""
    widths = _widths(by_mixer)
    table = Table(title=setting)
    table.add_column("mixer")
    for width in widths:
        table.add_column(f"d={width}\nacc (lr)", justify="right")
        table.add_column(f"d={width}\nstate", justify="right")
    for mixer, cells in by_mixer.items():
        row = [mixer]
        for width in widths:
            accuracy, state, style = _cell_texts(_cell(cells, width))
            row += [f"[{style}]{escape(accuracy)}[/]" if style else accuracy, state]
        table.add_row(*row)
    return table


def setting_markdown(setting: str, by_mixer: dict) -> str:
    """The same table as GitHub markdown: accuracy (best lr) and state size per d_model."""
    widths = _widths(by_mixer)
    lines = [f"**{setting}** (test accuracy, best lr in brackets; recurrent state per sequence)",
             "", "| mixer | " + " | ".join(f"d={w} | state" for w in widths) + " |",
             "| --- |" + " ---: | ---: |" * len(widths)]
    for mixer, cells in by_mixer.items():
        texts = [text for width in widths for text in _cell_texts(_cell(cells, width))[:2]]
        lines.append(f"| {mixer} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


def plot_recall(summary: dict, plots_dir: str | Path) -> list[Path]:
    """accuracy vs d_model (one panel per setting) and accuracy vs state size (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    settings = list(summary)
    paths = []
    for name, x_key, x_label in (("recall_accuracy_vs_d_model.png", "d_model", "d_model"),
                                 ("recall_accuracy_vs_state.png", "state_bytes",
                                  "recurrent state per sequence (bytes, log scale)")):
        figure, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.8),
                                    squeeze=False, sharey=True)
        for axis, setting in zip(axes[0], settings):
            for mixer, cells in summary[setting].items():
                points = sorted(
                    (int(d) if x_key == "d_model" else cell.get("state_bytes"), cell["score"])
                    for d, cell in cells.items()
                    if cell["score"] is not None and (x_key == "d_model" or cell.get("state_bytes")))
                if points:
                    axis.plot(*zip(*points), marker="o", label=mixer)
            axis.set_title(setting, fontsize=8)
            axis.set_xlabel(x_label)
            axis.set_xscale("log", base=2)
            axis.set_ylim(-0.02, 1.02)
            axis.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy (best lr)")
        axes[0][-1].legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(plots_dir / name, dpi=120)
        plt.close(figure)
        paths.append(plots_dir / name)
    return paths


def render_recall(data: dict, console: Console, plots_dir: str | Path | None = None,
                  markdown: bool = False) -> list[Path]:
    """Print one table per task setting (GitHub markdown with `markdown`); with `plots_dir`,
    write the PNG plots there and return their paths."""
    runs = data.get("runs") or []
    summary = summarize(runs)
    env = data.get("environment") or {}
    config = data.get("config") or {}
    console.print(f"[bold]recall[/] (schema {data.get('schema_version')}): {len(runs)} runs, "
                  f"device {config.get('device', '?')}, {data.get('seconds', '?')} s; "
                  f"torch {env.get('torch', '?')}")
    for setting, by_mixer in summary.items():
        if markdown:
            console.print(setting_markdown(setting, by_mixer), markup=False, highlight=False,
                          soft_wrap=True)
        else:
            console.print(setting_table(setting, by_mixer))
    failed = [run for run in runs if run.get("status") != "ok"]
    for run in failed:
        where = f"{run['mixer']} d={run['d_model']} lr={run['lr']:g} [{run['setting']}]"
        console.print(f"[red]{run['status']}[/]: " + escape(f"{where}: {run.get('error', '')}"))
    if plots_dir is None or not summary:
        return []
    paths = plot_recall(summary, plots_dir)
    for path in paths:
        console.print(f"plot written to {path}")
    return paths
