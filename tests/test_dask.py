"""The Dask executor on CPU: a local cluster of 2 workers gives the local executor's results,
a task whose worker dies is run once more, and a stopped Dask sweep resumes."""

import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import yaml
from click.testing import CliRunner

from hla_bench.cli import main

distributed = pytest.importorskip("distributed")

from hla_bench import dask_executor  # noqa: E402
from hla_bench.recall import pool  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

SWEEP = ["recall", "--task", "mqar", "--mixers", "linear-attn,hla2", "--d-model", "16",
         "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "32", "--lrs", "3e-3,1e-2",
         "--seeds", "0,1", "--epochs", "2", "--num-train", "192", "--num-val", "32",
         "--num-test", "32", "--batch-size", "32", "--device", "cpu", "--workers", "2"]


def scores(path):
    return {(r["mixer"], r["lr"], r["seed"]): (r["test_accuracy"], r["curve"])
            for r in yaml.safe_load(Path(path).read_text())["runs"]}


@pytest.mark.slow
def test_a_dask_sweep_gives_the_local_executors_results(tmp_path):
    local = CliRunner().invoke(main, SWEEP + ["--out", str(tmp_path / "local.yaml")])
    assert local.exit_code == 0, local.output
    dask = CliRunner().invoke(main, SWEEP + ["--executor", "dask", "--out", str(tmp_path / "dask.yaml")])
    assert dask.exit_code == 0, dask.output
    assert "dask: 2 worker(s)" in dask.output
    assert scores(tmp_path / "dask.yaml") == scores(tmp_path / "local.yaml")
    assert len(scores(tmp_path / "local.yaml")) == 8
    data = yaml.safe_load((tmp_path / "dask.yaml").read_text())
    assert data["executor"]["executor"] == "dask" and data["executor"]["workers"] == 2


@pytest.mark.slow
def test_a_stopped_dask_sweep_resumes(tmp_path):
    out = str(tmp_path / "r.yaml")
    stopped = CliRunner().invoke(main, SWEEP + ["--executor", "dask", "--out", out,
                                                "--time-limit", "0.001", "--epochs", "3"])
    assert stopped.exit_code == 0 and "stopped at --time-limit" in stopped.output, stopped.output
    assert yaml.safe_load(Path(out).read_text())["complete"] is False
    resumed = CliRunner().invoke(main, SWEEP + ["--executor", "dask", "--out", out, "--resume",
                                                "--epochs", "3"])
    assert resumed.exit_code == 0, resumed.output
    data = yaml.safe_load(Path(out).read_text())
    assert data["complete"] is True and len(data["runs"]) == 8
    assert all(r["status"] == "ok" for r in data["runs"])


def dies_once(group, options):
    """Group 0 kills its worker the first time (a marker file remembers), then succeeds;
    the other groups succeed at once."""
    marker = Path(options["checkpoint_dir"]) / "died"
    if group[0]["run_id"] == 0 and not marker.exists():
        marker.write_text("")
        os._exit(1)
    return [{**spec, "status": "ok"} for spec in group]


def always_dies(group, options):
    if group[0]["run_id"] == 0:
        os._exit(1)
    return [{**spec, "status": "ok"} for spec in group]


def run_stand_in_groups(tmp_path, task, count: int, after=lambda client: None):
    """`count` one-run groups through `task` on a local cluster of 2 CPU workers: whether the
    sweep completed, the results by run id and what `after(client)` says before it closes."""
    client = dask_executor.connect(None, gpus=0, workers=2)
    try:
        groups = [[{"run_id": i, "device": "cpu", "mixer": "m"}] for i in range(count)]
        finished = []
        complete = pool.run_groups_dask(client, groups, lambda ids, event: None,
                                                 finished.extend, checkpoint_dir=str(tmp_path),
                                                 task=task)
        seen = after(client)
    finally:
        client.close()
    return complete, {r["run_id"]: r for r in finished}, seen


@pytest.mark.slow
@pytest.mark.parametrize("task,status", [(dies_once, "ok"), (always_dies, "crashed")])
def test_a_task_whose_worker_dies_runs_once_more_then_is_recorded(tmp_path, task, status):
    complete, by_id, _ = run_stand_in_groups(tmp_path, task, 3)
    assert complete and sorted(by_id) == [0, 1, 2]
    assert by_id[1]["status"] == by_id[2]["status"] == "ok"  # the others lost nothing
    assert by_id[0]["status"] == status
    if status == "crashed":
        assert "KilledWorker" in by_id[0]["error"]


def faults_on_group_0(group, options):
    """Group 0 returns a CUDA fault; every result names the process that computed it."""
    import time

    from hla_bench.recall.pool import CudaFault, failed_result

    time.sleep(0.2)
    if group[0]["run_id"] == 0:
        return CudaFault([{**failed_result(spec, "error", "CUDA error: device-side assert"),
                           "pid": os.getpid()} for spec in group])
    return [{**spec, "status": "ok", "pid": os.getpid()} for spec in group]


