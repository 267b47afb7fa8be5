"""Stacked training equals training each run alone: forward, losses, AdamW steps, repacking,
checkpoints; in float64 on the CPU, for every mixer family that trains stacked."""

import math

import pytest
import torch

from grids import parametrize
import tasks
from hla_bench import registry
from hla_bench.recall.plan import stackable
from hla_bench.recall.pool import build_model
from tasks import IGNORE
from hla_bench.recall.stacked import FlatAdamW, StackedLM, labelled_rows
from hla_bench.recall.train import (TIMING_FIELDS, RunSpec, _GroupTrainer, lr_factors,
                                    task_splits, train_group)

TINY = dict(task="mqar", params=dict(vocab_size=64, seq_len=32, num_kv_pairs=4))
MIXERS = ["sdpa", "linear-attn", "based", "hla2", "ahla2", "hla3", "mamba2-ssd"]


def spec(**changes) -> dict:
    fields = dict(mixer="hla2", d_model=16, lr=3e-3, epochs=2, num_train=96, num_val=32,
                  num_test=32, batch_size=40, eval_every=0, stop_accuracy=1.1, **TINY)
    return RunSpec(**{**fields, **changes}).as_dict()


def build64(run: dict):
    return build_model(run).double()


def group(mixer="hla2", lrs=(1e-3, 3e-3, 1e-2), seeds=(0, 1, 0), **changes):
    return [spec(mixer=mixer, lr=lr, seed=seed, run_id=i, **changes)
            for i, (lr, seed) in enumerate(zip(lrs, seeds))]


def train_alone(run: dict, steps: int):
    """The reference: one TinyLM, torch.optim.AdamW, the run's own batches, step by step."""
    r = RunSpec(**run)
    data = task_splits(r.task, r.seed, r.num_train, r.num_val, r.num_test,
                       tasks.get(r.task).resolve_params(r.params))
    x, y = data.train
    torch.manual_seed(r.seed)
    model = build64(run)
    optimizer = torch.optim.AdamW(model.parameters(), lr=r.lr, weight_decay=r.weight_decay,
                                  foreach=False)
    per_epoch = math.ceil(r.num_train / r.batch_size)
    factors = lr_factors(r.schedule, r.epochs, per_epoch, r.warmup_frac)
    generator = torch.Generator().manual_seed(r.seed)
    losses = []
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(r.num_train, generator=generator) if r.shuffle \
                else torch.arange(r.num_train)
        rows = order[(step % per_epoch) * r.batch_size:][:r.batch_size]
        for group_ in optimizer.param_groups:
            group_["lr"] = r.lr * factors[step]
        loss = model.loss(x[rows], y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def assert_same_params(stacked: StackedLM, slot: int, model):
    for name, value in model.named_parameters():
        torch.testing.assert_close(stacked.params[name][slot], value.detach(), rtol=1e-9,
                                   atol=1e-11, msg=f"{name} differs")


LOSS_CASES = [(state_mixer, mixer) for mixer in MIXERS for state_mixer in ("identity", "mlp")]
# the fast suite: sdpa, hla2 and mamba2-ssd with the identity state mixer, sdpa with the mlp
LOSS_FAST = {("identity", "sdpa"), ("identity", "hla2"), ("identity", "mamba2-ssd"),
             ("mlp", "sdpa")}


@parametrize("state_mixer, mixer", LOSS_CASES, ids=[f"{s}-{m}" for s, m in LOSS_CASES],
             fast=lambda case: case in LOSS_FAST)
def test_stacked_losses_equal_each_model_alone(mixer, state_mixer):
    assert_stacked_equals_alone(group(mixer, state_mixer=state_mixer, init="zoology",
                                      embed_dropout=0.0))


def test_stacked_mamba2_with_head_dim_equals_each_model_alone():
    """Several SSD heads per copy (head_dim 8 of an inner width 32: 4 heads a model)."""
    assert_stacked_equals_alone(group("mamba2-ssd", mixer_options={"layer_head_dim": 8},
                                      init="zoology", embed_dropout=0.0))


def assert_stacked_equals_alone(runs: list[dict]):
    """Losses and gradients of the stacked models equal each model's own, in float64."""
    models = []
    for run in runs:
        torch.manual_seed(run["seed"])
        models.append(build64(run))
    stacked = StackedLM(models)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (3, 4, 32), generator=generator)
    labels = torch.full((3, 4, 32), IGNORE)
    labels[:, :, 9::7] = torch.randint(0, 64, (3, 4, 4), generator=generator)
    labels[1, 0, 30] = 3  # one model with one more labelled position than the others
    losses = stacked.losses(tokens, labels, max_rows=4 * 5)
    for n, model in enumerate(models):
        torch.testing.assert_close(losses[n], model.loss(tokens[n], labels[n]), rtol=1e-10,
                                   atol=1e-12)
    losses.sum().backward()
    for n, model in enumerate(models):
        model.zero_grad()
        model.loss(tokens[n], labels[n]).backward()
        for name, value in model.named_parameters():
            torch.testing.assert_close(stacked.params[name].grad[n], value.grad, rtol=1e-9,
                                       atol=1e-12, msg=f"grad of {name}")


