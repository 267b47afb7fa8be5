"""--isolate: each mixer of a sweep in a process of its own, so a mixer that kills its
process costs only its own points."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hla_bench.results import bench_files as results

ROOT = Path(__file__).resolve().parents[1]
# Run as a script: the spawned children import it again (as __mp_main__), so they register
# the same mixers; the command itself runs only in the parent.
SCRIPT = textwrap.dedent("""
    import os
    import signal

    from hla_bench import registry
    from hla_bench.cli import main


    def build_crash(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            if q.shape[1] >= 32:  # T=16 measures, T=32 kills the process measuring it
                os.kill(os.getpid(), signal.SIGKILL)
            return v, None
        return op


    def build_fine(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            return v * 2, None
        return op


    registry.register(registry.Mixer("fake-crash", "fake", "kills its process", build_crash))
    registry.register(registry.Mixer("fake-fine", "fake", "fine", build_fine))

    if __name__ == "__main__":
        import sys
        main(sys.argv[1:], prog_name="hla-bench")
""")


def bench(tmp_path, *extra):
    script = tmp_path / "bench_with_fakes.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), "bench", "--mixers", "fake-crash,fake-fine",
            "--seq-lens", "16,32,64", "--modes", "fwd", "--batch", "1", "--heads", "1",
            "--head-dim", "4", "--device", "cpu", "--warmup", "0", "--repeats", "2", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_a_mixer_that_kills_its_process_costs_only_its_own_points(tmp_path):
    out = tmp_path / "r.yaml"
    done = bench(tmp_path, "--isolate", "--out", str(out))
    assert done.returncode == 0, done.stderr
    data = results.load(out)
    by = {(p["mixer"], p["seq_len"]): p for p in data["points"]}
    assert data["complete"] is True and len(by) == 6
    assert by["fake-crash", 16]["status"] == "ok"  # measured before the crash: kept
    for T in (32, 64):
        assert by["fake-crash", T]["status"] == "error"
        assert "ended (killed by SIGKILL)" in by["fake-crash", T]["reason"]
    assert all(by["fake-fine", T]["status"] == "ok" for T in (16, 32, 64))
    assert "each mixer in a process of its own" in data["environment"]["timing_method"]

    # a resume measures nothing kept again, and tries the failed points once more
    again = bench(tmp_path, "--isolate", "--out", str(out), "--resume")
    assert again.returncode == 0, again.stderr
    resumed = {(p["mixer"], p["seq_len"]): p for p in results.load(out)["points"]}
    assert resumed["fake-fine", 64] == by["fake-fine", 64]
    assert resumed["fake-crash", 32]["status"] == "error"


@pytest.mark.slow
def test_without_isolation_the_same_crash_ends_the_sweep(tmp_path):
    out = tmp_path / "r.yaml"
    done = bench(tmp_path, "--out", str(out))
    assert done.returncode == -9  # the one process is gone, with the sweep
    data = results.load(out)  # the points of T=16, stored before the crash
    assert data["complete"] is False and {p["seq_len"] for p in data["points"]} == {16}
