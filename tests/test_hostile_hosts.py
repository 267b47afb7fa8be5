"""Hosts and processes, under fault injection on the CPU: the local Dask cluster listens on
the loopback interface only, without a dashboard unless asked for; no process the command
started outlives it (SIGKILL or SIGINT of the command, with --executor dask or --isolate);
a point whose process the kernel kills for memory is recorded `oom` and the lock is
released."""

import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from hla_bench.results import bench_files as results
from hla_bench.cli import main

ROOT = Path(__file__).resolve().parents[1]


def http_status(url: str) -> int | None:
    """The HTTP status a GET of `url` gets; None where nothing answers HTTP there."""
    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, ValueError):
        return None


def listening(psutil, processes) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every listening TCP socket of `processes`."""
    found = []
    for process in processes:
        connections = getattr(process, "net_connections", None) or process.connections
        for connection in connections(kind="inet"):
            if connection.status == psutil.CONN_LISTEN:
                found.append((process.pid, connection.laddr.ip, connection.laddr.port))
    return found


# ---------------------------------------------------------------- the local cluster


@pytest.mark.slow
def test_a_local_cluster_listens_on_loopback_only_and_serves_no_dashboard():
    pytest.importorskip("distributed")
    psutil = pytest.importorskip("psutil")
    from hla_bench import dask_executor

    client = dask_executor.connect(None, gpus=0, workers=1)
    try:
        info = client.scheduler_info()
        me = psutil.Process()
        sockets = listening(psutil, [me, *me.children(recursive=True)])
        dashboard = client.dashboard_link
    finally:
        client.close()
    assert info["address"].startswith("tcp://127.0.0.1:")
    assert info["workers"] and all(address.startswith("tcp://127.0.0.1:")
                                   for address in info["workers"])
    # the scheduler, the nanny, the worker and their HTTP servers
    assert len({pid for pid, _, _ in sockets}) >= 2 and len(sockets) >= 4, sockets
    assert {ip for _, ip, _ in sockets} == {"127.0.0.1"}, sockets
    # the HTTP servers Dask always starts serve the health check and nothing else
    for _, _, port in sockets:
        assert http_status(f"http://127.0.0.1:{port}/status") in (None, 404), port
        assert http_status(f"http://127.0.0.1:{port}/info/main/workers.html") in (None, 404)
    assert http_status(dashboard.rsplit("/", 1)[0] + "/health") is None  # closed with it


@pytest.mark.slow
def test_the_dashboard_is_served_on_loopback_only_when_asked_for():
    pytest.importorskip("distributed")
    from hla_bench import dask_executor

    client = dask_executor.connect(None, gpus=0, workers=1, dashboard=True)
    try:
        link = client.dashboard_link
        status = http_status(link)
    finally:
        client.close()
    assert link.startswith("http://127.0.0.1:") and link.endswith("/status")
    assert status == 200


@pytest.mark.parametrize("extra, message", [
    ([], "--dashboard is the dashboard of the local Dask cluster"),
    (["--executor", "dask", "--scheduler", "tcp://127.0.0.1:1"], "serves its own"),
])
def test_dashboard_needs_the_local_dask_cluster(tmp_path, extra, message):
    result = CliRunner().invoke(main, ["bench", "--mixers", "hla2", "--seq-lens", "16",
                                       "--device", "cpu", "--dashboard", *extra,
                                       "--out", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "r.yaml").exists()


# ---------------------------------------------------------------- no process left behind

# A plugin (found through its entry point by every process the command starts, via
# PYTHONPATH): `fake-stall` marks that a process started to measure it, then sleeps.
PLUGIN = textwrap.dedent("""
    import os
    import time
    from pathlib import Path

    from hla_bench.registry import Mixer


    def build_stall(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            Path(os.environ["HOSTILE_MARKS"], str(os.getpid())).write_text("")
            time.sleep(120)
            return v, None
        return op


    def mixers():
        return [Mixer("fake-stall", "fake", "sleeps while measured", build_stall)]
""")


def install_plugin(folder: Path) -> Path:
    site = folder / "site"
    info = site / "hostile_fakes-0.dist-info"
    info.mkdir(parents=True)
    (site / "hostile_fakes.py").write_text(PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-fakes\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[hla_bench.mixers]\nfakes = hostile_fakes:mixers\n")
    return site


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dask", "isolate"])
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_no_process_outlives_the_command(tmp_path, how, stop):
    psutil = pytest.importorskip("psutil")
    if how == "dask":
        pytest.importorskip("distributed")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "HOSTILE_MARKS": str(marks),
           "PYTHONPATH": os.pathsep.join([str(install_plugin(tmp_path)), str(ROOT)])}
    flag = ["--executor", "dask"] if how == "dask" else ["--isolate"]
    command = subprocess.Popen(
        [sys.executable, "-m", "hla_bench", "bench", "--mixers", "fake-stall", "--seq-lens",
         "16", "--modes", "fwd", "--device", "cpu", "--warmup", "0", "--repeats", "1", *flag,
         "--out", str(tmp_path / "r.yaml")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    survivors = []
    try:
        measuring = int(wait_for(lambda: next(iter(os.listdir(marks)), None), 120,
                                 "the point to start"))
        parent = psutil.Process(command.pid)
        started = parent.children(recursive=True)
        assert measuring in {p.pid for p in started}, "the measuring process is not listed"
        os.kill(command.pid, stop)
        command.wait(timeout=60)

        def all_gone():
            return not [p for p in started if p.is_running() and p.status() != "zombie"]
        try:
            wait_for(all_gone, 20, "the command's processes to end")
        except AssertionError:
            survivors = [(p.pid, " ".join(p.cmdline())[:120]) for p in started
                         if p.is_running() and p.status() != "zombie"]
        assert not survivors, f"still alive after {stop.name} of the command: {survivors}"
        if stop == signal.SIGINT:
            assert command.returncode == 130, command.stderr.read()
            assert not (tmp_path / "r.yaml.lock").exists()
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
        for pid, _ in survivors:  # the test's own leftovers, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        command.stderr.close()


# ---------------------------------------------------------------- memory kills

# Run as a script, so the spawned children import it again (as __mp_main__) and register
# its mixers. `fake-oom` at T >= 32 does what the kernel's out-of-memory killer does: it
# counts a kill in the counter file the harness reads (in place of /proc/vmstat) and sends
# its process SIGKILL. Points from T=32 count as big enough for the watchdog.
OOM_SCRIPT = textwrap.dedent("""
    import os
    import signal
    import sys
    from pathlib import Path

    from hla_bench import registry
    from hla_bench.speed import isolate

    COUNTER = Path(os.environ["HOSTILE_OOM_COUNTER"])


    def build_oom(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            if q.shape[1] >= 32:
                kills = int(COUNTER.read_text().split("oom_kill ")[1])
                COUNTER.write_text(f"pgfault 7\\noom_kill {kills + 1}\\n")
                os.kill(os.getpid(), signal.SIGKILL)
            return v * 1, None
        return op


    def build_fine(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            return v * 2, None
        return op


    registry.register(registry.Mixer("fake-oom", "fake", "killed for memory", build_oom))
    registry.register(registry.Mixer("fake-fine", "fake", "fine", build_fine))
    isolate.OOM_KILL_COUNTERS = (str(COUNTER),)
    isolate.watch_threshold_bytes = lambda: 32 * 16 * 4  # T=32, 1 head of 4 dims, fp32

    if __name__ == "__main__":
        from hla_bench.cli import main
        main(sys.argv[1:], prog_name="hla-bench")
""")


def test_a_point_killed_for_memory_is_recorded_oom_and_the_lock_released(tmp_path):
    script = tmp_path / "bench_killed_for_memory.py"
    script.write_text(OOM_SCRIPT)
    counter = tmp_path / "vmstat"
    counter.write_text("pgfault 7\noom_kill 3\n")
    out = tmp_path / "r.yaml"
    done = subprocess.run(
        [sys.executable, str(script), "bench", "--mixers", "fake-oom,fake-fine", "--seq-lens",
         "16,32,64", "--modes", "fwd,fwdbwd", "--batch", "1", "--heads", "1", "--head-dim",
         "4", "--device", "cpu", "--warmup", "0", "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOSTILE_OOM_COUNTER": str(counter)})
    assert done.returncode == 0, done.stderr
    assert "each mixer is measured in a process of its own" in done.stderr
    data = results.load(out)
    by = {(p["mixer"], p["mode"], p["seq_len"]): p for p in data["points"]}
    assert data["complete"] is True and len(by) == 12
    assert not out.with_name("r.yaml.lock").exists()
    for mode in ("fwd", "fwdbwd"):  # the second mode measured by a new process
        assert by["fake-oom", mode, 16]["status"] == "ok"
        killed = by["fake-oom", mode, 32]
        assert killed["status"] == "oom", killed["reason"]
        assert "out-of-memory killer" in killed["reason"]
        assert "killed by SIGKILL" in killed["reason"]
        assert by["fake-oom", mode, 64]["status"] == "oom"
        assert by["fake-oom", mode, 64]["reason"] == "skipped: out of memory at T=32"
        assert all(by["fake-fine", mode, T]["status"] == "ok" for T in (16, 32, 64))
    assert counter.read_text().split()[-1] == "5"  # two kills, one per mode


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as on Linux")
def test_a_point_past_the_hosts_memory_is_watched_and_recorded_oom(tmp_path):
    """The point of the report (16 GB a tensor), in a process limited to 4 GiB of address
    space, so nothing is allocated: measured under the watchdog, recorded oom."""
    out = tmp_path / "r.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "hla_bench", "bench", "--mixers", "hla2", "--device", "cpu",
         "--seq-lens", "1000000000", "--heads", "1", "--head-dim", "4", "--modes", "fwd",
         "--warmup", "0", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300, preexec_fn=_limit_memory,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "each mixer is measured in a process of its own" in done.stderr
    (point,) = results.load(out)["points"]
    assert point["status"] == "oom" and "allocate" in point["reason"]
    assert not out.with_name("r.yaml.lock").exists()
