"""Hostile files on the CPU: links planted where the harness writes, names that would leave
their folder, a checkpoint that would run code, files that are not the harness's to
replace. Each test plants the fault, runs the command, and checks that nothing outside the
target changed (a planted link and what it points to stay as they were) and that the
command refused with exit 2 naming the problem, or went on safely, saying so."""

import os
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from hla_bench.results import index, store
from hla_bench.results.load import load
from hla_bench.cli import main
from test_recall import recall_args
from test_sweeps import fake_mixers  # noqa: F401  (fixture)

BENCH = ["bench", "--mixers", "fake-fast", "--seq-lens", "16", "--heads", "1", "--head-dim",
         "4", "--device", "cpu", "--modes", "fwd", "--warmup", "0", "--repeats", "1"]
PRECIOUS = "precious\n"


def invoke(args, **kwargs):
    return CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(arg) for arg in args], **kwargs)


def victim(tmp_path, text=PRECIOUS, name="victim.txt"):
    """A file outside every folder the command is told about."""
    folder = tmp_path / "elsewhere"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture
def bench_file(tmp_path, fake_mixers):
    """A whole bench results file, written by a real run, with its sweep named `plain`."""
    config = tmp_path / "plain.yaml"
    config.write_text("name: plain\nmixers: [fake-fast]\nseq_lens: [16]\nheads: 1\n"
                      "head_dim: 4\nmodes: [fwd]\ndevice: cpu\nwarmup: 0\nrepeats: 1\n")
    out = tmp_path / "r.yaml"
    result = invoke(["run", config, "--out", out])
    assert result.exit_code == 0, result.output
    return out


def renamed(value, old, new):
    """`value` with every string (and mapping key) equal to `old` replaced by `new`."""
    if isinstance(value, dict):
        return {(new if key == old else key): renamed(item, old, new)
                for key, item in value.items()}
    if isinstance(value, list):
        return [renamed(item, old, new) for item in value]
    return new if value == old else value


def with_sweep_named(path, name):
    """The results file at `path`, rewritten whole with its sweep named `name`."""
    data = renamed(load(path), "plain", name)
    path.write_text(store.dump_results(data))
    return path


# ---------------------------------------------------------------- links


@pytest.mark.parametrize("dangling", [False, True])
def test_a_lock_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path, fake_mixers,
                                                                 dangling):
    target = tmp_path / "elsewhere" / "absent.txt" if dangling else victim(tmp_path)
    target.parent.mkdir(exist_ok=True)
    out = tmp_path / "r.yaml"
    lock = tmp_path / "r.yaml.lock"
    lock.symlink_to(target)
    result = invoke([*BENCH, "--out", out])
    assert result.exit_code == 2, result.output
    assert "symbolic link" in result.output and "Traceback" not in result.output
    assert lock.is_symlink() and not out.exists()
    if dangling:
        assert not target.exists()  # nothing created through the link
    else:
        assert target.read_text() == PRECIOUS


def test_a_lock_that_is_a_hard_link_to_another_file_is_refused(tmp_path, fake_mixers):
    target = victim(tmp_path)
    os.link(target, tmp_path / "r.yaml.lock")
    result = invoke([*BENCH, "--out", tmp_path / "r.yaml"])
    assert result.exit_code == 2 and "hard link" in result.output, result.output
    assert target.read_text() == PRECIOUS


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_a_results_file_that_is_a_symlink_is_refused_link_and_target_kept(tmp_path, bench_file,
                                                                         flag):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "theirs.yaml"
    bench_file.rename(target)
    before = target.read_text()
    out = tmp_path / "mine.yaml"
    out.symlink_to(target)
    result = invoke(["run", tmp_path / "plain.yaml", "--out", out, flag])
    assert result.exit_code == 2, result.output
    assert "is a symbolic link" in result.output and str(out) in result.output
    assert out.is_symlink() and target.read_text() == before


def test_plots_that_are_symlinks_are_refused_before_any_output(tmp_path, bench_file):
    plots = tmp_path / "plots"
    plots.mkdir()
    target = victim(tmp_path)
    (plots / "plain-fwd.png").symlink_to(target)
    result = invoke(["report", bench_file, "--plots", plots])
    assert result.exit_code == 2, result.output
    assert "plain-fwd.png: the plot is a symbolic link" in result.output
    assert "median ms" not in result.output  # refused before the tables
    assert target.read_text() == PRECIOUS and (plots / "plain-fwd.png").is_symlink()


def test_an_index_that_is_a_symlink_is_refused_link_and_target_kept(tmp_path, bench_file):
    target = victim(tmp_path, index.GENERATED_LINE + "\n")  # looks like a generated index
    (tmp_path / "README.md").symlink_to(target)
    result = invoke(["report", "--index", tmp_path])
    assert result.exit_code == 2 and "is a symbolic link" in result.output, result.output
    assert (tmp_path / "README.md").is_symlink()
    assert target.read_text() == index.GENERATED_LINE + "\n"


