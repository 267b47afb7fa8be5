"""Fault injection: bench sweeps run as subprocesses, killed with SIGKILL at random moments,
and several writers at once. Whatever happens, a results file is absent or valid and
resumable, a resume measures nothing the file already holds, and no point is lost."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hla_bench.results import bench_files as results

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("a", "b", "c", "d")
SEQ_LENS = (16, 32, 64, 128, 256, 512)
# A mixer that sleeps a few milliseconds a call (and waits while the file $FAULT_HOLD
# exists), registered in the subprocess; every point the subprocess starts to measure is
# logged as `pid label T` to $FAULT_LOG.
DRIVER = textwrap.dedent("""
    import os, sys, time
    from hla_bench import registry
    from hla_bench.speed import runner
    from hla_bench.cli import main

    def build(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            time.sleep(0.004)
            while os.path.exists(os.environ.get("FAULT_HOLD", "/nonexistent")):
                time.sleep(0.01)
            return v, None
        return op

    registry.register(registry.Mixer("fake-sleepy", "fake", "sleeps", build,
                                     options={"scale": 1.0}), replace=True)
    measure = runner.run_together

    def logged(points, *args):
        with open(os.environ["FAULT_LOG"], "a") as log:
            for point in points:
                log.write(f"{os.getpid()} {point.spec.label} {point.seq_len}\\n")
        return measure(points, *args)

    runner.run_together = logged
    import gc
    gc.freeze()  # the runner collects garbage around every point: keep that quick here
    main(sys.argv[1:], prog_name="hla-bench")
""")
ARGS = ["bench", "--mixers", ",".join(f"fake-sleepy:label={label}" for label in LABELS),
        "--seq-lens", ",".join(map(str, SEQ_LENS)), "--modes", "fwd", "--batch", "1",
        "--heads", "1", "--head-dim", "4", "--device", "cpu", "--warmup", "0",
        "--repeats", "1"]
PLANNED = {(label, t) for label in LABELS for t in SEQ_LENS}


def start(tmp_path, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAULT_LOG": str(tmp_path / "measured.log"),
           "FAULT_HOLD": str(tmp_path / "hold")}
    return subprocess.Popen([sys.executable, "-c", DRIVER, *ARGS, *extra], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def wait_until(condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def measured_by(tmp_path, pid):
    log = tmp_path / "measured.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return {(label, int(t)) for p, label, t in (line.split() for line in lines) if int(p) == pid}


def snapshot(path):
    """The points of a results file, by (label, T); {} when there is no file. A file that
    exists must be valid: this is the invariant under test."""
    if not path.exists():
        return {}
    data = results.load(path)
    points = {(p["mixer"], p["seq_len"]): p for p in data["points"]}
    assert len(points) == len(data["points"]), "a point is in the file twice"
    return points


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_a_valid_resumable_file(tmp_path):
    rng = random.Random(20)
    started = time.monotonic()
    kills = chains = 0
    # at least 2 chains and 4 kills (a loaded machine takes longer for them), 18 s or more
    while (chains < 2 or kills < 4 or time.monotonic() < started + 18) and \
            time.monotonic() < started + 150:
        chains += 1
        out = tmp_path / f"chain{chains}" / "r.yaml"
        out.parent.mkdir()
        for run in range(40):
            before = snapshot(out)
            mtime = out.stat().st_mtime_ns if out.exists() else None
            process = start(tmp_path, "--out", str(out), "--resume")
            if run == 0 and rng.random() < 0.5:
                time.sleep(rng.uniform(0, 2.5))  # often before the first point is written
            else:  # once it has written a point, at any moment of the sweep
                wait_until(lambda: process.poll() is not None or (
                    out.exists() and out.stat().st_mtime_ns != mtime))
                time.sleep(rng.uniform(0, 0.6))
            process.send_signal(signal.SIGKILL)
            code = process.wait()
            kills += code == -signal.SIGKILL
            after = snapshot(out)
            context = f"chain {chains}, run {run}, exit {code}: {process.stderr.read()[-2000:]}"
            assert code in (0, -signal.SIGKILL), context
            for key, point in before.items():  # nothing measured is lost or changed
                assert after.get(key) == point, context
            assert not measured_by(tmp_path, process.pid) & set(before), context
            if code == 0:
                break
        data = results.load(out)
        assert data["complete"] is True and set(snapshot(out)) == PLANNED
        assert all(p["status"] == "ok" for p in data["points"])
        assert sorted(p.name for p in out.parent.iterdir()) == ["r.yaml"]  # no lock, no temp
    assert kills >= 4


@pytest.mark.slow
def test_two_writers_of_one_file_never_lose_a_point(tmp_path):
    """The first writer is held inside its sweep until the others have tried."""
    out = tmp_path / "r.yaml"
    hold = tmp_path / "hold"
    hold.write_text("")
    first = start(tmp_path, "--out", str(out))
    # two runs without --out started together: names that cannot collide
    unnamed = [start(tmp_path), start(tmp_path)]
    lock = tmp_path / "r.yaml.lock"
    try:
        wait_until(lambda: first.poll() is not None or lock.exists())
        refused = [start(tmp_path, "--out", str(out), *flag)
                   for flag in (["--resume"], ["--overwrite"], [])]
        for process in refused:
            assert process.wait(timeout=60) == 2
            message = " ".join(process.stderr.read().split())
            assert f"is being written by pid {first.pid}" in message, message
            assert not measured_by(tmp_path, process.pid)
    finally:
        hold.unlink()
    assert first.wait(timeout=60) == 0, first.stderr.read()
    assert set(snapshot(out)) == PLANNED and results.load(out)["complete"] is True
    for process in unnamed:
        assert process.wait(timeout=60) == 0, process.stderr.read()
    written = sorted((tmp_path / "runs").iterdir())
    assert len(written) == 2
    assert all(set(snapshot(path)) == PLANNED for path in written)
