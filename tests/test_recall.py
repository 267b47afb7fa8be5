"""Tiny LM, training loop, sweeps, result YAML and the `recall` / `tasks` commands."""


import pytest
import torch
import torch.nn.functional as F
import yaml
from click.testing import CliRunner
from rich.console import Console

from hla_bench import registry
from hla_bench.cli import main
from hla_bench.recall_report import render_recall
from mixers.layer import MixerLayer
from tasks import IGNORE
from tasks.model import TinyLM, labelled_rows
from tasks.train import (RunSpec, default_workers, run_sweep, state_bytes, summarize,
                         train_run, warmup_cosine)


def softmax_op(**_):
    def op(q, k, v, initial_state=None, output_final_state=False):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2), None
    return op


class KVCache:
    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        return (torch.zeros(batch, heads, context_len, head_dim, dtype=dtype),
                torch.zeros(batch, heads, context_len, value_dim, dtype=dtype))

    def state_bytes(self, state):
        return sum(t.numel() * t.element_size() for t in state)


def broken_op(**_):
    def op(q, k, v, initial_state=None, output_final_state=False):
        raise RuntimeError("this mixer always fails")
    return op


registry.register(registry.Mixer(
    "test-softmax", "softmax", "causal softmax attention (test)", build_op=softmax_op,
    build_layer=lambda d, h, **o: MixerLayer(d, h, softmax_op(), qk_norm="none"),
    build_decoder=lambda **o: KVCache()), replace=True)
registry.register(registry.Mixer(
    "test-broken", "linear", "fails in forward (test)", build_op=broken_op,
    build_layer=lambda d, h, **o: MixerLayer(d, h, broken_op())), replace=True)

registry.register(registry.Mixer(
    "test-needs-cuda", "linear", "needs CUDA (test)", build_op=broken_op,
    build_layer=lambda d, h, **o: MixerLayer(d, h, broken_op()), requires=("cuda",)), replace=True)

TINY = dict(task="mqar", params=dict(vocab_size=16, seq_len=8, num_kv_pairs=2))


def tiny_spec(**changes) -> dict:
    return RunSpec(**{**dict(mixer="test-softmax", d_model=32, lr=3e-3, epochs=2, num_train=256,
                             num_test=64, eval_every=2, stop_accuracy=1.1, **TINY), **changes}).as_dict()


def test_labelled_logits_give_the_full_logits_loss_and_gradient():
    torch.manual_seed(0)
    model = TinyLM(32, 32, "test-softmax")
    inputs = torch.randint(0, 32, (4, 16))
    labels = torch.full((4, 16), IGNORE)
    labels[:, 5::4] = torch.randint(0, 32, (4, 3))
    loss = model.loss(inputs, labels)
    grad = torch.autograd.grad(loss, model.embed.weight)[0]
    full = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    full_grad = torch.autograd.grad(full, model.embed.weight)[0]
    torch.testing.assert_close(loss, full)
    torch.testing.assert_close(grad, full_grad)
    counted = model.loss(inputs, labels, count=12)  # the gather path (no boolean index)
    torch.testing.assert_close(counted, full)
    torch.testing.assert_close(torch.autograd.grad(counted, model.embed.weight)[0], full_grad)


def test_labelled_rows_in_order_and_exact_count():
    labels = torch.tensor([IGNORE, 3, IGNORE, IGNORE, 7, 1, IGNORE, 2])
    assert labelled_rows(labels, 4).tolist() == [1, 4, 5, 7]
    assert labelled_rows(torch.full((5,), IGNORE), 0).tolist() == []


def test_positions_only_for_softmax_and_last_state_readout():
    assert TinyLM(32, 32, "test-softmax").positions is not None
    assert TinyLM(32, 32, "test-broken").positions is None
    model = TinyLM(16, 32, "test-softmax", readout="last", max_len=8)
    inputs = torch.randint(0, 16, (2, 8))
    changed = inputs.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 16
    assert model(inputs).shape == (2, 8, 16)
    assert not torch.allclose(model(inputs)[:, 0], model(changed)[:, 0])  # first logit sees the end
    with pytest.raises(ValueError, match="readout"):
        TinyLM(16, 32, "test-softmax", readout="mean")
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 100, 10) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 10) == pytest.approx(0.5)
    assert warmup_cosine(100, 100, 10) == pytest.approx(0.0)


