"""Terminal output at 80 columns (what a pipe or a redirect gets): every identifier whole,
no line wider than the console, whichever layout the width leads to."""

import io

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.table import Table

from hla_bench import registry, report, verify
from hla_bench.results import bench_files as results, tables
from hla_bench.cli import main
from test_report import _data, _point
from test_sweeps import _fast_op, fake_mixers  # noqa: F401  (fixture)

LONG = "fake-mixer-with-a-rather-long-registered-name"


def _lines(text):
    return text.rstrip("\n").split("\n")


def _whole(text, identifiers):
    """Each identifier on one line of `text`, unbroken."""
    missing = [name for name in identifiers if not any(name in line for line in _lines(text))]
    assert not missing, f"cut or missing: {missing}\n{text}"


def _narrow(text, width=80):
    wide = [line for line in _lines(text) if len(line) > width]
    assert not wide, "\n".join(wide)


def _console(width=80):
    return Console(file=io.StringIO(), width=width, force_terminal=False, record=True)


@pytest.fixture
def long_mixer(fake_mixers):
    mixer = registry.Mixer(LONG, "fake", "a long name with long options", _fast_op,
                           options={"scale": 1.0, "a_long_option_name": "a_long_value",
                                    "another_option": None}, forms=("op", "decode"))
    registry.register(mixer, replace=True)
    yield mixer
    registry._REGISTRY.pop(LONG, None)


def _mixer_identifiers():
    names = []
    for mixer in registry.all_mixers():
        names += [mixer.name, *mixer.forms, *(f"{k}={v}" for k, v in mixer.options.items())]
        if mixer.unavailable_reason():
            names += mixer.unavailable_reason().split("; ")
    return names


@pytest.mark.parametrize("columns", ["80", "200"])
def test_list_keeps_every_name_form_and_option_whole(long_mixer, columns):
    result = CliRunner(env={"COLUMNS": columns}).invoke(main, ["list"])
    assert result.exit_code == 0, result.output
    _whole(result.output, _mixer_identifiers())
    _narrow(result.output, int(columns))


@pytest.mark.parametrize("columns", ["80", "250"])
def test_tasks_list_keeps_every_task_and_parameter_name_whole(columns):
    import tasks as task_registry

    result = CliRunner(env={"COLUMNS": columns}).invoke(main, ["tasks", "list"])
    assert result.exit_code == 0, result.output
    names = []
    for task in task_registry.all_tasks():
        names += [task.name, *(f"{key}={value}" for key, value in task.params.items()),
                  f"{task.num_train}/{task.num_test}"]
    _whole(result.output, names)
    _narrow(result.output, int(columns))


def test_bench_tables_split_their_mixer_columns_at_80_columns():
    labels = [f"{name}-variant-{i}" for i, name in enumerate(("hla2", "sdpa-cudnn", "mamba2",
                                                                "linear-attn", "ahla2", "hla3"))]
    points = [_point(label, t, 1.5 * (i + 1) * t / 1024, status="oom" if i == 2 and t > 1024
                     else "ok") for i, label in enumerate(labels) for t in (1024, 4096, 65536)]
    data = _data(points)
    data["sweeps"][0]["baseline"] = labels[0]
    console = _console()
    report.render_bench(data, console, ("time", "memory"))
    text = console.export_text()
    _whole(text, labels + ["64k", "OOM"])
    _narrow(text)
    assert text.count("· mixers 1–") == 2  # split: one set of tables per metric
    values = [cell for _, _, cells in report.bench_cells(points, "time", labels[0])[1]
              for cell in cells if isinstance(cell, tuple)]
    _whole(text, [word for text_, _ in values for word in text_.split()])


def test_a_bench_table_that_fits_is_one_table():
    data = _data([_point("a", 1024, 4.0), _point("b", 1024, 2.0)])
    console = _console()
    report.render_bench(data, console)
    text = console.export_text()
    assert "mixers 1–" not in text and text.count("┏") == 1


def test_bench_lines_where_no_table_fits():
    data = _data([_point(LONG, 1024, 4.0), _point("b", 1024, 2.0)])
    console = _console(width=40)
    report.render_bench(data, console)
    text = console.export_text()
    assert "┃" not in text
    _whole(text, [f"T=1k batch=1 {LONG}: 4.000", "T=1k batch=1 b: 2.000 (best)"])