@pytest.fixture
def quick_verify(monkeypatch):
    """verify with stand-in checks: what is tested is where its output goes."""
    import hla_bench.verify as verify

    monkeypatch.setattr(verify, "run_all", lambda **kw: {"passed": True, "checks": []})
    monkeypatch.setattr(verify, "render", lambda result, console: None)


def test_verify_output_that_is_a_symlink_is_refused_link_and_target_kept(tmp_path,
                                                                         quick_verify):
    earlier = "device: cpu\ndtype: float64\nseed: 0\nseq_len: 32\nchecks: []\npassed: true\n"
    target = victim(tmp_path, earlier, "old.yaml")  # a verify output, which --overwrite replaces
    link = tmp_path / "verify.yaml"
    link.symlink_to(target)
    result = invoke(["verify", "--yaml", link, "--overwrite"])
    assert result.exit_code == 2 and "is a symbolic link" in result.output, result.output
    assert link.is_symlink() and target.read_text() == earlier


def test_a_symlink_planted_while_a_file_is_written_is_not_followed(tmp_path, monkeypatch):
    """The check before the rename: a link that appears while the temporary file is
    written (here: at its fsync) is refused too, and the temporary file removed; the
    helpers that open files never follow one either."""
    target = victim(tmp_path)
    path = tmp_path / "out.yaml"
    path.write_text("kind: bench\n")
    real_fsync = os.fsync

    def plant_then_fsync(fd):
        if not path.is_symlink():
            path.unlink()
            path.symlink_to(target)
        real_fsync(fd)

    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", plant_then_fsync)
        with pytest.raises(OSError, match="symbolic link"):
            store.atomic_write_text(path, "new\n")
    assert target.read_text() == PRECIOUS and path.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out.yaml"]

    from hla_bench import safe_files

    with pytest.raises(FileExistsError):
        os.close(safe_files.open_new_nofollow(target))
    for opener in (safe_files.open_new_nofollow, safe_files.open_nofollow):
        with pytest.raises(safe_files.UnsafePathError):
            os.close(opener(path, os.O_RDWR | os.O_CREAT))
    assert target.read_text() == PRECIOUS


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["../../x", "a/b", "/ABSOLUTE/x", "..", ".hidden", "a\\b",
                                  "nul\0byte", ""])
def test_a_sweep_name_that_is_not_one_plain_component_is_refused_at_config_load(
        tmp_path, fake_mixers, name):
    name = name.replace("/ABSOLUTE", str(tmp_path / "abs"))
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"mixers": ["fake-fast"], "seq_lens": [16],
                                      "device": "cpu", "sweeps": [{"name": name}]}))
    result = invoke(["run", config, "--out", tmp_path / "r.yaml"])
    assert result.exit_code == 2, result.output
    assert "cannot be part of a file name" in result.output and repr(name) in result.output
    assert not (tmp_path / "r.yaml").exists()


@pytest.mark.parametrize("name", ["../../x", "a/b", "/ABSOLUTE/x", ".."])
def test_report_plots_refuse_a_sweep_name_that_would_leave_the_folder(tmp_path, bench_file,
                                                                      name):
    name = name.replace("/ABSOLUTE", str(tmp_path / "abs"))
    with_sweep_named(bench_file, name)
    plots = tmp_path / "deep" / "er" / "plots"
    before = sorted(tmp_path.rglob("*"))
    result = invoke(["report", bench_file, "--plots", plots])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and repr(name) in result.output
    assert "cannot be part of a plot's file name" in result.output
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, in the folder or out


def test_a_plot_name_is_checked_where_the_path_is_made():
    """The last guard, behind the check at load: a name never joins a folder unchecked."""
    from hla_bench import safe_files
    from hla_bench.results.plots import plot_path

    assert plot_path("out", "d64-fwd", "png") == Path("out/d64-fwd.png")
    for stem in ("../x-fwd", "a/b-fwd", "/abs/x-fwd", ".x", "", 3):
        with pytest.raises(safe_files.UnsafeNameError, match="plot name"):
            plot_path("out", stem, "png")
    with pytest.raises(safe_files.UnsafeNameError, match="checkpoint name"):
        safe_files.path_in("ck", "../group", "checkpoint name", ".pt")


# ---------------------------------------------------------------- verify's --yaml


def test_verify_overwrite_never_replaces_a_file_that_is_not_a_verify_output(tmp_path,
                                                                           quick_verify):
    script = tmp_path / "tool.py"
    script.write_text("print('mine')\n")
    config = tmp_path / "sweep.yaml"
    config.write_text("mixers: [hla2]\n")
    for path in (script, config):
        before = path.read_text()
        result = invoke(["verify", "--yaml", path, "--overwrite"])
        assert result.exit_code == 2, result.output
        assert "is not a verify output" in result.output and str(path) in result.output
        assert path.read_text() == before