def test_swiglu_and_last_state_readout_stack():
    runs = [spec(mixer="linear-attn", task="compression", params={}, state_mixer="swiglu",
                 seed=s, run_id=s) for s in (0, 1)]
    models = []
    for run in runs:
        torch.manual_seed(run["seed"])
        models.append(build64(run))
    assert models[0].decoder is not None
    stacked = StackedLM(models)
    tokens = torch.randint(0, 16, (2, 3, models[0].max_len))
    labels = torch.randint(0, 16, (2, 3, models[0].max_len))
    losses = stacked.losses(tokens, labels, 3 * models[0].max_len)
    for n, model in enumerate(models):
        torch.testing.assert_close(losses[n], model.loss(tokens[n], labels[n]), rtol=1e-10, atol=0)


@pytest.mark.slow  # fast: test_a_run_leaving_the_stack_does_not_change_the_others
@pytest.mark.parametrize("mixer,schedule,shuffle", [
    ("hla2", "warmup-cosine", True), ("sdpa", "epoch-cosine", False),
    ("mamba2-ssd", "constant", True), ("based", "epoch-cosine", True)])
def test_training_stacked_equals_training_each_alone(mixer, schedule, shuffle):
    runs = group(mixer, schedule=schedule, shuffle=shuffle, epochs=3)
    assert_trains_as_each_alone(runs, 7)  # past an epoch boundary (3 batches: 40, 40, 16 rows)


def assert_trains_as_each_alone(runs: list[dict], steps: int) -> None:
    """`steps` steps of the runs stacked leave each run's parameters and summed loss as
    training it alone does."""
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(steps)
    losses = trainer.loss_sum.clone()
    for n, run in enumerate(runs):
        model, alone = train_alone(run, steps)
        assert_same_params(trainer.model, n, model)
        assert losses[n].item() == pytest.approx(sum(alone), rel=1e-9)


@pytest.mark.slow
def test_a_step_captured_once_trains_as_each_run_alone_across_shuffled_epochs(monkeypatch):
    """A CUDA graph replays the tensors it captured, not the trainer's attributes of the
    moment: the step here is bound to the trainer's tensors once, after its eager warm-up
    steps, as a capture binds their memory, and replayed from them. With a new batch order
    every epoch, training still equals each run alone (the order is rewritten in place)."""
    import types

    import hla_bench.recall.train as train

    def frozen_call(step):
        if step.eager_steps < step.WARM_STEPS:
            step.eager_steps += 1
            return step.run()
        if step.graph is None:   # "capture": the trainer's tensors as they are now
            live = step.trainer
            step.graph = types.SimpleNamespace(**vars(live), losses=live.losses,
                                               autocast=live.autocast)
            step.trainer = step.graph
        step.run()

    monkeypatch.setattr(train._Step, "__call__", frozen_call)
    # 3 batches an epoch: the third step captures, then three new orders
    assert_trains_as_each_alone(group("linear-attn", shuffle=True, epochs=4), 10)


def test_a_run_leaving_the_stack_does_not_change_the_others():
    runs = group("linear-attn")
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(2)
    trainer._keep([0, 2])           # run 1 stops early
    trainer.train_to(5)
    assert trainer.active == [0, 2]
    for slot, index in enumerate(trainer.active):
        model, _ = train_alone(runs[index], 5)
        assert_same_params(trainer.model, slot, model)


@pytest.mark.slow
def test_a_retired_run_keeps_its_slot_frozen_and_the_others_train_as_each_alone():
    """A run that stops keeps its slot: the stack's size stays, its parameters stay those of
    its stop, and the other runs train as each alone."""
    runs = group("linear-attn")
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(2)
    at_stop = trainer.model.flat[1].clone()
    trainer._finish(1, early=True)
    trainer.train_to(5)
    assert trainer.slots == [0, 1, 2] and trainer.active == [0, 2]
    assert trainer.model.count == 3
    assert torch.equal(trainer.model.flat[1], at_stop)
    assert trainer.results[1]["steps"] == 2
    for index in (0, 2):
        model, _ = train_alone(runs[index], 5)
        assert_same_params(trainer.model, index, model)