def test_softmax_learns_tiny_mqar():
    torch.set_num_threads(2)
    result = train_run(RunSpec(mixer="test-softmax", d_model=64, lr=3e-3, epochs=2, num_train=20_000,
                               num_test=200, eval_every=50, **TINY).as_dict())
    assert result["status"] == "ok" and result["score"] > 0.9, result["curve"]
    assert result["curve"][0]["accuracy"] < 0.8  # it learned, it did not start there
    assert result["early_stopped"] == (result["steps"] < 626)


def test_runs_are_deterministic_and_record_curve_and_sizes():
    first, second = train_run(tiny_spec()), train_run(tiny_spec())
    assert first["curve"] == second["curve"] and len(first["curve"]) == 4
    assert [point["step"] for point in first["curve"]] == [2, 4, 6, 8]
    assert first["score"] == max(point["accuracy"] for point in first["curve"])
    assert first["state_bytes"] == 2 * (2 * 8 * 32 * 4)  # K and V caches, 2 layers, float32
    assert first["n_params"] > 0 and first["seq_len"] == 8
    assert train_run(tiny_spec(seed=1))["curve"] != first["curve"]


def test_state_bytes_without_decoder_is_none():
    assert state_bytes("test-broken", {}, 32, 1, 2, 16) is None


def test_failing_run_is_recorded_and_the_sweep_goes_on():
    specs = [tiny_spec(mixer="test-broken", run_id=0), tiny_spec(run_id=1)]
    events = []
    results = run_sweep(specs, workers=1, on_event=lambda run_id, event: events.append((run_id, event["event"])))
    assert results[0]["status"] == "error" and "always fails" in results[0]["error"]
    assert results[1]["status"] == "ok"
    assert (1, "start") in events and (0, "done") in events and (1, "done") in events
    cells = summarize(results)[""]
    assert cells["test-broken"][32]["score"] is None and cells["test-softmax"][32]["score"] is not None


def test_parallel_workers_report_failures():
    specs = [tiny_spec(mixer="not-in-worker", run_id=i) for i in range(2)]
    results = run_sweep(specs, workers=2)
    assert [r["status"] for r in results] == ["error", "error"]
    assert all("UnknownMixerError" in r["error"] for r in results)


def test_summary_keeps_the_best_learning_rate():
    runs = [{"setting": "s", "mixer": "m", "d_model": 64, "lr": lr, "score": score, "status": "ok"}
            for lr, score in ((1e-3, 0.5), (3e-3, 0.9), (1e-2, None))]
    assert summarize(runs)["s"]["m"][64]["lr"] == 3e-3
    assert default_workers("cpu") >= 1


def recall_args(tmp_path, *extra):
    return ["recall", "--task", "mqar", "--mixers", "test-softmax", "--d-model", "32",
            "--seq-len", "8", "--num-kv-pairs", "2", "--vocab-size", "16", "--lrs", "3e-3,1e-2",
            "--epochs", "1", "--num-train", "128", "--num-test", "64", "--device", "cpu",
            "--workers", "1", "--out", str(tmp_path / "recall.yaml"), *extra]


def test_recall_cli_writes_yaml_that_round_trips_into_the_report(tmp_path):
    result = CliRunner().invoke(main, recall_args(tmp_path, "--plots-dir", str(tmp_path / "plots")))
    assert result.exit_code == 0, result.output
    assert "recall sweep: 2 runs on cpu, 1 worker(s)" in result.output
    assert "test-softmax d=32 lr=0.003 [mqar" in result.output
    data = yaml.safe_load((tmp_path / "recall.yaml").read_text())
    assert data["kind"] == "recall" and data["schema_version"] == 1
    assert data["config"]["lrs"] == [3e-3, 1e-2] and len(data["runs"]) == 2
    assert all(run["status"] == "ok" and run["curve"] for run in data["runs"])
    assert {"python", "torch"} <= set(data["environment"])
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "recall_accuracy_vs_d_model.png", "recall_accuracy_vs_state.png"]
    console = Console(record=True, width=200)
    render_recall(data, console)
    text = console.export_text()
    best = max(run["score"] for run in data["runs"])
    assert "test-softmax" in text and f"{best:.3f}" in text
    report = CliRunner().invoke(main, ["report", str(tmp_path / "recall.yaml")])
    assert report.exit_code == 0, report.output
    assert "test-softmax" in report.output
    markdown = CliRunner().invoke(main, ["report", str(tmp_path / "recall.yaml"), "--markdown"])
    assert markdown.exit_code == 0, markdown.output
    best_lr = max(data["runs"], key=lambda run: run["score"])["lr"]
    assert "| mixer | d=32 | state |" in markdown.output
    assert f"| test-softmax | {best:.3f} ({best_lr:g}) |" in markdown.output


