"""The figures the report draws: colours by family, legends outside the data, readable log
axes, at most 8 series a panel, failed points under the figure (docs/figures.md)."""

import colorsys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors  # noqa: E402
import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from hla_bench import report  # noqa: E402
from hla_bench.recall import report as recall_report  # noqa: E402
from hla_bench.speed import compare
from hla_bench.results import plots, bench_files as results, styles  # noqa: E402
from hla_bench.recall.report import summarize  # noqa: E402

BENCH_MIXERS = [  # (label, mixer name, time factor)
    ("hla2-triton", "hla2", 1.3), ("hla2-chunk", "hla2", 14), ("ahla2-triton", "ahla2", 4),
    ("hla3-triton", "hla3", 6), ("hla2-unmasked", "hla2-unmasked", 16),
    ("fla-linear-attn", "fla-linear-attn", 1.0), ("fla-gla", "fla-gla", 4.2),
    ("fla-delta-rule", "fla-delta-rule", 5), ("linear-attn", "linear-attn", 2.2),
    ("sdpa-cudnn", "sdpa", 3), ("sdpa-flash", "sdpa", 3.5), ("mamba2-ssd", "mamba2-ssd", 3.1),
]


def _point(label, name, t, factor, status="ok"):
    ms = factor * (1 + t / 65536) if status == "ok" else None
    return {"sweep": "d64", "mode": "fwdbwd", "mixer": label, "name": name, "seq_len": t,
            "batch": 65536 // t, "status": status, "median_ms": ms,
            "p20_ms": ms and ms * 0.97, "p80_ms": ms and ms * 1.03,
            "peak_memory_bytes": int(factor * 2 ** 30) if ms else None, "state_bytes": 2 ** 20,
            "heads": 16, "head_dim": 64, "value_dim": 64, "dtype": "bfloat16", "device": "cuda",
            "reason": "" if ms else "RuntimeError: this kernel is broken here"}


def _bench(extra_failed=True):
    points = [_point(label, name, t, factor) for label, name, factor in BENCH_MIXERS
              for t in (2048, 8192, 32768, 65536)]
    if extra_failed:
        points += [_point("fla-simple-gla", "fla-simple-gla", t, 1, "error") for t in (2048, 8192)]
        points += [_point("flash-attn", "flash-attn", 2048, 1, "unavailable")]
    return {"points": points}


def _capture(monkeypatch):
    """The figures the plot functions would save, kept open for inspection."""
    figures = {}

    def keep(figure, path, dpi=110):
        figures[path.name] = figure
        return path

    monkeypatch.setattr(plots, "save_figure_tight", keep)
    return figures