@pytest.mark.slow
def test_the_stack_compacts_once_at_most_half_of_its_slots_train():
    runs = group("linear-attn", lrs=(1e-3, 2e-3, 3e-3, 4e-3), seeds=(0, 1, 0, 1))
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(1)
    trainer._finish(0, early=True)
    trainer._compact()
    assert trainer.slots == [0, 1, 2, 3] and trainer.model.count == 4  # 3 of 4 still train
    trainer._finish(2, early=True)
    trainer._compact()
    assert trainer.slots == [1, 3] and trainer.model.count == 2 and trainer.retired == set()
    trainer.train_to(4)
    for slot, index in enumerate(trainer.slots):
        model, _ = train_alone(runs[index], 4)
        assert_same_params(trainer.model, slot, model)


def step_each_alone(models, references, grads):
    """One torch.optim step of each model with its row of the flat gradients `grads`."""
    for n, (model, reference) in enumerate(zip(models, references)):
        offset = 0
        for p in model.parameters():
            p.grad = grads[n, offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        reference.step()


def test_flat_adamw_is_torch_adamw_with_a_learning_rate_per_row():
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2).double() for _ in range(2)]

    class Holder(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.blocks, self.inner = [], linear

    stacked = object.__new__(StackedLM)
    stacked.flat = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                                for m in models])
    stacked.grad = torch.zeros_like(stacked.flat)
    optimizer = FlatAdamW(stacked, weight_decay=0.1)
    references = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1, foreach=False)
                  for m, lr in zip(models, (1e-2, 3e-3))]
    for _ in range(4):
        grads = torch.randn_like(stacked.flat)
        stacked.grad.copy_(grads)
        optimizer.step(torch.tensor([1e-2, 3e-3], dtype=torch.float64))
        step_each_alone(models, references, grads)
    for n, model in enumerate(models):
        expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(stacked.flat[n], expected, rtol=1e-12, atol=1e-14)


def test_labelled_rows_per_model_in_order():
    labels = torch.tensor([[IGNORE, 3, IGNORE, 5], [1, IGNORE, IGNORE, IGNORE]])
    rows, counts = labelled_rows(labels, 3)
    assert rows.tolist() == [[1, 3, 0], [0, 0, 0]] and counts.tolist() == [2, 1]


@pytest.mark.slow
def test_train_group_results_are_reproducible_and_seeded(tmp_path):
    runs = group("hla2", lrs=(3e-3, 3e-3), seeds=(0, 1), eval_every=2)
    first = train_group(runs, build64, graphs=False)
    again = train_group(runs, build64, graphs=False)
    assert [r["curve"] for r in first] == [r["curve"] for r in again]
    assert first[0]["curve"] != first[1]["curve"]  # seed 1: other init, data and order
    alone = train_group(runs[1:], build64, graphs=False)
    assert alone[0]["curve"] == first[1]["curve"]  # a run's result does not depend on its group
    for result in first:
        assert result["status"] == "ok" and result["steps"] == 6
        assert [p["step"] for p in result["curve"]] == [2, 4, 6]
        assert 0 <= result["test_accuracy"] <= 1 and 0 <= result["in_context_rate"] <= 1
        assert result["final_train_loss"] == result["curve"][-1]["loss"]