def test_resume_keeps_finished_runs(tmp_path):
    """A recall sweep cut short continues from its results file: finished runs are kept."""
    assert CliRunner().invoke(main, recall_args(tmp_path)).exit_code == 0
    path = tmp_path / "recall.yaml"
    data = yaml.safe_load(path.read_text())
    kept = data["runs"][0]
    data["runs"] = [kept]  # as if killed after the first run
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, recall_args(tmp_path, "--resume"))
    assert result.exit_code == 0, result.output
    assert "resuming: 1 finished run(s) kept" in result.output
    runs = yaml.safe_load(path.read_text())["runs"]
    assert len(runs) == 2 and runs[0]["curve"] == kept["curve"] and runs[1]["status"] == "ok"
    assert runs[0]["seconds"] == kept["seconds"]  # not trained again
    no_out = [arg for arg in recall_args(tmp_path) if arg not in ("--out", str(path))]
    bad = CliRunner().invoke(main, no_out + ["--resume"])
    assert bad.exit_code == 2 and "--resume needs --out" in bad.output


def test_recall_cli_from_config_and_bad_input(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "mixers": ["test-softmax"], "d_model": [32], "lrs": [3e-3], "device": "cpu", "workers": 1,
        "train": {"epochs": 1, "num_train": 64, "num_test": 32},
        "settings": [{"task": "compression", "params": {"seq_len": 8}}]}))
    result = CliRunner().invoke(main, ["recall", "--config", str(config), "--out", str(tmp_path / "o.yaml")])
    assert result.exit_code == 0, result.output
    run = yaml.safe_load((tmp_path / "o.yaml").read_text())["runs"][0]
    assert run["task"] == "compression" and run["status"] == "ok" and run["seq_len"] == 8
    bad = CliRunner().invoke(main, recall_args(tmp_path, "--mixers", "no-such-mixer"))
    assert bad.exit_code == 2 and "unknown mixer 'no-such-mixer'" in bad.output
    bad = CliRunner().invoke(main, recall_args(tmp_path, "--seq-len", "15"))
    assert bad.exit_code == 2 and "seq_len must be an even" in bad.output
    config.write_text("mixers: [sdpa]\nbogus: 1\n")
    bad = CliRunner().invoke(main, ["recall", "--config", str(config)])
    assert bad.exit_code == 2 and "unknown keys bogus" in bad.output


def test_tasks_show_and_list():
    runner = CliRunner()
    shown = runner.invoke(main, ["tasks", "show", "mqar", "--seq-len", "64", "--num-kv-pairs", "4"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("→") == 4 + 1 and "4 labelled positions of 64" in shown.output
    listed = runner.invoke(main, ["tasks", "list"])
    assert listed.exit_code == 0 and "mqar" in listed.output and "memorization" in listed.output
    bad = runner.invoke(main, ["tasks", "show", "mqar", "--seq-len", "63"])
    assert bad.exit_code == 2 and "seq_len must be an even" in bad.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the test mixer is available with CUDA")
def test_unavailable_mixer_is_recorded_not_run(tmp_path):
    result = CliRunner().invoke(main, recall_args(tmp_path, "--mixers", "test-needs-cuda", "--lrs", "1e-3"))
    assert result.exit_code == 0, result.output
    run = yaml.safe_load((tmp_path / "recall.yaml").read_text())["runs"][0]
    assert run["status"] == "unavailable" and "CUDA" in run["error"] and run["curve"] == []
    assert "unavailable" in result.output
