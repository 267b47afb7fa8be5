"""`hla-bench verify`: tables, JSON/YAML output, exit codes (with an injected disagreement)."""

import importlib
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from hla_bench.cli import main

FAST = ["verify", "--seq-len", "14"]
# The modules (mixers.hla re-exports functions under the same names).
ahla2_module = importlib.import_module("mixers.hla.ahla2")
hla3_module = importlib.import_module("mixers.hla.hla3")


def invoke(*args):
    return CliRunner().invoke(main, [*FAST, *args], catch_exceptions=False,
                              env={"COLUMNS": "160"})


@pytest.mark.slow  # fast: every form against its sums in its own module
def test_default_run_agrees_and_prints_both_tables():
    result = invoke()
    assert result.exit_code == 0, result.output
    for text in ("HLA identities", "Paper formulas vs corrected operators", "hla2", "ahla2",
                 "hla3", "chunk vs naive", "prefill + step"):
        assert text in result.output
    assert "FAIL" not in result.output


@pytest.mark.slow
def test_json_and_yaml_outputs(tmp_path):
    path = tmp_path / "verify.yaml"
    result = invoke("--json", "--dtype", "float32", "--seed", "3", "--yaml", str(path))
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["passed"] and data["dtype"] == "float32" and data["seed"] == 3
    assert yaml.safe_load(path.read_text())["checks"] == data["checks"]
    covered = {(row["operator"], row["pair"].split()[0]) for row in data["checks"]}
    for operator in ("hla2", "ahla2", "hla3"):
        assert {(operator, form) for form in ("serial", "scan", "chunk", "split", "prefill")} \
            <= covered
    assert all(row["status"] == "pass" and row["tolerance"] == 1e-4 for row in data["checks"])
    notes = {(row["comparison"], row["setting"]): row["relative_difference"]
             for row in data["discrepancies"]}
    assert notes[("hla2 decay_form paper vs masked", "decay 1.0")] < 1e-5
    assert notes[("hla2 decay_form paper vs masked", "decay 0.9")] > 1e-2
    assert notes[("hla3 variant paper vs causal", "plain")] > 1e-1


@pytest.mark.slow
def test_injected_disagreement_exits_1(monkeypatch):
    real_scan = ahla2_module.FORMS["scan"]

    def skewed_scan(*args):
        o, state = real_scan(*args)
        return o * (1 + 1e-6), state

    monkeypatch.setitem(ahla2_module.FORMS, "scan", skewed_scan)
    result = invoke("--json")
    assert result.exit_code == 1
    failed = {(row["operator"], row["pair"]) for row in json.loads(result.output)["checks"]
              if row["status"] == "FAIL"}
    assert failed == {("ahla2", "scan vs naive")}


def test_a_broken_form_is_an_error_row_and_exits_1(monkeypatch):
    def unfinished(*args):
        raise NotImplementedError("hla3 scan")

    monkeypatch.setattr(hla3_module, "hla3_scan", unfinished)
    result = invoke()
    assert result.exit_code == 1 and "error" in result.output and "failed" in result.output


def test_cuda_without_a_device_is_a_usage_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert invoke("--device", "cuda").exit_code == 2


def test_an_unwritable_yaml_path_is_a_usage_error_before_the_checks(tmp_path, monkeypatch):
    import hla_bench.verify as verify

    monkeypatch.setattr(verify, "run_all", lambda **kw: pytest.fail("the checks ran"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(main, [*FAST, "--yaml", str(blocker / "sub" / "v.yaml")])
    assert result.exit_code == 2 and "cannot write in" in result.output
    assert "Traceback" not in result.output


def test_an_existing_yaml_file_is_replaced_only_with_overwrite_and_never_a_results_file(
        tmp_path, monkeypatch):
    import hla_bench.verify as verify
    from hla_bench.results import store

    monkeypatch.setattr(verify, "run_all", lambda **kw: {"passed": True, "checks": []})
    monkeypatch.setattr(verify, "render", lambda result, console: None)
    path = tmp_path / "v.yaml"
    path.write_text("earlier: output\n")  # not a verify output: never replaced
    for flags in ([], ["--overwrite"]):
        refused = CliRunner().invoke(main, [*FAST, "--yaml", str(path), *flags])
        assert refused.exit_code == 2 and "is not a verify output" in refused.output
        assert path.read_text() == "earlier: output\n"
    path.unlink()
    written = CliRunner().invoke(main, [*FAST, "--yaml", str(path)])
    assert written.exit_code == 0, written.output
    assert yaml.safe_load(path.read_text()) == {"kind": "verify", "schema_version": 1,
                                                "passed": True, "checks": []}
    refused = CliRunner().invoke(main, [*FAST, "--yaml", str(path)])
    assert refused.exit_code == 2 and "give --overwrite" in refused.output
    replaced = CliRunner().invoke(main, [*FAST, "--yaml", str(path), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    # an output written before the kind line (run_all's keys first) is one too
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("device: cpu\ndtype: float64\nseed: 0\nseq_len: 32\nchecks: []\n"
                      "passed: true\n")
    replaced = CliRunner().invoke(main, [*FAST, "--yaml", str(legacy), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert yaml.safe_load(legacy.read_text())["kind"] == "verify"
    results = tmp_path / "r.yaml"
    store.atomic_write_text(results, "kind: bench\nschema_version: 2\n")
    kept = CliRunner().invoke(main, [*FAST, "--yaml", str(results), "--overwrite"])
    assert kept.exit_code == 2 and "is a bench results file" in kept.output
    assert results.read_text() == "kind: bench\nschema_version: 2\n"
    seed = CliRunner().invoke(main, [*FAST, "--seed", "99999999999999999999"])
    assert seed.exit_code == 2 and "--seed" in seed.output