def test_early_stopped_runs_leave_and_are_scored(monkeypatch):
    runs = group("linear-attn", lrs=(1e-3, 1e-2), seeds=(0, 0), stop_accuracy=-1.0)
    results = train_group(runs, build64, graphs=False)
    assert all(r["early_stopped"] and r["steps"] == 3 for r in results)
    assert all(r["test_accuracy"] is not None for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("group_stop", [False, True])
def test_group_stop_ends_a_seeds_other_runs_at_the_evaluation_where_one_stops_early(
        monkeypatch, group_stop):
    """Validation says the lr 1e-2 run of seed 0 passes stop_accuracy at the first
    evaluation. With group_stop the other seed-0 run stops there too (scored, marked
    stopped_by_group) while seed 1 trains on; its curve is a prefix of the uncut run's."""
    runs = group("linear-attn", lrs=(1e-2, 1e-3, 1e-2), seeds=(0, 0, 1), epochs=3,
                 stop_accuracy=0.5, group_stop=group_stop)
    original = _GroupTrainer._scores

    def scores(self, split, context=False):
        accuracy, loss, rate, slices = original(self, split, context)
        if split is self.data.val:
            accuracy = [1.0 if (self.specs[i].seed, self.specs[i].lr) == (0, 1e-2) else 0.0
                        for i in self.slots]
            slices = [accuracy]
        return accuracy, loss, rate, slices

    monkeypatch.setattr(_GroupTrainer, "_scores", scores)
    results = train_group(runs, build64, graphs=False)
    uncut = train_group([{**r, "group_stop": False} for r in runs], build64, graphs=False)
    winner, other, seed1 = results
    assert winner["early_stopped"] and winner["steps"] == 3 and not winner["stopped_by_group"]
    assert not seed1["early_stopped"] and seed1["steps"] == 9
    assert seed1["curve"] == uncut[2]["curve"]
    if group_stop:
        assert other["stopped_by_group"] and not other["early_stopped"]
        assert other["steps"] == 3 and other["test_accuracy"] is not None
        assert other["curve"] == uncut[1]["curve"][:1]
    else:
        assert not other["stopped_by_group"] and other["steps"] == 9
        assert other["curve"] == uncut[1]["curve"]


@pytest.mark.slow
def test_checkpoint_resume_continues_where_the_deadline_stopped(tmp_path):
    from hla_bench.recall.train import Interrupted

    runs = group("hla2", lrs=(1e-3, 3e-3), seeds=(0, 1), eval_every=2)
    straight = train_group(runs, build64, graphs=False)
    checkpoint = tmp_path / "group.pt"
    with pytest.raises(Interrupted):
        train_group(runs, build64, graphs=False, deadline=0.0, checkpoint=checkpoint)
    assert checkpoint.exists()
    resumed = train_group(runs, build64, graphs=False, checkpoint=checkpoint)
    assert [r["curve"] for r in resumed] == [r["curve"] for r in straight]
    assert not checkpoint.exists()


@pytest.mark.slow
def test_a_deadline_between_evaluations_stops_at_the_next_step_and_resumes_exactly(
        tmp_path, monkeypatch):
    """A group cut mid-epoch, between two evaluations, checkpoints there (not at its next
    evaluation) and its resumed curves and parameters equal an uncut run's."""
    import time as real_time

    import hla_bench.recall.train as train
    from hla_bench.recall.train import Interrupted

    runs = group("linear-attn", lrs=(1e-3, 3e-3), seeds=(0, 1), num_train=120, epochs=2,
                 eval_every=0)          # 3 steps an epoch, one evaluation per epoch
    straight = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    straight_results = straight.run(None, None)

    class Clock:                        # the wall clock moves one second per reading
        now = 0.0

        @classmethod
        def time(cls):
            cls.now += 1.0
            return cls.now

        perf_counter = staticmethod(real_time.perf_counter)
        time_ns = staticmethod(real_time.time_ns)

    monkeypatch.setattr(train, "time", Clock)
    checkpoint = tmp_path / "group.pt"
    cut = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    with pytest.raises(Interrupted):
        cut.run(deadline=2.5, checkpoint=checkpoint)  # passes after the second step
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["step"] == 2 and saved["last_eval"] == 0 and saved["curves"] == [[], []]
    monkeypatch.setattr(train, "time", real_time)
    resumed = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    results = resumed.run(None, checkpoint)
    assert [r["curve"] for r in results] == [r["curve"] for r in straight_results]
    torch.testing.assert_close(resumed.model.flat, straight.model.flat, rtol=0, atol=0)
    assert not checkpoint.exists()


@pytest.mark.parametrize("mixer", MIXERS)
def test_every_builtin_layer_trains_stacked(mixer):
    assert stackable(spec(mixer=mixer))


@pytest.mark.slow
def test_a_mixer_without_a_stacked_form_trains_alone():
    from mixers.layer import MixerLayer

    class Plain(torch.nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.inner = MixerLayer(d_model, n_heads, lambda q, k, v: (v, None))

        def forward(self, x):
            return self.inner(x)

    registry.register(registry.Mixer("test-plain-layer", "linear", "no stacked form (test)",
                                     build_op=lambda **o: None,
                                     build_layer=lambda d, h, **o: Plain(d, h)), replace=True)
    run = spec(mixer="test-plain-layer")
    assert not stackable(run)
    result, = train_group([run], build64, graphs=False)
    assert result["status"] == "ok"


# --- weight decay per run, and the MAD-lab model features -------------------------------

def test_flat_adamw_weight_decay_per_row_is_torch_adamw_per_row():
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2).double() for _ in range(3)]
    stacked = object.__new__(StackedLM)
    stacked.flat = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()])
                                for m in models])
    stacked.grad = torch.zeros_like(stacked.flat)
    lrs, decays = (1e-2, 3e-3, 1e-2), (0.0, 0.1, 0.3)
    optimizer = FlatAdamW(stacked, weight_decay=list(decays))
    references = [torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, foreach=False)
                  for m, lr, wd in zip(models, lrs, decays)]
    for step in range(5):
        if step == 2:  # the middle row leaves: the others keep their own decay
            keep = [0, 2]
            stacked.flat = stacked.flat[keep].clone()
            stacked.grad = torch.zeros_like(stacked.flat)
            optimizer = optimizer.select(stacked, keep)
            models, references, lrs = [models[i] for i in keep], [references[i] for i in keep], \
                [lrs[i] for i in keep]
        grads = torch.randn_like(stacked.flat)
        stacked.grad.copy_(grads)
        optimizer.step(torch.tensor(lrs, dtype=torch.float64))
        step_each_alone(models, references, grads)
    assert optimizer.weight_decay.view(-1).tolist() == [0.0, 0.3]
    for n, model in enumerate(models):
        expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(stacked.flat[n], expected, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="one per row"):
        FlatAdamW(stacked, weight_decay=[0.1, 0.2, 0.3])