def legend_overlaps(figure):
    """The plotted points (display coordinates, from matplotlib's own layout) that fall
    inside a legend box of `figure`."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.axes if ax.get_legend()]
    boxes = [legend.get_window_extent(renderer) for legend in legends]
    assert boxes, "the figure has no legend"
    hits = []
    for ax in figure.axes:
        if not ax.get_visible():
            continue
        for line in ax.lines:
            xy = line.get_xydata()
            if not len(xy):
                continue
            for x, y in line.get_transform().transform(xy):
                hits += [(line.get_label(), x, y) for box in boxes if box.contains(x, y)]
    return hits


def series(ax):
    """The labelled series of a panel (the legend's entries it holds)."""
    return [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]


def test_the_overlap_check_finds_a_legend_drawn_over_the_data():
    """The check can fail: a legend in the middle of a panel covers points."""
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots()
    for offset in range(6):
        ax.plot(range(20), [offset + 0.1 * i for i in range(20)], "o-", label=f"s{offset}")
    ax.legend(loc="center")
    assert legend_overlaps(figure)
    plt.close(figure)


def _hue(color):
    r, g, b = matplotlib.colors.to_rgb(color)
    return colorsys.rgb_to_hsv(r, g, b)


def test_colours_go_by_family_and_stay_with_the_mixer():
    for name in ("hla2", "ahla2", "hla3", "hla2-unmasked", "hla4-new"):
        hue, saturation, _ = _hue(styles.color(name))
        assert 0.52 <= hue <= 0.80 and saturation > 0.2, (name, hue)  # blues to purples
    for name in ("fla-linear-attn", "linear-attn", "fla-gla", "fla-simple-gla", "fla-delta-rule",
                 "fla-gated-delta-rule", "based", "fla-new-kernel"):
        hue, saturation, _ = _hue(styles.color(name))
        assert 0.15 <= hue <= 0.50 and saturation > 0.2, (name, hue)  # greens and teals
    for name in ("sdpa", "flash-attn"):
        assert _hue(styles.color(name))[1] == 0, name  # grey or black
    hue, saturation, _ = _hue(styles.color("mamba2-ssd"))
    assert 0.0 <= hue <= 0.12 and saturation > 0.5  # orange
    known = [m for _, mixers, _ in styles.FAMILIES.values() for m in mixers if m != "mamba2"]
    assert len({styles.color(m) for m in known}) == len(known)
    # a mixer's colour does not depend on the others a figure holds
    assert styles.mixer_colors(["hla2-chunk"]) == {"hla2-chunk": styles.color("hla2")}
    assert (styles.mixer_colors(["sdpa", "hla2", "zzz"])["hla2"]
            == styles.mixer_colors(["hla2"])["hla2"])


def test_variants_share_the_colour_and_differ_by_line_and_marker():
    triton, chunk = styles.style("hla2-triton", "hla2"), styles.style("hla2-chunk", "hla2")
    assert triton.color == chunk.color == styles.color("hla2")
    assert (triton.linestyle, triton.marker) != (chunk.linestyle, chunk.marker)
    assert styles.style("hla2-chunk").color == styles.color("hla2")  # name found from label
    cudnn, flash = styles.style("sdpa-cudnn", "sdpa"), styles.style("sdpa-flash", "sdpa")
    assert cudnn.color == flash.color and cudnn.linestyle != flash.linestyle


def test_split_views_keep_eight_series_and_show_every_mixer():
    labels = [label for label, _, _ in BENCH_MIXERS]
    names = {label: name for label, name, _ in BENCH_MIXERS}
    rank = {label: factor for label, _, factor in BENCH_MIXERS}
    views = styles.split_views(labels, names, rank, "fla-linear-attn")
    assert views[0][0] == "" and all(len(shown) <= 8 for _, shown in views)
    assert all("fla-linear-attn" in shown for _, shown in views)
    assert {label for _, shown in views for label in shown} == set(labels)
    overview = views[0][1]
    assert "hla2-triton" in overview and "hla2-chunk" not in overview  # fastest variant
    assert {"sdpa-cudnn", "mamba2-ssd"} <= set(overview)  # each family's best
    assert [suffix for suffix, _ in views[1:]] == ["-hla", "-linear", "-softmax"]
    assert styles.split_views(labels[:8], names, rank) == [("", styles.ordered(labels[:8], names))]


@pytest.mark.parametrize("low, high, base", [(1000, 1010, 10), (1.0, 1.02, 2), (3.1, 3.1, 10),
                                             (2 ** 30, 2 ** 30 * 1.1, 2), (0.2, 5000, 10),
                                             (2 ** 15, 2 ** 23, 2)])
def test_log_ticks_give_at_least_three_labels(low, high, base):
    ticks, (bottom, top) = plots.log_ticks(low, high, base)
    assert 3 <= len(ticks) <= plots.MAX_TICKS
    assert all(bottom <= t <= top for t in ticks) and bottom <= low and top >= high


def test_byte_ticks_read_in_binary_units():
    assert [plots.format_bytes_tick(v) for v in (512, 2048, 1.5 * 2 ** 30, 3 * 2 ** 20)] == \
        ["512 B", "2 KiB", "1.5 GiB", "3 MiB"]


def _log_axes_readable(figure):
    for ax in figure.axes:
        if not ax.get_visible():
            continue
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                low, high = sorted(axis.get_view_interval())
                labels = [text for tick, text in zip(axis.get_majorticklocs(),
                                                     [t.get_text() for t in axis.get_majorticklabels()])
                          if low <= tick <= high and text]
                assert len(labels) >= 3, (ax.get_title(), labels)


def test_bench_figures_split_keep_legends_off_the_data_and_list_failures(tmp_path, monkeypatch):
    figures = _capture(monkeypatch)
    written = report.write_plots(_bench(), tmp_path)
    assert [p.name for p in written] == ["d64-fwdbwd.png", "d64-fwdbwd-hla.png",
                                         "d64-fwdbwd-linear.png", "d64-fwdbwd-softmax.png"]
    for name, figure in figures.items():
        assert legend_overlaps(figure) == [], name
        time_ax, ratio_ax, memory_ax = figure.axes
        assert len(series(time_ax)) <= 8, name
        assert "fla-linear-attn" in series(time_ax)  # the baseline, in every view
        assert ratio_ax.get_ylabel() == "time / fla-linear-attn's time"
        assert ratio_ax.get_yscale() == "log" and ratio_ax.yaxis.get_transform().base == 2
        assert any(text.get_text().endswith(" GiB") for text in memory_ax.get_yticklabels())
        _log_axes_readable(figure)
        entries = [text.get_text() for legend in figure.legends for text in legend.get_texts()]
        assert not any("simple-gla" in entry or "flash-attn" in entry for entry in entries)
    notes = "\n".join(text.get_text() for text in figures["d64-fwdbwd.png"].texts)
    assert "fla-simple-gla: error at T=2k,8k (RuntimeError: this kernel is broken here)" in notes
    assert "flash-attn: n/a at T=2k" in notes
    linear = "\n".join(text.get_text() for text in figures["d64-fwdbwd-linear.png"].texts)
    assert "fla-simple-gla" in linear and "flash-attn" not in linear


def test_bench_figures_take_a_baseline_and_a_choice_of_mixers(tmp_path, monkeypatch):
    figures = _capture(monkeypatch)
    written = report.write_plots(_bench(), tmp_path, baseline="sdpa-cudnn", mixers="hla2*,mamba")
    assert [p.name for p in written] == ["d64-fwdbwd.png"]
    time_ax, ratio_ax, _ = figures["d64-fwdbwd.png"].axes
    assert series(time_ax) == ["hla2-triton", "hla2-chunk", "hla2-unmasked", "sdpa-cudnn",
                               "mamba2-ssd"]
    assert ratio_ax.get_ylabel() == "time / sdpa-cudnn's time"


def test_the_default_baseline_is_the_fastest_linear_attention_mixer():
    points = _bench()["points"]
    assert plots.default_baseline(points) == "fla-linear-attn"
    slower = [p for p in points if p["mixer"] != "fla-linear-attn"]
    assert plots.default_baseline(slower) == "linear-attn"  # hla2-triton is faster, not linear


H200_A = Path(__file__).parent.parent / "results" / "h100-2026-12-05" / "h200-a.yaml"


@pytest.mark.slow
def test_report_plots_mixers_option(tmp_path):
    runner = CliRunner()
    base = [str(H200_A), "--sweep", "d64", "--mode", "fwdbwd", "--plots"]
    done = runner.invoke(report.report, base + [str(tmp_path / "p"), "--mixers", "hla2-triton"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["d64-fwdbwd.png"]
    bad = runner.invoke(report.report, base + [str(tmp_path / "q"), "-k", "nope"])
    assert bad.exit_code == 2 and "-k 'nope' matches no mixer of" in bad.output
    assert not (tmp_path / "q").exists()  # refused before any work
    table = runner.invoke(report.report, [str(H200_A), "--sweep", "d64", "--mode", "fwdbwd",
                                          "--markdown", "-k", "hla3-triton,fla-linear-attn"])
    assert table.exit_code == 0, table.output
    header = next(line for line in table.output.splitlines() if line.startswith("| T |"))
    assert header == "| T | batch | hla3-triton | fla-linear-attn |"  # the tables choose too


def _recall_runs():
    mixers = ["hla2", "ahla2", "hla3", "linear-attn", "fla-gla", "fla-delta-rule", "based",
              "sdpa", "mamba2-ssd"]
    runs = []
    for setting, seq_len in (("mqar a", 64), ("mqar b", 128)):
        for index, mixer in enumerate(mixers):
            for d_model in (64, 128, 256):
                score = min(1.0, 0.5 + 0.05 * index + d_model / 1024)
                runs.append({"setting": setting, "mixer": mixer, "d_model": d_model, "lr": 1e-3,
                             "seed": 0, "status": "ok", "val_accuracy": score,
                             "test_accuracy": score, "steps": 10,
                             "state_bytes": d_model * 512 * (seq_len if mixer == "sdpa" else 4)})
    return runs


def test_pareto_front_keeps_the_points_no_other_beats():
    points = [(1, 0.5), (2, 0.4), (2, 0.7), (4, 0.7), (8, 0.9), (16, 0.85)]
    assert recall_report.pareto_front(points) == [(1, 0.5), (2, 0.7), (8, 0.9)]


def test_recall_figures_split_draw_fronts_and_published_points(tmp_path, monkeypatch):
    figures = _capture(monkeypatch)
    published = {"mqar a": {"Zoology: Attention": {64: 1.0, 128: 1.0},
                            "Zoology: Hyena": {64: 0.5}}}
    written = recall_report.plot_recall(summarize(_recall_runs()), tmp_path, "png", published,
                                        {"Attention": "sdpa"})
    assert [p.name for p in written] == [
        "recall_accuracy_vs_state.png", "recall_accuracy_vs_state-linear.png",
        "recall_accuracy_vs_d_model.png", "recall_accuracy_vs_d_model-linear.png"]
    for name, figure in figures.items():
        assert legend_overlaps(figure) == [], name
        panels = [ax for ax in figure.axes if ax.get_visible()]
        assert [ax.get_title() for ax in panels][-1].startswith("overall")
        assert len(panels) == 3  # two settings and the overall
        assert all(len(series(ax)) <= 8 for ax in panels), name
        _log_axes_readable(figure)
    state = figures["recall_accuracy_vs_state.png"]
    first = state.axes[0]
    hollow = [line for line in first.lines if line.get_markerfacecolor() == "none"]
    assert len(hollow) == 1 and hollow[0].get_markeredgecolor() == styles.color("sdpa")
    # at sdpa's own state for d_model 64 and 128 in that setting
    assert list(hollow[0].get_xdata()) == [64 * 512 * 64, 128 * 512 * 64]
    fronts = [line for line in first.lines if line.get_drawstyle() == "steps-post"]
    assert len(fronts) == len(series(first))
    entries = [t.get_text() for legend in state.legends for t in legend.get_texts()]
    assert recall_report.PUBLISHED_NOTE in entries
    notes = "\n".join(text.get_text() for text in state.texts)
    assert "Zoology's Hyena: no hla-bench mixer" in notes


def test_compare_figures_keep_the_legend_off_the_data(tmp_path, monkeypatch):
    figures = _capture(monkeypatch)
    rows = [{"mode": "fwd", "sweep": "d64", "mixer": label, "seq_len": t,
             "ratio": 1 + 0.01 * index, "ci": (0.99, 1.02 + 0.01 * index)}
            for index, (label, _, _) in enumerate(BENCH_MIXERS) for t in (2048, 8192, 32768)]
    compare.write_plots({"rows": rows, "control": None, "alpha": 0.01}, tmp_path)
    (figure,) = figures.values()
    assert legend_overlaps(figure) == []
    colors = {bars.get_label(): bars.lines[0].get_color() for bars in figure.axes[0].containers}
    assert colors["hla2-chunk"] == colors["hla2-triton"] == styles.color("hla2")


def test_the_state_plot_draws_the_published_frontier_points_hollow(tmp_path, monkeypatch):
    """frontier_points places each mapped architecture's published points under the first
    mixer of the setting that is one of its mixers, at their states over the model (as the
    runs' state_bytes of two layers); the state plot draws them hollow in that mixer's
    colour, the d_model plot not at all."""
    from hla_bench.recall.report import FRONTIER_REFERENCE, frontier_points, load_reference
    from test_report import _protocol_run

    reference = load_reference(FRONTIER_REFERENCE)
    runs = [_protocol_run(mixer, state, 0.9, 0.5, reference)
            for mixer, state in (("sdpa:window=16", 8192), ("sdpa:window=32", 16384),
                                 ("based", 70980), ("hla2", 4096))]
    summary = summarize(runs)
    placed = frontier_points(runs, summary, reference)
    figures = reference["points"]
    sliding = (figures["based-figure2"]["Sliding Window"]
               + figures["zoology-results"]["Sliding Window"])
    assert set(placed) == {"frontier"} and set(placed["frontier"]) == {"sdpa:window=16", "based"}
    assert sorted(placed["frontier"]["sdpa:window=16"]) == sorted(map(tuple, sliding))
    drawn = _capture(monkeypatch)
    recall_report.plot_recall(summary, tmp_path, "png", frontier=placed)
    hollow = [line for line in drawn["recall_accuracy_vs_state.png"].axes[0].lines
              if line.get_markerfacecolor() == "none"]
    assert {line.get_markeredgecolor() for line in hollow} == {styles.color("sdpa:window=16"),
                                                               styles.color("based")}
    based = figures["based-figure2"]["Based"] + figures["zoology-results"]["Based"]
    assert sorted(x for line in hollow for x in line.get_xdata()) == sorted(
        state for state, _ in sliding + based)
    d_model = drawn["recall_accuracy_vs_d_model.png"].axes[0].lines
    assert not [line for line in d_model if line.get_markerfacecolor() == "none"]


def test_a_setting_tested_on_a_mix_has_a_panel_per_test_slice(monkeypatch, tmp_path):
    """slice_summary scores each run on each test slice (the lr still picked on validation
    over the mix) at its state after that slice; the figures put the slices' panels after
    their setting's, and the overall mean counts the settings alone."""
    def run(mixer, lr, val, slices, per_layer):
        return {"setting": "mix", "mixer": mixer, "d_model": 64, "lr": lr, "seed": 0,
                "status": "ok", "val_accuracy": val, "test_accuracy": 0.5, "steps": 10,
                "n_layers": 2, "state_bytes_per_layer": per_layer[-1],
                "state_bytes": 2 * per_layer[-1],
                "test_slices": [{"slice": f"seq_len={t}", "seq_len": t, "accuracy": a,
                                 "state_bytes_per_layer": b}
                                for t, a, b in zip((64, 256), slices, per_layer)]}

    runs = [run("sdpa", 1e-3, 0.9, (1.0, 0.8), (64 * 512, 256 * 512)),
            run("sdpa", 1e-2, 0.5, (1.0, 0.99), (64 * 512, 256 * 512)),  # rejected on val
            run("hla2", 1e-3, 0.9, (0.9, 0.6), (4096, 4096)),
            {**run("hla2", 1e-3, 0.9, (0.9, 0.6), (4096, 4096)), "setting": "other"}]
    slices = recall_report.slice_summary(runs)
    assert set(slices) == {f"{s}{recall_report.SLICE_PANEL}seq_len={t}"
                           for s in ("mix", "other") for t in (64, 256)}
    long = slices[f"mix{recall_report.SLICE_PANEL}seq_len=256"]
    assert long["sdpa"][64]["score"]["mean"] == 0.8  # the val-picked run's slice accuracy
    assert long["sdpa"][64]["state_bytes"] == 2 * 256 * 512  # at the slice's own length
    assert long["hla2"][64]["state_bytes"] == 2 * 4096
    figures = _capture(monkeypatch)
    recall_report.plot_recall(summarize(runs), tmp_path, "png", slices=slices)
    titles = [ax.get_title().replace("\n", " ")
              for ax in figures["recall_accuracy_vs_state.png"].axes if ax.get_visible()]
    assert titles == ["mix", f"mix{recall_report.SLICE_PANEL}seq_len=64",
                      f"mix{recall_report.SLICE_PANEL}seq_len=256", "other",
                      f"other{recall_report.SLICE_PANEL}seq_len=64",
                      f"other{recall_report.SLICE_PANEL}seq_len=256",
                      "overall: mean over the 2 settings"]
    ys = [y for line in figures["recall_accuracy_vs_state.png"].axes[2].lines
          for y in line.get_ydata()]
    assert 0.8 in ys and 0.6 in ys and 0.99 not in ys