# ---------------------------------------------------------------- checkpoints


class _PastEveryDeadline:
    """hla_bench.recall.train's clock, read a day late: a group stops (and checkpoints) at its first
    step, whatever the machine's speed, while the sweep around it starts it in time."""

    perf_counter = staticmethod(time.perf_counter)
    time_ns = staticmethod(time.time_ns)
    time = staticmethod(lambda: time.time() + 86_400.0)


def cut_recall(tmp_path, monkeypatch):
    """A recall run stopped at its time limit after its group's first step (one worker:
    in this process): (its results file, its checkpoint)."""
    import hla_bench.recall.train

    with monkeypatch.context() as patched:
        patched.setattr(hla_bench.recall.train, "time", _PastEveryDeadline)
        stopped = invoke(recall_args(tmp_path, "--time-limit", "600", "--epochs", "3"))
    assert stopped.exit_code == 0 and "stopped at --time-limit" in stopped.output, \
        stopped.output
    checkpoints = list((tmp_path / "recall.yaml.checkpoints").glob("*.pt"))
    assert len(checkpoints) == 1, checkpoints
    return tmp_path / "recall.yaml", checkpoints[0]


class _WritesAMarker:
    """Unpickled, it would create the file `marker` (what any code could do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_pickle_checkpoint_is_never_unpickled_and_the_group_starts_over(tmp_path, monkeypatch):
    results_file, checkpoint = cut_recall(tmp_path, monkeypatch)
    marker = tmp_path / "marker"
    torch.save({"run_ids": [0, 1], "payload": _WritesAMarker(marker)}, checkpoint)
    resumed = invoke(recall_args(tmp_path, "--resume", "--epochs", "3"))
    assert resumed.exit_code == 0, resumed.output
    assert not marker.exists()
    text = " ".join(resumed.output.split())
    assert f"checkpoint {checkpoint.name} ignored and removed" in text
    assert "not a checkpoint of plain tensors and values" in text
    assert "the group starts over" in text and "resumed at step" not in text
    assert not checkpoint.exists()
    data = yaml.safe_load(results_file.read_text())
    assert data["complete"] is True and all(run["status"] == "ok" for run in data["runs"])


def test_a_checkpoint_of_other_code_is_removed_not_loaded(tmp_path, monkeypatch):
    _, checkpoint = cut_recall(tmp_path, monkeypatch)
    state = torch.load(checkpoint, weights_only=True)
    assert len(state["code_version"]) == 20 and state["group"] and "slots" in state
    state["code_version"] = "0" * 20
    torch.save(state, checkpoint)
    resumed = invoke(recall_args(tmp_path, "--resume", "--epochs", "3"))
    assert resumed.exit_code == 0, resumed.output
    text = " ".join(resumed.output.split())
    assert "ignored and removed (it was written by other code" in text
    assert "resumed at step" not in text and not checkpoint.exists()


def test_resume_of_the_same_file_continues_its_checkpoint(tmp_path, monkeypatch):
    """The checkpoint of a cut run is continued by --resume of that file (the control of
    the tests around it: their messages are not printed for a good checkpoint)."""
    _, checkpoint = cut_recall(tmp_path, monkeypatch)
    resumed = invoke(recall_args(tmp_path, "--resume", "--epochs", "3"))
    assert resumed.exit_code == 0, resumed.output
    assert "resumed at step" in resumed.output and "ignored" not in resumed.output
    assert not checkpoint.exists()


@pytest.mark.parametrize("how", ["overwrite", "new-out"])
def test_overwrite_or_a_new_file_never_resumes_old_weights(tmp_path, monkeypatch, how):
    results_file, checkpoint = cut_recall(tmp_path, monkeypatch)
    extra = ["--overwrite"] if how == "overwrite" else []
    if how == "new-out":
        results_file.unlink()  # the same --out, written afresh: its old checkpoints are stale
    rerun = invoke(recall_args(tmp_path, "--epochs", "3", *extra))
    assert rerun.exit_code == 0, rerun.output
    text = " ".join(rerun.output.split())
    assert "removed 1 checkpoint(s) of an earlier run" in text
    assert "resumed at step" not in text and not checkpoint.exists()
    assert yaml.safe_load(results_file.read_text())["complete"] is True


def test_a_checkpoint_folder_that_is_a_symlink_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.pt").write_text("not ours\n")
    (tmp_path / "recall.yaml.checkpoints").symlink_to(elsewhere)
    result = invoke(recall_args(tmp_path))
    assert result.exit_code == 2 and "checkpoint folder is a symbolic link" in result.output, \
        result.output
    assert (elsewhere / "keep.pt").read_text() == "not ours\n"
