"""Recall results (`kind: recall` YAML): the summary over learning rates and seeds, tables
and plots.

Scoring. For each (setting, mixer, d_model) and seed, the (learning rate, weight decay) of
the grid is chosen on the validation split (carved from the training data) and that run's
test accuracy, scored once when it stopped, is the cell's score ("val-picked"). Beside it,
"test-picked" is the best test accuracy over the grid: as Zoology, of each run's final test
accuracy; or, where the runs recorded their test accuracy at their evaluation of lowest
validation loss (`test_at_best_val`), the best of that, MAD-lab's pick (its runs report the
test accuracy of their epoch of lowest test perplexity, and a setting the best run of its
grid; here validation, carrying test targets, stands in for test in choosing the epoch). A
cell shows the mean over seeds with the sample standard deviation.

Zoology view (`zoology_rows`): for a setting that is a panel of Zoology's Figure 2 (MQAR,
vocab 8192, its sequence length and key-value pairs, zero fillers), the test-picked accuracy
of each mixer by d_model (Zoology's own pick) beside the accuracies Zoology publishes there
(configs/published/zoology-fig2.yaml, read from its figure).

MAD score view (`mad_scores`): per task of the MAD suite, the mean over its settings of the
cells' scores, val-picked and test-picked, beside MAD-lab's published scores
(configs/published/mad-lab.yaml): under its mixer where the file maps an architecture to one,
after every mixer otherwise.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path
from typing import Any

import yaml
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hla_bench import configs
from hla_bench.results.plots import RECALL_PLOT_NAMES, plot_path, pyplot_for
from hla_bench.results.tables import print_table, table_lines
from tasks.mad import MAD_TASKS, mad_settings

MAD_REFERENCE = configs.published("mad-lab.yaml")
ZOOLOGY_REFERENCE = configs.published("zoology-fig2.yaml")
FRONTIER_REFERENCE = configs.published("zoology-frontier.yaml")
METRIC_NAMES = {"micro": "accuracy over the labelled positions",
                "mad-macro": "MAD-lab's macro accuracy per batch of 128, averaged"}
def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def _pick(runs: list[dict], key: str) -> dict:
    """The run with the best `key` (ties: the smaller learning rate, then the smaller weight
    decay)."""
    return max(sorted(runs, key=lambda r: (r["lr"], r.get("weight_decay") or 0.0)),
               key=lambda r: r[key] or 0.0)


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    """{setting: {mixer: {d_model: cell}}}; a cell holds, over seeds, the val-picked score
    and the test-picked ones ({mean, std, min, max, n}): `test_picked` of the final test
    accuracies (Zoology's), `test_picked_mad` of the test accuracies at the lowest
    validation loss (MAD-lab's; None unless every run of the cell recorded one); the chosen
    learning rates and weight decays, the weight decays of the grid, the metric, state
    bytes, and means of the chosen runs' steps, steps to 0.5 / 0.9 and in-context value
    rate. A cell whose runs all failed has `score: None` and the failure."""
    cells: dict[tuple, dict[int, list[dict]]] = {}
    for run in runs:
        key = (run["setting"], run.get("variant") or run["mixer"], int(run["d_model"]))
        cells.setdefault(key, {}).setdefault(int(run.get("seed", 0)), []).append(run)
    table: dict[str, dict[str, dict[int, dict]]] = {}
    for (setting, mixer, d_model), by_seed in cells.items():
        ok = {seed: [r for r in seed_runs if r.get("status") == "ok"]
              for seed, seed_runs in by_seed.items()}
        ok = {seed: seed_runs for seed, seed_runs in ok.items() if seed_runs}
        any_run = next(iter(by_seed.values()))[0]
        cell: dict[str, Any] = {"state_bytes": any_run.get("state_bytes"),
                                "state_bytes_per_layer": any_run.get("state_bytes_per_layer"),
                                "runs": sum(len(r) for r in by_seed.values())}
        if not ok:
            failed = [r for seed_runs in by_seed.values() for r in seed_runs]
            cell.update({"score": None, "status": failed[0].get("status"),
                         "error": failed[0].get("error", "")})
        else:
            picked = {seed: _pick(seed_runs, "val_accuracy") for seed, seed_runs in sorted(ok.items())}
            best_test = {seed: _pick(seed_runs, "test_accuracy")
                         for seed, seed_runs in sorted(ok.items())}
            at_best = "test_accuracy_at_best_val_loss"
            mad_pick = None
            if all(r.get(at_best) is not None for seed_runs in ok.values() for r in seed_runs):
                mad_pick = _spread([_pick(seed_runs, at_best)[at_best]
                                    for _, seed_runs in sorted(ok.items())])
            cell.update({
                "status": "ok",
                "score": _spread([p["test_accuracy"] for p in picked.values()]),
                "test_picked": _spread([p["test_accuracy"] for p in best_test.values()]),
                "test_picked_mad": mad_pick,
                "metric": next(iter(picked.values())).get("metric", "micro"),
                "lrs": [p["lr"] for p in picked.values()],
                "weight_decays": [p.get("weight_decay") for p in picked.values()],
                "grid_weight_decays": sorted({r.get("weight_decay") for seed_runs in ok.values()
                                              for r in seed_runs}, key=lambda v: v or 0.0),
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


def _test_rule(cells: list[dict]) -> str:
    """"mad-lab" when every scored cell has MAD-lab's test pick, else "zoology"."""
    scored = [cell for cell in cells if cell["score"] is not None]
    return "mad-lab" if scored and all(c["test_picked_mad"] for c in scored) else "zoology"


def _cell_row(mixer: str, d_model: int, cell: dict, rule: str = "zoology") -> list[str]:
    if cell["score"] is None:
        return [mixer, str(d_model), format_bytes(cell.get("state_bytes")), cell["status"],
                "", "", "", "", "", ""]
    score = cell["score"]
    lrs = sorted(set(cell["lrs"]))
    decays = sorted({wd for wd in cell["weight_decays"] if wd is not None})
    steps = f"{cell['steps']:.0f}"
    in_context = "-" if cell["in_context_rate"] is None else f"{cell['in_context_rate']:.2f}"
    test = cell["test_picked_mad"] if rule == "mad-lab" else cell["test_picked"]
    return [mixer, str(d_model), format_bytes(cell.get("state_bytes")), format_score(score),
            str(score["n"]), f"{test['mean']:.3f}",
            ",".join(format_lr(lr) for lr in lrs), ",".join(f"{wd:g}" for wd in decays),
            in_context, steps]


COLUMNS = ("mixer", "d_model", "state", "val-picked", "seeds", "test-picked", "lr", "wd",
           "in-ctx", "steps")
# Short headers for the terminal table, explained in its caption.
SHORT = {"d_model": "d", "val-picked": "val", "seeds": "n", "test-picked": "test", "in-ctx": "ctx"}
TEST_RULES = {"zoology": "the best final test accuracy over the grid, as Zoology",
              "mad-lab": "the best over the grid of each run's test accuracy at its lowest "
                         "validation loss, as MAD-lab"}


def _table_notes(cells: list[dict]) -> tuple[str, bool]:
    """The caption's words for the metric and the test pick, and whether the cells have a
    weight-decay grid (then the chosen weight decay gets a column)."""
    metrics = sorted({cell["metric"] for cell in cells if cell["score"] is not None})
    metric = "; ".join(METRIC_NAMES.get(m, m) for m in metrics) or METRIC_NAMES["micro"]
    rule = _test_rule(cells)
    grid = any(len(cell.get("grid_weight_decays") or ()) > 1 for cell in cells)
    return f"metric: {metric}; test-picked: {TEST_RULES[rule]}", grid


def _rows(by_mixer: dict) -> list[tuple[str, int, dict]]:
    return [(mixer, int(d_model), cells[d_model])
            for mixer, cells in by_mixer.items() for d_model in sorted(cells, key=int)]


def setting_table(setting: str, by_mixer: dict) -> Table:
    """One row per (mixer, d_model): state size, the val-picked test accuracy (mean ± std
    over seeds), the test-picked one, chosen lrs (and weight decays, given a grid of them),
    in-context rate, steps."""
    cells = [cell for _, _, cell in _rows(by_mixer)]
    notes, grid = _table_notes(cells)
    rule = _test_rule(cells)
    table = Table(title=escape(setting), box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="test accuracy, mean ±std over n seeds, of the (lr, wd) chosen on "
                  "validation (val), and the mean of the test-picked one (test); d: d_model; "
                  "state: recurrent state per sequence; ctx: share of answers that are a "
                  f"value of the context; {notes}")
    rows = [(_cell_row(mixer, d_model, cell, rule), cell) for mixer, d_model, cell in _rows(by_mixer)]
    seeds = {row[4] for row, cell in rows if cell["score"] is not None}
    shown = [index for index, column in enumerate(COLUMNS)
             if not (column == "seeds" and len(seeds) <= 1)  # one seed count: in the caption
             and not (column == "wd" and not grid)]
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
        row = [f"[{accuracy_style(score)}]{escape(text)}[/]" if index == 3 else escape(text)
               for index, text in enumerate(row)]
        table.add_row(*(row[index] for index in shown))
    return table


def setting_markdown(setting: str, by_mixer: dict) -> str:
    """The same table as GitHub markdown."""
    cells = [cell for _, _, cell in _rows(by_mixer)]
    notes, grid = _table_notes(cells)
    rule = _test_rule(cells)
    shown = [index for index, column in enumerate(COLUMNS) if not (column == "wd" and not grid)]
    lines = [f"**{setting}** (test accuracy: (lr, wd) chosen on validation, mean ± std over "
             f"seeds; {notes})", "",
             "| " + " | ".join(COLUMNS[i] for i in shown) + " |",
             "| --- |" + " ---: |" * (len(shown) - 1)]
    for mixer, d_model, cell in _rows(by_mixer):
        row = _cell_row(mixer, d_model, cell, rule)
        lines.append("| " + " | ".join(row[i] for i in shown) + " |")
    return "\n".join(lines) + "\n"


def load_reference(path: str | Path) -> dict | None:
    """Published scores (a file of configs/published/), or None without the file."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError:
        return None


# --- the Zoology view ------------------------------------------------------------------------

def zoology_panel(run: dict, reference: dict) -> int | None:
    """The sequence length of the Figure 2 panel whose setting `run` trained on, or None."""
    params = run.get("params") or {}
    panel = (reference.get("settings") or {}).get(params.get("seq_len"))
    if run.get("task") != "mqar" or panel is None or params.get("random_non_queries", True):
        return None
    if params.get("vocab_size") != panel["vocab_size"] or panel["num_kv_pairs"] is None:
        return None
    return params["seq_len"] if params.get("num_kv_pairs") == panel["num_kv_pairs"] else None


def _published(reference: dict, seq_len: int) -> dict[str, dict[int, float]]:
    """{architecture: {d_model: accuracy}} that Zoology plots in its `seq_len` panel."""
    return {name: {int(d): v for d, v in by_seq[seq_len].items()}
            for name, by_seq in (reference.get("scores") or {}).items() if by_seq.get(seq_len)}


def zoology_rows(runs: list[dict], summary: dict, reference: dict) -> dict[str, tuple[list[int], list[list[str]]]]:
    """{setting: (d_models, rows)} for the settings that are Figure 2 panels: a row per
    mixer of `runs` (its test-picked mean accuracy at each d_model, Zoology's pick: the best
    final test accuracy over the learning rates; "-" where not run or failed), then a row
    per architecture Zoology plots there ("Zoology: NAME", "(= MIXER)" where hla-bench runs
    the same mixer; "-" where its marker is hidden)."""
    panels = {run["setting"]: zoology_panel(run, reference) for run in runs}
    matches = reference.get("architectures_in_hla_bench") or {}
    views = {}
    for setting, by_mixer in summary.items():
        seq_len = panels.get(setting)
        if seq_len is None:
            continue
        published = _published(reference, seq_len)
        d_models = sorted({int(d) for cells in by_mixer.values() for d in cells}
                          | {d for values in published.values() for d in values})
        rows = []
        for mixer, cells in by_mixer.items():
            by_d = {int(d): cell for d, cell in cells.items()}
            rows.append([mixer] + [f"{by_d[d]['test_picked']['mean']:.3f}"
                                   if d in by_d and by_d[d]["score"] is not None else "-"
                                   for d in d_models])
        for name, values in published.items():
            label = f"Zoology: {name}" + (f" (= {matches[name]})" if name in matches else "")
            rows.append([label] + [f"{values[d]:.2f}" if d in values else "-" for d in d_models])
        views[setting] = (d_models, rows)
    return views


def _zoology_caption(reference: dict) -> str:
    return ("test-picked accuracy by d_model (the best final test accuracy over the "
            "learning rates, as Zoology picks) beside Zoology's Figure 2, read from its "
            f"figure (±{reference['precision']}; configs/published/zoology-fig2.yaml); "
            "-: not run, or a hidden marker")


def zoology_table(setting: str, d_models: list[int], rows: list[list[str]], reference: dict) -> Table:
    table = Table(title=escape(f"Zoology Figure 2: {setting}"), box=box.SIMPLE_HEAD,
                  pad_edge=False, caption=_zoology_caption(reference))
    table.add_column("mixer", no_wrap=True)
    for d_model in d_models:
        table.add_column(f"d {d_model}", justify="right")
    for row in rows:
        table.add_row(*(escape(text) for text in row))
    return table


def zoology_markdown(setting: str, d_models: list[int], rows: list[list[str]], reference: dict) -> str:
    lines = [f"**Zoology Figure 2: {setting}** ({_zoology_caption(reference)})", "",
             "| mixer | " + " | ".join(f"d {d}" for d in d_models) + " |",
             "| --- |" + " ---: |" * len(d_models)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- the MAD score view ---------------------------------------------------------------------

def load_mad_reference(path: str | Path = MAD_REFERENCE) -> dict | None:
    """MAD-lab's published scores (configs/published/mad-lab.yaml), or None without the file."""
    return load_reference(path)


def mad_scores(runs: list[dict], summary: dict | None = None) -> dict[tuple[str, int], dict]:
    """{(mixer, d_model): {task: entry}} for the MAD tasks among `runs`. An entry holds the
    mean over the task's scored settings of the cells' val-picked means (`val`) and
    test-picked means (`test`: MAD-lab's pick where every such cell has it, else Zoology's;
    `rule` names which), the number of settings scored and MAD-lab's number of settings of
    the task (`settings`, `expected`)."""
    summary = summarize(runs) if summary is None else summary
    task_of = {run["setting"]: run.get("task") for run in runs}
    collected: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for setting, by_mixer in summary.items():
        task = task_of.get(setting)
        if task not in MAD_TASKS:
            continue
        for mixer, cells in by_mixer.items():
            for d_model, cell in cells.items():
                if cell["score"] is not None:
                    collected.setdefault((mixer, int(d_model)), {}).setdefault(task, []).append(cell)
    scores: dict[tuple[str, int], dict] = {}
    for key, by_task in collected.items():
        for task, cells in by_task.items():
            rule = _test_rule(cells)
            test = [(c["test_picked_mad"] if rule == "mad-lab" else c["test_picked"])["mean"]
                    for c in cells]
            scores.setdefault(key, {})[task] = {
                "val": statistics.fmean(c["score"]["mean"] for c in cells),
                "test": statistics.fmean(test), "rule": rule, "settings": len(cells),
                "expected": len(mad_settings(task))}
    return dict(sorted(scores.items()))


def _mad_layout(scores: dict, reference: dict | None):
    """(tasks shown, rows of texts, caption) of the MAD score view."""
    shown = [task for task in MAD_TASKS if any(task in row for row in scores.values())]
    complete = len(shown) == len(MAD_TASKS)
    matches = dict((reference or {}).get("architectures_in_hla_bench") or {})
    published = (reference or {}).get("scores") or {}

    def published_cells(values: dict) -> list[str]:
        """An architecture's published scores in the view's columns."""
        return ([f"{values[task]:.3f}" if task in values else "-" for task in shown]
                + ([f"{values.get('mean', math.nan):.3f}"] if complete else []))

    rows = []
    for (mixer, d_model), by_task in scores.items():
        texts = []
        for task in shown:
            entry = by_task.get(task)
            if entry is None:
                texts.append("-")
                continue
            text = f"{entry['val']:.3f} / {entry['test']:.3f}"
            if entry["settings"] < entry["expected"]:
                text += f" ({entry['settings']}/{entry['expected']})"
            texts.append(text)
        if complete:
            full = [by_task.get(task) for task in MAD_TASKS]
            texts.append("-" if None in full else
                         f"{statistics.fmean(e['val'] for e in full):.3f} / "
                         f"{statistics.fmean(e['test'] for e in full):.3f}")
        rows.append([mixer, str(d_model), *texts])
        for architecture, matched in matches.items():
            if matched == mixer and architecture in published:
                rows.append([f"MAD-lab: {architecture} (= {mixer})", "128",
                             *published_cells(published[architecture])])
    # the architectures hla-bench has no mixer for, after every mixer: the published range
    # its mixers' scores fall beside, as Zoology's view shows Zoology's other architectures
    for architecture, values in published.items():
        if architecture not in matches:
            rows.append([f"MAD-lab: {architecture}", "128", *published_cells(values)])
    rules = {entry["rule"] for by_task in scores.values() for entry in by_task.values()}
    caption = ("per task, the mean over its settings of each setting's best run; a cell is "
               "val-picked / test-picked (test-picked: "
               + " or ".join(TEST_RULES[rule] for rule in sorted(rules))
               + "); (n/m): n of MAD-lab's m settings scored")
    if reference is None:
        caption += "; MAD-lab's published scores: configs/published/mad-lab.yaml not found"
    elif published:
        caption += ("; MAD-lab rows: its published scores, a task's mean over all its settings "
                    "(configs/published/mad-lab.yaml, read from its figure); "
                    + ("(= MIXER) marks the hla-bench mixer of the same architecture"
                       if matches else "none of its architectures is an hla-bench mixer"))
        absent = sorted(set(matches.values()) - {mixer for mixer, _ in scores})
        if absent:
            caption += f"; not run here: {', '.join(absent)}"
    return shown + (["mean"] if complete else []), rows, caption


def mad_table(scores: dict, reference: dict | None) -> Table:
    columns, rows, caption = _mad_layout(scores, reference)
    table = Table(title="MAD scores", box=box.SIMPLE_HEAD, pad_edge=False, caption=caption)
    for index, header in enumerate(["mixer", "d", *columns]):
        table.add_column(header, justify="left" if index == 0 else "right",
                         no_wrap=index == 0, overflow="fold")
    for row in rows:
        table.add_row(*(escape(str(cell)) for cell in row))
    return table


def mad_markdown(scores: dict, reference: dict | None) -> str:
    columns, rows, caption = _mad_layout(scores, reference)
    lines = [f"**MAD scores** ({caption})", "", "| " + " | ".join(["mixer", "d", *columns]) + " |",
             "| --- |" + " ---: |" * (len(columns) + 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _mix_pairs(run: dict) -> set[tuple[int, int]]:
    """(seq_len, num_kv_pairs) of each test slice of an MQAR run, from the slices' names."""
    pairs = set()
    for part in run.get("test_slices") or []:
        fields = dict(item.split("=", 1) for item in str(part.get("slice", "")).split()
                      if "=" in item)
        if "seq_len" in fields and "num_kv_pairs" in fields:
            pairs.add((int(fields["seq_len"]), int(fields["num_kv_pairs"])))
    return pairs


def _protocol_settings(runs: list[dict], reference: dict | None) -> set[str]:
    """The settings whose runs were tested on a published frontier file's `test_mix`."""
    if not reference:
        return set()
    protocol = {tuple(pair) for pair in reference["test_mix"]}
    return {run["setting"] for run in runs if _mix_pairs(run) == protocol}


def _is_architecture(mixer: str, names: list[str]) -> bool:
    """Whether `mixer` (a name or variant label) is one of an architecture's hla-bench mixers
    (a name ending in ":" stands for every variant of that mixer)."""
    return any(mixer == name or (name.endswith(":") and mixer.startswith(name))
               for name in names)


def published_points(reference: dict, architecture: str, per_layer: bool) -> list[tuple]:
    """[(label, state bytes, accuracy)] of an architecture's points in every figure of a
    published frontier file (configs/published/zoology-frontier.yaml), the state per layer
    when `per_layer` (the file's states are over its `layers`), by state."""
    points = []
    for figure, by_architecture in reference["points"].items():
        label = f"{reference['labels'][figure]}: {architecture}"
        for state, accuracy in by_architecture.get(architecture) or []:
            points.append((label, round(state / reference["layers"]) if per_layer else state,
                           accuracy))
    return sorted(points, key=lambda point: (point[0], point[1]))


def frontier_rows(runs: list[dict], summary: dict, reference: dict | None = None,
                  per_layer: bool = True) -> dict[str, list[tuple]]:
    """{setting: [(mixer, state bytes, best accuracy, on the front)]} for the settings whose
    runs were tested on a mix of more than one slice: per mixer (variant) and state size,
    the best val-picked accuracy over the mix among its d_models and knobs at that state,
    and whether that point is on the mixer's Pareto front (no smaller state scores as high).
    State is per layer where the runs record it (`per_layer`), else over the whole model.
    With a published frontier `reference`, a setting tested on its `test_mix` also holds the
    published points of each architecture it maps to a mixer of the setting, after that
    architecture's last mixer, as rows (figure: architecture, state, accuracy, None)."""
    mixed = {run["setting"] for run in runs if len(run.get("test_slices") or []) > 1}
    published = _protocol_settings(runs, reference)
    architectures = (reference or {}).get("architectures_in_hla_bench") or {}
    table: dict[str, list[tuple]] = {}
    for setting, by_mixer in summary.items():
        if setting not in mixed:
            continue
        last = {}  # architecture -> the last mixer of the setting that is one of its mixers
        if setting in published:
            for mixer in by_mixer:
                for architecture, names in architectures.items():
                    if _is_architecture(mixer, names):
                        last[architecture] = mixer
        rows = []
        for mixer, cells in by_mixer.items():
            best: dict[int, float] = {}
            for cell in cells.values():
                state = cell.get("state_bytes_per_layer") or cell.get("state_bytes")
                if cell["score"] is None or not state:
                    continue
                best[int(state)] = max(best.get(int(state), 0.0), cell["score"]["mean"])
            front = set(pareto_front(list(best.items())))
            rows += [(mixer, state, accuracy, (state, accuracy) in front)
                     for state, accuracy in sorted(best.items())]
            for architecture in [a for a, m in last.items() if m == mixer]:
                rows += [(*point, None)
                         for point in published_points(reference, architecture, per_layer)]
        if rows:
            table[setting] = rows
    return table


PUBLISHED_POINTS_NOTE = ("published: a point read from the Based paper's or Zoology's figure "
                         "(the accuracy picked on their test mix, within 0.02; state within "
                         "5%; configs/published/zoology-frontier.yaml)")


def _front_mark(front: bool | None) -> str:
    return "published" if front is None else "*" if front else ""


def frontier_markdown(setting: str, rows: list[tuple], per_layer: bool) -> str:
    unit = "state bytes per layer" if per_layer else "state bytes (all layers)"
    lines = [f"**Accuracy against state: {setting}** (best val-picked accuracy over the test "
             f"mix at each {unit} a mixer ran; front: no smaller state of that mixer scores as "
             "high)", "", f"| mixer | {unit} | accuracy | front |", "| --- | ---: | ---: | :---: |"]
    lines += [f"| {mixer} | {state:,} | {accuracy:.3f} | {_front_mark(front)} |"
              for mixer, state, accuracy, front in rows]
    if any(front is None for *_, front in rows):
        lines += ["", PUBLISHED_POINTS_NOTE]
    return "\n".join(lines) + "\n"


def frontier_table(setting: str, rows: list[tuple], per_layer: bool) -> Table:
    unit = "state bytes / layer" if per_layer else "state bytes"
    table = Table(title=f"Accuracy against state: {setting}", box=box.SIMPLE_HEAD,
                  pad_edge=False, caption="best val-picked accuracy over the test mix at each "
                  "state a mixer ran; *: on the mixer's front")
    for index, header in enumerate(["mixer", unit, "accuracy", "front"]):
        table.add_column(header, justify="left" if index == 0 else "right",
                         no_wrap=index == 0, overflow="fold")
    for mixer, state, accuracy, front in rows:
        table.add_row(escape(mixer), f"{state:,}", f"{accuracy:.3f}", _front_mark(front))
    if any(front is None for *_, front in rows):
        table.caption += "; " + PUBLISHED_POINTS_NOTE
    return table


def zoology_curves(runs: list[dict], reference: dict) -> dict[str, dict[str, dict[int, float]]]:
    """{setting: {"Zoology: NAME": {d_model: accuracy}}} for the settings that are Figure 2
    panels (`zoology_panel`)."""
    curves = {}
    for run in runs:
        seq_len = zoology_panel(run, reference)
        if seq_len is not None:
            curves[run["setting"]] = {f"Zoology: {name}": values
                                      for name, values in _published(reference, seq_len).items()}
    return curves


PLOT_COLUMNS = 4  # panels per row of a recall plot (a MAD suite has 66 settings)
PUBLISHED_NOTE = "hollow: published, read from its figure (configs/published/)"


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (state, accuracy) that no other point beats: none with at most their
    state has a higher accuracy; by state, accuracy rising."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


SLICE_PANEL = " | test slice "  # joins a setting and one of its test slices in a panel's name


def slice_summary(runs: list[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    """`summarize` of each test slice of the settings tested on a mix of more than one
    slice, as a setting of its own named SETTING | test slice SLICE: each run's accuracy on
    that slice (the learning rate still picked on validation over the mix, as the setting's
    score) at its state after that slice's length."""
    parts = []
    for run in runs:
        slices = run.get("test_slices") or []
        if run.get("status") != "ok" or len(slices) < 2:
            continue
        for part in slices:
            if part.get("accuracy") is None:
                continue
            per_layer = part.get("state_bytes_per_layer")
            parts.append({**run, "setting": f"{run['setting']}{SLICE_PANEL}{part['slice']}",
                          "test_accuracy": part["accuracy"],
                          "state_bytes_per_layer": per_layer,
                          "state_bytes": (None if per_layer is None or not run.get("n_layers")
                                          else per_layer * run["n_layers"])})
    return summarize(parts)


def _cell_points(by_mixer: dict, x_key: str) -> dict[str, list[tuple]]:
    """{mixer: [(x, mean, std, d_model)]} of one setting's scored cells."""
    points: dict[str, list[tuple]] = {}
    for mixer, cells in by_mixer.items():
        for d_model, cell in cells.items():
            x = int(d_model) if x_key == "d_model" else cell.get("state_bytes")
            if cell["score"] is not None and x:
                points.setdefault(mixer, []).append(
                    (x, cell["score"]["mean"], cell["score"]["std"], int(d_model)))
    return points


def _panel_points(summary: dict, x_key: str,
                  slices: dict | None = None) -> dict[str, dict[str, list[tuple]]]:
    """{panel: {mixer: [(x, mean, std, d_model)]}}: a panel per setting, each followed by
    its test slices' panels (`slices`, `slice_summary`), then "overall" (with more than one
    setting): a mixer's mean score over every setting at a d_model it scored in all of them,
    at the largest state among them (the state that serves each)."""
    panels: dict[str, dict[str, list[tuple]]] = {}
    for setting, by_mixer in summary.items():
        points = _cell_points(by_mixer, x_key)
        if points:
            panels[setting] = points
        for name, slice_mixers in (slices or {}).items():
            slice_points = (_cell_points(slice_mixers, x_key)
                            if name.startswith(setting + SLICE_PANEL) else None)
            if slice_points:
                panels[name] = slice_points
    if len(summary) > 1:
        overall: dict[str, list[tuple]] = {}
        mixers = dict.fromkeys(m for by_mixer in summary.values() for m in by_mixer)
        for mixer in mixers:
            by_d: dict[int, list[tuple]] = {}
            for setting in summary:
                for x, y, _, d in panels.get(setting, {}).get(mixer, []):
                    by_d.setdefault(d, []).append((x, y))
            for d, got in sorted(by_d.items()):
                if len(got) == len(summary):
                    overall.setdefault(mixer, []).append(
                        (max(x for x, _ in got), statistics.fmean(y for _, y in got), 0.0, d))
        panels["overall"] = overall
    return panels


def _published_points(summary: dict, published: dict | None, matches: dict,
                      x_key: str) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{setting: {mixer: [(x, accuracy)]}}: the published accuracies of the architectures
    that are an hla-bench mixer (`matches`: architecture -> mixer), at the d_model they
    were published for, or at the state of that mixer's own cell of that d_model."""
    placed: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for setting, curves in (published or {}).items():
        for label, values in curves.items():
            mixer = matches.get(label.removeprefix("Zoology: "))
            if mixer is None:
                continue
            cells = {int(d): cell for d, cell in summary.get(setting, {}).get(mixer, {}).items()}
            for d_model, accuracy in sorted(values.items()):
                x = d_model if x_key == "d_model" else (cells.get(d_model) or {}).get("state_bytes")
                if x:
                    placed.setdefault(setting, {}).setdefault(mixer, []).append((x, accuracy))
    return placed


def recall_figure(plt: Any, panels: dict, published: dict, mixers: list[str], x_key: str,
                  notes: list[str]) -> Any:
    """One panel per setting and the overall (PLOT_COLUMNS to a row), a series per mixer of
    `mixers` in its family colour: the points (error bars: std over seeds) with, against
    state, each mixer's Pareto front drawn through them, against d_model a line; the
    published points hollow in the same colour; the legend right of the panels and
    `notes` under them."""
    from hla_bench.results import styles
    from hla_bench.results.plots import format_bytes_tick, legend_outside, log_axis, notes_under

    names = list(panels)
    columns = min(len(names), PLOT_COLUMNS)
    rows = math.ceil(len(names) / columns)
    figure = plt.figure(figsize=(4.3 * columns + 1.8, 3.7 * rows + 0.6), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False, sharey=True)
    cells = list(axes.flat)
    for ax in cells[len(names):]:
        ax.set_visible(False)
    hollow = False
    scores = [y for panel in panels.values() for points in panel.values() for _, y, _, _ in points]
    scores += [y for by_mixer in published.values() for points in by_mixer.values()
               for _, y in points]
    # the accuracies a reader compares: from just below the lowest to 1 (a grid that every
    # mixer solves would otherwise draw every line on top of the others at 1.0)
    lowest = min(scores or [0.0])
    bottom = max(0.0, lowest - max(0.003, 0.25 * (1.0 - lowest)))
    bottom = 0.0 if bottom < 0.3 else bottom
    for ax, panel in zip(cells, names):
        xs_all: list[float] = []
        for mixer in mixers:
            look = styles.style(mixer)
            points = sorted(panels[panel].get(mixer, []))
            if points:
                xs, ys, errors, _ = zip(*points)
                xs_all += xs
                if x_key == "state_bytes":
                    front = pareto_front(list(zip(xs, ys)))
                    ax.plot(*zip(*front), color=look.color, linestyle=look.linestyle,
                            marker=look.marker, markersize=5, drawstyle="steps-post",
                            linewidth=1.6, label=mixer)
                    ax.errorbar(xs, ys, yerr=errors if any(errors) else None, fmt=look.marker,
                                color=look.color, markersize=5, capsize=2, alpha=0.85)
                else:
                    ax.errorbar(xs, ys, yerr=errors if any(errors) else None,
                                marker=look.marker, linestyle=look.linestyle, color=look.color,
                                markersize=5, capsize=2, label=mixer)
            shown = published.get(panel, {}).get(mixer, [])
            if shown:
                hollow = True
                ax.plot(*zip(*shown), linestyle="none", marker=look.marker, markersize=10,
                        markerfacecolor="none", markeredgecolor=look.color, markeredgewidth=1.4)
                xs_all += [x for x, _ in shown]
        settings = [name for name in names if name != "overall" and SLICE_PANEL not in name]
        title = (f"overall: mean over the {len(settings)} settings" if panel == "overall"
                 else textwrap.fill(panel, 44))  # whole, on as many lines
        ax.set_title(title, fontsize=8)
        if x_key == "d_model":
            log_axis(ax, "x", xs_all, 2, lambda v: f"{v:g}", most=6)
            ax.set_xlabel("d_model", fontsize=8)
        else:
            log_axis(ax, "x", xs_all, 2, format_bytes_tick, most=5)
            ax.set_xlabel("recurrent state per sequence, all layers", fontsize=8)
        ax.tick_params(labelsize=7.5)
        ax.set_ylim(bottom - 0.02 * (1 - bottom), 1 + 0.07 * (1 - bottom))
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("test accuracy (lr chosen on validation)"
                          + (f", from {bottom:.3g}" if bottom else ""), fontsize=8)
    extra = []
    if hollow:
        extra.append((plt.Line2D([], [], linestyle="none", marker="o", markersize=9,
                                 markerfacecolor="none", markeredgecolor="black"), PUBLISHED_NOTE))
    legend_outside(figure, [ax for ax in cells if ax.get_visible()],
                   "line: Pareto front" if x_key == "state_bytes" else None, extra)
    notes_under(figure, notes, width=int(20 * columns + 10))
    return figure


def frontier_points(runs: list[dict], summary: dict,
                    reference: dict | None) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{setting: {mixer: [(state bytes over the model, accuracy)]}}: for the settings tested
    on a published frontier file's test mix, the points of each architecture it maps to a
    mixer of the setting, under the first such mixer (its colour in the plots). The file's
    states are over the figures' models (`layers` layers), as `state_bytes` of runs with as
    many."""
    placed: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for setting in _protocol_settings(runs, reference):
        for architecture, names in reference["architectures_in_hla_bench"].items():
            mixer = next((m for m in summary.get(setting, {}) if _is_architecture(m, names)),
                         None)
            points = [(state, accuracy) for _, state, accuracy
                      in published_points(reference, architecture, per_layer=False)]
            if mixer is not None and points:
                placed.setdefault(setting, {}).setdefault(mixer, []).extend(points)
    return placed


def plot_recall(summary: dict, plots_dir: str | Path, fmt: str = "png",
                published: dict | None = None, matches: dict | None = None,
                mixers: str | None = None, frontier: dict | None = None,
                slices: dict | None = None) -> list[Path]:
    """Accuracy (val-picked, error bars: std over seeds) against recurrent state per sequence
    (with each mixer's Pareto front) and against d_model, one panel per setting plus the
    overall (`_panel_points`), a colour per mixer by family (`hla_bench.results.styles`), one legend
    outside the panels. `published` ({setting: {"Zoology: NAME": {d_model: accuracy}}},
    Zoology's Figure 2) draws, for an architecture `matches` maps to an hla-bench mixer,
    hollow markers of that mixer's colour, and so do against state the points of
    `frontier` (`frontier_points`). `slices` (`slice_summary`) adds a panel per test slice
    after each setting tested on a mix. Past styles.MAX_SERIES mixers, the files
    `recall_accuracy_vs_*.FMT` are an overview and `recall_accuracy_vs_*-FAMILY.FMT` hold
    each family; `mixers` (comma-separated globs) chooses the mixers instead, in one
    figure."""
    from hla_bench.results import styles
    from hla_bench.results.plots import save_figure_tight, select

    plt, plots_dir = pyplot_for(plots_dir, fmt)
    every = list(dict.fromkeys(m for by_mixer in summary.values() for m in by_mixer))
    matches = dict(matches or {})
    unmatched = sorted({label.removeprefix("Zoology: ") for curves in (published or {}).values()
                        for label in curves} - set(matches))
    paths = []
    for name, x_key in zip(RECALL_PLOT_NAMES, ("state_bytes", "d_model")):
        panels = _panel_points(summary, x_key, slices)
        placed = _published_points(summary, published, matches, x_key)
        if x_key == "state_bytes":
            for setting, by_mixer in (frontier or {}).items():
                for mixer, points in by_mixer.items():
                    placed.setdefault(setting, {}).setdefault(mixer, []).extend(points)
        ranked = {mixer: -statistics.fmean(y for points in panels.values()
                                           for x, y, _, _ in points.get(mixer, []) or [(0, 0, 0, 0)])
                  for mixer in every}
        views = ([("", select(every, {}, mixers))] if mixers
                 else styles.split_views(every, {}, ranked))
        for suffix, shown in views:
            notes = []
            if unmatched:
                notes.append(f"Zoology's {', '.join(unmatched)}: no hla-bench mixer, so not "
                             "drawn; their published accuracies are in the Zoology tables")
            left = [m for m in every if m not in shown]
            if not suffix and len(views) > 1:
                notes.append(f"overview: {styles.MAX_SERIES} mixers at most; in the family "
                             f"figures {name}-FAMILY.{fmt} also: {', '.join(left)}")
            elif suffix:
                notes.append(f"{styles.family_title(suffix[1:].split('-', 1)[0])} only")
            figure = recall_figure(plt, panels, placed, shown, x_key, notes)
            paths.append(save_figure_tight(figure, plot_path(plots_dir, f"{name}{suffix}", fmt),
                                           dpi=120))
    return paths


RECALL_TABLES = ("all", "settings", "reference")


def failure_lines(runs: list[dict]) -> list[str]:
    """A line per (status, mixer, d_model, seed, setting, message) of the runs not ok, their
    learning rates joined, in the runs' order. An out-of-memory message keeps its first two
    sentences (what ran out, how much it asked for); the results file keeps it whole."""
    failed: dict[tuple, list[float]] = {}
    for run in runs:
        if run.get("status") == "ok":
            continue
        message = run.get("error") or ""
        if run["status"] == "oom":
            message = ". ".join(message.split(". ")[:2]).rstrip(".") + "."
        key = (run["status"], run["mixer"], run["d_model"], run.get("seed", 0), run["setting"],
               message)
        failed.setdefault(key, []).append(run["lr"])
    return [f"{status}: {mixer} d={d_model} lr={','.join(f'{lr:g}' for lr in lrs)} "
            f"seed={seed} [{setting}]: {message}".rstrip()
            for (status, mixer, d_model, seed, setting, message), lrs in failed.items()]


def path_lines(runs: list[dict]) -> list[str]:
    """A line per (mixer, what its dispatch ran) over the runs that record it (`mixer_path`),
    with the widths it covers, in the runs' order: which form or kernel trained each model."""
    widths: dict[tuple[str, str], list[int]] = {}
    for run in runs:
        ran = run.get("mixer_path")
        if not isinstance(ran, dict):
            continue
        facts = ", ".join(f"{key}={value}" for key, value in ran.items() if key != "packages")
        packages = ", ".join(f"{name} {version or 'missing'}"
                             for name, version in (ran.get("packages") or {}).items())
        what = (facts or "no dispatch noted") + (f" ({packages})" if packages else "")
        found = widths.setdefault((run["mixer"], what), [])
        if run["d_model"] not in found:
            found.append(run["d_model"])
    return [f"ran: {mixer} [d {', '.join(str(d) for d in sorted(ds))}]: {what}"
            for (mixer, what), ds in widths.items()]


def render_recall(data: dict, console: Console, plots_dir: str | Path | None = None,
                  markdown: bool = False, fmt: str = "png", tables: str = "all",
                  mixers: str | None = None) -> list[Path]:
    """Print one table per task setting ("settings"), the Zoology view of the settings that
    are panels of its Figure 2, for runs of MAD tasks the MAD score view and, for settings
    tested on a mix, the accuracy-against-state table (`frontier_rows`) ("reference"),
    or all of them; then what each mixer's dispatch ran (the runs' `mixer_path`) and the
    runs that failed (GitHub markdown with `markdown`). With
    `plots_dir`, write the plots there (`plot_recall`; `mixers` chooses the mixers drawn)
    and return their paths."""
    from hla_bench.recall.plan import check_recall_file  # imports torch: only once rendering

    if tables not in RECALL_TABLES:
        raise ValueError(f"tables must be one of {RECALL_TABLES}, got {tables!r}")
    check_recall_file(data)
    runs = data["runs"]
    summary = summarize(runs)
    env, config = data["environment"], data["config"]
    parts = data.get("parts") or []
    gpus = list(dict.fromkeys(str(part.get("gpu")) for part in parts))
    header = (f"recall (schema {data.get('schema_version')}): {len(runs)} runs, device "
              f"{config.get('device', '?')}, {data.get('seconds', '?')} s"
              + (f" in {len(parts)} parts on {', '.join(gpus)}" if len(parts) > 1 else "")
              + f"; torch {env.get('torch', '?')}"
              + ("" if data.get("complete", True) else "; INCOMPLETE"))
    console.print(header + ("\n" if markdown else ""), markup=False, highlight=False,
                  soft_wrap=True)
    def show(markdown_text, table_of):
        """One table: as markdown text with --markdown, else a rich table (lines if narrow)."""
        if markdown:
            console.print(markdown_text(), markup=False, highlight=False, soft_wrap=True)
        else:
            table = table_of()
            print_table(console, table, lambda: table_lines(table, console))

    for setting, by_mixer in summary.items() if tables != "reference" else ():
        show(lambda: setting_markdown(setting, by_mixer), lambda: setting_table(setting, by_mixer))
    zoology = load_reference(ZOOLOGY_REFERENCE)
    views = zoology_rows(runs, summary, zoology) if zoology and tables != "settings" else {}
    for setting, (d_models, rows) in views.items():
        show(lambda: zoology_markdown(setting, d_models, rows, zoology),
             lambda: zoology_table(setting, d_models, rows, zoology))
    scores = mad_scores(runs, summary) if tables != "settings" else {}
    if scores:
        reference = load_mad_reference()
        show(lambda: mad_markdown(scores, reference), lambda: mad_table(scores, reference))
    per_layer = all(run.get("state_bytes_per_layer") for run in runs if run.get("status") == "ok")
    published_frontier = load_reference(FRONTIER_REFERENCE)
    frontier = (frontier_rows(runs, summary, published_frontier, per_layer)
                if tables != "settings" else {})
    for setting, rows in frontier.items():
        show(lambda: frontier_markdown(setting, rows, per_layer),
             lambda: frontier_table(setting, rows, per_layer))
    for line in path_lines(runs) + failure_lines(runs):
        console.print(f"- {line}" if markdown else line, markup=False, highlight=False,
                      soft_wrap=True)
    if plots_dir is None or not summary:
        return []
    paths = plot_recall(summary, plots_dir, fmt, zoology_curves(runs, zoology) if zoology else None,
                        (zoology or {}).get("architectures_in_hla_bench"), mixers,
                        frontier_points(runs, summary, published_frontier),
                        slice_summary(runs))
    for path in paths:
        console.print(f"plot written to {path}", markup=False, highlight=False, soft_wrap=True)
    return paths