@pytest.mark.slow
def test_runs_differing_in_weight_decay_train_as_one_group_equal_to_each_alone():
    from hla_bench.recall.plan import plan_groups

    runs = [spec(mixer="hla2", lr=lr, weight_decay=wd, seed=seed, run_id=i, epochs=3)
            for i, (lr, wd, seed) in enumerate([(1e-2, 0.0, 0), (1e-2, 0.5, 0), (3e-3, 0.5, 1)])]
    assert len(plan_groups(runs, 32)) == 1
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(5)
    for n, run in enumerate(runs):
        model, _ = train_alone(run, 5)
        assert_same_params(trainer.model, n, model)
    # the decay matters: the two runs of equal lr and seed moved apart
    assert not torch.allclose(trainer.model.flat[0], trainer.model.flat[1])


MODEL_VARIANTS = {
    "rms": dict(norm="rms"),
    "untied": dict(head="untied"),
    "swiglu-hidden": dict(state_mixer="swiglu", swiglu_hidden=24),
    "mad-lab": dict(norm="rms", head="untied", state_mixer="swiglu", swiglu_hidden=24),
}


def _stacked_and_alone(runs):
    models = []
    for run in runs:
        torch.manual_seed(run["seed"])
        models.append(build64(run))
    return StackedLM(models), models


def _assert_losses_and_grads(stacked, models, tokens, labels, max_rows):
    losses = stacked.losses(tokens, labels, max_rows=max_rows)
    losses.sum().backward()
    for n, model in enumerate(models):
        model.zero_grad()
        loss = model.loss(tokens[n], labels[n])
        torch.testing.assert_close(losses[n], loss, rtol=1e-10, atol=1e-12)
        loss.backward()
        for name, value in model.named_parameters():
            torch.testing.assert_close(stacked.params[name].grad[n], value.grad, rtol=1e-9,
                                       atol=1e-12, msg=f"grad of {name}")


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
@parametrize("mixer", ["sdpa", "hla2", "mamba2-ssd"], fast=[0])
def test_model_features_stack(mixer, variant):
    runs = group(mixer, **MODEL_VARIANTS[variant])
    stacked, models = _stacked_and_alone(runs)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (3, 4, 32), generator=generator)
    labels = torch.full((3, 4, 32), IGNORE)
    labels[:, :, 9::7] = torch.randint(0, 64, (3, 4, 4), generator=generator)
    _assert_losses_and_grads(stacked, models, tokens, labels, 4 * 4)


@parametrize("decoder", ["default", "mad-lab"], fast=[1])
@parametrize("norm", ["layer", "rms"], fast=[1])
def test_last_state_decoders_stack(decoder, norm):
    runs = [spec(mixer="linear-attn", task="compression", params={}, decoder=decoder, norm=norm,
                 head="untied", seed=s, run_id=s) for s in (0, 1)]
    stacked, models = _stacked_and_alone(runs)
    T = models[0].max_len
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 16, (2, 3, T), generator=generator)
    labels = torch.randint(0, 16, (2, 3, T), generator=generator)
    _assert_losses_and_grads(stacked, models, tokens, labels, 3 * T)


@pytest.mark.slow
def test_training_with_the_mad_lab_model_stacked_equals_each_alone():
    runs = group("linear-attn", lrs=(1e-3, 3e-3), seeds=(0, 1), epochs=3, norm="rms",
                 head="untied", state_mixer="swiglu", swiglu_hidden=24, weight_decay=0.1)
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(4)
    for n, run in enumerate(runs):
        model, _ = train_alone(run, 4)
        assert_same_params(trainer.model, n, model)


RECALL = dict(task="in_context_recall", params=dict(vocab_size=16, seq_len=16))


def _unstacked(trainer, slot, run):
    torch.manual_seed(run["seed"])
    model = build64(run)
    model.load_state_dict(trainer.model.unstack(slot), strict=False)
    return model.eval()


