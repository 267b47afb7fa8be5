"""Two bench results files compared point by point: `hla-bench report --compare OLD NEW`.

Points are matched by what was measured, not by where it sat in a config: the mixer spec
(registry name and options), the mode, the shape (T, batch, heads, head dim, value dim,
dtype, device) and, for decode, the tokens per timed call and whether a CUDA graph was
replayed. Sweep names and mixer labels may differ between the files. Where one file holds
the same (spec, mode, shape) in more than one sweep, those points are matched by sweep name
too (and, failing that, by label), and the output says so.

Per matched point (docs/comparing.md states the method):
- ratio = new median time / old median time (above 1: slower), with a `1 - alpha`
  percentile bootstrap interval of the ratio of the sample medians (seeded: the same files
  give the same output);
- p: two-sided Mann-Whitney U of the two sets of samples (exact without ties for small
  sizes, else the normal approximation with tie and continuity corrections), adjusted over
  the tested points by Benjamini-Hochberg;
- significant: adjusted p below alpha and the whole interval beyond a smallest change that
  counts (min_change, default 2%: above the noise floor measured by running one sweep twice,
  docs/comparing.md), so that hundreds of samples do not make a 0.5% drift "significant";
- a point without samples on either side (files written before `samples_ms`) shows its
  median ratio, marked not tested, and is never significant;
- memory: the ratio of peak_memory_bytes, listed when it moves by more than a tolerance;
- a status change (ok -> oom, error, ...) is always listed and counts as a regression.

With a control mixer, each ratio is divided by the control's ratio at the same (mode,
shape), so a machine that runs everything slower on the second day does not read as a
regression of every mixer.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from rich.markup import escape
from rich.table import Table

from hla_bench.results.tables import format_seq_len
from hla_bench.results.plots import plot_path, pyplot_for, seq_len_axis
from hla_bench.results.tables import STATUS_LABELS, format_value

ALPHA = 0.01
BOOTSTRAP_DRAWS = 2000
BOOTSTRAP_SEED = 0
MEMORY_TOLERANCE = 0.05
# The smallest time change a comparison calls significant (a fraction): the interval of the
# ratio must lie wholly above 1 + MIN_CHANGE or below 1 - MIN_CHANGE.
MIN_CHANGE = 0.02
# Exact Mann-Whitney distribution (no ties) up to this many (old x new) sample pairs.
EXACT_PAIRS = 2500
SHAPE = ("seq_len", "batch", "heads", "head_dim", "value_dim", "dtype", "device")


# -- statistics ---------------------------------------------------------------------------

def _ranks(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(1-based ranks, ties averaged; the size of each group of equal values)."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return (ends - (counts - 1) / 2)[inverse], counts


@functools.lru_cache(maxsize=64)
def _u_distribution(m: int, n: int) -> np.ndarray:
    """P(U = u), u = 0..m*n, for samples of sizes m and n drawn from one continuous
    distribution (every order of the m + n values equally likely). U counts the pairs
    (x, y) with x > y; the largest value is an x with probability m / (m + n), adding n."""
    table = {(0, j): np.ones(1) for j in range(n + 1)}
    table.update({(i, 0): np.ones(1) for i in range(m + 1)})
    for i in range(1, m + 1):
        for j in range(1, n + 1):
            size = i * j + 1
            dist = np.zeros(size)
            dist[j:] += i / (i + j) * table[i - 1, j]
            dist[:size - i] += j / (i + j) * table[i, j - 1]
            table[i, j] = dist
    return table[m, n]


def mann_whitney(old: Iterable[float], new: Iterable[float]) -> float:
    """Two-sided p of the Mann-Whitney U test that `old` and `new` come from one
    distribution: exact when there are no ties and at most EXACT_PAIRS pairs, else the
    normal approximation with the tie correction of the variance and a continuity
    correction of 1/2. 1.0 when every value is equal."""
    x, y = np.asarray(list(old), float), np.asarray(list(new), float)
    m, n = len(x), len(y)
    if m == 0 or n == 0:
        raise ValueError("mann_whitney needs at least one value on each side")
    ranks, ties = _ranks(np.concatenate([x, y]))
    u = float(ranks[:m].sum() - m * (m + 1) / 2)
    if ties.max() == 1 and m * n <= EXACT_PAIRS:
        dist = _u_distribution(m, n)
        k = int(round(u))
        return float(min(1.0, 2 * min(dist[:k + 1].sum(), dist[k:].sum())))
    total = m + n
    variance = m * n / 12 * ((total + 1) - float((ties ** 3 - ties).sum()) / (total * (total - 1)))
    if variance <= 0:
        return 1.0
    z = max(abs(u - m * n / 2) - 0.5, 0.0) / math.sqrt(variance)
    return math.erfc(z / math.sqrt(2))


def bootstrap_ratio(new: Iterable[float], old: Iterable[float], alpha: float = ALPHA,
                    control: tuple[Iterable[float], Iterable[float]] | None = None,
                    draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The `1 - alpha` percentile bootstrap interval of median(new) / median(old), each
    sample set resampled with replacement; with `control` = (control new, control old),
    of that ratio over the control's ratio (all four resampled). Seeded: deterministic."""
    rng = np.random.default_rng(seed)

    def medians(values: Iterable[float]) -> np.ndarray:
        values = np.asarray(list(values), float)
        return np.median(values[rng.integers(0, len(values), (draws, len(values)))], axis=1)

    ratios = medians(new) / medians(old)
    if control is not None:
        ratios = ratios / (medians(control[0]) / medians(control[1]))
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def adjust(pvalues: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values (q-values), in the order given: a point is
    significant at false-discovery rate alpha when its adjusted p is below alpha."""
    count = len(pvalues)
    order = sorted(range(count), key=lambda i: pvalues[i])
    adjusted = [1.0] * count
    running = 1.0
    for rank in range(count, 0, -1):
        index = order[rank - 1]
        running = min(running, pvalues[index] * count / rank)
        adjusted[index] = running
    return adjusted


# -- matching -----------------------------------------------------------------------------

def match_key(point: dict[str, Any]) -> tuple:
    """What a point measured: mixer spec, mode, shape, and how decode was timed."""
    return (point["name"], json.dumps(point.get("options") or {}, sort_keys=True, default=str),
            point["mode"], *(point[name] for name in SHAPE),
            point.get("decode_steps") or 1,
            bool(point.get("decode_graph") or point.get("cuda_graph")), point.get("level") or "op")


def match(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, Any]:
    """{"pairs": [(old point, new point)] in the new file's order, "only_old", "only_new":
    the points without a partner, "by_sweep": the number of pairs matched by sweep name
    too, since their (spec, mode, shape) occurs more than once in a file (by label as
    well where one sweep holds the same spec twice)}."""
    def keys(extend: set, level: list[list[tuple]], add) -> list[list[tuple]]:
        return [[key + add(point) if key in extend else key for key, point in zip(side, points)]
                for side, points in zip(level, (old, new))]

    def repeated(level: list[list[tuple]]) -> set:
        return {key for side in level for key, count in Counter(side).items() if count > 1}

    base = [[match_key(p) for p in points] for points in (old, new)]
    by_sweep = repeated(base)
    level = keys(by_sweep, base, lambda p: (p["sweep"],))
    level = keys(repeated(level), level, lambda p: (p["mixer"],))
    old_map = dict(zip(level[0], old))
    new_map = dict(zip(level[1], new))
    pairs = [(old_map[key], point) for key, point in new_map.items() if key in old_map]
    return {"pairs": pairs,
            "only_old": [p for key, p in old_map.items() if key not in new_map],
            "only_new": [p for key, p in new_map.items() if key not in old_map],
            "by_sweep": sum(match_key(pair[1]) in by_sweep for pair in pairs)}


def _selected(pair: tuple[dict, dict], pattern: str) -> bool:
    """`-k PATTERN`: a glob (a bare word matches as a substring) against either file's
    mixer label and sweep, the mixer name and the mode."""
    glob = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
    old, new = pair
    return any(fnmatch.fnmatchcase(str(text), glob)
               for text in (old["mixer"], new["mixer"], old["sweep"], new["sweep"], new["name"],
                            new["mode"]))


# -- comparison ---------------------------------------------------------------------------

def _samples(point: dict[str, Any]) -> list[float] | None:
    samples = point.get("samples_ms") if point["status"] == "ok" else None
    return [float(v) for v in samples] if samples else None


def _time(point: dict[str, Any]) -> float | None:
    return point.get("median_ms") if point["status"] == "ok" else None


# What a results file records of where it ran, compared between the two files: a change in
# any of them can move every point (another card, driver or library), not the code.
ENVIRONMENT_KEYS = ("gpu", "gpu_count", "driver", "cuda", "cudnn", "torch", "git_commit")


def environment_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for each ENVIRONMENT_KEYS entry and package version that
    differs between the two documents' environments (absent reads as None)."""
    before, after = old.get("environment") or {}, new.get("environment") or {}
    changes = [(key, before.get(key), after.get(key)) for key in ENVIRONMENT_KEYS
               if before.get(key) != after.get(key)]
    old_packages, new_packages = before.get("packages") or {}, after.get("packages") or {}
    for name in sorted(set(old_packages) | set(new_packages)):
        if old_packages.get(name) != new_packages.get(name):
            changes.append((name, old_packages.get(name), new_packages.get(name)))
    return changes


def compare(old: dict[str, Any], new: dict[str, Any], alpha: float = ALPHA,
            control: str | None = None, pattern: str | None = None,
            memory_tolerance: float = MEMORY_TOLERANCE,
            min_change: float = MIN_CHANGE) -> dict[str, Any]:
    """The comparison of two bench documents: {"rows": a dict per matched point (below),
    "only_old", "only_new", "by_sweep" (see `match`), "untested": rows without samples,
    "missing_control": rows whose control was not measured (ok in both files) at their
    shape, "environment": `environment_changes`, "alpha", "control", "memory_tolerance",
    "min_change"}.

    A row: sweep, old_sweep, mixer, old_mixer, mode, seq_len, batch, old_ms, new_ms,
    old_status, new_status, ratio (new / old median, over the control's ratio with
    `control`), ci (low, high) or None, p (raw) and q (adjusted) or None, tested,
    significant, memory_ratio (or None), memory_changed, status_changed, is_control.
    """
    matched = match(old["points"], new["points"])
    pairs = matched["pairs"]
    controls: dict[tuple, list[tuple[dict, dict]]] = {}
    if control is not None:
        for pair in pairs:
            if pair[0]["mixer"] == control and pair[1]["mixer"] == control:
                controls.setdefault(match_key(pair[1])[2:], []).append(pair)
    if pattern:
        pairs = [pair for pair in pairs if _selected(pair, pattern)]
    rows, missing = [], []
    for before, after in pairs:
        row = {"sweep": after["sweep"], "old_sweep": before["sweep"], "mixer": after["mixer"],
               "old_mixer": before["mixer"], "mode": after["mode"], "seq_len": after["seq_len"],
               "batch": after["batch"], "old_ms": _time(before), "new_ms": _time(after),
               "old_status": before["status"], "new_status": after["status"],
               "ratio": None, "ci": None, "p": None, "q": None, "tested": False,
               "significant": False, "memory_ratio": None, "memory_changed": False,
               "status_changed": before["status"] == "ok" and after["status"] != "ok",
               "is_control": control is not None and after["mixer"] == control
               and before["mixer"] == control}
        old_mem, new_mem = (p.get("peak_memory_bytes") if p["status"] == "ok" else None
                            for p in (before, after))
        if old_mem and new_mem is not None:
            row["memory_ratio"] = new_mem / old_mem
            row["memory_changed"] = abs(row["memory_ratio"] - 1) > memory_tolerance
        rows.append(row)
        if row["old_ms"] is None or row["new_ms"] is None:
            continue
        old_samples, new_samples = _samples(before), _samples(after)
        reference = None
        if control is not None and not row["is_control"]:
            candidates = controls.get(match_key(after)[2:], [])
            same = [pair for pair in candidates if pair[1]["sweep"] == after["sweep"]]
            reference = (same or candidates or [None])[0]
            if reference is None or _time(reference[0]) is None or _time(reference[1]) is None:
                missing.append(row)
                continue
        drift = _time(reference[1]) / _time(reference[0]) if reference else 1.0
        row["ratio"] = row["new_ms"] / row["old_ms"] / drift
        if row["is_control"]:  # its ratio is the drift the others are divided by
            continue
        control_samples = None
        if reference is not None:
            control_samples = (_samples(reference[1]), _samples(reference[0]))
            if None in control_samples:
                continue
        if old_samples is None or new_samples is None:
            continue
        row["tested"] = True
        row["p"] = mann_whitney(old_samples, [v / drift for v in new_samples])
        row["ci"] = bootstrap_ratio(new_samples, old_samples, alpha, control_samples)
    tested = [row for row in rows if row["tested"]]
    for row, q in zip(tested, adjust([row["p"] for row in tested])):
        row["q"] = q
        low, high = row["ci"]
        row["significant"] = q < alpha and (low > 1 + min_change or high < 1 - min_change)
    untested = [row for row in rows
                if not row["tested"] and row["ratio"] is not None and not row["is_control"]]
    return {"rows": rows, "only_old": matched["only_old"], "only_new": matched["only_new"],
            "by_sweep": matched["by_sweep"], "untested": untested, "missing_control": missing,
            "environment": environment_changes(old, new), "alpha": alpha, "control": control,
            "memory_tolerance": memory_tolerance,
            "min_change": min_change}


def why(row: dict[str, Any]) -> str:
    """A failing row and what failed, for the `--fail-on-regression` verdict."""
    reasons = []
    if row["status_changed"]:
        reasons.append(f"{row['old_status']} -> {row['new_status']}")
    if row["significant"] and row["ratio"] > 1:
        reasons.append(f"time {row['ratio']:.3f}x")
    if row["memory_changed"] and row["memory_ratio"] > 1:
        reasons.append(f"memory {row['memory_ratio']:.2f}x")
    return f"{where([row])} ({', '.join(reasons)})"


def regressions(result: dict[str, Any], percent: float) -> list[dict[str, Any]]:
    """The rows that fail `--fail-on-regression PCT`: a status change from ok, a
    significant slowdown whose ratio exceeds 1 + PCT/100, or peak memory grown beyond both
    PCT and the memory tolerance."""
    limit = 1 + percent / 100
    return [row for row in result["rows"]
            if row["status_changed"]
            or (row["significant"] and row["ratio"] > limit)
            or (row["memory_changed"] and row["memory_ratio"] > limit)]


# -- output -------------------------------------------------------------------------------

COLUMNS = ("sweep", "mode", "mixer", "T", "old ms", "new ms", "ratio", "CI", "p", "memory",
           "result")


def _verdict(row: dict[str, Any]) -> str:
    if row["old_status"] != "ok" or row["new_status"] != "ok":
        if row["old_status"] == row["new_status"]:
            return f"{STATUS_LABELS.get(row['new_status'], row['new_status'])} in both"
        return f"{row['old_status']} -> {row['new_status']}"
    if row["is_control"]:
        return "control (its own ratio)"
    if row["ratio"] is None:
        return "no control"
    if not row["tested"]:
        return "no samples, not tested"
    if row["significant"]:
        return "slower" if row["ratio"] > 1 else "faster"
    return "no significant change"


def _cells(row: dict[str, Any]) -> list[str]:
    """The comparison row as the table shows it, in COLUMNS order."""
    def time(ms: float | None, status: str) -> str:
        return format_value("time", ms) if ms is not None else STATUS_LABELS.get(status, status)

    sweep = row["sweep"] if row["sweep"] == row["old_sweep"] else f"{row['old_sweep']}->{row['sweep']}"
    mixer = row["mixer"] if row["mixer"] == row["old_mixer"] else f"{row['old_mixer']}->{row['mixer']}"
    ratio = "—" if row["ratio"] is None else f"{row['ratio']:.3f}x"
    ci = "—" if row["ci"] is None else f"{row['ci'][0]:.3f}–{row['ci'][1]:.3f}"
    p = "—" if row["q"] is None else f"{row['q']:.2g}"
    memory = "—" if row["memory_ratio"] is None else f"{row['memory_ratio']:.2f}x"
    if row["memory_changed"]:
        memory += " changed"
    return [sweep, row["mode"], mixer, format_seq_len(row["seq_len"]),
            time(row["old_ms"], row["old_status"]), time(row["new_ms"], row["new_status"]),
            ratio, ci, p, memory, _verdict(row)]


def _style(row: dict[str, Any]) -> str | None:
    if row["status_changed"] or (row["significant"] and row["ratio"] > 1):
        return "red"
    if row["significant"] or (row["memory_changed"] and row["memory_ratio"] < 1):
        return "green"
    return "yellow" if row["memory_changed"] else None


def caption(result: dict[str, Any]) -> str:
    """What the columns mean and the rule of significance."""
    alpha, level = result["alpha"], 1 - result["alpha"]
    versus = f", over {result['control']}'s ratio at the same shape" if result["control"] else ""
    return (f"ratio = new / old median time{versus} (above 1: slower); CI: {level:.0%} "
            f"bootstrap interval; p: Mann-Whitney U, Benjamini-Hochberg adjusted over "
            f"{sum(r['tested'] for r in result['rows'])} tested points; significant: "
            f"p < {alpha:g} and CI beyond ±{result['min_change']:.1%}; memory: new / old "
            f"peak, changed beyond ±{result['memory_tolerance']:.0%}")


def comparison_table(result: dict[str, Any], old_name: str, new_name: str) -> Table:
    """The comparison as a rich table: a row per matched point, slower in red, faster in
    green; identifiers never wrap."""
    table = Table(title=escape(f"{old_name} -> {new_name}"), caption=escape(caption(result)))
    for name in COLUMNS:
        numeric = name in ("T", "old ms", "new ms", "ratio", "CI", "p", "memory")
        table.add_column(name, justify="right" if numeric else "left",
                         no_wrap=name in ("sweep", "mixer", "T", "ratio", "CI"),
                         overflow="fold")
    for row in result["rows"]:
        table.add_row(*(escape(cell) for cell in _cells(row)), style=_style(row))
    return table


def comparison_lines(result: dict[str, Any], old_name: str, new_name: str) -> list[str]:
    """The comparison as plain lines, for a console too narrow for its table: a line per
    point, its result in capitals when significant or a status change."""
    lines = [f"{old_name} -> {new_name}", f"({caption(result)})"]
    for row in result["rows"]:
        sweep, mode, mixer, t, old, new, ratio, ci, p, memory, verdict = _cells(row)
        old, new = (f"{text} ms" if ms is not None else text
                    for text, ms in ((old, row["old_ms"]), (new, row["new_ms"])))
        if row["significant"]:
            verdict = verdict.upper()
        lines.append(f"  {sweep} {mode} {mixer} T={t}: {old} -> {new}, ratio {ratio} "
                     f"(CI {ci}, p {p}), memory {memory}: {verdict}")
    return lines


def comparison_markdown(result: dict[str, Any], old_name: str, new_name: str) -> str:
    """The comparison as a GitHub markdown table (significant results in bold)."""
    lines = [f"**{old_name} -> {new_name}** ({caption(result)})", "",
             "| " + " | ".join(COLUMNS) + " |",
             "| " + " | ".join("---:" if name not in ("sweep", "mode", "mixer", "result")
                               else "---" for name in COLUMNS) + " |"]
    for row in result["rows"]:
        cells = _cells(row)
        if _style(row) in ("red", "green"):
            cells[-1] = f"**{cells[-1]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def where(rows: Iterable[dict[str, Any]]) -> str:
    """The points named by sweep, mode and mixer, each with its lengths: "s fwd a T=1k,4k"."""
    lengths: dict[tuple[str, str, str], list[str]] = {}
    for r in rows:
        lengths.setdefault((r["sweep"], r["mode"], r["mixer"]), []).append(
            format_seq_len(r["seq_len"]))
    return ", ".join(f"{sweep} {mode} {mixer} T={','.join(seq_lens)}"
                     for (sweep, mode, mixer), seq_lens in lengths.items())


def summary(result: dict[str, Any], old_name: str, new_name: str) -> list[str]:
    """The lines after the table: what was matched, what could not be tested, the counts."""
    rows = result["rows"]
    lines = [f"{len(rows)} points matched; {len(result['only_old'])} only in {old_name}, "
             f"{len(result['only_new'])} only in {new_name}"]
    if result.get("environment"):
        lines.append("the files ran in different environments, which can move every point: "
                     + "; ".join(f"{key} {before} -> {after}"
                                 for key, before, after in result["environment"]))
    if result["by_sweep"]:
        lines.append(f"{result['by_sweep']} points matched by sweep name too, as their "
                     "(mixer spec, mode, shape) occurs in more than one sweep of a file")
    if result["untested"]:
        lines.append(f"{len(result['untested'])} points without samples in one file or both "
                     "(files written before samples_ms), or whose control has none: ratio "
                     "shown, not tested, never significant")
    if result["missing_control"]:
        # a sweep without the control at all (decode, say) is named once, with its count
        missing = result["missing_control"]
        with_control = {r["sweep"] for r in rows if r["is_control"]}
        without = Counter(r["sweep"] for r in missing if r["sweep"] not in with_control)
        named = []
        if without:
            named.append("sweeps without it: " + ", ".join(
                f"{sweep} ({count} points)" for sweep, count in without.items()))
        if sum(without.values()) < len(missing):
            named.append(where(r for r in missing if r["sweep"] in with_control))
        lines.append(f"control {result['control']} not measured in both files at the shape "
                     f"of {len(missing)} points, which have no ratio: " + "; ".join(named))
    slower = [r for r in rows if r["significant"] and r["ratio"] > 1]
    faster = [r for r in rows if r["significant"] and r["ratio"] < 1]
    status = [r for r in rows if r["old_status"] != r["new_status"]]
    memory = [r for r in rows if r["memory_changed"]]
    lines.append(f"{len(slower)} significantly slower, {len(faster)} significantly faster, "
                 f"{len(status)} status change(s), {len(memory)} memory change(s) beyond "
                 f"±{result['memory_tolerance']:.0%} in {len(rows)} points")
    return lines


def write_plots(result: dict[str, Any], out_dir: str | Path, fmt: str = "png") -> list[Path]:
    """One figure per mode: the ratio against T, a line per (sweep, mixer) in one colour per
    mixer, with the bootstrap interval as error bars where there are samples; a dashed line
    at 1 (no change)."""
    from hla_bench.results import styles
    from hla_bench.results.plots import legend_outside, save_figure_tight

    plt, out_dir = pyplot_for(out_dir, fmt)
    rows = [row for row in result["rows"] if row["ratio"] is not None]
    written = []
    for mode in dict.fromkeys(row["mode"] for row in rows):
        mine = [row for row in rows if row["mode"] == mode]
        lines = list(dict.fromkeys((row["sweep"], row["mixer"]) for row in mine))
        several = len({sweep for sweep, _ in lines}) > 1
        figure = plt.figure(figsize=(9.5, 4.5), layout="constrained")
        ax = figure.subplots()
        for sweep, mixer in lines:
            points = sorted((r for r in mine if (r["sweep"], r["mixer"]) == (sweep, mixer)),
                            key=lambda r: r["seq_len"])
            ts = [r["seq_len"] for r in points]
            ratios = [r["ratio"] for r in points]
            low = [r["ratio"] - r["ci"][0] if r["ci"] else 0 for r in points]
            high = [r["ci"][1] - r["ratio"] if r["ci"] else 0 for r in points]
            look = styles.style(mixer, points[0].get("name"))
            ax.errorbar(ts, ratios, yerr=[low, high], capsize=3, **look.line(),
                        label=f"{sweep} {mixer}" if several else mixer)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        seq_len_axis(ax, {r["seq_len"] for r in mine})
        ax.set_xlabel("sequence length T")
        versus = f" / {result['control']}'s ratio" if result["control"] else ""
        ax.set_ylabel(f"new / old median time{versus}")
        ax.grid(True, which="both", alpha=0.3)
        legend_outside(figure, [ax])
        ax.set_title(f"{mode}: ratio with {1 - result['alpha']:.0%} bootstrap interval "
                     "(no bar: no samples)", fontsize=10)
        written.append(save_figure_tight(figure, plot_path(out_dir, f"compare-{mode}", fmt)))
    return written
