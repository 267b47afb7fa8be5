"""GPU utilisation sampled from nvidia-smi (hla_bench.gpu_use), here from a stand-in
nvidia-smi on PATH."""

import os
import stat
import time

import pytest

from hla_bench import gpu_use


def fake_nvidia_smi(folder, body: str):
    """An executable `nvidia-smi` in `folder` running the shell `body`; PATH is that folder
    alone (with the shell's own folders for its builtins' helpers)."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{folder}{os.pathsep}/usr/bin{os.pathsep}/bin"


def test_a_sample_reads_every_gpus_utilisation_and_memory_and_skips_what_is_not_a_number(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, 'echo "0, 87, 1234"\n'
                                                         'echo "1, [N/A], 5"\n'
                                                         'echo "1, 12, 40"'))
    assert gpu_use.read_gpus() == [(0, 87.0, 1234.0), (1, 12.0, 40.0)]


@pytest.mark.parametrize("body, why", [
    (None, "nvidia-smi not found"),
    ('echo "no devices" >&2; exit 9', "nvidia-smi exited 9: no devices"),
    ('echo "No devices were found"', "nvidia-smi gave no sample: 'No devices were found'")])
def test_without_a_sample_the_reason_is_said(tmp_path, monkeypatch, body, why):
    if body is None:
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, body))
    assert gpu_use.read_gpus() == why
    sampler = gpu_use.GpuUse(interval=0.01)
    time.sleep(0.2)
    sampler.stop()
    assert sampler.summary() == {"unavailable": why}


def test_the_summary_is_mean_median_and_most_memory_over_the_samples(tmp_path, monkeypatch):
    """The stand-in reports utilisation 0, 1, 2, ... and memory ten times that on GPU 0, and
    a constant on GPU 3, one step per call. The counter is replaced by a rename, so the test
    never reads it half written."""
    counter = tmp_path / "count"
    counter.write_text("0")
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, f'n=$(cat {counter})\n'
                                                         f'echo $((n + 1)) > {counter}.new\n'
                                                         f'mv {counter}.new {counter}\n'
                                                         'echo "0, $n, $((n * 10))"\n'
                                                         'echo "3, 50, 7"'))
    sampler = gpu_use.GpuUse(interval=0.01)
    deadline = time.time() + 20
    while int(counter.read_text()) < 5 and time.time() < deadline:
        time.sleep(0.05)
    sampler.stop()
    first, other = sampler.summary()
    k = first["samples"]
    assert k >= 5 and k == other["samples"]
    assert first == {"index": 0, "samples": k, "utilization_mean": round((k - 1) / 2, 1),
                     "utilization_median": round((k - 1) / 2, 1),
                     "memory_used_max_mib": 10.0 * (k - 1)}
    assert other == {"index": 3, "samples": k, "utilization_mean": 50.0,
                     "utilization_median": 50.0, "memory_used_max_mib": 7.0}
