"""The `list`, `bench` and `run` commands through click's test runner, with fake mixers."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from hla_bench import bench, configs, registry
from hla_bench.results import bench_files as results
from hla_bench.speed import runner as engine_runner
from hla_bench.speed.sweeps import load_config
from hla_bench.results.records import point_key
from hla_bench.cli import main
from test_sweeps import fake_mixers  # noqa: F401  (fixture)


@pytest.fixture
def runner():
    return CliRunner(env={"COLUMNS": "200"})


def test_list_table_and_json(runner, fake_mixers):
    table = runner.invoke(main, ["list"])
    assert table.exit_code == 0, table.output
    assert "fake-fast" in table.output and "scale=1.0" in table.output
    assert "no_such_package_for_hla_bench not installed" in table.output
    rows = {row["name"]: row for row in json.loads(runner.invoke(main, ["list", "--json"]).output)}
    assert rows["fake-fast"]["available"] and rows["fake-fast"]["options"] == {"scale": 1.0}
    assert not rows["fake-missing"]["available"]
    assert rows["fake-missing"]["reason"] == "no_such_package_for_hla_bench not installed"


def test_bench_writes_results_and_tables(runner, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    result = runner.invoke(main, [
        "bench", "--mixers", "fake-fast,fake-fast:scale=2:label=double,fake-oom,fake-missing",
        "--seq-lens", "64,128", "--tokens-per-batch", "256", "--heads", "2", "--head-dim", "8",
        "--value-dim", "4", "--modes", "fwd,decode", "--decode-batch", "3", "--device", "cpu",
        "--repeats", "2", "--warmup", "1", "--baseline", "fake-fast", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "median ms" in result.output and "peak memory above inputs" in result.output
    assert f"results written to {out}" in result.output.replace("\n", "")
    data = results.load(out)
    assert data["config"]["seq_lens"] == [64, 128] and data["sweeps"][0]["baseline"] == "fake-fast"
    by = {(p["mixer"], p["mode"], p["seq_len"]): p for p in data["points"]}
    assert len(by) == 4 * 2 * 2
    assert by["double", "fwd", 64]["batch"] == 4 and by["double", "fwd", 128]["batch"] == 2
    assert by["double", "decode", 128]["batch"] == 3 and by["double", "fwd", 64]["value_dim"] == 4
    assert by["double", "fwd", 64]["options"] == {"scale": 2}
    assert {by["fake-oom", "fwd", t]["status"] for t in (64, 128)} == {"oom"}
    assert by["fake-missing", "decode", 64]["status"] == "unavailable"
    assert data["environment"]["wall_s"] > 0


@pytest.mark.slow
def test_bench_point_timeout_recorded_in_results_and_table(runner, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    result = runner.invoke(main, ["bench", "--mixers", "fake-slow,fake-fast", "--seq-lens", "16",
                                  "--heads", "1", "--head-dim", "4", "--device", "cpu",
                                  "--modes", "fwd", "--repeats", "1", "--warmup", "0",
                                  "--point-timeout-s", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "timeout" in result.output
    by = {p["mixer"]: p for p in results.load(out)["points"]}
    assert by["fake-slow"]["status"] == "timeout" and by["fake-fast"]["status"] == "ok"
    assert results.load(out)["sweeps"][0]["point_timeout_s"] == 3
    bad = runner.invoke(main, ["bench", "--mixers", "fake-fast", "--point-timeout-s", "0"])
    assert bad.exit_code == 2


def test_bench_json_output(runner, fake_mixers, tmp_path):
    result = runner.invoke(main, ["bench", "--mixers", "fake-fast", "--seq-lens", "32",
                                  "--heads", "1", "--head-dim", "4", "--device", "cpu",
                                  "--repeats", "1", "--warmup", "0", "--json",
                                  "--out", str(tmp_path / "r.yaml")])
    assert result.exit_code == 0, result.output
    stdout = result.stdout
    data = json.loads(stdout)
    assert data["kind"] == "bench"
    assert [(p["mode"], p["status"]) for p in data["points"]] == [("fwd", "ok"), ("fwdbwd", "ok"), ("decode", "ok")]


def test_bench_options_are_the_sweep_settings_with_their_defaults(runner, monkeypatch):
    """A bench run without options and a config file giving only the mixers are the same
    sweep: one default per setting."""
    from hla_bench.speed.sweeps import SweepConfig, setting_fields

    seen = []
    monkeypatch.setattr(bench, "execute", lambda config, sweeps, *a: seen.append(sweeps))
    result = runner.invoke(main, ["bench", "--mixers", "sdpa"])
    assert result.exit_code == 0, result.output
    from_file = SweepConfig.from_dict({"name": "bench", "mixers": ["sdpa"]})
    assert seen[0][0].to_dict() == from_file.to_dict()
    options = {param.name for param in bench.bench.params}
    assert {each.name for each in setting_fields() if each.metadata["cli"]} <= options


@pytest.mark.parametrize("args, message", [
    (["--mixers", "no-such-mixer"], "unknown mixer 'no-such-mixer'"),
    (["--mixers", "fake-fast:colour=red"], "has no option 'colour'"),
    (["--mixers", "fake-fast", "--seq-lens", "4q"], "bad sequence length '4q'"),
    (["--mixers", "fake-fast", "--modes", "fwd,bwd"], "bad mode 'bwd'"),
    (["--mixers", "fake-fast", "--baseline", "sdpa"], "baseline 'sdpa'"),
    (["--mixers", "fake-fast", "--batch", "2", "--tokens-per-batch", "8"], "not both"),
    (["--mixers", "fake-fast", "--json", "--yaml"], "not both"),
    (["--mixers", "fake-fast", "--device", "gpu7"], "bad device 'gpu7'"),
    (["--mixers", "fake-fast", "--device", "meta"], "device 'meta' cannot be timed"),
    (["--mixers", "fake-fast", "--seq-lens", "64,64"], "sequence length 64 is given twice"),
    (["--mixers", "fake-fast", "--seq-lens", "1k,1024"], "sequence length 1k is given twice"),
    (["--mixers", "fake-fast", "--modes", "fwd,fwd"], "mode 'fwd' is given twice"),
    (["--mixers", "fake-fast", "--seq-lens", "1k,,2k"], "empty item in the sequence lengths"),
    (["--mixers", "fake-fast", "--seq-lens", "1k,2k,"], "empty item in the sequence lengths"),
    (["--mixers", "fake-fast", "--modes", "fwd,,decode"], "empty item in the modes"),
    (["--mixers", "fake-fast,,fake-oom"], "empty item in the mixers"),
    (["--mixers", "fake-fast", "--device", "mps"], "device 'mps' cannot be timed"),
])
def test_bench_usage_errors_exit_2_without_traceback(runner, fake_mixers, tmp_path, args, message):
    result = runner.invoke(main, ["bench", *args, "--out", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r.yaml").exists()


@pytest.mark.slow
def test_run_config_with_two_sweeps(runner, fake_mixers, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny", "heads": 2, "device": "cpu", "warmup": 0, "repeats": 2,
        "seq_lens": ["64", "128"], "batch": 1, "modes": ["fwd", "fwdbwd"],
        "sweeps": [
            {"name": "d8", "head_dim": 8, "baseline": "fast",
             "mixers": [{"name": "fake-fast", "label": "fast"}, "fake-broken"]},
            {"name": "d16", "head_dim": 16,
             "mixers": [{"name": "fake-fast", "label": "fast", "options": {"scale": 0.5}}]},
        ]}))
    out = tmp_path / "out.yaml"
    result = runner.invoke(main, ["run", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 sweep(s), 12 points" in result.output
    assert "d8 · fwd · H=2 D=8" in result.output and "d16 · fwdbwd · H=2 D=16" in result.output
    data = results.load(out)
    assert data["config"]["sweeps"][1]["head_dim"] == 16
    assert {p["sweep"] for p in data["points"]} == {"d8", "d16"}
    assert {p["status"] for p in data["points"] if p["mixer"] == "fake-broken"} == {"error"}
    assert all(p["status"] == "ok" for p in data["points"] if p["mixer"] == "fast")


def test_run_selected_sweeps(runner, fake_mixers, tmp_path):
    """--sweep runs the named sweeps of a config only; an unknown name is a usage error."""
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({
        "heads": 2, "device": "cpu", "warmup": 0, "repeats": 2, "seq_lens": ["64"],
        "batch": 1, "modes": ["fwd"], "mixers": ["fake-fast"],
        "sweeps": [{"name": "d8", "head_dim": 8}, {"name": "d16", "head_dim": 16}]}))
    out = tmp_path / "out.yaml"
    result = runner.invoke(main, ["run", str(config), "--sweep", "d16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 sweep(s), 1 points" in result.output
    assert [p["sweep"] for p in results.load(out)["points"]] == ["d16"]
    result = runner.invoke(main, ["run", str(config), "--sweep", "d32"])
    assert result.exit_code == 2 and "--sweep 'd32' is not a sweep of two.yaml (d8, d16)" in result.output


@pytest.mark.slow
def test_resume_keeps_measured_points_and_reruns_errors(runner, fake_mixers, tmp_path,
                                                        monkeypatch):
    """A sweep cut short is continued from its results file: kept points are not measured
    again, errors and missing points are."""
    out = tmp_path / "out.yaml"
    args = ["bench", "--mixers", "fake-fast:label=fast,fake-broken", "--seq-lens", "16,32",
            "--modes", "fwd", "--batch", "1", "--heads", "2", "--head-dim", "8",
            "--device", "cpu", "--warmup", "0", "--repeats", "2", "--out", str(out)]
    assert runner.invoke(main, args).exit_code == 0
    first = results.load(out)["points"]
    data = results.load(out)
    data["points"] = [p for p in data["points"] if p["seq_len"] == 16]  # as if killed
    results.save(data, out)
    measured = []
    original = engine_runner.run_together
    monkeypatch.setattr(engine_runner, "run_together",
                        lambda points, *a: measured.extend(p.describe() for p in points)
                        or original(points, *a))
    result = runner.invoke(main, args + ["--resume"])
    assert result.exit_code == 0, result.output
    assert sorted(measured) == ["bench fake-broken fwd T=16", "bench fake-broken fwd T=32",
                                "bench fast fwd T=32"]
    resumed = results.load(out)["points"]
    assert resumed[0] == first[0]  # fast T=16 kept as it was
    assert sorted((p["mixer"], p["seq_len"]) for p in resumed) == \
        sorted((p["mixer"], p["seq_len"]) for p in first)



@pytest.mark.slow
def test_ctrl_c_keeps_the_measured_points_says_how_to_resume_and_exits_130(
        runner, fake_mixers, tmp_path, monkeypatch):
    out = tmp_path / "out.yaml"
    args = ["bench", "--mixers", "fake-fast:label=fast,fake-broken", "--seq-lens", "16,32",
            "--modes", "fwd", "--batch", "1", "--heads", "2", "--head-dim", "8",
            "--device", "cpu", "--warmup", "0", "--repeats", "2", "--out", str(out)]
    original, calls = engine_runner.run_together, []

    def interrupted_at_the_second_shape(points, *a):
        calls.append(points[0].seq_len)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(points, *a)

    monkeypatch.setattr(engine_runner, "run_together", interrupted_at_the_second_shape)
    result = runner.invoke(main, args)
    assert result.exit_code == 130, result.output
    text = " ".join(result.output.split())
    assert f"interrupted: 2 point(s) kept in {out}" in text
    assert f"run the same command with --resume --out {out}" in text
    data = results.load(out)
    assert data["complete"] is False and {p["seq_len"] for p in data["points"]} == {16}
    assert not Path(f"{out}.lock").exists()
    monkeypatch.setattr(engine_runner, "run_together", original)
    resumed = runner.invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert results.load(out)["complete"] is True and len(results.load(out)["points"]) == 4


def test_labels_that_look_like_markup_are_shown_as_written(runner, fake_mixers, tmp_path):
    out = tmp_path / "m.yaml"
    result = runner.invoke(main, ["bench", "--mixers", "fake-fast:label=[red]x[/red],"
                                  "fake-fast:scale=2:label=[/]", "--seq-lens", "16",
                                  "--modes", "fwd", "--batch", "1", "--heads", "2",
                                  "--head-dim", "8", "--device", "cpu", "--warmup", "0",
                                  "--repeats", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for args in ([str(out)], [str(out), str(out), "--compare"]):
        shown = runner.invoke(main, ["report", *args])
        assert shown.exit_code == 0, shown.output
        assert "[red]x[/red]" in shown.output and "[/]" in shown.output

def test_resume_needs_out(runner, fake_mixers):
    result = runner.invoke(main, ["bench", "--mixers", "fake-fast", "--device", "cpu", "--resume"])
    assert result.exit_code == 2 and "--resume needs --out" in result.output


def test_run_bad_config_exit_2(runner, fake_mixers, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("mixers: [no-such-mixer]\nseq_lens: [64]\n")
    result = runner.invoke(main, ["run", str(config), "--out", str(tmp_path / "o.yaml")])
    assert result.exit_code == 2 and "unknown mixer 'no-such-mixer'" in result.output
    config.write_text("mixers: [fake-fast]\nseq_lens: [64]\nrepeat: 3\n")
    result = runner.invoke(main, ["run", str(config)])
    assert result.exit_code == 2 and "unknown sweep key 'repeat'" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_cuda_config_without_cuda_exit_2(runner):
    result = runner.invoke(main, ["run", "gpu-mixers"])
    assert result.exit_code == 2 and "CUDA is not available" in result.output


def _bench_configs():
    return [name for name in configs.names()
            if "settings" not in yaml.safe_load(configs.shipped(name).read_text())]


def test_shipped_configs_parse_name_registered_mixers_and_are_listed_in_run_help():
    names = _bench_configs()
    assert {"cpu-smoke", "gpu-mixers", "gpu-kernels", "gpu-decode"} <= set(names)
    for name in names:
        _, sweeps = load_config(configs.shipped(name))
        for sweep in sweeps:
            sweep.check_mixers()
    help_text = bench.run.help or ""
    assert [name for name in names
            if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text)] == []


def test_shipped_configs_are_the_checkouts_configs_folder_and_the_wheels_package_data():
    """A checkout runs the repository's configs/; what `pip install .` ships is the same
    folder as hla_bench/shipped_configs (pyproject's package-dir), whose package-data globs
    cover every file there, and pyproject's package list is every package of the code."""
    from fnmatch import fnmatch

    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    root = Path(__file__).parents[1]
    folder = configs.folder()
    assert folder == root / "configs" == configs.CHECKOUT
    assert configs.INSTALLED.parent == Path(configs.__file__).parent
    assert configs.shipped("cpu-smoke") == folder / "cpu-smoke.yaml"
    assert configs.shipped("cpu-smoke.yaml").is_file()
    assert configs.published("mad-lab.yaml").is_file()
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = {"hla_bench.shipped_configs": "", "hla_bench.shipped_configs.published": "published/"}
    assert setuptools["package-dir"] == {"hla_bench.shipped_configs": "configs"}
    assert sorted(setuptools["packages"]) == sorted(
        find_packages(str(root), include=["hla_bench*", "mixers*", "tasks*"]) + list(data))
    globs = [prefix + glob for package, prefix in data.items()
             for glob in setuptools["package-data"][package]]
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    assert files and [f for f in files if not any(fnmatch(f, g) and
                                                  f.count("/") == g.count("/") for g in globs)] == []


def test_config_argument_is_a_file_or_a_shipped_name(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert configs.find("gpu-kernels") == configs.shipped("gpu-kernels")
    (tmp_path / "gpu-kernels").write_text("mixers: [sdpa]\nseq_lens: [64]\n")
    assert configs.find("gpu-kernels") == Path("gpu-kernels")  # a file comes first
    unknown = runner.invoke(main, ["run", "no-such-config"])
    assert unknown.exit_code == 2 and "no shipped config of that name" in unknown.output
    assert "cpu-smoke" in unknown.output
    with pytest.raises(ValueError, match="no shipped config"):
        configs.shipped("published/mad-lab")


# ---------------------------------------------------------------- the results file


BENCH = ["bench", "--heads", "1", "--head-dim", "4", "--device", "cpu", "--modes", "fwd",
         "--warmup", "0", "--repeats", "1"]


def _points(path):
    return {(p["mixer"], p["mode"], p["seq_len"]): p for p in results.load(path)["points"]}


def test_resume_with_another_plan_keeps_every_point(runner, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    first = runner.invoke(main, [*BENCH, "--mixers", "fake-fast,fake-fast:scale=2:label=b",
                                 "--seq-lens", "16,32", "--out", str(out)])
    assert first.exit_code == 0, first.output
    before = _points(out)
    assert len(before) == 4
    second = runner.invoke(main, [*BENCH, "--mixers", "fake-fast:scale=3:label=c",
                                  "--seq-lens", "16", "--out", str(out), "--resume"])
    assert second.exit_code == 0, second.output
    after = _points(out)
    assert len(after) == 5 and all(after[key] == point for key, point in before.items())
    data = results.load(out)
    assert data["complete"] is True and [s["name"] for s in data["sweeps"]] == ["bench"]
    assert data["config"]["mixers"][0]["label"] == "c"
    assert data["earlier_runs"][0]["config"]["mixers"][1]["label"] == "b"
    assert "4 point(s) kept" in second.output


def test_resume_with_other_timing_settings_is_refused(runner, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    assert runner.invoke(main, [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16",
                                "--out", str(out)]).exit_code == 0
    before = out.read_text()
    args = [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16", "--out", str(out), "--resume"]
    result = runner.invoke(main, [*args, "--repeats", "20", "--heads", "2"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "sweeps.bench.repeats: file 1, this run 20" in text
    assert "sweeps.bench.heads: file 1, this run 2" in text
    assert out.read_text() == before


def test_out_existing_needs_resume_or_overwrite(runner, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    args = [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16", "--out", str(out)]
    assert runner.invoke(main, args).exit_code == 0
    before = out.read_text()
    again = runner.invoke(main, args)
    assert again.exit_code == 2 and "already exists" in again.output
    assert "--resume" in again.output and "--overwrite" in again.output
    assert out.read_text() == before
    both = runner.invoke(main, [*args, "--resume", "--overwrite"])
    assert both.exit_code == 2 and "not both" in both.output
    replaced = runner.invoke(main, [*BENCH, "--mixers", "fake-fast:label=z", "--seq-lens", "32",
                                    "--out", str(out), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert list(_points(out)) == [("z", "fwd", 32)]
    alone = runner.invoke(main, [*BENCH, "--mixers", "fake-fast", "--overwrite"])
    assert alone.exit_code == 2 and "--overwrite needs --out" in alone.output


@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume"]])
def test_a_config_or_markdown_file_is_never_overwritten(runner, fake_mixers, tmp_path, flag):
    config = tmp_path / "self.yaml"
    config.write_text("mixers: [fake-fast]\nseq_lens: [16]\nheads: 1\nhead_dim: 4\n"
                      "device: cpu\nmodes: [fwd]\nrepeats: 1\nwarmup: 0\n")
    before = config.read_text()
    result = runner.invoke(main, ["run", str(config), "--out", str(config), *flag])
    assert result.exit_code == 2 and "is not a results file" in result.output
    assert config.read_text() == before
    notes = tmp_path / "notes.md"
    notes.write_text("# notes\n")
    result = runner.invoke(main, [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16",
                                  "--out", str(notes), *flag])
    assert result.exit_code == 2 and notes.read_text() == "# notes\n"


def test_runs_without_out_never_share_a_file(runner, fake_mixers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16"]
    for _ in range(3):
        assert runner.invoke(main, args).exit_code == 0
    written = sorted((tmp_path / "runs").iterdir())
    assert len(written) == 3 and all(p.name.startswith("bench-") for p in written)
    assert all(len(results.load(p)["points"]) == 1 for p in written)


def test_a_file_being_written_is_refused_naming_the_writer(runner, fake_mixers, tmp_path):
    import os

    from hla_bench.results.store import ResultsStore

    out = tmp_path / "r.yaml"
    holder = ResultsStore.open(out, kind="bench", key=point_key, settings={},
                               mode="new", header={"schema_version": 2})
    try:
        for flag in ([], ["--resume"], ["--overwrite"]):
            result = runner.invoke(main, [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16",
                                          "--out", str(out), *flag])
            assert result.exit_code == 2, result.output
            assert f"being written by pid {os.getpid()}" in " ".join(result.output.split())
    finally:
        holder.release()
    assert not out.exists()


def test_a_cut_short_file_is_refused_by_resume_and_report(runner, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    args = [*BENCH, "--mixers", "fake-fast", "--seq-lens", "16,32", "--out", str(out)]
    assert runner.invoke(main, args).exit_code == 0
    text = out.read_text()
    cut = text[:text.rindex("\n- sweep:")]  # cut at a line, after the first point
    out.write_text(cut)
    for command in ([*args, "--resume"], ["report", str(out)]):
        result = runner.invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "cut short" in result.output and "Traceback" not in result.output
    assert out.read_text() == cut


# ---------------------------------------------------------------- mixer specs


@pytest.mark.parametrize("spec, message", [
    ("hla2:impl=trtion", "impl must be one of 'auto', 'serial', 'scan', 'chunk', 'parallel', "
                         "'triton', got 'trtion'"),
    ("hla2:decay=1.5", "decay must lie in (0, 1]"),
    ("hla2:chunk_size=abc", "chunk_size must be a positive int, got 'abc'"),
    ("sdpa:backend=maht", "backend must be one of"),
    ("hla2:short_conv=0", "option 'short_conv' of 'hla2' applies to layers only"),
    ("sdpa:bias=true", "option 'bias' of 'sdpa' applies to layers only"),
    ("linear-attn:qk_norm=none:label=l2",
     "option 'qk_norm' of 'linear-attn' applies to layers only"),
    ("mamba2-ssd:d_state=16", "option 'd_state' of 'mamba2-ssd' applies to layers only"),
])
@pytest.mark.parametrize("modes", ["fwd,decode", "decode"])
def test_bad_option_values_are_usage_errors_before_any_point(runner, tmp_path, monkeypatch,
                                                             spec, message, modes):
    """Decode points are checked against the op too, so the message lists the op's impls."""
    monkeypatch.setattr(engine_runner, "run_point", lambda *a: pytest.fail("a point ran"))
    monkeypatch.setattr(engine_runner, "run_together", lambda *a: pytest.fail("a point ran"))
    out = tmp_path / "r.yaml"
    result = runner.invoke(main, ["bench", "--mixers", f"linear-attn,{spec}", "--seq-lens", "32",
                                  "--modes", modes, "--heads", "2", "--head-dim", "8",
                                  "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert message in text and "Traceback" not in text
    assert "'torch'" not in text  # the decoder's own list of impls
    assert not out.exists()


def test_a_config_with_a_bad_backend_is_a_usage_error(runner, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("mixers: [{name: sdpa, options: {backend: maht}}]\nseq_lens: [32]\n"
                      "heads: 1\nhead_dim: 4\ndevice: cpu\nmodes: [fwd]\n")
    result = runner.invoke(main, ["run", str(config), "--out", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2 and "backend must be one of" in result.output
    assert not (tmp_path / "r.yaml").exists()


def _picky_op(level, **_):
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level!r}")
    return lambda q, k, v, initial_state=None, output_final_state=False: (v, None)


class _PickyDecoder:
    def __init__(self, steps):
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps!r}")

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        return None

    def step(self, q, k, v, state):
        return v, state

    def state_bytes(self, state):
        return 0


@pytest.fixture
def picky_mixers(fake_mixers):
    """fake-picky: its op checks `level`, its decoder `steps`; fake-broken-options fails
    whatever its options."""
    added = [
        registry.Mixer("fake-picky", "fake", "checks its options", _picky_op,
                       build_decoder=lambda steps, **_: _PickyDecoder(steps),
                       options={"level": 1, "steps": 1}),
        registry.Mixer("fake-broken-options", "fake", "raises whatever its options",
                       lambda **o: _picky_op(level=0), options={"level": 1}),
    ]
    for mixer in added:
        registry.register(mixer, replace=True)
    yield
    for mixer in added:
        registry._REGISTRY.pop(mixer.name, None)


def test_options_are_blamed_only_when_the_defaults_work(runner, picky_mixers, tmp_path):
    args = [*BENCH, "--seq-lens", "16", "--out", str(tmp_path / "r.yaml")]
    bad = runner.invoke(main, [*args, "--mixers", "fake-picky:level=3"])
    assert bad.exit_code == 2
    assert "mixer 'fake-picky' (fake-picky:level=3): its op rejects the options: level must " \
           "be 1 or 2, got 3" in " ".join(bad.output.split())
    # a mixer that fails with its defaults too is a result of its points, not a usage error
    broken = runner.invoke(main, [*args, "--mixers", "fake-broken-options:level=2"])
    assert broken.exit_code == 0, broken.output
    assert _points(tmp_path / "r.yaml")["fake-broken-options", "fwd", 16]["status"] == "error"


def test_decoder_options_are_checked_when_the_sweep_decodes(runner, picky_mixers, tmp_path):
    args = [*BENCH, "--mixers", "fake-picky:steps=0", "--seq-lens", "16"]
    fwd = runner.invoke(main, [*args, "--out", str(tmp_path / "fwd.yaml")])
    assert fwd.exit_code == 0, fwd.output
    decode = runner.invoke(main, [*args, "--modes", "fwd,decode",
                                  "--out", str(tmp_path / "decode.yaml")])
    assert decode.exit_code == 2
    assert "its decoder rejects the options: steps must be positive, got 0" in \
        " ".join(decode.output.split())
    assert not (tmp_path / "decode.yaml").exists()


@pytest.mark.parametrize("line, message", [
    ("seq_lens: 64", "seq_lens must be a list (or a comma-separated string), got 64"),
    ("modes: 5", "modes must be a list (or a comma-separated string), got 5"),
    ("repeats: true", "repeats must be an integer from 1 to 2147483647, got True"),
    ("device: 5", "device must be a string, got 5"),
])
def test_config_values_of_the_wrong_type_are_usage_errors(runner, fake_mixers, tmp_path,
                                                          line, message):
    config = tmp_path / "c.yaml"
    base = {"mixers": "[fake-fast]", "seq_lens": "[64]", "device": "cpu"}
    key = line.split(":")[0]
    config.write_text("".join(f"{k}: {v}\n" for k, v in base.items() if k != key) + line + "\n")
    result = runner.invoke(main, ["run", str(config), "--out", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    config.write_text(config.read_text().replace("mixers: [fake-fast]", "mixers: 5"))
    result = runner.invoke(main, ["run", str(config)])
    assert result.exit_code == 2 and "mixers must be a list" in " ".join(result.output.split())


@pytest.mark.parametrize("args, message", [
    (["run", ""], "CONFIG is empty"),
    (["bench", "--mixers", "fake-fast", "--device", "cpu", "--out", ""], "--out is empty"),
    (["recall", "--out", ""], "--out is empty"),
    (["recall", "--task", "", "--dry-run"], "--task is empty"),
    (["verify", "--yaml", ""], "is empty: give a file")])
def test_an_empty_string_is_a_usage_error_not_the_default(runner, fake_mixers, tmp_path,
                                                         monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(main, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "runs").exists()


def test_a_key_given_twice_in_a_config_is_a_usage_error(runner, fake_mixers, tmp_path):
    bench_config = tmp_path / "b.yaml"
    bench_config.write_text("mixers: [fake-fast]\nseq_lens: [16]\nseq_lens: [32]\n")
    result = runner.invoke(main, ["run", str(bench_config)])
    assert result.exit_code == 2 and "the key 'seq_lens' is given twice (line 3" in result.output
    recall_config = tmp_path / "r.yaml"
    recall_config.write_text("lrs: [0.001]\nsettings:\n  - {task: mqar, task: mqar}\n")
    result = runner.invoke(main, ["recall", "--config", str(recall_config), "--dry-run"])
    assert result.exit_code == 2 and "the key 'task' is given twice (line 3" in result.output
    merged = tmp_path / "m.yaml"  # a merge key's entries may be overridden
    merged.write_text("device: cpu\nbatch: 1\nheads: 2\nhead_dim: 8\nwarmup: 0\nrepeats: 2\n"
                      "modes: [fwd]\nsweeps:\n"
                      "  - &a {name: a, mixers: [fake-fast], seq_lens: [16]}\n"
                      "  - {<<: *a, name: b}\n")
    ran = runner.invoke(main, ["run", str(merged), "--out", str(tmp_path / "o.yaml")])
    assert ran.exit_code == 0, ran.output


@pytest.mark.parametrize("flags", [["--cuda-graph"], ["--modes", "decode", "--decode-graph"]])
def test_cuda_graphs_on_the_cpu_are_a_usage_error_before_any_point(runner, fake_mixers,
                                                                   tmp_path, flags):
    result = runner.invoke(main, ["bench", "--mixers", "fake-fast", "--seq-lens", "16",
                                  "--device", "cpu", "--out", str(tmp_path / "o.yaml"), *flags])
    assert result.exit_code == 2 and "need a CUDA device" in result.output, result.output
    assert not (tmp_path / "o.yaml").exists()


def test_a_config_of_the_other_kind_names_the_command_that_runs_it(runner):
    bench = runner.invoke(main, ["run", "recall-cpu"])
    assert bench.exit_code == 2 and "`hla-bench recall --config recall-cpu`" in bench.output
    recall = runner.invoke(main, ["recall", "--config", "cpu-smoke", "--dry-run"])
    assert recall.exit_code == 2 and "is a bench config" in recall.output


def test_decode_settings_without_decode_points_are_a_usage_error(runner, fake_mixers):
    result = runner.invoke(main, ["bench", "--mixers", "fake-fast", "--device", "cpu",
                                  "--modes", "fwd", "--decode-steps", "4"])
    assert result.exit_code == 2 and "--decode-steps applies to decode" in result.output
