"""The accuracy-vs-state protocol: training and test mixes of slices, state bytes per mixer,
sliding-window attention and the shipped frontier configs."""

import pytest
import torch

import tasks
from hla_bench.recall.plan import ConfigError, plan_runs, validate_config
from hla_bench.recall.pool import run_group
from tasks import IGNORE
from hla_bench.recall.train import RunSpec, _GroupTrainer, interleave, steps_per_epoch

MIX_PARAMS = dict(vocab_size=128, seq_len=16, num_kv_pairs=2)
TRAIN_MIX = [{"seq_len": 16, "num_kv_pairs": 2, "count": 40},
             {"seq_len": 32, "num_kv_pairs": 4, "count": 24},
             {"seq_len": 32, "num_kv_pairs": 8, "count": 8}]
SLICE_A = {"seq_len": 16, "num_kv_pairs": 2, "count": 12}
SLICE_B = {"seq_len": 48, "num_kv_pairs": 6, "count": 10}


def mix_spec(**changes) -> dict:
    return RunSpec(**{**dict(task="mqar", mixer="sdpa", d_model=16, lr=1e-2, epochs=2,
                             num_val=8, batch_size=16, eval_every=3, stop_accuracy=1.0,
                             params=MIX_PARAMS, train_mix=TRAIN_MIX,
                             test_mix=[SLICE_A, SLICE_B], positions="none",
                             mixer_options={"short_conv": 4}), **changes}).as_dict()


def test_mix_slices_have_their_own_streams_and_validation_never_overlaps_train_or_test():
    task = tasks.get("mqar")
    splits = task.mix_splits(TRAIN_MIX, [SLICE_A, SLICE_B], 0, 30, 0, seed=3, **MIX_PARAMS)
    assert [x.shape for x, _ in splits.train] == [(40, 16), (24, 32), (8, 32)]
    assert [x.shape[1] for x, _ in splits.test] == [16, 48]
    assert [int((y != IGNORE).sum(1).max()) for _, y in splits.train] == [2, 4, 8]
    assert [p["num_kv_pairs"] for p in splits.test_params] == [2, 6]
    # slice A of test and the first training slice share parameters, not their examples
    train_rows = {tuple(row) for row in splits.train[0][0].tolist()}
    assert not train_rows & {tuple(row) for row in splits.test[0][0].tolist()}
    for (val_x, _), (test_x, _) in zip(splits.val, splits.test):
        assert val_x.shape[1] == test_x.shape[1] and len(val_x) > 0
        rows = {tuple(row) for row in val_x.tolist()}
        assert not rows & {tuple(row) for row in test_x.tolist()}
        assert not rows & train_rows
    again = task.mix_splits(TRAIN_MIX, [SLICE_A, SLICE_B], 0, 30, 0, seed=3, **MIX_PARAMS)
    assert torch.equal(again.test[1][0], splits.test[1][0])
    other = task.mix_splits(TRAIN_MIX, [SLICE_A, SLICE_B], 0, 30, 0, seed=4, **MIX_PARAMS)
    assert not torch.equal(other.test[1][0], splits.test[1][0])


def test_interleave_spreads_each_slices_batches_over_the_epoch():
    order = interleave([4, 2, 1])
    assert sorted(order) == [0, 0, 0, 0, 1, 1, 2]
    assert order[:2] == [0, 1] and order.index(2) == 3  # the lone batch mid-epoch
    assert interleave([3]) == [0, 0, 0]
    assert steps_per_epoch(mix_spec(), 0) == 3 + 2 + 1


def test_a_training_mix_never_mixes_lengths_in_a_batch(monkeypatch):
    batches = []
    losses = _GroupTrainer.losses

    def recording(self, tokens, labels, max_rows):
        labelled = (labels[0] != IGNORE).sum(-1)
        batches.append((tokens.shape[-1], sorted(set(labelled[labelled > 0].tolist()))))
        return losses(self, tokens, labels, max_rows)

    monkeypatch.setattr(_GroupTrainer, "losses", recording)
    results = run_group([mix_spec(), mix_spec(lr=3e-3, seed=1, run_id=1)], lambda event: None)
    assert all(r["status"] == "ok" for r in results), results[0].get("error")
    # 2 epochs of 3 + 2 + 1 batches; each batch of one slice: one length, one pair count
    assert len(batches) == 12 and results[0]["steps"] == 12
    assert all(len(kv) == 1 for _, kv in batches), batches
    per_epoch = sorted((length, kv[0]) for length, kv in batches[:6])
    assert per_epoch == [(16, 2)] * 3 + [(32, 4)] * 2 + [(32, 8)]
    assert batches[:6] == batches[6:]  # the same interleave every epoch


