"""Messages that say what is true, and values from a file or a caller that are checked.

Each test plants one hostile or misleading case on the CPU: an interrupted --overwrite, a
report on a file whose writer is alive, a call that holds the interpreter past its time
limit, an empty list of modes, a wrong state passed to a step form, command-line task values
that a config's settings refuse, results files with values out of range or a point twice, a
bool tensor as a decay, and a verify length whose references cannot be allocated.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hla_bench import registry
from hla_bench.results import bench_files as results, store
from hla_bench.cli import main
from hla_bench.speed import runner as engine_runner
from hla_bench.speed.sweeps import parse_modes
from hla_bench.speed.timing import PointTimeout, time_limit
from mixers.hla import ahla2, ahla2_step, hla2, hla2_step, hla3, hla3_step
from test_sweeps import fake_mixers, tiny_sweep  # noqa: F401  (fixture)


@pytest.fixture
def cli():
    return CliRunner(env={"COLUMNS": "200"})


def _text(result) -> str:
    return " ".join(result.output.split())


BENCH = ["bench", "--mixers", "fake-fast", "--seq-lens", "16,32", "--modes", "fwd",
         "--batch", "1", "--heads", "2", "--head-dim", "8", "--device", "cpu",
         "--warmup", "0", "--repeats", "2"]


def _point(mixer="a", seq_len=64, median_ms=1.0, **changes):
    """A whole `ok` bench point of sweep `s`."""
    point = {"sweep": "s", "mixer": mixer, "name": mixer, "options": {}, "mode": "fwd",
             "seq_len": seq_len, "batch": 1, "heads": 2, "head_dim": 8, "value_dim": 8,
             "dtype": "float32", "device": "cpu", "status": "ok", "reason": None,
             "repeats": 3, "warmup": 1, "median_ms": median_ms, "p20_ms": median_ms,
             "p80_ms": median_ms, "tokens_per_s": seq_len / median_ms * 1e3,
             "peak_memory_bytes": 4096, "state_bytes": None, "flops": 1e6, "tflops": 1e-3,
             "samples_ms": [median_ms] * 3, "spread": 0.0}
    point.update(changes)
    return point


def _bench_doc(points, complete=True):
    return {"kind": "bench", "schema_version": 2, "created": "2026-12-01T00:00:00+00:00",
            "config": {"name": "s"}, "sweeps": [{"name": "s", "baseline": None}],
            "environment": {"device": "cpu"}, "settings": {}, "points": points,
            "complete": complete, "end_of_results": True}


def _run(**changes):
    """A finished recall run record."""
    run = {"setting": "mqar", "task": "mqar", "mixer": "sdpa", "d_model": 64, "lr": 1e-3,
           "weight_decay": 0.0, "seed": 0, "status": "ok", "val_accuracy": 0.5,
           "test_accuracy": 0.4, "in_context_rate": 0.9, "steps": 10, "seconds": 2.0,
           "train_seconds": 1.5, "state_bytes": 1024,
           "curve": [{"step": 10, "epoch": 1.0, "loss": 1.0, "accuracy": 0.5}]}
    run.update(changes)
    return run


def _recall_doc(runs):
    return {"kind": "recall", "schema_version": 2, "config": {"name": "r"},
            "environment": {"device": "cpu"}, "seconds": 3.0, "settings": {}, "runs": runs,
            "complete": True, "end_of_results": True}


def _plant(path: Path, doc) -> Path:
    """Write `doc` as a whole results file, without the store's checks of its values (a file
    edited by hand, or written by other code)."""
    store.atomic_write_text(path, store.dump_results(doc))
    return path


# ---------------------------------------------------------------- item 9: messages


def test_an_interrupted_overwrite_says_the_file_still_holds_the_earlier_points(
        cli, fake_mixers, tmp_path, monkeypatch):
    out = tmp_path / "r.yaml"
    first = cli.invoke(main, BENCH + ["--out", str(out)])
    assert first.exit_code == 0, first.output
    before = out.read_bytes()

    def interrupted(points, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_runner, "run_together", interrupted)
    stopped = cli.invoke(main, BENCH + ["--out", str(out), "--overwrite"])
    assert stopped.exit_code == 130, stopped.output
    text = _text(stopped)
    assert "0 point(s) kept" not in text and "--resume" not in text
    assert f"{out} is unchanged, it still holds the earlier results (2 point(s))" in text
    assert out.read_bytes() == before and not Path(f"{out}.lock").exists()


def _incomplete(tmp_path) -> Path:
    return _plant(tmp_path / "r.yaml", _bench_doc([_point()], complete=False))


def test_report_on_a_file_whose_writer_is_alive_says_it_is_being_written(cli, tmp_path):
    path = _incomplete(tmp_path)
    Path(f"{path}.lock").write_text(f"{os.getpid()} {socket.gethostname()}\n")
    shown = cli.invoke(main, ["report", str(path)])
    assert shown.exit_code == 0, shown.output
    text = _text(shown)
    assert "was stopped" not in text
    assert f"it is still being written (its lock names pid {os.getpid()}" in text


def test_report_tells_a_stopped_writer_and_one_on_another_host_apart(cli, tmp_path):
    path = _incomplete(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lock = Path(f"{path}.lock")
    lock.write_text(f"{gone.pid} {socket.gethostname()}\n")
    stale = _text(cli.invoke(main, ["report", str(path)]))
    assert "its run was stopped before the end of its plan" in stale
    assert "still being written" not in stale
    lock.write_text(f"{os.getpid()} not-{socket.gethostname()}\n")
    remote = _text(cli.invoke(main, ["report", str(path)]))
    assert f"its lock names pid {os.getpid()} on not-{socket.gethostname()}" in remote
    assert "may still be written there" in remote


def _hold_the_interpreter(seconds: float) -> None:
    """What a long kernel does to a pending SIGALRM: it is handled only once the call
    returns to Python."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        time.sleep(seconds)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def _stopped_after(message: str) -> float:
    found = re.search(r"stopped after ([0-9.]+) s", message)
    assert found, message
    return float(found.group(1))