@pytest.mark.slow
def test_the_worker_that_returns_a_cuda_fault_is_restarted(tmp_path):
    complete, by_id, alive = run_stand_in_groups(
        tmp_path, faults_on_group_0, 4, after=lambda client: set(client.run(os.getpid).values()))
    assert complete and sorted(by_id) == [0, 1, 2, 3]
    assert by_id[0]["status"] == "error" and "device-side assert" in by_id[0]["error"]
    assert all(by_id[i]["status"] == "ok" for i in (1, 2, 3))
    assert by_id[0]["pid"] not in alive


@pytest.mark.parametrize("gpus, workers, visible", [
    (2, 4, ["0", "1", "0", "1"]), (8, 8, [str(g) for g in range(8)]), (1, 4, ["0"] * 4)])
def test_a_local_clusters_gpu_workers_are_spread_over_the_gpus(gpus, workers, visible):
    """As the local executor's workers_per_gpu: several workers may share a GPU (under CUDA
    MPS their kernels run side by side); each sees its GPU alone and runs one task at a time."""
    specs = dask_executor.worker_specs(gpus, workers)
    assert len(set(specs)) == workers
    assert [spec["options"]["env"]["CUDA_VISIBLE_DEVICES"] for spec in specs.values()] == visible
    assert all(spec["options"]["resources"] == {"GPU": 1} and spec["options"]["nthreads"] == 1
               for spec in specs.values())


def test_a_recall_sweep_asks_the_local_cluster_for_its_workers(tmp_path, monkeypatch):
    asked = {}

    def connect(scheduler, *, gpus, workers, dashboard):
        asked.update(gpus=gpus, workers=workers, dashboard=dashboard)
        raise KeyboardInterrupt

    monkeypatch.setattr(dask_executor, "connect", connect)
    result = CliRunner().invoke(main, SWEEP + ["--executor", "dask", "--workers", "3",
                                               "--out", str(tmp_path / "o.yaml")])
    assert result.exit_code == 130, result.output
    assert asked == {"gpus": 0, "workers": 3, "dashboard": False}


def test_executor_flags_are_checked_before_work(tmp_path, monkeypatch):
    bad = CliRunner().invoke(main, SWEEP + ["--scheduler", "tcp://nowhere:1"])
    assert bad.exit_code == 2 and "--scheduler needs --executor dask" in bad.output
    monkeypatch.setattr("importlib.util.find_spec",
                        lambda name, *a: None if name == "distributed" else object())
    missing = CliRunner().invoke(main, SWEEP + ["--executor", "dask", "--out", str(tmp_path / "x.yaml")])
    assert missing.exit_code == 2 and 'pip install "hla-bench[dask]"' in missing.output



def _closed_port() -> int:
    """A local TCP port with nothing listening (bound, then released)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("address, says", [("nowhere", "missing port number"),
                                           ("tcp://h:abc", "expected tcp://HOST:PORT"),
                                           ("closed", "no scheduler answers there")])
@pytest.mark.parametrize("command", ["recall", "bench"])
def test_a_scheduler_that_cannot_serve_is_a_usage_error_before_any_file(tmp_path, address,
                                                                       says, command):
    if address == "closed":
        address = f"tcp://127.0.0.1:{_closed_port()}"
    out = tmp_path / "x.yaml"
    args = (SWEEP if command == "recall" else BENCH) + [
        "--executor", "dask", "--scheduler", address, "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and says in result.output, result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []

BENCH = ["bench", "--mixers", "hla2,linear-attn,sdpa", "--seq-lens", "64,128", "--modes",
         "fwd,decode", "--device", "cpu", "--repeats", "2", "--warmup", "1"]


def points(path):
    from hla_bench.results.records import point_key

    return {point_key(p): p for p in yaml.safe_load(Path(path).read_text())["points"]}


@pytest.mark.slow
def test_a_dask_bench_sweep_measures_the_local_plan_and_resumes(tmp_path):
    local = CliRunner().invoke(main, BENCH + ["--out", str(tmp_path / "local.yaml")])
    assert local.exit_code == 0, local.output
    out = tmp_path / "dask.yaml"
    dask = CliRunner().invoke(main, BENCH + ["--executor", "dask", "--out", str(out)])
    assert dask.exit_code == 0, dask.output
    measured = points(out)
    assert set(measured) == set(points(tmp_path / "local.yaml")) and len(measured) == 12
    assert {p["status"] for p in measured.values()} == {"ok"}
    again = CliRunner().invoke(main, BENCH + ["--executor", "dask", "--out", str(out), "--resume"])
    assert again.exit_code == 0, again.output
    assert points(out) == measured  # every point kept, none measured again