@pytest.mark.slow
def test_mad_macro_metric_is_mad_accuracy_per_batch_of_128_averaged_by_examples():
    from tasks.mad import mad_accuracy

    runs = group("linear-attn", lrs=(1e-2, 3e-3), seeds=(0, 1), metric="mad-macro",
                 num_train=64, num_val=32, num_test=200, **RECALL)
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(4)
    macro, *_ = trainer._scores(trainer.data.test)
    vocab = 16
    for slot, run in enumerate(runs):
        model = _unstacked(trainer, slot, run)
        x, y = trainer.data.test[0][trainer.seeds.index(run["seed"])]
        with torch.no_grad():
            predictions = model(x).argmax(-1)
        per_batch = [(mad_accuracy(predictions[s:s + 128], y[s:s + 128], vocab), len(y[s:s + 128]))
                     for s in (0, 128)]
        expected = sum(a * n for a, n in per_batch) / 200
        assert macro[slot] == pytest.approx(expected, rel=1e-12)
        valid = y != IGNORE
        micro = float((predictions == y)[valid].double().mean())
        assert expected != pytest.approx(micro)  # the two metrics differ here
    trainer.specs = [RunSpec(**{**r, "metric": "micro"}) for r in runs]
    micro_scores, *_ = trainer._scores(trainer.data.test)
    for slot, run in enumerate(runs):
        model = _unstacked(trainer, slot, run)
        x, y = trainer.data.test[0][trainer.seeds.index(run["seed"])]
        with torch.no_grad():
            predictions = model(x).argmax(-1)
        assert micro_scores[slot] == pytest.approx(
            float((predictions == y)[y != IGNORE].double().mean()), rel=1e-6)  # float32 counts


@pytest.mark.slow
def test_test_accuracy_at_the_lowest_validation_loss_changes_nothing_else(tmp_path):
    from hla_bench.recall.train import Interrupted

    # few examples, many epochs: validation loss turns up before the end
    fields = dict(lrs=(3e-2, 1e-2), seeds=(0, 1), num_train=32, num_val=64, num_test=64,
                  batch_size=16, epochs=12, **RECALL)
    plain = train_group(group("linear-attn", **fields), build64, graphs=False)
    runs = group("linear-attn", test_at_best_val=True, **fields)
    tracked = train_group(runs, build64, graphs=False)
    recorded = ("best_val_loss", "best_val_loss_step", "test_accuracy_at_best_val_loss",
                "test_at_best_val", *TIMING_FIELDS)
    for a, b in zip(plain, tracked):
        assert a["best_val_loss"] is None and a["test_accuracy_at_best_val_loss"] is None
        assert {k: v for k, v in a.items() if k not in recorded} == \
            {k: v for k, v in b.items() if k not in recorded}
    earlier = 0
    for run, result in zip(runs, tracked):
        losses = [point["val_loss"] for point in result["curve"]]
        step = result["best_val_loss_step"]
        assert result["best_val_loss"] == min(losses)
        assert step == result["curve"][losses.index(min(losses))]["step"]
        earlier += step < result["steps"]
        alone = _GroupTrainer([RunSpec(**run)], build64, graphs=False, progress=None)
        alone.train_to(step)
        (accuracy,), *_ = alone._scores(alone.data.test)
        assert result["test_accuracy_at_best_val_loss"] == round(accuracy, 5)
    assert earlier  # some run's best validation loss came before its last evaluation
    checkpoint = tmp_path / "group.pt"
    with pytest.raises(Interrupted):
        train_group(runs, build64, graphs=False, deadline=0.0, checkpoint=checkpoint)
    resumed = train_group(runs, build64, graphs=False, checkpoint=checkpoint)
    for a, b in zip(resumed, tracked):
        assert a["test_accuracy_at_best_val_loss"] == b["test_accuracy_at_best_val_loss"]
        assert a["best_val_loss_step"] == b["best_val_loss_step"]


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["micro", "mad-macro"])
def test_scores_do_not_depend_on_how_many_examples_one_evaluation_forward_holds(
        monkeypatch, metric):
    """300 test examples in one forward, and in forwards of the training batch (micro) or
    of one metric batch of 128 (mad-macro, 128 + 128 + 44): the same scores, and each
    evaluation reads the device once."""
    import hla_bench.recall.train as train

    runs = group("linear-attn", lrs=(1e-2, 3e-3), seeds=(0, 1), metric=metric, num_test=300)
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    trainer.train_to(4)
    forwards = []
    original = StackedLM.labelled_logits

    def counted(self, tokens, labels, max_rows):
        forwards.append(tokens.shape[1])
        return original(self, tokens, labels, max_rows)

    monkeypatch.setattr(StackedLM, "labelled_logits", counted)
    whole = trainer._scores(trainer.data.test, context=True)
    assert forwards == [300]
    forwards.clear()
    monkeypatch.setattr(train, "EVAL_TOKENS", 1)
    pieces = trainer._scores(trainer.data.test, context=True)
    assert forwards == ([40] * 7 + [20] if metric == "micro" else [128, 128, 44])
    assert all(rate is not None for rate in whole[2])  # MQAR has context values
    for a, b in zip(whole[:3], pieces[:3]):
        assert a == pytest.approx(b, rel=1e-12)
    for a, b in zip(whole[3], pieces[3]):  # each test slice's own accuracies
        assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.slow
