"""benchmarks/gpu_runs.sh runs where nothing can be fixed between calls (a GPU host without
a package index): every command it calls, every option it passes and every shipped config
it names must exist here, and an unknown stage, alone or in a list, is a usage error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hla_bench import configs
from hla_bench.cli import main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_runs.sh"


def commands() -> list[str]:
    """The script's command lines, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    return [line.split("#")[0].strip() for line in text.splitlines()]


def options_of(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", command))


def test_the_script_parses_and_refuses_an_unknown_stage(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    refused = subprocess.run(["bash", str(SCRIPT), "no-such-stage", str(tmp_path)],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown stage no-such-stage" in refused.stderr
    # a list is checked whole before any stage runs or OUT is made
    out = tmp_path / "out"
    refused = subprocess.run(["bash", str(SCRIPT), "kernels,no-such-stage", str(out)],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "unknown stage no-such-stage" in refused.stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted({m for line in commands()
                                         for m in re.findall(r"benchmarks/(\w+)\.py", line)}))
def test_every_benchmark_option_it_passes_exists(name):
    used = set().union(*(options_of(line) for line in commands()
                         if f"benchmarks/{name}.py" in line))
    script = ROOT / "benchmarks" / f"{name}.py"
    help_text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                               text=True, cwd=ROOT).stdout
    assert used and used <= options_of(help_text), used - options_of(help_text)


def test_every_hla_bench_command_option_and_config_it_names_exists():
    lines = [line for line in commands()
             if re.search(r"(^|\s)(hla|python3 -m hla_bench) (verify|run|recall)\b", line)]
    assert {re.search(r"\b(verify|run|recall)\b", line).group(1) for line in lines} == {
        "verify", "run", "recall"}
    for line in lines:
        verb = re.search(r"\b(verify|run|recall)\b", line).group(1)
        help_text = CliRunner().invoke(main, [verb, "--help"]).output
        assert options_of(line) <= options_of(help_text), (verb, line)
    named = set(re.findall(r"(?:run|--config) ([a-z0-9-]+)\b", " ".join(lines)))
    named |= set(re.findall(r"\) config=([a-z0-9-]+) ;;", SCRIPT.read_text()))
    assert {"gpu-mixers", "zoology-fig2", "zoology-frontier", "mad", "mad-budget"} <= named
    assert named <= set(configs.names())


@pytest.mark.slow
def test_layer_parts_runs_on_the_cpu(tmp_path):
    """benchmarks/layer_parts.py on a tiny CPU shape: a row for every part the mixer's layer
    has, its operator and the three ways of the short convolution."""
    import os

    import yaml

    out = tmp_path / "parts.yaml"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "layer_parts.py"), "--device", "cpu",
         "--mixers", "linear-attn", "--seq-lens", "16", "--tokens", "32", "--heads", "2",
         "--head-dim", "8", "--modes", "fwd", "--yaml", str(out)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    rows = yaml.safe_load(out.read_text())["rows"]
    assert [(r["mixer"], r["part"]) for r in rows] == [
        ("linear-attn", part) for part in ("layer", "no short conv", "no q/k norm",
                                           "no output norm", "none of the three", "operator")
    ] + [("-", "conv: Conv1d"), ("-", "conv: shifted sums"), ("-", "conv: shifted sums, compiled")]
    assert all(r["mode"] == "fwd" and r["median_ms"] > 0 for r in rows)


@pytest.mark.slow
def test_the_compile_cache_comes_in_and_goes_out_packed(tmp_path):
    """COMPILE_CACHE's folder is unpacked where torch.compile and Triton keep their caches
    and packed into OUT/compile-cache.tar when the script ends, a stage that fails included;
    past COMPILE_CACHE_MB it is not packed."""
    import os
    import tarfile

    seed = tmp_path / "seed"
    (seed / "inductor").mkdir(parents=True)
    (seed / "inductor" / "entry").write_text("compiled")
    packed = tmp_path / "in.tar"
    with tarfile.open(packed, "w") as archive:
        archive.add(seed, arcname=".")
    env = {**os.environ, "COMPILE_CACHE": str(packed), "TIME_LIMIT": "30"}
    # bench-a asks for CUDA: on this machine the stage fails at once
    done = subprocess.run(["bash", str(SCRIPT), "bench-a", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True)
    assert f"from {packed}" in done.stdout, done.stdout + done.stderr
    with tarfile.open(tmp_path / "out" / "compile-cache.tar") as archive:
        names = archive.getnames()
        assert "./inductor/entry" in names and "./triton" in names
        assert archive.extractfile("./inductor/entry").read() == b"compiled"
    done = subprocess.run(["bash", str(SCRIPT), "bench-a", str(tmp_path / "big")],
                          env={**env, "COMPILE_CACHE_MB": "0"}, capture_output=True, text=True)
    assert "over COMPILE_CACHE_MB=0: not packed" in done.stdout
    assert not (tmp_path / "big" / "compile-cache.tar").exists()
