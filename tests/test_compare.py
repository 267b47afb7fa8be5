"""`report --compare`: the test and interval on the samples, matching, control, exit codes."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from grids import parametrize
from hla_bench import report
from hla_bench.speed import compare
from hla_bench.results import bench_files as results
from test_report import _data, _point

RESULTS = Path(__file__).parent.parent / "results"


def _sampled(mixer, seq_len, scale, seed, count=25, sweep="s", sigma=0.05, memory=2 ** 20):
    """An ok point whose samples are `scale` times seeded log-normal draws around 1 ms."""
    samples = scale * np.random.default_rng(seed).lognormal(0.0, sigma, count)
    point = _point(mixer, seq_len, float(np.median(samples)), memory=memory)
    low, high = np.percentile(samples, [25, 75])
    point.update(sweep=sweep, samples_ms=[float(v) for v in samples],
                 p20_ms=float(np.percentile(samples, 20)), p80_ms=float(np.percentile(samples, 80)),
                 spread=float((high - low) / np.median(samples)))
    return point


def _pair(scales_old, scales_new, seed=0, seq_lens=(1024, 4096), **kwargs):
    """Two documents of the mixers in `scales_*` (label -> scale), independent draws."""
    def doc(scales, offset):
        return _data([_sampled(label, t, scale, seed * 1000 + offset + 10 * i + j, **kwargs)
                      for i, (label, scale) in enumerate(scales.items())
                      for j, t in enumerate(seq_lens)])
    return doc(scales_old, 0), doc(scales_new, 500)


def _rows(result):
    return {(row["mixer"], row["seq_len"]): row for row in result["rows"]}


# ---------------------------------------------------------------- statistics


def test_exact_mann_whitney_is_the_enumerated_distribution():
    """Every split of 7 distinct values into 4 and 3 is equally likely under the null."""
    m, n = 4, 3
    counts = [0] * (m * n + 1)
    for xs in itertools.combinations(range(m + n), m):
        counts[sum(x > y for x in xs for y in range(m + n) if y not in xs)] += 1
    assert np.allclose(compare._u_distribution(m, n), np.array(counts) / sum(counts))
    # completely separated samples of 5: the two extreme orders of 252
    assert compare.mann_whitney([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == pytest.approx(2 / 252)
    assert compare.mann_whitney([6, 7, 8, 9, 10], [1, 2, 3, 4, 5]) == pytest.approx(2 / 252)


def test_mann_whitney_with_ties_uses_the_corrected_normal_approximation():
    # ranks of 1,1,2 | 1,2,2: the 1s share rank 2, the 2s rank 5; U = 2 + 2 + 5 - 6 = 3
    variance = 3 * 3 / 12 * (7 - (2 * (3 ** 3 - 3)) / (6 * 5))
    expected = math.erfc((abs(3 - 4.5) - 0.5) / math.sqrt(variance) / math.sqrt(2))
    assert compare.mann_whitney([1, 1, 2], [1, 2, 2]) == pytest.approx(expected)
    assert compare.mann_whitney([3, 3], [3, 3, 3]) == 1.0


def test_normal_approximation_agrees_with_the_exact_test(monkeypatch):
    rng = np.random.default_rng(2)
    x, y = rng.normal(0, 1, 40), rng.normal(0.3, 1, 40)
    exact = compare.mann_whitney(x, y)
    assert 0.005 < exact < 0.5
    monkeypatch.setattr(compare, "EXACT_PAIRS", 0)
    assert compare.mann_whitney(x, y) == pytest.approx(exact, abs=0.002)


def test_benjamini_hochberg():
    assert compare.adjust([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.16 / 3, 0.16 / 3, 0.2])
    assert compare.adjust([]) == []


def test_a_20_percent_slowdown_is_significant_and_the_same_distribution_is_not():
    result = compare.compare(*_pair({"a": 1.0, "b": 1.0}, {"a": 1.2, "b": 1.0}))
    rows = _rows(result)
    for t in (1024, 4096):
        slow, same = rows["a", t], rows["b", t]
        assert slow["tested"] and slow["significant"] and slow["q"] < 0.01
        assert slow["ci"][0] > 1 and slow["ratio"] == pytest.approx(1.2, rel=0.05)
        assert same["tested"] and not same["significant"]
        assert same["ci"][0] < 1 < same["ci"][1]
    assert compare.regressions(result, 10) == [rows["a", 1024], rows["a", 4096]]
    assert compare.regressions(result, 30) == []


def test_a_drift_below_the_smallest_change_is_not_significant():
    """Hundreds of samples make a 1% drift statistically detectable; it is significant only
    once the smallest change that counts (default 2%) is lowered below it."""
    pair = _pair({"a": 1.0}, {"a": 1.01}, count=500, sigma=0.01)
    drifted = _rows(compare.compare(*pair))["a", 1024]
    assert drifted["q"] < 1e-6 and drifted["ci"][0] > 1 and not drifted["significant"]
    assert _rows(compare.compare(*pair, min_change=0.0))["a", 1024]["significant"]
    slowed = _pair({"a": 1.0}, {"a": 1.05}, count=500, sigma=0.01)
    assert _rows(compare.compare(*slowed))["a", 1024]["significant"]


@parametrize("folder, names, control, least", [
    ("h200-2026-12-04", ("h200-a.yaml", "h200-b.yaml"), "fla-linear-attn", 30),
    ("h100-2026-12-05", ("h200-b.yaml", "h200-c.yaml"), "fla-linear-attn", 180),
    ("h100-2026-12-05", ("h200-b.yaml", "h200-c.yaml"), None, 280),
], fast=[0])
def test_the_committed_runs_of_one_sweep_twice_differ_in_no_point(folder, names, control, least):
    """The noise floor docs/comparing.md quotes: the same sweep run twice on one machine,
    compared with and without its control, has no significant change at the default
    smallest change, and no point changed its memory or status."""
    old, new = (results.load(RESULTS / folder / name) for name in names)
    result = compare.compare(old, new, control=control)
    tested = [row for row in result["rows"] if row["tested"]]
    assert len(tested) >= least and not any(row["significant"] for row in tested)
    assert not any(row["memory_changed"] or row["status_changed"] for row in result["rows"])
    assert sorted(abs(row["ratio"] - 1) for row in tested)[len(tested) // 2] < 0.005


@pytest.mark.slow
def test_runs_of_one_config_on_two_machines_differ_significantly():
    """The same config on two machines of one kind (docs/comparing.md): the test finds
    changes beyond the 2% default that the same-machine pair does not have."""
    folder = RESULTS / "h100-2026-12-05"
    old, new = (results.load(folder / name) for name in ("h200-a.yaml", "h200-b.yaml"))
    significant = [row for row in compare.compare(old, new)["rows"] if row["significant"]]
    assert len(significant) >= 10


def test_false_positive_rate_stays_near_the_nominal_level():
    """Two draws of one distribution, over many seeds: the test rejects at about its level,
    and the significance rule (test and interval) no more often."""
    rng = np.random.default_rng(0)
    draws = [(rng.lognormal(0, 0.1, 15), rng.lognormal(0, 0.1, 15)) for _ in range(400)]
    rate = np.mean([compare.mann_whitney(x, y) < 0.05 for x, y in draws])
    assert 0.02 <= rate <= 0.08
    flagged = 0
    for x, y in draws[:150]:
        low, high = compare.bootstrap_ratio(y, x, 0.05, draws=500)
        flagged += compare.mann_whitney(x, y) < 0.05 and not low < 1 < high
    assert flagged / 150 <= 0.08


def test_the_summary_names_what_differs_between_the_environments():
    """Another card, driver, library or commit can move every point: the summary says which
    differ (packages by name); two files from one environment add no such line."""
    old, new = _pair({"a": 1.0}, {"a": 1.0})
    same = compare.compare(old, new)
    assert same["environment"] == []
    assert not any("environments" in line for line in compare.summary(same, "A", "B"))
    new["environment"] = {**old["environment"], "gpu": "NVIDIA H100", "git_commit": "abc",
                          "packages": {**(old["environment"].get("packages") or {}),
                                       "triton": "9.9"}}
    result = compare.compare(old, new)
    keys = [key for key, _, _ in result["environment"]]
    assert keys == ["gpu", "git_commit", "triton"]
    line = next(line for line in compare.summary(result, "A", "B") if "environments" in line)
    assert f"gpu {old['environment'].get('gpu')} -> NVIDIA H100" in line and "triton" in line


def test_the_interval_is_seeded():
    x, y = np.arange(1.0, 11.0), np.arange(2.0, 12.0)
    assert compare.bootstrap_ratio(y, x) == compare.bootstrap_ratio(y, x)


# ---------------------------------------------------------------- matching and control


def test_control_cancels_a_uniform_drift():
    drift = {"a": 1.3, "b": 1.3, "ctl": 1.3}
    old, new = _pair({"a": 1.0, "b": 1.0, "ctl": 1.0}, drift)
    plain = _rows(compare.compare(old, new))
    assert all(row["significant"] and row["ratio"] > 1.2 for row in plain.values())
    controlled = compare.compare(old, new, control="ctl")
    rows = _rows(controlled)
    for t in (1024, 4096):
        assert not rows["a", t]["significant"] and not rows["b", t]["significant"]
        assert rows["a", t]["ratio"] == pytest.approx(1.0, abs=0.05)
        assert rows["ctl", t]["is_control"] and compare._verdict(rows["ctl", t]).startswith("control")
    assert compare.regressions(controlled, 5) == []
    # a real slowdown on top of the drift still shows
    old, new = _pair({"a": 1.0, "ctl": 1.0}, {"a": 1.3 * 1.25, "ctl": 1.3})
    rows = _rows(compare.compare(old, new, control="ctl"))
    assert rows["a", 1024]["significant"] and rows["a", 1024]["ratio"] == pytest.approx(1.25, rel=0.05)


def test_a_missing_control_is_reported_not_guessed():
    old, new = _pair({"a": 1.0, "ctl": 1.0}, {"a": 1.0, "ctl": 1.0})
    new["points"] = [p for p in new["points"] if not (p["mixer"] == "ctl" and p["seq_len"] == 4096)]
    result = compare.compare(old, new, control="ctl")
    rows = _rows(result)
    assert rows["a", 4096]["ratio"] is None and not rows["a", 4096]["significant"]
    assert result["missing_control"] == [rows["a", 4096]]
    assert rows["a", 1024]["ratio"] is not None
    text = " ".join(compare.summary(result, "old", "new"))
    assert "control ctl not measured in both files at the shape of 1 points" in text
    assert "s fwd a T=4k" in text


def test_the_points_without_control_are_named_by_sweep_or_by_mixer_with_their_lengths():
    """A sweep without the control (decode, say) is named once with its count; in a sweep
    that has it, each mixer is named once with the lengths it lacks there."""
    old, new = _pair({"a": 1.0, "b": 1.0, "ctl": 1.0}, {"a": 1.0, "b": 1.0, "ctl": 1.0},
                     seq_lens=(1024, 4096, 16384))
    other_old, other_new = _pair({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0},
                                 seq_lens=(2048, 8192))
    for doc, other in ((old, other_old), (new, other_new)):
        doc["points"] = [p for p in doc["points"] if not (p["mixer"] == "ctl"
                                                          and p["seq_len"] > 1024)]
        doc["points"] += [{**p, "sweep": "dec"} for p in other["points"]]
    result = compare.compare(old, new, control="ctl")
    assert len(result["missing_control"]) == 8
    text = " ".join(compare.summary(result, "old", "new"))
    assert "sweeps without it: dec (4 points)" in text and "dec fwd" not in text
    assert text.count("s fwd a T=") == 1 and "s fwd a T=4k,16k" in text
    assert "s fwd b T=4k,16k" in text


def test_points_match_across_renamed_sweeps_and_labels():
    old, new = _pair({"a": 1.0}, {"a": 1.0})
    for point in new["points"]:
        point.update(sweep="renamed", mixer="a-renamed")
    new["points"].append(_sampled("a", 16384, 1.0, 3))  # only in new
    result = compare.compare(old, new)
    assert [(r["old_sweep"], r["sweep"], r["old_mixer"], r["mixer"]) for r in result["rows"]] \
        == [("s", "renamed", "a", "a-renamed")] * 2
    assert len(result["only_new"]) == 1 and result["only_old"] == [] and result["by_sweep"] == 0
    cells = compare._cells(result["rows"][0])
    assert cells[0] == "s->renamed" and cells[2] == "a->a-renamed"
    # another shape or spec is another point
    other = _data([{**p, "head_dim": 16} for p in old["points"]]
                  + [{**p, "options": {"x": 1}} for p in old["points"]])
    assert compare.compare(old, other)["rows"] == []


def test_the_same_spec_in_two_sweeps_is_matched_by_sweep_name_too():
    old = _data([_sampled("a", 1024, 1.0, 1, sweep="one"), _sampled("a", 1024, 2.0, 2, sweep="two")])
    new = _data([_sampled("a", 1024, 1.0, 3, sweep="two"), _sampled("a", 1024, 2.0, 4, sweep="one")])
    result = compare.compare(old, new)
    assert {(r["old_sweep"], r["sweep"]) for r in result["rows"]} == {("one", "one"), ("two", "two")}
    assert result["by_sweep"] == 2
    assert "2 points matched by sweep name too" in " ".join(compare.summary(result, "o", "n"))


# ---------------------------------------------------------------- old files, memory, status


def test_points_without_samples_show_their_ratio_untested():
    old = _data([_point("a", 1024, 1.0), _sampled("b", 1024, 1.0, 1)])
    new = _data([_point("a", 1024, 2.0), _sampled("b", 1024, 1.0, 2)])
    result = compare.compare(old, new)
    rows = _rows(result)
    assert rows["a", 1024]["ratio"] == pytest.approx(2.0) and not rows["a", 1024]["tested"]
    assert not rows["a", 1024]["significant"] and rows["a", 1024]["ci"] is None
    assert compare._verdict(rows["a", 1024]) == "no samples, not tested"
    assert result["untested"] == [rows["a", 1024]] and rows["b", 1024]["tested"]
    assert compare.regressions(result, 0) == []
    assert "1 points without samples" in " ".join(compare.summary(result, "o", "n"))


def test_memory_changes_and_status_changes():
    old = _data([_point("a", 1024, 1.0, memory=100), _point("b", 1024, 1.0),
                 _point("c", 1024, 1.0, memory=100)])
    new = _data([_point("a", 1024, 1.0, memory=120), _point("b", 1024, 0, status="oom"),
                 _point("c", 1024, 1.0, memory=103)])
    result = compare.compare(old, new)
    rows = _rows(result)
    assert rows["a", 1024]["memory_ratio"] == pytest.approx(1.2) and rows["a", 1024]["memory_changed"]
    assert not rows["c", 1024]["memory_changed"]  # within the 5% tolerance
    assert rows["b", 1024]["status_changed"] and compare._verdict(rows["b", 1024]) == "ok -> oom"
    assert compare.regressions(result, 10) == [rows["a", 1024], rows["b", 1024]]
    assert compare.regressions(result, 25) == [rows["b", 1024]]


# ---------------------------------------------------------------- the command


@pytest.fixture
def slowed(tmp_path):
    old, new = _pair({"a": 1.0, "b": 1.0}, {"a": 1.2, "b": 1.0})
    return str(results.save(old, tmp_path / "old.yaml")), str(results.save(new, tmp_path / "new.yaml"))


def _invoke(*args):
    return CliRunner(env={"COLUMNS": "200"}).invoke(report.report, list(args))


def test_fail_on_regression_exit_codes(slowed):
    old, new = slowed
    shown = _invoke(old, new, "--compare")
    assert shown.exit_code == 0, shown.output
    failed = _invoke(old, new, "--compare", "--fail-on-regression", "10")
    assert failed.exit_code == 1, failed.output
    ratios = [row["ratio"] for row in compare.compare(*(results.load(path) for path in slowed))["rows"]]
    assert (f"FAIL: 2 regression(s) beyond 10%: s fwd a T=1k (time {ratios[0]:.3f}x), "
            f"s fwd a T=4k (time {ratios[1]:.3f}x)") in " ".join(failed.output.split())
    passed = _invoke(old, new, "--compare", "--fail-on-regression", "30")
    assert passed.exit_code == 0 and "no regression beyond 30%" in passed.output
    assert _invoke(old, new, "--compare", "--fail-on-regression", "10", "-k", "b").exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["--fail-on-regression", "-5"], "expected a percentage of at least 0"),
    (["--fail-on-regression", "nan"], "expected a percentage of at least 0"),
    (["--fail-on-regression", "ten"], "is not a valid float"),
    (["--control", "nosuch"], "--control 'nosuch' is not a mixer label of"),
    (["--alpha", "1.5"], "--alpha"),
    (["--min-change", "-1"], "expected a percentage of at least 0"),
])
def test_usage_errors_exit_2(slowed, args, message):
    result = _invoke(*slowed, "--compare", *args)
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert "ratio" not in result.output


def test_compare_options_need_compare(slowed):
    result = _invoke(slowed[0], "--fail-on-regression", "5")
    assert result.exit_code == 2 and "--fail-on-regression applies to --compare" in result.output


def test_output_is_deterministic_and_filtered(slowed):
    first, second = _invoke(*slowed, "--compare"), _invoke(*slowed, "--compare")
    assert first.output == second.output and "slower" in first.output
    only_b = _invoke(*slowed, "--compare", "-k", "b")
    assert "2 points matched" in only_b.output and "│ slower" not in only_b.output
    assert "0 significantly slower" in only_b.output and "│ slower" in first.output
    none = _invoke(*slowed, "--compare", "-k", "zz*")
    assert none.exit_code == 2 and "-k 'zz*' matches no point" in none.output
    gate = _invoke(*slowed, "--compare", "-k", "zz*", "--fail-on-regression", "0")
    assert gate.exit_code == 2  # a typo in -k never passes a CI gate


def test_options_that_do_nothing_in_a_mode_are_refused(slowed, tmp_path):
    for args, message in (([slowed[0], "--alpha", "0.05"], "--alpha applies to --compare"),
                          ([slowed[0], "--min-change", "5"], "--min-change applies to --compare"),
                          ([slowed[0], "--memory-tolerance", "5"], "applies to --compare"),
                          ([slowed[0], "--format", "svg"], "--format applies to --plots")):
        result = _invoke(*args)
        assert result.exit_code == 2 and message in result.output, result.output
    index = _invoke("--index", str(tmp_path), "--markdown")
    assert index.exit_code == 2 and "takes no other option (given: --markdown)" in index.output


def test_markdown_and_plots(slowed, tmp_path):
    shown = _invoke(*slowed, "--compare", "--markdown", "--plots", str(tmp_path / "plots"))
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert "| sweep | mode | mixer | T | old ms | new ms | ratio | CI | p | memory | result |" in lines
    assert any(line.startswith("| s | fwd | a | 1k |") and line.endswith("| **slower** |")
               for line in lines)
    assert "┃" not in shown.output
    assert (tmp_path / "plots" / "compare-fwd.png").read_bytes()[:4] == b"\x89PNG"


def test_narrow_output_keeps_plain_lines(slowed):
    result = CliRunner(env={"COLUMNS": "60"}).invoke(report.report, [*slowed, "--compare"])
    assert result.exit_code == 0 and "┃" not in result.output
    assert "  s fwd a T=1k:" in result.output and "SLOWER" in result.output


# ---------------------------------------------------------------- spread in bench tables


def test_bench_tables_flag_spreads_above_10_percent():
    wide = _sampled("a", 1024, 1.0, 1, sigma=0.5)
    narrow = _sampled("b", 1024, 1.0, 2, sigma=0.01)
    labels, [(_, _, cells)] = report.bench_cells([wide, narrow], "time")
    assert cells[0][0].endswith(f"±{wide['spread']:.0%}") and "±" not in cells[1][0]
    note = report.spread_note([wide, narrow])
    assert note == (f"spread above 10% at 1 of 2 points (IQR / median of the samples): "
                    f"a T=1k {wide['spread']:.0%}")
    old = _point("c", 1024, 1.0)
    old.update(p20_ms=0.5, p80_ms=1.5)  # a file without samples: p20-p80 stands in
    assert report.spread(old) == (1.0, False)
    assert "p80 - p20 over the median" in report.spread_note([old])
    assert report.spread_note([narrow]) is None


def test_markdown_tables_count_the_wide_spreads_in_their_title():
    points = [_sampled("a", 1024, 1.0, 1, sigma=0.5), _sampled("b", 1024, 1.0, 2, sigma=0.01)]
    title = report.bench_markdown(points, "t").splitlines()[0]
    assert title.endswith("IQR / median of the samples) **spread above 10% at 1 of 2 points**")
    assert "spread above" not in report.bench_markdown(points[1:], "t").splitlines()[0][-30:]
    assert "±" not in report.bench_markdown(points, "t", "memory")


def test_bench_and_report_print_the_spread_warning():
    from rich.console import Console

    data = _data([_sampled("a", 1024, 1.0, 1, sigma=0.5), _sampled("b", 1024, 1.0, 2, sigma=0.01)])
    console = Console(record=True, width=200, force_terminal=False)
    report.render_bench(data, console)
    text = console.export_text()
    assert "spread above 10% at 1 of 2 points (IQR / median of the samples): a T=1k" in text
    assert "±: spread above 10%, IQR / median of the samples" in " ".join(text.split())


def test_table_options_do_not_apply_to_a_comparison(slowed):
    for option in (["--metric", "memory"], ["--baseline", "a"]):
        result = _invoke(*slowed, "--compare", *option)
        assert result.exit_code == 2 and "not to --compare" in result.output, result.output