def test_the_test_split_is_scored_once_a_run_with_test_at_best_val(monkeypatch, tmp_path):
    """test_at_best_val keeps each run's parameters of lowest validation loss and scores
    them on test when the run stops (at most twice a run in all, not at every new low); a
    group checkpointed after its runs' lows and resumed records the same scores."""
    fields = dict(lrs=(3e-2, 1e-2), seeds=(0, 1), num_train=32, num_val=64, num_test=64,
                  batch_size=16, epochs=12, test_at_best_val=True, **RECALL)
    runs = group("linear-attn", **fields)
    calls = []
    original = _GroupTrainer._scores

    def scores(self, split, context=False):
        calls.append(split is self.data.test)
        return original(self, split, context)

    monkeypatch.setattr(_GroupTrainer, "_scores", scores)
    whole = train_group(runs, build64, graphs=False)
    assert 0 < sum(calls) <= 2 * len(runs)
    lows = [r["best_val_loss_step"] for r in whole if r["best_val_loss_step"] < r["steps"]]
    assert lows  # some run's lowest validation loss came before its last evaluation
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None)
    while trainer.step < max(lows):
        trainer.train_to(trainer.step + trainer.eval_every)
        trainer._evaluate()
    checkpoint = tmp_path / "group.pt"
    trainer._save(checkpoint)
    resumed = train_group(runs, build64, graphs=False, checkpoint=checkpoint)
    for a, b in zip(resumed, whole):
        assert a["test_accuracy_at_best_val_loss"] == b["test_accuracy_at_best_val_loss"]
        assert a["best_val_loss_step"] == b["best_val_loss_step"]


@pytest.fixture
def fresh_compiler(monkeypatch):
    """No compiled code or model template left by earlier tests (a process keeps both, by
    design): tests that count compilations start from none."""
    from hla_bench.recall import train

    torch._dynamo.reset()
    monkeypatch.setattr(train, "_TEMPLATES", {})
    yield
    torch._dynamo.reset()


def _eager_and_compiled(runs):
    return [_GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None,
                          compile=compile) for compile in (False, True)]


@pytest.mark.slow
def test_compiled_training_equals_eager_training():
    """torch.compile'd stacked steps (inductor; the layer's op traced with it) give the
    eager steps' losses and parameters (float64)."""
    runs = group("linear-attn", num_train=80, epochs=3)  # 2 full batches an epoch
    eager, compiled = _eager_and_compiled(runs)
    for trainer in (eager, compiled):
        trainer.train_to(2)
    assert compiled._compiled is not None and compiled._compiled[0] is compiled.model
    torch.testing.assert_close(compiled.loss_sum, eager.loss_sum, rtol=1e-9, atol=0)
    torch.testing.assert_close(compiled.model.flat, eager.model.flat, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_compiled_training_follows_a_run_leaving_the_stack(monkeypatch):
    """After a run leaves, the smaller stack compiles anew and still equals eager training
    (traced by dynamo and AOT autograd, run eagerly: inductor's code is checked above)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    runs = group("hla2", num_train=80, epochs=3)
    eager, compiled = _eager_and_compiled(runs)
    for trainer in (eager, compiled):
        trainer.train_to(2)
        trainer._keep([0, 2])
        trainer.train_to(4)
    assert compiled._compiled is not None and compiled._compiled[0] is compiled.model
    torch.testing.assert_close(compiled.loss_sum, eager.loss_sum, rtol=1e-9, atol=0)
    torch.testing.assert_close(compiled.model.flat, eager.model.flat, rtol=1e-9, atol=1e-12)


@pytest.mark.slow
def test_a_compiled_group_compiles_at_most_three_times(monkeypatch, fresh_compiler):
    """The epoch's short last batch runs at full size (its extra rows ignored), and the loss
    does not read the stack size: a group of 5 runs that shrinks to 4, 3, 2 and 1 compiles
    for its first size, once for every later size above 1 (a symbolic stack size) and once
    for size 1, however many epochs."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    runs = group("linear-attn", lrs=(1e-3, 2e-3, 3e-3, 4e-3, 5e-3), seeds=(0, 1, 0, 1, 0),
                 num_train=100, batch_size=40, epochs=5)  # batches 40, 40, 20
    trainer = _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False, progress=None,
                            compile=True)
    counters.clear()
    trainer.train_to(3)                 # an epoch: its short batch at full size
    for size, end in ((4, 6), (3, 9), (2, 12), (1, 15)):
        trainer._keep(list(range(size)))
        trainer.train_to(end)
    assert counters["frames"]["ok"] == 3, dict(counters["frames"])