def test_test_slices_are_scored_separately_and_together_over_their_positions():
    """One training, three test mixes: each slice's accuracy in the mix is the accuracy of a
    run tested on that slice alone, and the mix's accuracy counts every position once."""
    from hla_bench.recall.plan import resolve_shapes

    planned = {run_id: shape.state() for run_id, shape in resolve_shapes([mix_spec()]).items()}
    both, = run_group([mix_spec()], lambda event: None, state_bytes=planned)
    alone_a, = run_group([mix_spec(test_mix=[SLICE_A])], lambda event: None)
    alone_b, = run_group([mix_spec(test_mix=[{**SLICE_B}])], lambda event: None)
    assert both["status"] == alone_a["status"] == alone_b["status"] == "ok"
    parts = both["test_slices"]
    assert [(p["slice"], p["seq_len"], p["count"]) for p in parts] == [
        ("seq_len=16 num_kv_pairs=2", 16, 12), ("seq_len=48 num_kv_pairs=6", 48, 10)]
    assert parts[0]["accuracy"] == alone_a["test_accuracy"]
    assert parts[1]["accuracy"] == alone_b["test_accuracy"]
    positions = [12 * 2, 10 * 6]
    mix = sum(p["accuracy"] * n for p, n in zip(parts, positions)) / sum(positions)
    assert both["test_accuracy"] == pytest.approx(mix, abs=1e-4)
    assert both["seq_len"] == 48 and both["resolved"]["num_test"] == 22
    assert len(both["curve"][-1]["slices"]) == 2
    # the KV cache of sdpa grows with the slice's length (the plan counts it); the run
    # records the longest
    assert [p["state_bytes_per_layer"] for p in parts] == [16 * 2 * 16 * 4, 48 * 2 * 16 * 4]
    assert both["state_bytes_per_layer"] == 48 * 2 * 16 * 4
    assert both["state_bytes"] == 2 * both["state_bytes_per_layer"]


def test_a_run_without_a_mix_records_its_one_slice():
    spec = RunSpec(task="mqar", mixer="sdpa", d_model=16, lr=1e-2, epochs=1, num_train=32,
                   num_val=8, num_test=16, batch_size=16, params=MIX_PARAMS).as_dict()
    result, = run_group([spec], lambda event: None)
    part, = result["test_slices"]
    assert part["slice"] == "all" and part["count"] == 16 and part["seq_len"] == 16
    assert part["accuracy"] == result["test_accuracy"]
    assert part["val_accuracy"] == result["val_accuracy"]


MIX_SETTING = {"task": "mqar", "params": {"vocab_size": 256},
               "train_mix": [{"seq_len": 64, "num_kv_pairs": 4, "count": 100},
                             {"seq_len": 128, "num_kv_pairs": 8, "count": 50}],
               "test_mix": [{"seq_len": 64, "num_kv_pairs": 8, "count": 10}]}


def test_a_setting_with_mixes_plans_its_slices_and_a_label_naming_them():
    config = validate_config({"mixers": ["hla2"], "lrs": [1e-3], "settings": [MIX_SETTING]})
    spec, = plan_runs(config, "cpu")
    assert spec["train_mix"] == MIX_SETTING["train_mix"]
    assert spec["test_mix"] == MIX_SETTING["test_mix"]
    assert spec["setting"] == ("mqar vocab_size=256 test_mix=[seq_len=64 num_kv_pairs=8 x10] "
                               "train_mix=[seq_len=64 num_kv_pairs=4 x100, "
                               "seq_len=128 num_kv_pairs=8 x50]")


@pytest.mark.parametrize("setting,message", [
    ({**MIX_SETTING, "train_mix": []}, "train_mix must be a non-empty list"),
    ({**MIX_SETTING, "test_mix": [{"seq_len": 64}]}, r"test_mix\[0\] must be a mapping .* `count`"),
    ({**MIX_SETTING, "test_mix": [{"seq_len": 64, "count": 0}]}, r"test_mix\[0\].count must be"),
    ({**MIX_SETTING, "test_mix": [{"seq_len": 64, "count": 5}, {"seq_len": 64, "count": 9}]},
     "slice 'seq_len=64' is given twice"),
    ({**MIX_SETTING, "test_mix": [{"seq_len": 64, "kv": 4, "count": 5}]},
     r"test_mix\[0\]: task 'mqar' has no parameter 'kv'"),
    ({**MIX_SETTING, "test_mix": [{"seq_len": 64, "num_kv_pairs": 40, "count": 5}]},
     r"test_mix\[0\]: num_kv_pairs \(40\) must be at most"),
    ({**MIX_SETTING, "train": {"num_train": 10}}, "train_mix gives each slice's count; leave "
                                                  "train.num_train out"),
    ({**MIX_SETTING, "train": {"metric": "mad-macro"}}, "metric must be micro"),
])
def test_a_bad_mix_is_a_config_error_naming_it(setting, message):
    with pytest.raises(ConfigError, match=message):
        validate_config({"mixers": ["hla2"], "settings": [setting]})



