"""Recall results (`kind: recall` YAML): the summary over learning rates and seeds, tables
and plots.

Scoring. For each (setting, mixer, d_model) and seed, the learning rate is chosen on the
validation split (carved from the training data) and that run's test accuracy, scored once
when it stopped, is the cell's score ("val-picked"). Zoology picks the best test accuracy
over learning rates; that number is reported beside it, labelled "test-picked". A cell
shows the mean over seeds with the sample standard deviation.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

SPLIT_NAMES = {"val": "val-picked", "test": "test-picked (as Zoology)"}
REQUIRED_RUN_FIELDS = ("setting", "mixer", "d_model", "lr", "seed", "status")


class RecallFileError(ValueError):
    """A recall results file that does not follow the schema; the message names the field."""


def validate_recall(data: Any) -> None:
    """Raise RecallFileError unless `data` is a whole recall results file."""
    if not isinstance(data, dict) or data.get("kind") != "recall":
        raise RecallFileError("not a recall results file (no `kind: recall`)")
    for key, kind in (("config", dict), ("environment", dict), ("runs", list)):
        if not isinstance(data.get(key), kind):
            raise RecallFileError(f"field `{key}` must be a {kind.__name__}")
    for index, run in enumerate(data["runs"]):
        if not isinstance(run, dict):
            raise RecallFileError(f"runs[{index}] must be a mapping")
        missing = [key for key in REQUIRED_RUN_FIELDS if key not in run]
        if missing:
            raise RecallFileError(f"runs[{index}] lacks {', '.join(missing)}")


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def _pick(runs: list[dict], by: str) -> dict:
    """The run with the best `by` accuracy (ties: the smaller learning rate)."""
    return max(sorted(runs, key=lambda r: r["lr"]), key=lambda r: r[f"{by}_accuracy"] or 0.0)


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    """{setting: {mixer: {d_model: cell}}}; a cell holds, over seeds, the val-picked and
    test-picked scores ({mean, std, min, max, n}), the chosen learning rates, state bytes,
    and means of the chosen runs' steps, steps to 0.5 / 0.9 and in-context value rate. A
    cell whose runs all failed has `score: None` and the failure."""
    cells: dict[tuple, dict[int, list[dict]]] = {}
    for run in runs:
        key = (run["setting"], run["mixer"], int(run["d_model"]))
        cells.setdefault(key, {}).setdefault(int(run.get("seed", 0)), []).append(run)
    table: dict[str, dict[str, dict[int, dict]]] = {}
    for (setting, mixer, d_model), by_seed in cells.items():
        ok = {seed: [r for r in seed_runs if r.get("status") == "ok"]
              for seed, seed_runs in by_seed.items()}
        ok = {seed: seed_runs for seed, seed_runs in ok.items() if seed_runs}
        any_run = next(iter(by_seed.values()))[0]
        cell: dict[str, Any] = {"state_bytes": any_run.get("state_bytes"),
                                "runs": sum(len(r) for r in by_seed.values())}
        if not ok:
            failed = [r for seed_runs in by_seed.values() for r in seed_runs]
            cell.update({"score": None, "status": failed[0].get("status"),
                         "error": failed[0].get("error", "")})
        else:
            picked = {seed: _pick(seed_runs, "val") for seed, seed_runs in sorted(ok.items())}
            best_test = {seed: _pick(seed_runs, "test") for seed, seed_runs in sorted(ok.items())}
            cell.update({
                "status": "ok",
                "score": _spread([p["test_accuracy"] for p in picked.values()]),
                "test_picked": _spread([p["test_accuracy"] for p in best_test.values()]),
                "lrs": [p["lr"] for p in picked.values()],
                "seeds": list(picked),
                "steps": statistics.fmean(p["steps"] for p in picked.values()),
                "in_context_rate": _mean_or_none([p.get("in_context_rate") for p in picked.values()]),
                "steps_to_0.5": _mean_or_none([p.get("steps_to_0.5") for p in picked.values()]),
                "steps_to_0.9": _mean_or_none([p.get("steps_to_0.9") for p in picked.values()]),
                "state_bytes": next(iter(picked.values())).get("state_bytes"),
            })
        table.setdefault(setting, {}).setdefault(mixer, {})[d_model] = cell
    return table


def _mean_or_none(values: list) -> float | None:
    """The mean when every value is known, else None (a run that never got there)."""
    return None if not values or any(v is None for v in values) else statistics.fmean(values)


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
    return f"{size:.1f} GiB"


def format_lr(lr: float) -> str:
    """A learning rate in two significant digits: 3e-3, 4.6e-4."""
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def format_score(score: dict | None) -> str:
    if score is None:
        return "-"
    text = f"{score['mean']:.3f}"
    return text + (f"±{score['std']:.3f}" if score["n"] > 1 else "")


def _cell_row(mixer: str, d_model: int, cell: dict) -> list[str]:
    if cell["score"] is None:
        return [mixer, str(d_model), format_bytes(cell.get("state_bytes")), cell["status"],
                "", "", "", "", ""]
    score = cell["score"]
    lrs = sorted(set(cell["lrs"]))
    steps = f"{cell['steps']:.0f}"
    in_context = "-" if cell["in_context_rate"] is None else f"{cell['in_context_rate']:.2f}"
    return [mixer, str(d_model), format_bytes(cell.get("state_bytes")), format_score(score),
            str(score["n"]), f"{cell['test_picked']['mean']:.3f}",
            ",".join(format_lr(lr) for lr in lrs), in_context, steps]


COLUMNS = ("mixer", "d_model", "state", "val-picked", "seeds", "test-picked", "lr", "in-ctx", "steps")
# Short headers for the terminal table, explained in its caption.
SHORT = {"d_model": "d", "val-picked": "val", "seeds": "n", "test-picked": "test", "in-ctx": "ctx"}


def setting_table(setting: str, by_mixer: dict) -> Table:
    """One row per (mixer, d_model): state size, the val-picked test accuracy (mean ± std
    over seeds), the test-picked one (Zoology's), chosen lrs, in-context rate, steps."""
    table = Table(title=setting, box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="test accuracy, mean ±std over n seeds, of the lr chosen on "
                  "validation (val), and the mean of the lr chosen on test as Zoology does "
                  "(test); d: d_model; state: "
                  "recurrent state per sequence; ctx: share of answers that are a value of "
                  "the context")
    rows = [(_cell_row(mixer, int(d_model), cells[d_model]), cells[d_model])
            for mixer, cells in by_mixer.items() for d_model in sorted(cells, key=int)]
    seeds = {row[4] for row, cell in rows if cell["score"] is not None}
    shown = [index for index, column in enumerate(COLUMNS)
             if not (column == "seeds" and len(seeds) <= 1)]  # one seed count: in the caption
    if len(seeds) == 1:
        table.caption += f"; n = {seeds.pop()}"
    for index in shown:
        column = COLUMNS[index]
        header = SHORT.get(column, column)
        widest = max([len(header)] + [len(row[index]) for row, _ in rows])
        # names stay whole; the other cells fold only when the terminal is too narrow
        table.add_column(header, justify="left" if index == 0 else "right", min_width=widest,
                         no_wrap=index == 0, overflow="fold")
    for row, cell in rows:
        score = cell["score"]["mean"] if cell["score"] else None
        row = [f"[{accuracy_style(score)}]{text}[/]" if index == 3 else text
               for index, text in enumerate(row)]
        table.add_row(*(row[index] for index in shown))
    return table


def setting_markdown(setting: str, by_mixer: dict) -> str:
    """The same table as GitHub markdown."""
    lines = [f"**{setting}** (test accuracy: lr chosen on validation, mean ± std over seeds; "
             "test-picked: lr chosen on test, as Zoology)", "",
             "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    for mixer, cells in by_mixer.items():
        for d_model in sorted(cells, key=int):
            lines.append("| " + " | ".join(_cell_row(mixer, int(d_model), cells[d_model])) + " |")
    return "\n".join(lines) + "\n"


def mixer_colors(names: list[str]) -> dict[str, Any]:
    """One colour per mixer, stable across figures (sorted names on tab10/tab20)."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: palette(index % palette.N) for index, name in enumerate(sorted(names))}


def plot_recall(summary: dict, plots_dir: str | Path, fmt: str = "png") -> list[Path]:
    """Accuracy (val-picked, error bars: std over seeds) against recurrent state per sequence
    and against d_model, one panel per setting, one point per (mixer, d_model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    settings = list(summary)
    colors = mixer_colors(sorted({m for by_mixer in summary.values() for m in by_mixer}))
    paths = []
    for name, x_key, x_label in (("recall_accuracy_vs_state", "state_bytes",
                                  "recurrent state per sequence, all layers (bytes)"),
                                 ("recall_accuracy_vs_d_model", "d_model", "d_model")):
        figure, axes = plt.subplots(1, len(settings), figsize=(4.8 * len(settings), 4.0),
                                    squeeze=False, sharey=True)
        for axis, setting in zip(axes[0], settings):
            for mixer, cells in summary[setting].items():
                points = []
                for d_model, cell in cells.items():
                    x = int(d_model) if x_key == "d_model" else cell.get("state_bytes")
                    if cell["score"] is not None and x:
                        points.append((x, cell["score"]["mean"], cell["score"]["std"]))
                if points:
                    xs, ys, errors = zip(*sorted(points))
                    axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=mixer,
                                  color=colors[mixer])
            axis.set_title(textwrap.fill(setting, 44), fontsize=8)  # whole, on as many lines
            axis.set_xlabel(x_label)
            axis.set_xscale("log", base=2)
            axis.set_ylim(-0.02, 1.02)
            axis.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy (lr chosen on validation)")
        axes[0][-1].legend(fontsize=7)
        figure.tight_layout()
        path = plots_dir / f"{name}.{fmt}"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        paths.append(path)
    return paths


def render_recall(data: dict, console: Console, plots_dir: str | Path | None = None,
                  markdown: bool = False) -> list[Path]:
    """Print one table per task setting (GitHub markdown with `markdown`); with `plots_dir`,
    write the plots there and return their paths."""
    validate_recall(data)
    runs = data["runs"]
    summary = summarize(runs)
    env, config = data["environment"], data["config"]
    header = (f"recall (schema {data.get('schema_version')}): {len(runs)} runs, device "
              f"{config.get('device', '?')}, {data.get('seconds', '?')} s; torch "
              f"{env.get('torch', '?')}" + ("" if data.get("complete", True) else "; INCOMPLETE"))
    console.print(header, markup=False, highlight=False, soft_wrap=True)
    for setting, by_mixer in summary.items():
        if markdown:
            console.print(setting_markdown(setting, by_mixer), markup=False, highlight=False,
                          soft_wrap=True)
        else:
            console.print(setting_table(setting, by_mixer))
    for run in runs:
        if run.get("status") != "ok":
            where = f"{run['mixer']} d={run['d_model']} lr={run['lr']:g} seed={run.get('seed', 0)} [{run['setting']}]"
            console.print(f"{run['status']}: {where}: {run.get('error', '')}", markup=False,
                          highlight=False, soft_wrap=True)
    if plots_dir is None or not summary:
        return []
    paths = plot_recall(summary, plots_dir)
    for path in paths:
        console.print(f"plot written to {path}", markup=False, highlight=False, soft_wrap=True)
    return paths