def test_comparison_keeps_names_whole():
    from hla_bench.speed import compare

    old = _data([_point(LONG, 1024, 4.0), _point("b", 4096, 2.0)])
    new = _data([_point(LONG, 1024, 8.0), _point("b", 4096, 1.0)])
    result = compare.compare(old, new)
    for width in (200, 40):
        console = _console(width)
        tables.print_table(console, compare.comparison_table(result, "old.yaml", "new.yaml"),
                           lambda: compare.comparison_lines(result, "old.yaml", "new.yaml"))
        text = console.export_text()
        _whole(text, [LONG, "b", "4k", "2.000x", "0.500x"])
        assert ("┃" in text) == (width == 200)  # the plain layout where the table cannot fit


def _verify_result():
    rows = []
    for option in ("masked", "masked, decay per head, paper form, normalize"):
        for pair in ("serial vs naive", "split via initial_state vs naive",
                     "prefill + step vs naive"):
            rows.append({"operator": "hla2", "option": option, "pair": pair, "error": 1e-16,
                         "tolerance": 1e-10, "status": "pass"})
    rows.append({"operator": "hla2", "option": "masked", "pair": "triton vs naive",
                 "error": None, "tolerance": 1e-10, "status": "skip",
                 "note": "the Triton form does not offer ridge"})
    return {"device": "cpu", "dtype": "float64", "seed": 0, "seq_len": 32, "checks": rows,
            "discrepancies": [{"comparison": "hla2 decay_form paper vs masked",
                               "setting": "decay 0.9", "relative_difference": 0.43}],
            "passed": True, "wall_s": 1.0}


@pytest.mark.parametrize("width", [80, 44])
def test_verify_tables_keep_pairs_and_options_whole(width):
    console = _console(width)
    verify.render(_verify_result(), console)
    text = console.export_text()
    pairs = ["serial vs naive", "split via initial_state vs naive", "prefill + step vs naive",
             "triton vs naive", "hla2 decay_form paper vs masked"]
    _whole(text, pairs + ["masked", "decay per head", "paper form", "normalize", "ridge"])
    _narrow(text, width)


@pytest.mark.slow
def test_verify_command_at_80_columns():
    result = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["verify", "--seq-len", "14"])
    assert result.exit_code == 0, result.output
    pairs = [f"{form} vs naive" for form in ("serial", "scan", "chunk")]
    _whole(result.output, pairs + ["split via initial_state vs naive", "prefill + step vs naive",
                                   "hla3 variant paper vs causal", "ahla2"])
    _narrow(result.output)


def test_fit_keeps_identifiers_and_words_whole_or_says_it_cannot():
    table = Table()
    table.add_column("name", no_wrap=True)
    table.add_column("notes")
    table.add_row("an-identifier-of-30-characters", "words that can wrap between them")
    assert tables.fit(table, _console(), width=50)
    assert table.columns[0].width == 30 and table.columns[1].width == 50 - 30 - 7
    assert sum(c.width for c in table.columns) + 7 <= 50
    narrow = Table()
    narrow.add_column("name", no_wrap=True)
    narrow.add_row("an-identifier-of-30-characters")
    assert not tables.fit(narrow, _console(), width=30)  # 30 + borders and padding
    assert narrow.columns[0].width is None  # left as it was


def test_pack_keeps_items_whole():
    assert tables.pack(["aa bb", "cc", "dddddddddd"], 8) == ["aa bb", "cc", "dddddddddd"]
    assert tables.pack(["a", "b", "c"], 4, sep=" ") == ["a b", "c"]
    assert tables.wrap("one two three", 8, indent="  ", hang="  ") == ["  one", "    two",
                                                                        "    three"]


def test_table_lines_give_every_cell_whole_with_its_header():
    table = Table(title="[bold]a title[/]", caption="a caption")
    for header in ("mixer", "d", "val"):
        table.add_column(header)
    table.add_row("hla2-very-long-label", "64", "0.991\n±0.004")
    table.add_row("sdpa", "128", "")
    assert tables.table_lines(table, Console(width=20)) == [
        "a title", ["hla2-very-long-label", "d 64", "val 0.991 ±0.004"], ["sdpa", "d 128"],
        "a caption"]