@pytest.mark.slow
def test_a_later_group_of_the_same_structure_compiles_nothing(monkeypatch, fresh_compiler):
    """Compiled code stays with the process: a second group of the same model structure and
    stack size (other learning rates, seeds and protocol) runs on the first one's code, and
    still trains as eager training does; another structure compiles anew."""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    counters.clear()

    def trainer(runs, compile=True):
        return _GroupTrainer([RunSpec(**r) for r in runs], build64, graphs=False,
                             progress=None, compile=compile)

    first = trainer(group("linear-attn"))
    first.train_to(2)
    compiled = counters["frames"]["ok"]
    assert compiled >= 1
    later_runs = group("linear-attn", lrs=(2e-3, 5e-3, 4e-3), seeds=(3, 3, 4), epochs=3)
    later, eager = trainer(later_runs), trainer(later_runs, compile=False)
    for each in (later, eager):
        each.train_to(3)
    assert counters["frames"]["ok"] == compiled, dict(counters["frames"])
    assert later.model.template is first.model.template
    torch.testing.assert_close(later.model.flat, eager.model.flat, rtol=1e-9, atol=1e-12)
    other = trainer(group("linear-attn", d_model=24))
    other.train_to(1)
    assert counters["frames"]["ok"] > compiled


@pytest.mark.slow
@pytest.mark.parametrize("n_layers", [3])
def test_an_op_outside_the_trace_leaves_the_rest_of_the_model_compiled(monkeypatch, n_layers,
                                                                        fresh_compiler):
    """A mixer op that torch.compile cannot trace (a Triton launcher: here hla2's PyTorch forms
    run through mixers.dispatch.opaque, as its kernels do on CUDA) breaks the graph at each
    block. The blocks are not a Python loop, so dynamo compiles around the break instead of
    running the whole forward eagerly, within the recompile limit as the stack shrinks, and
    the steps still equal eager training."""
    import functools
    import importlib

    from torch._dynamo.utils import counters

    from mixers.dispatch import opaque

    hla2_module = importlib.import_module("mixers.hla.hla2")
    monkeypatch.setattr(hla2_module, "_FORMS", {
        impl: functools.partial(opaque, form) for impl, form in hla2_module._FORMS.items()})
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    runs = group("hla2", num_train=80, epochs=3, n_layers=n_layers)
    eager, compiled = _eager_and_compiled(runs)
    counters.clear()
    for trainer in (eager, compiled):
        trainer.train_to(1)
        trainer._keep([0, 2])
        trainer.train_to(2)
        trainer._keep([1])
        trainer.train_to(3)
    assert counters["graph_break"], "the op did not break the graph"
    assert not counters["unimplemented"], dict(counters["unimplemented"])
    assert counters["frames"]["ok"] == counters["frames"]["total"], dict(counters["frames"])
    torch.testing.assert_close(compiled.loss_sum, eager.loss_sum, rtol=1e-9, atol=0)
    torch.testing.assert_close(compiled.model.flat, eager.model.flat, rtol=1e-9, atol=1e-12)


@parametrize("mixer,options", [(mixer, {}) for mixer in MIXERS]
             + [(mixer, {"impl": "parallel"})
                for mixer in ("hla2", "ahla2", "hla3", "linear-attn", "based")], fast=[3])
def test_stacked_layers_trace_their_pytorch_ops_into_one_graph(mixer, options):
    """On the CPU every built-in op runs a PyTorch form, and torch.compile traces the whole
    stacked loss, op included, without a graph break (so the op's elementwise work fuses
    with the layer's)."""
    runs = group(mixer, lrs=(1e-3, 3e-3), seeds=(0, 1), mixer_options=options)
    models = []
    for run in runs:
        torch.manual_seed(run["seed"])
        models.append(build_model(run))
    stacked = StackedLM(models)
    tokens = torch.randint(0, 64, (2, 4, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(tokens, IGNORE)
    labels[..., -4:] = tokens[..., -4:]
    explained = torch._dynamo.explain(stacked.losses)(tokens, labels, 16)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [str(reason.reason)[:200] for reason in explained.break_reasons]


def test_an_op_not_marked_traceable_stays_out_of_the_trace():
    from mixers.layer import MixerLayer
    from mixers.linear_attn import linear_attn

    def stacked_loss(layer):
        params = {name: p.detach().unsqueeze(0).expand(2, *p.shape).clone()
                  for name, p in layer.named_parameters()}
        return lambda x: layer.forward_stacked(params, x).sum()

    x = torch.randn(2, 3, 16, 8)
    for traceable in (True, False):
        layer = MixerLayer(8, 1, linear_attn, traceable_op=traceable)
        breaks = torch._dynamo.explain(stacked_loss(layer))(x).graph_break_count
        assert (breaks == 0) == traceable
