"""Fault injection for recall sweeps run as subprocesses: a sweep killed with SIGKILL at a
random moment leaves no results file or a valid, resumable one, whose finished runs a
resume keeps without training them again; worker processes die with their sweep."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hla_bench.recall.plan import check_recall_file
from hla_bench.results.load import load

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ["recall", "--task", "mqar", "--mixers", "linear-attn,hla2,mamba2-ssd",
         "--d-model", "16", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "32",
         "--lrs", "3e-3,1e-2", "--seeds", "0,1", "--epochs", "2", "--num-train", "192",
         "--num-val", "32", "--num-test", "32", "--batch-size", "32", "--device", "cpu"]
RUNS = 3 * 2 * 2


def start(tmp_path, *extra, workers=1):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "hla_bench", *SWEEP, "--workers", str(workers),
                             *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_killed_sweeps_leave_a_resumable_file_and_resume_trains_only_the_missing(tmp_path):
    rng = random.Random(7)
    out = tmp_path / "recall.yaml"
    for trial in range(4):
        process = start(tmp_path, "--out", str(out), "--resume")
        time.sleep(rng.uniform(1.5, 6.0))
        process.send_signal(signal.SIGKILL)
        process.wait()
        if not out.exists():
            continue
        data = load(out, "recall", validate=check_recall_file)
        finished = {(r["mixer"], r["lr"], r["seed"]): r["curve"] for r in data["runs"]
                    if r["status"] == "ok"}
        resumed = subprocess.run([sys.executable, "-m", "hla_bench", *SWEEP, "--workers", "1",
                                  "--out", str(out), "--resume"], cwd=tmp_path,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        planned = re.search(r"\((\d+) to train in", resumed.stdout)
        assert int(planned.group(1)) == RUNS - len(finished)
        after = yaml.safe_load(out.read_text())
        assert after["complete"] is True and len(after["runs"]) == RUNS
        for run in after["runs"]:
            key = (run["mixer"], run["lr"], run["seed"])
            if key in finished:
                assert run["curve"] == finished[key]  # kept, not trained again
        out.unlink()


@pytest.mark.slow
def test_workers_die_with_their_sweep(tmp_path):
    process = start(tmp_path, "--epochs", "200", "--num-train", "2048", workers=2)
    deadline = time.monotonic() + 120
    workers = set()
    while time.monotonic() < deadline and len(workers) < 2:
        workers = {pid for pid in children(process.pid)
                   if "spawn" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")}
        time.sleep(0.2)
    assert len(workers) >= 2, "the sweep did not start its workers"
    everyone = children(process.pid)
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(pid) for pid in everyone):
        time.sleep(0.2)
    assert not [pid for pid in everyone if alive(pid)], "processes outlived the sweep"


def test_cuda_mps_is_seen_by_its_daemon_process(tmp_path):
    """A recall sweep notes when its GPU workers take turns without MPS: the daemon is found
    by its process name (truncated to 15 characters, as /proc shows it)."""
    from hla_bench.processes import cuda_mps_active

    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "comm").write_text("python3\n")
    (tmp_path / "self").mkdir()
    assert not cuda_mps_active(tmp_path)
    (tmp_path / "345").mkdir()
    (tmp_path / "345" / "comm").write_text("nvidia-cuda-mps\n")
    assert cuda_mps_active(tmp_path)
