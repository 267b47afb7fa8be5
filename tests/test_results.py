"""Results files: environment capture, YAML round trip, schema errors naming the field."""

import copy

import pytest
import yaml

from hla_bench.results import bench_files as results
from hla_bench.speed.runner import run_sweeps
from hla_bench import registry
from test_sweeps import FAKES, tiny_sweep


@pytest.fixture(scope="module")
def measured():
    """One small real run (fakes registered only while it runs), shared by the module."""
    for mixer in FAKES:
        registry.register(mixer, replace=True)
    try:
        sweep = tiny_sweep(["fake-fast", "fake-broken"], modes=["fwd", "decode"])
        points = run_sweeps([sweep])
    finally:
        for mixer in FAKES:
            registry._REGISTRY.pop(mixer.name, None)
    return results.make_results({"name": "tiny"}, [sweep.to_dict()], points,
                                results.capture_environment("cpu"))


@pytest.fixture
def bench_data(measured):
    return copy.deepcopy(measured)


def test_environment_fields():
    env = results.capture_environment("cpu")
    for key in ("hostname", "utc_time", "torch", "cuda", "gpu", "driver", "git_commit",
                "cpu_count", "memory_method", "packages"):
        assert key in env
    assert env["cpu_count"] >= 1 and env["git_commit"]
    assert {"triton", "flash-linear-attention", "mamba-ssm", "flash-attn"} <= set(env["packages"])


def test_git_commit_prefers_the_variable(monkeypatch):
    """HLA_BENCH_GIT_COMMIT names the measured tree where its git metadata may not: it wins."""
    monkeypatch.setenv("HLA_BENCH_GIT_COMMIT", "abc1234")
    assert results.git_commit() == "abc1234"
    monkeypatch.delenv("HLA_BENCH_GIT_COMMIT")
    assert results.git_commit() != "abc1234"


def test_git_commit_is_the_checkouts_commit(monkeypatch):
    """Without the variable, a checkout records its own HEAD (the repository root, not the
    package folder, holds .git)."""
    import re
    import subprocess
    from pathlib import Path

    root = Path(results.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    monkeypatch.delenv("HLA_BENCH_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()
    commit = results.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit), commit
    assert commit.split("+")[0] == head


def test_round_trip(bench_data, tmp_path):
    path = results.save(bench_data, tmp_path / "sub" / "r.yaml")
    loaded = results.load(path)
    assert loaded == bench_data
    assert loaded["kind"] == "bench" and loaded["schema_version"] == results.SCHEMA_VERSION
    statuses = {(p["mixer"], p["mode"]): p["status"] for p in loaded["points"]}
    assert statuses == {("fake-fast", "fwd"): "ok", ("fake-broken", "fwd"): "error",
                        ("fake-fast", "decode"): "ok", ("fake-broken", "decode"): "unsupported"}


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("environment"), r"^environment: missing field"),
    (lambda d: d.update(kind="recall"), r"^kind: expected 'bench'"),
    (lambda d: d.update(schema_version=99), r"^schema_version: expected 1"),
    (lambda d: d["points"][1].update(status="exploded"), r"^points\[1\]\.status: expected one of"),
    (lambda d: d["points"][0].update(seq_len="16"), r"^points\[0\]\.seq_len: expected int"),
    (lambda d: d["points"][0].update(median_ms=None), r"^points\[0\]\.median_ms: required"),
    (lambda d: d["points"][2].pop("mode"), r"^points\[2\]\.mode: missing field"),
    (lambda d: d["points"][0].update(batch=True), r"^points\[0\]\.batch: expected int"),
    (lambda d: d["points"][4].update(decode_graph=1), r"^points\[4\]\.decode_graph: expected bool"),
    (lambda d: d["points"][4].update(decode_steps=2.5), r"^points\[4\]\.decode_steps: expected int"),
])
def test_schema_errors_name_the_field(bench_data, edit, message):
    edit(bench_data)
    with pytest.raises(results.ResultsSchemaError, match=message):
        results.validate(bench_data)


def test_files_without_the_decode_fields_still_load(bench_data):
    """decode_steps and decode_graph came later: older results files lack them."""
    decode = bench_data["points"][4]
    assert decode["mode"] == "decode" and decode["decode_steps"] == 8 and decode["decode_graph"] is False
    for point in bench_data["points"]:
        del point["decode_steps"], point["decode_graph"]
    results.validate(bench_data)


def test_load_names_the_file(bench_data, tmp_path):
    bench_data["points"][0]["mode"] = "sideways"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bench_data, sort_keys=False))
    with pytest.raises(results.ResultsSchemaError, match=r"bad\.yaml: points\[0\]\.mode"):
        results.load(path)
    with pytest.raises(results.ResultsSchemaError):
        results.save(bench_data, tmp_path / "never.yaml")
    assert not (tmp_path / "never.yaml").exists()