def test_mixers_take_specs_with_options_each_a_variant_of_its_own():
    from hla_bench.recall.report import summarize

    config = validate_config({
        "mixers": ["sdpa", "sdpa:window=16", "sdpa:window=32:label=swa-32", "based:feature_dim=8"],
        "mixer_options": {"sdpa": {"short_conv": 4}, "swa-32": {"dropout": 0.1}},
        "mixer_model": {"sdpa:window=16": {"n_layers": 3}},
        "lrs": [1e-3], "settings": [{"task": "mqar"}]})
    specs = plan_runs(config, "cpu")
    assert [(s["mixer"], s["variant"], s["mixer_options"], s["n_layers"]) for s in specs] == [
        ("sdpa", "", {"short_conv": 4}, 2),
        ("sdpa", "sdpa:window=16", {"short_conv": 4, "window": 16}, 3),
        ("sdpa", "swa-32", {"short_conv": 4, "dropout": 0.1, "window": 32}, 2),
        ("based", "based:feature_dim=8", {"feature_dim": 8}, 2)]
    runs = [{**spec, "status": "ok", "val_accuracy": 0.5, "test_accuracy": 0.5, "steps": 1}
            for spec in specs]
    assert sorted(summarize(runs)["mqar"]) == ["based:feature_dim=8", "sdpa", "sdpa:window=16",
                                                "swa-32"]
    for mixers, message in ((["sdpa:window=4:label=w4", "sdpa:window=8:label=w4"],
                             "'w4' is given twice"),
                            (["sdpa:window"], "is not key=value"),
                            (["sdpa:windw=4"], "has no option 'windw'")):
        with pytest.raises(ConfigError, match=message):
            validate_config({"mixers": mixers})


def test_the_frontier_and_mad_budget_configs_plan_what_their_headers_state():
    from hla_bench import configs
    from hla_bench.recall.plan import check_layers, load_config, plan_rows

    frontier = load_config(str(configs.find("zoology-frontier")), {})
    specs = plan_runs(frontier, "cuda")
    check_layers(specs)
    # mixer variants x d_model x learning rates, and the 3 Based variants at d_model 48
    assert len(specs) == 25 * 2 * 4 + 3 * 4
    assert {s["mixer"] for s in specs if s["d_model"] == 48} == {"based"}
    spec = specs[0]
    assert [(e["seq_len"], e["num_kv_pairs"], e["count"]) for e in spec["train_mix"]] == [
        (64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000),
        (256, 64, 20_000)]
    assert [(e["seq_len"], e["num_kv_pairs"]) for e in spec["test_mix"]] == [
        (64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256)]
    assert {e["count"] for e in spec["test_mix"]} == {1000}
    assert spec["positions"] == "none" and spec["batch_size"] == 256 and spec["epochs"] == 32
    assert all(s["mixer_options"].get("short_conv", 4) == 4 for s in specs)
    rows = plan_rows(specs, frontier["max_group"])
    # 391 + 4 x 79 batches of 256 an epoch, 32 epochs
    assert {row["steps"] for row in rows} == {32 * (391 + 4 * 79)}
    budget = load_config(str(configs.find("mad-budget")), {})
    rows = plan_rows(plan_runs(budget, "cuda"), budget["max_group"])
    assert sum(row["runs"] for row in rows) == 216
    assert sum(row["model_steps"] for row in rows) == 722_880  # the header's arithmetic
    assert sum(row["groups"] for row in rows) == 132 and budget["compile"]
    assert len({row["setting"] for row in rows}) == 12


def test_frontier_config_dry_run_prints_its_plan(tmp_path):
    from click.testing import CliRunner

    from hla_bench.cli import main

    result = CliRunner().invoke(main, ["recall", "--config", "zoology-frontier", "--mixers",
                                       "sdpa:window=16", "--d-model", "64", "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "recall plan: 4 runs" in result.output and f"{32 * 707:,}" in result.output
    bad = CliRunner().invoke(main, ["recall", "--config", "zoology-frontier", "--num-train",
                                    "10", "--dry-run"])
    assert bad.exit_code == 2 and "leave train.num_train out" in bad.output