def test_a_time_limit_reports_the_time_that_really_passed_and_the_limit():
    with pytest.raises(PointTimeout) as stopped:
        with time_limit(0.05):
            _hold_the_interpreter(0.6)
    message = str(stopped.value)
    assert _stopped_after(message) >= 0.55
    assert "past the limit of 0.05 s" in message


def _holding_op(**options):
    def op(q, k, v, initial_state=None, output_final_state=False):
        _hold_the_interpreter(2.5)
        return v, None
    return op


@pytest.fixture
def holding_mixer():
    mixer = registry.Mixer("fake-holds", "fake", "holds the interpreter 2.5 s a call",
                           _holding_op, forms=("op",))
    registry.register(mixer, replace=True)
    yield mixer
    registry._REGISTRY.pop(mixer.name, None)


def test_a_timed_out_point_records_its_real_time_and_its_limit(holding_mixer):
    sweep = tiny_sweep(["fake-holds"], seq_lens=(16,), warmup=0, repeats=1,
                       point_timeout_s=1)
    record = engine_runner.run_point(engine_runner.plan([sweep])[0])
    assert record["status"] == "timeout"
    assert _stopped_after(record["reason"]) >= 2.4
    assert "past the limit of 1 s" in record["reason"]


def test_an_empty_list_of_modes_is_called_empty(cli, fake_mixers, tmp_path):
    with pytest.raises(ValueError, match="the list of modes is empty") as refused:
        parse_modes([])
    assert "''" not in str(refused.value)
    config = tmp_path / "c.yaml"
    config.write_text("name: s\ndevice: cpu\nmixers: [fake-fast]\nseq_lens: [16]\nmodes: []\n")
    result = cli.invoke(main, ["run", str(config), "--out", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2
    assert "the list of modes is empty" in _text(result) and "bad mode" not in result.output


def _token(B=1, H=2, D=4):
    return [torch.randn(B, H, D, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("step, whole", [(ahla2_step, ahla2), (hla3_step, hla3)])
def test_a_step_form_names_its_state_argument(step, whole):
    bad = {"P": torch.zeros(1)}
    with pytest.raises(ValueError) as refused:
        step(*_token(), bad)
    assert str(refused.value).startswith("state") and "initial_state" not in str(refused.value)
    q, k, v = (x.unsqueeze(1) for x in _token())
    with pytest.raises(ValueError, match="^initial_state"):
        whole(q, k, v, initial_state=bad)


@pytest.mark.parametrize("args, blamed", [
    (["--seq-len", "3"], "--seq-len 3: seq_len must be"),
    (["--config", "recall-cpu", "--num-kv-pairs", "0"], "--num-kv-pairs 0: num_kv_pairs must"),
    (["--param", "no_such_param=1"], "--param no_such_param=1: task 'mqar' has no parameter"),
    (["--task", "mqar", "--seq-len", "5"], "--task mqar --seq-len 5: seq_len must be"),
    (["--config", "mad", "--vocab-size", "2"], "--vocab-size 2: these command-line values"),
])
def test_recall_command_line_values_are_blamed_on_their_options(cli, args, blamed):
    result = cli.invoke(main, ["recall", "--dry-run", *args])
    assert result.exit_code == 2, result.output
    text = _text(result)
    assert f"Error: {blamed}" in text
    assert "options.settings" not in text and ".yaml.settings[" not in text


# ---------------------------------------------------------------- item 10: values


@pytest.mark.parametrize("field, value, shown", [
    ("median_ms", -5.0, "-5.0"),
    ("p80_ms", float("nan"), "nan"),
    ("peak_memory_bytes", -1, "-1"),
    ("tokens_per_s", float("inf"), "inf"),
    ("samples_ms", [1.0, -2.0], "-2.0"),
    ("setup_s", -0.5, "-0.5"),
])
def test_report_refuses_a_bench_value_out_of_range_naming_the_record(cli, tmp_path, field,
                                                                      value, shown):
    path = _plant(tmp_path / "r.yaml", _bench_doc([_point("a"), _point("b", **{field: value})]))
    result = cli.invoke(main, ["report", str(path)])
    assert result.exit_code == 2, result.output
    text = _text(result)
    assert f"{path}: points[1] (sweep 's', mixer 'b', fwd, T=64" in text
    assert f"{field}: expected a finite number >= 0, got {shown}" in text


@pytest.mark.parametrize("field, value", [
    ("test_accuracy", 5.0), ("val_accuracy", -0.1), ("in_context_rate", 1.5),
    ("seconds", -1.0), ("state_bytes", -8), ("steps", -3), ("test_accuracy", True),
])
def test_report_refuses_a_recall_value_out_of_range_naming_the_run(cli, tmp_path, field, value):
    path = _plant(tmp_path / "r.yaml", _recall_doc([_run(), _run(seed=1, **{field: value})]))
    result = cli.invoke(main, ["report", str(path)])
    assert result.exit_code == 2, result.output
    text = _text(result)
    assert f"{path}: runs[1] (setting 'mqar', mixer 'sdpa', d_model 64" in text
    assert f"seed 1): {field}: expected a number" in text and repr(value) in text


def test_report_refuses_an_accuracy_out_of_range_in_a_curve(cli, tmp_path):
    run = _run(curve=[{"step": 10, "accuracy": 0.5}, {"step": 20, "accuracy": 2.0}])
    result = cli.invoke(main, ["report", str(_plant(tmp_path / "r.yaml", _recall_doc([run])))])
    assert result.exit_code == 2
    assert "curve[1].accuracy: expected a number in [0, 1], got 2.0" in _text(result)


def test_a_duplicated_point_is_refused_not_silently_replaced(cli, fake_mixers, tmp_path):
    out = tmp_path / "r.yaml"
    ran = cli.invoke(main, BENCH + ["--out", str(out)])
    assert ran.exit_code == 0, ran.output
    assert cli.invoke(main, ["report", str(out)]).exit_code == 0  # what a run records passes
    data = results.load(out)
    data["points"].append({**data["points"][0], "median_ms": 9.0})
    _plant(out, data)
    for args in (["report", str(out)], ["report", "--compare", str(out), str(out)],
                 BENCH + ["--out", str(out), "--resume"]):
        result = cli.invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "points[2] (sweep 'bench', mixer 'fake-fast', fwd, T=16" in _text(result)
        assert "has the key of points[0]" in _text(result)
    with pytest.raises(results.ResultsSchemaError, match=r"points\[2\].*points\[0\]"):
        results.load(out)


def test_a_duplicated_recall_run_is_refused(cli, tmp_path):
    path = _plant(tmp_path / "r.yaml", _recall_doc([_run(), _run(seed=1), _run(test_accuracy=0.9)]))
    result = cli.invoke(main, ["report", str(path)])
    assert result.exit_code == 2, result.output
    assert "runs[2] (setting 'mqar', mixer 'sdpa'" in _text(result)
    assert "has the key of runs[0]" in _text(result)


@pytest.mark.parametrize("decay", [torch.tensor([True, True]), torch.tensor([1, 1]),
                                   torch.tensor(True)])
@pytest.mark.parametrize("op", [hla2, ahla2])
def test_a_decay_tensor_that_is_not_floating_point_is_refused(op, decay):
    q, k, v = (torch.randn(1, 4, 2, 4) for _ in range(3))
    with pytest.raises(ValueError, match="decay must be a floating-point tensor, got dtype"):
        op(q, k, v, decay=decay)
    with pytest.raises(ValueError, match="decay must be a floating-point tensor"):
        (hla2_step if op is hla2 else ahla2_step)(q[:, 0], k[:, 0], v[:, 0], decay=decay)
    op(q, k, v, decay=decay.double())  # the same values as floats are taken


def test_verify_refuses_a_length_whose_references_cannot_be_allocated(cli):
    result = cli.invoke(main, ["verify", "--seq-len", "100000"])
    assert result.exit_code == 2, result.output
    text = _text(result)
    assert "--seq-len" in text and "100000 needs about" in text and "give at most" in text


def test_verify_refuses_a_length_above_the_memory_available(cli, monkeypatch):
    from hla_bench import verify

    monkeypatch.setattr(verify, "available_memory_bytes", lambda: 2 ** 30)
    result = cli.invoke(main, ["verify", "--seq-len", "64"])
    assert result.exit_code == 2, result.output
    largest = int(re.search(r"give at most (\d+)", _text(result)).group(1))
    assert verify.reference_bytes(largest) <= 2 ** 30 < verify.reference_bytes(largest + 1)


def test_verify_out_of_memory_says_what_to_do(cli, monkeypatch):
    from hla_bench import verify

    def allocation_fails(**kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 8000000000000 bytes.")

    monkeypatch.setattr(verify, "run_all", allocation_fails)
    result = cli.invoke(main, ["verify", "--seq-len", "40"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "out of memory at --seq-len 40" in _text(result)
    assert "give a smaller --seq-len" in _text(result)
