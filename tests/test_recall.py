"""Tiny LM, the recall protocol (validation split, scoring, in-context rate), result YAML,
resume and the `recall` / `tasks` commands."""

import importlib.metadata
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from click.testing import CliRunner
from rich.console import Console

import tasks
from hla_bench import configs, registry
from hla_bench.cli import main
from hla_bench.recall.plan import ConfigError, load_config, plan_runs, validate_config
from hla_bench.recall.report import render_recall, summarize
from hla_bench.results.load import RecallFileError, validate_recall
from hla_bench.results.store import dump_results
from hla_bench.recall.plan import default_workers
from hla_bench.recall.plan import state_bytes, step_flops
from hla_bench.recall.pool import build_model, run_groups
from mixers.layer import MixerLayer
from tasks import IGNORE
from hla_bench.recall.model import TinyLM, labelled_rows
from hla_bench.recall.train import RunSpec, in_context_hits, lr_factors, train_group, warmup_cosine


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
                             num_val=32, num_test=64, eval_every=2, stop_accuracy=1.1, **TINY),
                      **changes}).as_dict()


def softmax_model(vocab=32, d=32, **options):
    return TinyLM(vocab, d, lambda: MixerLayer(d, 1, softmax_op(), qk_norm="none"),
                  positions=True, **options)


def test_labelled_logits_give_the_full_logits_loss_and_gradient():
    torch.manual_seed(0)
    model = softmax_model()
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
    assert build_model(tiny_spec()).positions is not None
    assert build_model(tiny_spec(mixer="hla2")).positions is None
    model = TinyLM(16, 32, lambda: MixerLayer(32, 1, softmax_op(), qk_norm="none"),
                   readout="last", max_len=8)
    inputs = torch.randint(0, 16, (2, 8))
    changed = inputs.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 16
    assert model(inputs).shape == (2, 8, 16)
    assert not torch.allclose(model(inputs)[:, 0], model(changed)[:, 0])  # first logit sees the end
    with pytest.raises(ValueError, match="readout"):
        softmax_model(readout="mean")
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_zoology_block_adds_the_normalised_residual():
    """Zoology's identity state mixer: each block adds norm2(x) after the mixer."""
    torch.manual_seed(0)
    model = softmax_model(state_mixer="identity", n_layers=1)
    block = model.blocks[0]
    x = torch.randn(2, 8, 32)
    after_mixer = x + block.mixer(block.mixer_norm(x))
    torch.testing.assert_close(block(x), after_mixer + block.state_mixer(after_mixer))
    assert isinstance(block.state_mixer, torch.nn.LayerNorm)
    assert softmax_model(state_mixer="none").blocks[0].state_mixer is None


def test_zoology_init_scales_the_output_projections():
    torch.manual_seed(0)
    model = TinyLM(64, 256, lambda: MixerLayer(256, 1, softmax_op()), n_layers=2, init="zoology")
    std = model.blocks[0].mixer.out.weight.std().item()
    assert std == pytest.approx(0.02 / 2, rel=0.05)
    assert model.blocks[0].mixer.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_mad_lab_backbone_rms_norms_untied_head_and_swiglu_width():
    from hla_bench.recall.model import mad_swiglu_hidden

    torch.manual_seed(0)
    model = TinyLM(32, 128, lambda: MixerLayer(128, 1, softmax_op(), qk_norm="none"),
                   state_mixer="swiglu", norm="rms", head="untied", readout="last",
                   swiglu_hidden=mad_swiglu_hidden(128), max_len=8)
    assert mad_swiglu_hidden(128) == 352  # MAD-lab's width at d 128 (mad/model/layers/mlp.py)
    assert [mad_swiglu_hidden(d) for d in (64, 256)] == [176, 688]
    mixer_modules = {id(m) for block in model.blocks for m in block.mixer.modules()}
    norms = [m for m in model.modules() if id(m) not in mixer_modules
             and isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    # before each mixer, in each state mixer, final, and twice in the decoder: all RMSNorm
    assert len(norms) == 2 * 2 + 1 + 2
    assert all(isinstance(m, torch.nn.RMSNorm) and m.eps == 1e-5 for m in norms)
    assert model.blocks[0].state_mixer[1].w1.out_features == 352
    assert isinstance(model.head, torch.nn.Linear) and model.head.bias is not None
    assert model.head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert not model.head.bias.any()
    x = torch.randn(2, 8, 128)
    torch.testing.assert_close(model.norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
                               * model.norm.weight)
    inputs = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(model(inputs), model.hidden(inputs) @ model.head.weight.T
                               + model.head.bias)
    tied = softmax_model()
    assert tied.head is None
    torch.testing.assert_close(tied(inputs), tied.hidden(inputs) @ tied.embed.weight.T)
    with pytest.raises(ValueError, match="norm must be one of"):
        softmax_model(norm="batch")
    with pytest.raises(ValueError, match="swiglu_hidden must be"):
        softmax_model(swiglu_hidden=0)


def test_mad_lab_decoder_reads_the_raw_last_state_and_norms_before_the_head():
    from hla_bench.recall.model import fairseq_positions

    codes = fairseq_positions(5, 8)  # sines of the 4 frequencies 10000^(-i/3), then cosines
    freq = torch.tensor([10_000.0 ** (-i / 3) for i in range(4)])
    angles = torch.arange(5.0)[:, None] * freq
    torch.testing.assert_close(codes, torch.cat([angles.sin(), angles.cos()], 1))
    torch.manual_seed(0)
    make = lambda decoder: TinyLM(16, 32, lambda: MixerLayer(32, 1, softmax_op(), qk_norm="none"),  # noqa: E731
                                  readout="last", max_len=8, norm="rms", decoder=decoder)
    mad, default = make("mad-lab"), make("default")
    inputs = torch.randint(0, 16, (2, 8))
    x = mad.embed(inputs)
    for block in mad.blocks:
        x = block(x)
    code = x[:, -1:]  # the residual stream, no norm
    expected = mad.norm(mad.decoder.mlp(code + fairseq_positions(8, 32)))
    torch.testing.assert_close(mad.hidden(inputs), expected)
    y = default.embed(inputs)
    for block in default.blocks:
        y = block(y)
    torch.testing.assert_close(default.hidden(inputs),
                               default.decoder.mlp(default.norm(y)[:, -1:] + default.decoder.positions))


def test_schedules():
    assert warmup_cosine(0, 100, 10) == pytest.approx(0.1)
    assert warmup_cosine(9, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(55, 100, 10) == pytest.approx(0.5)
    epoch = lr_factors("epoch-cosine", 4, 3, 0.0)
    assert epoch[:3] == [1.0, 1.0, 1.0] and epoch[3] == pytest.approx(0.5 * (1 + 2 ** -0.5))
    assert epoch[6] == pytest.approx(0.5) and len(epoch) == 12  # Zoology: per epoch, T_max = epochs
    assert lr_factors("constant", 2, 3, 0.1) == [1.0] * 6
    with pytest.raises(ValueError, match="schedule"):
        lr_factors("linear", 2, 3, 0.1)


def test_validation_split_never_overlaps_train_or_test():
    task = tasks.get("mqar")
    # a tiny vocabulary makes repeated examples likely, so the filter has work to do
    splits = task.splits(600, 400, 400, 0, vocab_size=12, seq_len=8, num_kv_pairs=2)
    rows = lambda pair: {tuple(torch.cat(pair, 1)[i].tolist()) for i in range(len(pair[0]))}  # noqa: E731
    train, val, test = rows(splits.train), rows(splits.val), rows(splits.test)
    assert val and not (val & test) and not (val & train)
    raw = task.make("train", 1000, 0, vocab_size=12, seq_len=8, num_kv_pairs=2)
    assert len(splits.val[0]) < 400  # duplicates were dropped from validation...
    assert torch.equal(splits.train[0], raw[0][:600])  # ...and training is the stream's start
    assert (splits.val[0] == raw[0][600:][:len(splits.val[0])]).all(1).any()


def test_in_context_hits_on_a_constructed_example():
    # 1 model, 2 examples of 4 tokens; context values (5, 6) and (7, 8)
    values = torch.tensor([[[5, 6], [7, 8]]])
    rows = torch.tensor([[1, 3, 5, 6]])          # answers at (b0,t1) (b0,t3) (b1,t1) (b1,t2)
    predictions = torch.tensor([[6, 9, 5, 8]])   # value of its context, not a value, a value of
    valid = torch.tensor([[True, True, True, False]])  # the other example's context, unscored
    assert in_context_hits(predictions, valid, rows, values, 4).tolist() == [1]
    context = tasks.get("mqar").context_values(torch.tensor([[1, 9, 2, 10, 0, 1]]).numpy(),
                                               num_kv_pairs=2)
    assert context.tolist() == [[9, 10]]


@pytest.mark.slow
def test_softmax_learns_tiny_mqar():
    torch.set_num_threads(2)
    result, = train_group([RunSpec(mixer="test-softmax", d_model=64, lr=3e-3, epochs=2,
                                   num_train=20_000, num_val=200, num_test=200, eval_every=50,
                                   **TINY).as_dict()], build_model)
    assert result["status"] == "ok" and result["test_accuracy"] > 0.9, result["curve"]
    assert result["curve"][0]["accuracy"] < 0.8  # it learned, it did not start there
    assert result["early_stopped"] == (result["steps"] < 626)
    assert result["steps_to_0.5"] <= result["steps_to_0.9"] <= result["steps"]
    assert result["in_context_rate"] >= result["test_accuracy"]


def test_state_bytes_without_decoder_is_none():
    assert state_bytes("test-broken", {}, 32, 1, 2, 16) is None
    assert state_bytes("test-softmax", {}, 32, 1, 2, 8) == 2 * (2 * 8 * 32 * 4)


@pytest.mark.slow
def test_failing_group_is_recorded_and_the_sweep_goes_on():
    groups = [[tiny_spec(mixer="test-broken", run_id=0)], [tiny_spec(run_id=1)]]
    finished, events = [], []
    complete = run_groups(groups, 1, lambda ids, event: events.append((ids, event["event"])),
                          finished.extend)
    assert complete
    assert finished[0]["status"] == "error" and "always fails" in finished[0]["error"]
    assert finished[1]["status"] == "ok"
    assert ([1], "start") in events
    cells = summarize(finished)[finished[0]["setting"]]
    assert cells["test-broken"][32]["score"] is None and cells["test-softmax"][32]["score"] is not None


@pytest.mark.slow
def test_parallel_workers_report_failures():
    groups = [[tiny_spec(mixer="not-in-worker", run_id=i)] for i in range(2)]
    finished = []
    run_groups(groups, 2, lambda ids, event: None, finished.extend)
    assert [r["status"] for r in finished] == ["error", "error"]
    assert all("UnknownMixerError" in r["error"] for r in finished)
    assert default_workers("cpu") >= 1


@pytest.mark.slow
@pytest.mark.parametrize("order", [["small", "big", "small", "big", "small"],
                                   ["big", "small", "small", "big", "small"]])
def test_out_of_memory_beside_other_groups_waits_for_them_instead_of_failing(
        monkeypatch, tmp_path, order):
    """A group that runs out of memory while others run is queued again and the pool starts
    fewer groups at once, down to one: every group finishes, the big ones alone. This holds
    for a group that started first, with the others started beside it afterwards."""
    import pool_workers
    from hla_bench.recall import pool

    monkeypatch.setattr(pool, "_worker", pool_workers.memory_bound)
    groups = [[{**tiny_spec(mixer=mixer, run_id=i), "marks": str(tmp_path)}]
              for i, mixer in enumerate(order)]
    finished, retries = [], []
    complete = run_groups(groups, 3, lambda ids, event: retries.append(event["at_once"])
                          if event["event"] == "retry" else None, finished.extend)
    assert complete and sorted(r["run_id"] for r in finished) == [0, 1, 2, 3, 4]
    # a big group is ok only when no other group ran beside it (pool_workers.memory_bound);
    # whether the pool had marked it shared depends on how fast the others finished, so a
    # slow machine may find a big group alone that the pool started beside others
    assert [r["status"] for r in finished] == ["ok"] * 5
    assert retries and retries[-1] == 1


@pytest.mark.slow
def test_groups_after_one_that_needed_the_gpu_alone_run_side_by_side_again(monkeypatch,
                                                                          tmp_path):
    """The fewer-at-once limit lasts while the group that ran out of memory is unfinished:
    once the big group has run alone, the small groups queued behind it run three at once
    again (they see each other), and the sweep says so with an "at_once" event. How many
    small groups finish beside the big one before it runs alone depends on how fast the
    spawned workers start (a slow machine starts some late, and others take their slots), so
    the queue holds enough of them that some are left for after it."""
    import pool_workers
    from hla_bench.recall import pool

    monkeypatch.setattr(pool, "_worker", pool_workers.memory_bound)
    order = ["big"] + ["small"] * 11
    groups = [[{**tiny_spec(mixer=mixer, run_id=i), "marks": str(tmp_path)}]
              for i, mixer in enumerate(order)]
    finished, events = [], []
    complete = run_groups(groups, 3, lambda ids, event: events.append((ids, event)),
                          finished.extend)
    assert complete and [r["status"] for r in finished] == ["ok"] * len(order)
    big = next(i for i, r in enumerate(finished) if r["mixer"] == "big")
    assert not finished[big]["shared"]
    after = finished[big + 1:]
    assert len(after) >= 2 and all(r["shared"] for r in after), finished
    limits = [event for _, event in events if event["event"] in ("retry", "at_once")]
    assert limits[-1] == {"event": "at_once", "at_once": 3}
    assert limits[-2] == {"event": "retry", "at_once": 1}


@pytest.mark.slow
def test_out_of_memory_alone_splits_the_group_and_records_oom(monkeypatch):
    """run_group: out of memory with other groups running returns RETRY_WITH_FEWER and
    trains nothing more; alone, the group splits in halves down to single runs, which are
    recorded as oom (cuBLAS's failed allocation counts as out of memory)."""
    from hla_bench.recall import pool

    calls = []

    def no_memory(group, *args, **kwargs):
        calls.append(len(group))
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(pool, "train_group", no_memory)
    group = [tiny_spec(run_id=i, lr=lr) for i, lr in enumerate((1e-3, 3e-3, 1e-2))]
    assert pool.run_group(group, lambda event: None, shared=True) == pool.RETRY_WITH_FEWER
    assert calls == [3]
    calls.clear()
    results = pool.run_group(group, lambda event: None)
    assert calls == [3, 1, 2, 1, 1]
    assert [r["status"] for r in results] == ["oom"] * 3
    assert [r["run_id"] for r in results] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_a_group_out_of_memory_frees_its_model_before_anything_else_runs(monkeypatch, shared):
    """A group's trainer and its step refer to each other, so only the cycle collector frees
    its model (on a GPU, with its optimizer state and graph pools, tens of GiB that other
    groups wait for). run_group frees it before it returns RETRY_WITH_FEWER, and before the
    halves of a group out of memory alone start (the cycle collector is off here)."""
    import gc
    import weakref

    from hla_bench.recall import pool
    from hla_bench.recall import train as train_module

    models, seen_alive = [], []
    init, step = train_module._GroupTrainer.__init__, train_module._Step.run

    def tracked_init(self, *args, **kwargs):
        seen_alive.append([model() is not None for model in models])
        init(self, *args, **kwargs)
        models.append(weakref.ref(self.model))

    def step_until_memory_runs_out(self):
        if len(self.trainer.specs) > 1 and self.trainer.step == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 196.00 MiB")
        step(self)

    monkeypatch.setattr(train_module._GroupTrainer, "__init__", tracked_init)
    monkeypatch.setattr(train_module._Step, "run", step_until_memory_runs_out)
    group = [tiny_spec(run_id=i, lr=lr) for i, lr in enumerate((1e-3, 3e-3))]
    gc.disable()
    try:
        results = pool.run_group(group, lambda event: None, shared=shared)
        alive_after = [model() is not None for model in models]
    finally:
        gc.enable()
    if shared:
        assert results == pool.RETRY_WITH_FEWER and len(models) == 1
    else:
        assert [r["status"] for r in results] == ["ok", "ok"] and len(models) == 3
    assert seen_alive == [[], [False], [False, False]][:len(models)]
    assert alive_after == [False] * len(models)


def test_a_shape_the_mixer_refuses_is_recorded_unsupported_and_kept_on_resume(monkeypatch):
    """run_group: NotImplementedError (a mixer refusing a shape, as fla's delta rule a key
    head dim over 256) is recorded as unsupported with the mixer's words; a resume keeps
    such runs and ok ones, and trains again those that failed otherwise."""
    from hla_bench.recall import pool
    from hla_bench.recall.plan import kept_keys
    from hla_bench.recall.plan import run_key

    def refuse(group, *args, **kwargs):
        raise NotImplementedError("fla.ops.delta_rule's chunk kernels take key head dims "
                                  "up to 256, not 512")

    monkeypatch.setattr(pool, "train_group", refuse)
    group = [tiny_spec(run_id=i, lr=lr) for i, lr in enumerate((1e-3, 1e-2))]
    results = pool.run_group(group, lambda event: None, shared=True)
    assert [r["status"] for r in results] == ["unsupported"] * 2
    assert results[0]["error"].endswith("up to 256, not 512")
    records = [{**tiny_spec(lr=lr), "status": status}
               for lr, status in zip((1e-4, 1e-3, 1e-2, 3e-2), ("ok", "unsupported", "error", "oom"))]
    assert kept_keys(records) == {run_key(records[0]), run_key(records[1])}


@pytest.mark.slow
def test_a_cuda_fault_reruns_its_group_alone_and_retires_the_worker_that_faulted(monkeypatch):
    """A group whose kernels fault beside others is queued again and runs alone; its fault,
    once alone, is recorded on its runs, and no group starts afterwards in the process that
    faulted (its CUDA context is broken). Every other group finishes."""
    import pool_workers
    from hla_bench.recall import pool

    monkeypatch.setattr(pool, "_worker", pool_workers.cuda_fault)
    groups = [[tiny_spec(mixer=mixer, run_id=i)]
              for i, mixer in enumerate(["good", "bad", "good", "good", "good"])]
    finished, retries = [], []
    complete = run_groups(groups, 3, lambda ids, event: retries.append((ids, event))
                          if event["event"] == "retry" else None, finished.extend)
    assert complete and sorted(r["run_id"] for r in finished) == [0, 1, 2, 3, 4]
    assert retries == [([1], {"event": "retry", "at_once": 1, "alone": True})]
    (fault,) = [r for r in finished if r["mixer"] == "bad"]
    assert fault["status"] == "error" and "device-side assert" in fault["error"]
    assert fault["isolated"]
    assert all(r["status"] == "ok" for r in finished if r["mixer"] == "good")
    later = [r for r in finished if r["started"] > fault["started"]]
    assert later and all(r["pid"] != fault["pid"] for r in later)


def test_run_group_tells_a_cuda_fault_beside_others_from_its_own(monkeypatch):
    """run_group: a CUDA error other than out of memory returns RETRY_ALONE when other groups
    may have run beside it, else the failed runs as a CudaFault; releasing memory after it,
    which fails too on a broken context, does not hide the result."""
    from hla_bench.recall import pool

    def fault(group, *args, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered")

    def broken_context():
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(pool, "train_group", fault)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", broken_context)
    group = [tiny_spec(run_id=i, lr=lr) for i, lr in enumerate((1e-3, 3e-3))]
    assert pool.run_group(group, lambda event: None, isolated=False) == pool.RETRY_ALONE
    results = pool.run_group(group, lambda event: None)
    assert isinstance(results, pool.CudaFault)
    assert [r["status"] for r in results] == ["error"] * 2
    assert all("device-side assert" in r["error"] for r in results)
    assert not pool.is_cuda_fault(RuntimeError("CUDA out of memory. Tried to allocate"))


def test_a_cuda_fault_in_the_sweeps_own_process_ends_the_sweep(monkeypatch):
    """With one worker (this process) a CUDA fault is recorded and the sweep stops there,
    incomplete: the process cannot use the GPU again; --resume goes on in a fresh one."""
    from hla_bench.recall import pool

    def fault(group, progress, **options):
        if group[0]["mixer"] == "bad":
            return pool.CudaFault([pool.failed_result(group[0], "error", "CUDA error")])
        return [{**group[0], "status": "ok"}]

    monkeypatch.setattr(pool, "run_group", fault)
    groups = [[tiny_spec(mixer=mixer, run_id=i)] for i, mixer in enumerate(["good", "bad", "good"])]
    finished = []
    assert not run_groups(groups, 1, lambda ids, event: None, finished.extend)
    assert [(r["run_id"], r["status"]) for r in finished] == [(0, "ok"), (1, "error")]


def test_a_worker_that_does_not_stop_at_the_deadline_is_killed_after_the_grace(monkeypatch):
    """A group still busy past deadline + STOP_GRACE_S (here: generating 3 million
    sequences, which looks at no clock) loses its process; the sweep reports itself
    incomplete, records no failure, and returns within seconds, not when the group would
    have reached its first step."""
    from hla_bench.recall import pool

    monkeypatch.setattr(pool, "STOP_GRACE_S", 1.0)
    groups = [[tiny_spec(mixer="linear-attn", run_id=i, num_train=3_000_000)] for i in range(2)]
    finished = []
    started = time.time()
    complete = run_groups(groups, 2, lambda ids, event: None, finished.extend,
                          deadline=started + 1.0)
    assert not complete and finished == []
    assert time.time() - started < 6.0


def run(setting="s", mixer="m", d_model=64, seed=0, **fields):
    return {"setting": setting, "mixer": mixer, "d_model": d_model, "seed": seed,
            "status": "ok", "steps": 10, **fields}


def test_summary_picks_the_lr_on_validation_and_reports_the_test_pick_beside_it():
    runs = [run(lr=1e-3, val_accuracy=0.9, test_accuracy=0.80),
            run(lr=3e-3, val_accuracy=0.8, test_accuracy=0.95),   # best on test
            run(lr=1e-3, seed=1, val_accuracy=0.5, test_accuracy=0.60),
            run(lr=3e-3, seed=1, val_accuracy=0.7, test_accuracy=0.70),
            run(lr=1e-2, status="error", val_accuracy=None, test_accuracy=None)]
    cell = summarize(runs)["s"]["m"][64]
    assert cell["lrs"] == [1e-3, 3e-3] and cell["seeds"] == [0, 1]
    assert cell["score"]["mean"] == pytest.approx(0.75) and cell["score"]["n"] == 2
    assert cell["score"]["std"] == pytest.approx(0.0707107, rel=1e-5)
    assert cell["test_picked"]["mean"] == pytest.approx((0.95 + 0.70) / 2)
    failed = summarize([run(status="oom", error="CUDA out of memory")])["s"]["m"][64]
    assert failed["score"] is None and failed["status"] == "oom"


def test_summary_picks_over_lr_and_weight_decay_and_offers_mad_labs_test_pick():
    runs = [run(lr=1e-3, weight_decay=0.0, val_accuracy=0.7, test_accuracy=0.70,
                test_accuracy_at_best_val_loss=0.72, metric="mad-macro"),
            run(lr=1e-3, weight_decay=0.1, val_accuracy=0.9, test_accuracy=0.85,  # val's pick
                test_accuracy_at_best_val_loss=0.80, metric="mad-macro"),
            run(lr=3e-3, weight_decay=0.0, val_accuracy=0.8, test_accuracy=0.95,  # Zoology's
                test_accuracy_at_best_val_loss=0.60, metric="mad-macro"),
            run(lr=3e-3, weight_decay=0.1, val_accuracy=0.6, test_accuracy=0.50,  # MAD-lab's
                test_accuracy_at_best_val_loss=0.90, metric="mad-macro")]
    cell = summarize(runs)["s"]["m"][64]
    assert cell["lrs"] == [1e-3] and cell["weight_decays"] == [0.1]
    assert cell["score"]["mean"] == 0.85 and cell["test_picked"]["mean"] == 0.95
    assert cell["test_picked_mad"]["mean"] == 0.90
    assert cell["grid_weight_decays"] == [0.0, 0.1] and cell["metric"] == "mad-macro"
    tie = summarize([run(lr=1e-3, weight_decay=0.1, val_accuracy=0.5, test_accuracy=0.1),
                     run(lr=1e-3, weight_decay=0.0, val_accuracy=0.5, test_accuracy=0.2)])
    assert tie["s"]["m"][64]["weight_decays"] == [0.0]  # ties: the smaller weight decay
    console = Console(record=True, width=250)
    render_recall({"kind": "recall", "config": {}, "environment": {}, "runs": runs}, console)
    text = console.export_text()
    assert " wd " in text and "0.900" in text and "as MAD-lab" in text
    assert "MAD-lab's macro accuracy per batch of 128" in text
    # without a record at the lowest validation loss: Zoology's pick, no wd column without a grid
    plain = [dict(r, lr=lr, weight_decay=0.1, test_accuracy_at_best_val_loss=None,
                  metric="micro") for r, lr in zip(runs[:2], (1e-3, 3e-3))]
    assert summarize(plain)["s"]["m"][64]["test_picked_mad"] is None
    console = Console(record=True, width=250)
    render_recall({"kind": "recall", "config": {}, "environment": {}, "runs": plain}, console)
    text = console.export_text()
    assert "as Zoology" in text and " wd " not in text and "MAD scores" not in text


def test_failed_runs_are_listed_once_per_cell_and_reason_with_their_learning_rates():
    """Runs that failed alike (status, mixer, width, seed, setting, message) share a line
    naming their learning rates; an out-of-memory message keeps its first two sentences."""
    from hla_bench.recall.report import failure_lines

    oom = ("CUDA out of memory. Tried to allocate 196.00 MiB. GPU 0 has a total capacity of "
           "79.18 GiB of which 34.31 MiB is free.")
    runs = [run(lr=1e-4, status="oom", error=oom), run(lr=1e-2, status="oom", error=oom),
            run(lr=1e-3, val_accuracy=0.9, test_accuracy=0.8),
            run(lr=1e-3, status="error", error="AssertionError: head dim"),
            run(lr=1e-3, d_model=128, status="oom", error=oom)]
    assert failure_lines(runs) == [
        "oom: m d=64 lr=0.0001,0.01 seed=0 [s]: CUDA out of memory. Tried to allocate 196.00 MiB.",
        "error: m d=64 lr=0.001 seed=0 [s]: AssertionError: head dim",
        "oom: m d=128 lr=0.001 seed=0 [s]: CUDA out of memory. Tried to allocate 196.00 MiB."]


@pytest.mark.slow
@pytest.mark.parametrize("mixer, d_model, seq_len, recorded", [
    ("hla2", 8, 16, {"impl": "parallel", "fallback": "not triton: no CUDA device"}),
    ("hla2", 8, 18, {"impl": "chunk", "fallback": "not triton: no CUDA device"}),
    ("mamba2-ssd", 16, 8, {"impl": "chunk",
                           "fallback": "not mamba_ssm's Triton kernel: no CUDA device"}),
    ("test-softmax", 8, 8, {})])
def test_each_run_records_what_its_mixers_dispatch_ran(mixer, d_model, seq_len, recorded):
    """`mixer_path`: the notes of the mixer's dispatch (impl="auto" without CUDA takes the
    parallel form up to T = 2 D, the chunk form beyond) and the versions of the packages
    that ran; the report lists them per mixer with the widths they cover."""
    from hla_bench.recall.report import path_lines
    from hla_bench.recall.pool import run_group

    params = dict(TINY["params"], seq_len=seq_len, vocab_size=32)
    results = run_group([tiny_spec(mixer=mixer, d_model=d_model, params=params, run_id=i, lr=lr)
                         for i, lr in enumerate((1e-3, 3e-3))], lambda event: None)
    assert [r["status"] for r in results] == ["ok", "ok"]
    torch_version = importlib.metadata.version("torch")
    assert results[0]["mixer_path"] == {**recorded, "packages": {"torch": torch_version}}
    assert results[1]["mixer_path"] == results[0]["mixer_path"]
    facts = ", ".join(f"{key}={value}" for key, value in recorded.items())
    wider = dict(results[0], d_model=2 * d_model)
    assert path_lines([*results, wider, run(lr=1e-3)]) == [
        f"ran: {mixer} [d {d_model}, {2 * d_model}]: {facts or 'no dispatch noted'} "
        f"(torch {torch_version})"]


def test_notes_keep_the_first_or_the_last_fact_of_a_key():
    from mixers.dispatch import note, noting

    for keep, expected in (("last", {"impl": "chunk", "fallback": "x"}),
                           ("first", {"impl": "triton", "fallback": "x"})):
        with noting(keep=keep) as notes:
            note(impl="triton")
            note(impl="chunk", fallback="x")
        assert notes == expected
    with pytest.raises(ValueError, match="keep must be"):
        with noting(keep="middle"):
            pass


def test_recall_markdown_is_paragraphs_a_table_and_a_list_of_failed_runs():
    runs = [run(lr=1e-3, val_accuracy=0.9, test_accuracy=0.8),
            run(lr=1e-2, status="error", error="AssertionError: ", val_accuracy=None,
                test_accuracy=None)]
    console = Console(record=True, width=80)
    render_recall({"kind": "recall", "config": {}, "environment": {}, "runs": runs}, console,
                  markdown=True)
    lines = console.export_text().splitlines()
    assert lines[0].startswith("recall (") and lines[1] == ""
    assert lines[-1] == "- error: m d=64 lr=0.01 seed=0 [s]: AssertionError:"
    assert lines[-2] == "" and lines[-3].startswith("| m | 64 |")


def mad_run(task, setting, mixer="hla2", val=0.5, test=0.6, at_best=None, **fields):
    return run(**{"setting": setting, "mixer": mixer, "d_model": 128, "task": task, "lr": 1e-3,
                  "weight_decay": 0.0, "val_accuracy": val, "test_accuracy": test,
                  "test_accuracy_at_best_val_loss": at_best, **fields})


def test_mad_score_view_means_the_best_run_of_each_setting_over_a_tasks_settings():
    from hla_bench.recall.report import mad_markdown, mad_scores, mad_table

    runs = [mad_run("in_context_recall", "icr", test=0.9, at_best=0.95),
            mad_run("in_context_recall", "icr", val=0.9, test=0.8, at_best=0.7, lr=3e-3),
            mad_run("in_context_recall", "icr num_train=800", test=0.4, at_best=0.5),
            mad_run("memorization", "mem", test=0.3, at_best=0.3),
            mad_run("mqar", "mqar", test=1.0, at_best=1.0)]   # not a MAD task: not in the view
    scores = mad_scores(runs)
    entry = scores[("hla2", 128)]["in_context_recall"]
    assert entry["val"] == pytest.approx((0.8 + 0.4) / 2)   # val-picked: the lr of val 0.9
    assert entry["test"] == pytest.approx((0.95 + 0.5) / 2)  # MAD-lab's pick per setting
    assert entry["rule"] == "mad-lab" and (entry["settings"], entry["expected"]) == (2, 11)
    assert set(scores[("hla2", 128)]) == {"in_context_recall", "memorization"}
    reference = yaml.safe_load((Path(__file__).parents[1] / "configs" / "published" /
                                "mad-lab.yaml").read_text())
    console = Console(record=True, width=250)
    console.print(mad_table(scores, reference))
    text = " ".join(console.export_text().split())
    assert "0.600 / 0.725 (2/11)" in text and "0.300 / 0.300 (1/6)" in text
    assert "none of its architectures is an hla-bench mixer" in text
    # an unmapped architecture's published row comes after every mixer, for its tasks shown
    lines = mad_markdown(scores, reference).splitlines()
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows[0].startswith("| hla2 |")
    assert "| MAD-lab: Hyena + SwiGLU | 128 | 0.818 | 0.895 |" in rows
    assert all(row.startswith("| MAD-lab: ") for row in rows[1:])
    # a mapped architecture gets its published row right under its mixer
    mapped = {**reference, "architectures_in_hla_bench": {"Hyena + SwiGLU": "hla2"}}
    rows = [line for line in mad_markdown(scores, mapped).splitlines() if line.startswith("| ")]
    assert rows[3] == "| MAD-lab: Hyena + SwiGLU (= hla2) | 128 | 0.818 | 0.895 |", rows
    assert "(= MIXER) marks the hla-bench mixer" in mad_markdown(scores, mapped)
    absent = {**reference, "architectures_in_hla_bench": {"Hyena + SwiGLU": "sdpa"}}
    assert "not run here: sdpa" in mad_markdown(scores, absent)


def test_recall_plots_wrap_their_panels_and_name_every_mixer_in_one_legend(tmp_path, monkeypatch):
    """Five settings and the overall take two rows of four panels (two left blank); a mixer
    run in the first setting only still has its entry in the one legend, the figure's,
    outside the panels."""
    from hla_bench.recall import report as recall_report
    from hla_bench.results import plots

    figures = []
    monkeypatch.setattr(plots, "save_figure_tight",
                        lambda figure, path, dpi: figures.append(figure) or path)
    runs = [run(setting=f"s{i}", mixer="only-first" if i == 0 else "everywhere", lr=1e-3,
                val_accuracy=0.9, test_accuracy=0.8, state_bytes=1024) for i in range(5)]
    recall_report.plot_recall(summarize(runs), tmp_path)
    assert len(figures) == 2
    for figure in figures:
        panels = figure.axes
        assert len(panels) == 8 and [p.get_visible() for p in panels] == [True] * 6 + [False] * 2
        assert panels[5].get_title().startswith("overall")
        assert all(panel.get_legend() is None for panel in panels)
        (legend,) = figure.legends
        assert sorted(text.get_text() for text in legend.get_texts()) == ["everywhere", "only-first"]


def test_mad_score_view_adds_the_mean_over_the_six_tasks_once_every_task_is_scored():
    """With a score for each of MAD's six tasks the view gains a "mean" column: a mixer's
    mean of its six scores, and for a published row MAD-lab's own mean; with one task
    missing, no mean."""
    from tasks.mad import MAD_TASKS
    from hla_bench.recall.report import load_mad_reference, mad_markdown, mad_scores

    reference = load_mad_reference()
    tests = dict(zip(MAD_TASKS, (0.9, 0.6, 0.3, 0.8, 0.5, 0.7)))
    runs = [mad_run(task, task, val=0.5, test=value, at_best=value)
            for task, value in tests.items()]
    rows = {line.split(" | ")[0].lstrip("| "): line.strip("| ").split(" | ")
            for line in mad_markdown(mad_scores(runs), reference).splitlines()
            if line.startswith("| ") and "---" not in line}
    assert rows["mixer"][-1] == "mean" and len(rows["mixer"]) == 2 + 6 + 1
    assert rows["hla2"][-1] == f"{sum(tests.values()) / 6:.3f} / {sum(tests.values()) / 6:.3f}"
    hyena = reference["scores"]["Hyena + SwiGLU"]
    assert rows["MAD-lab: Hyena + SwiGLU"][2:] == [f"{hyena[task]:.3f}" for task in MAD_TASKS] + [
        f"{hyena['mean']:.3f}"]
    partial = mad_markdown(mad_scores(runs[:-1]), reference)
    assert "| mean |" not in partial and "selective_copying" not in partial


def zoology_run(seq_len=64, kv=4, mixer="sdpa", d_model=64, **fields):
    params = {"vocab_size": 8192, "seq_len": seq_len, "num_kv_pairs": kv,
              "random_non_queries": False}
    return run(**{"setting": f"mqar {seq_len}/{kv}", "task": "mqar", "params": params,
                  "mixer": mixer, "d_model": d_model, "lr": 1e-3, "val_accuracy": 0.9,
                  **fields})


def test_zoology_view_puts_each_mixers_test_pick_beside_figure_2_at_its_panel_only():
    from hla_bench.recall.report import ZOOLOGY_REFERENCE, load_reference, zoology_markdown, zoology_rows

    reference = load_reference(ZOOLOGY_REFERENCE)
    runs = [zoology_run(val_accuracy=0.9, test_accuracy=0.97),
            zoology_run(lr=1e-2, val_accuracy=0.5, test_accuracy=0.99),   # test-picked
            zoology_run(mixer="hla2", d_model=128, test_accuracy=0.42),
            zoology_run(128, 8, test_accuracy=0.8),
            zoology_run(128, 4, test_accuracy=0.1),                         # not a panel's pairs
            {**zoology_run(256, 16, test_accuracy=0.3),                     # random fillers
             "params": {"vocab_size": 8192, "seq_len": 256, "num_kv_pairs": 16,
                        "random_non_queries": True}, "setting": "mqar 256/16 random"}]
    views = zoology_rows(runs, summarize(runs), reference)
    assert set(views) == {"mqar 64/4", "mqar 128/8"}
    d_models, rows = views["mqar 64/4"]
    assert d_models == [64, 128, 256, 512]
    assert rows[0] == ["sdpa", "0.990", "-", "-", "-"] and rows[1] == ["hla2", "-", "0.420", "-", "-"]
    attention = reference["scores"]["Attention"][64]
    assert rows[2] == ["Zoology: Attention (= sdpa)"] + [
        f"{attention[d]:.2f}" if d in attention else "-" for d in d_models]
    assert [row[0] for row in rows[3:]] == [f"Zoology: {name}" for name in reference["scores"]
                                            if name != "Attention" and reference["scores"][name].get(64)]
    markdown = zoology_markdown("mqar 64/4", d_models, rows, reference)
    assert "| sdpa | 0.990 | - | - | - |" in markdown and "read from its figure" in markdown
    console = Console(record=True, width=250)
    render_recall({"kind": "recall", "config": {}, "environment": {}, "runs": runs}, console)
    text = console.export_text()
    assert text.count("Zoology Figure 2:") == 2 and "Zoology: BaseConv" in text


def test_recall_tables_choose_the_setting_or_the_reference_views(tmp_path):
    runs = [zoology_run(test_accuracy=0.97), zoology_run(mixer="hla2", status="error",
                                                         error="boom")]
    data = {"kind": "recall", "config": {}, "environment": {}, "runs": runs}
    shown = {}
    for tables in ("all", "settings", "reference"):
        console = Console(record=True, width=250)
        render_recall(data, console, tables=tables)
        shown[tables] = console.export_text()
    assert all("error: hla2" in text for text in shown.values())
    assert "Zoology Figure 2:" in shown["reference"] and "state" not in shown["reference"]
    assert "Zoology Figure 2:" not in shown["settings"] and "state" in shown["settings"]
    assert "Zoology Figure 2:" in shown["all"] and "state" in shown["all"]
    path = tmp_path / "recall.yaml"
    path.write_text(dump_results({"kind": "recall", "schema_version": 1, **data}))
    result = CliRunner().invoke(main, ["report", "--recall-tables", "reference", str(path)])
    assert result.exit_code == 0 and "Zoology Figure 2:" in result.output, result.output
    bench = Path(__file__).parent.parent / "results" / "h100-2026-12-05" / "h200-a.yaml"
    result = CliRunner().invoke(main, ["report", "--recall-tables", "settings", str(bench)])
    assert result.exit_code == 2 and "applies to the tables of recall files" in result.output


def test_zoology_reference_is_consistent():
    reference = yaml.safe_load((Path(__file__).parents[1] / "configs" / "published" /
                                "zoology-fig2.yaml").read_text())
    assert {"source", "metric", "precision", "settings", "scores",
            "architectures_in_hla_bench"} <= set(reference)
    for name, by_seq in reference["scores"].items():
        assert set(by_seq) <= set(reference["settings"]), name
        for values in by_seq.values():
            assert set(values) <= {64, 128, 256, 512}
            assert all(0.0 <= value <= 1.0 for value in values.values())
    # Figure 2's finding: attention solves every cell
    assert all(value >= 0.99 for values in reference["scores"]["Attention"].values()
               for value in values.values())
    for name, mixer in reference["architectures_in_hla_bench"].items():
        assert name in reference["scores"]
        registry.get(mixer)


def test_recall_file_validation():
    with pytest.raises(RecallFileError, match="kind: recall"):
        validate_recall({"kind": "bench"})
    with pytest.raises(RecallFileError, match="runs"):
        validate_recall({"kind": "recall", "config": {}, "environment": {}, "runs": 5})
    with pytest.raises(RecallFileError, match=r"runs\[0\] lacks setting"):
        validate_recall({"kind": "recall", "config": {}, "environment": {},
                         "runs": [{"mixer": "m"}]})


@pytest.mark.parametrize("changes,message", [
    ({"train": {"epoch": 1}}, "unknown key epoch"),
    ({"lrs": 0.01}, "lrs must be a non-empty list"),
    ({"lrs": [-1.0]}, "lrs must be a list of a number in"),
    ({"d_model": [0]}, "d_model must be a list of an int from 1 to 2147483647"),
    ({"train": {"epochs": 0}}, "epochs must be an int from 1 to 2147483647"),
    ({"train": {"batch_size": 0}}, "batch_size must be an int from 1 to 2147483647"),
    ({"workers": -3}, "workers must be an int from 1 to 2147483647"),
    ({"seeds": [0, 0]}, "without duplicates"),
    ({"model": {"state_mixer": "moe"}}, "state_mixer must be one of"),
    ({"train": {"schedule": "linear"}}, "schedule must be one of"),
    ({"mixers": ["sdpa"], "mixer_options": {"sdpa": {"backend": 3, "nope": 1}}}, "no option 'nope'"),
    ({"mixer_options": {"hla2x": {}}}, "names mixers not in"),
    ({"settings": [{"task": "mqar", "params": {"seq_len": 15}}]}, "seq_len must be an even"),
    ({"settings": [{"task": "mqar", "trian": {}}]}, "unknown key trian"),
    ({"bogus": 1}, "unknown key bogus"),
    ({"weight_decays": [-0.1]}, "weight_decays must be a list of a number in"),
    ({"train": {"stop_accuracy": 99}}, r"stop_accuracy must be a number in \(0, 1\]"),
    ({"weight_decays": [0.1], "settings": [{"task": "mqar", "train": {"weight_decay": 0.0}}]},
     r"settings\[0\].train.weight_decay: the config has a `weight_decays` grid"),
    ({"train": {"metric": "macro"}}, "metric must be one of micro, mad-macro"),
    ({"model": {"norm": "batch"}}, "norm must be one of layer, rms"),
    ({"model": {"head": "shared"}}, "head must be one of tied, untied"),
    ({"model": {"swiglu_hidden": 0}}, "swiglu_hidden must be an int from 1 to 2147483647"),
    ({"model": {"decoder": "mad"}}, "decoder must be one of default, mad-lab"),
    ({"mixer_model": {"hla2x": {}}}, "mixer_model names mixers not in"),
    ({"mixers": ["hla2"], "mixer_model": {"hla2": {"layers": 4}}}, "mixer_model.hla2: unknown key"),
    ({"mixers": ["hla2"], "mixer_model": {"hla2": {"n_layers": 4}},
      "settings": [{"task": "mqar", "model": {"n_layers": 3}}]},
     r"settings\[0\].model and mixer_model.hla2 both set n_layers"),
    ({"settings": [{"task": "mqar", "name": ""}]}, "name must be a non-empty string"),
    ({"settings": [{"task": "mqar", "train": {"num_train": 10}},
                   {"task": "mqar", "train": {"num_train": 10}}]},
     r"settings\[0\] and settings\[1\] have the same label 'mqar num_train=10'"),
    ({"settings": [{"task": "mqar", "name": "a"}, {"task": "memorization", "name": "a"}]},
     "have the same label 'a'"),
])
def test_config_validation_names_the_problem(changes, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(changes)


def test_configs_in_the_repository_are_valid():
    from pathlib import Path

    from hla_bench.recall.plan import plan_runs
    from hla_bench.recall.plan import plan_groups

    checked = []
    for path in sorted(Path(__file__).parents[1].glob("configs/*.yaml")):
        data = yaml.safe_load(path.read_text())
        if "settings" in data:  # a recall config
            config = load_config(str(path), {})
            assert config["name"] == path.stem
            specs = plan_runs(config, "cpu")
            assert len({spec["setting"] for spec in specs}) == len(config["settings"])
            for spec in specs[:200]:  # every run's model builds (spot check: the first runs)
                RunSpec(**spec)
            assert plan_groups(specs[:64], 32)
            checked.append(path.stem)
    assert {"mad", "zoology-fig2", "zoology-smoke", "recall-cpu"} <= set(checked)


def test_weight_decay_grid_plans_every_lr_wd_and_seed_in_one_group_per_cell(tmp_path):
    from hla_bench.recall.plan import plan_runs
    from hla_bench.recall.plan import plan_groups

    config = validate_config({
        "mixers": ["hla2", "linear-attn"], "d_model": [32], "lrs": [1e-3, 3e-3],
        "weight_decays": [0.0, 0.1, 0.3], "seeds": [0, 1],
        "settings": [{"task": "mqar", "params": {"seq_len": 16, "num_kv_pairs": 2}}]})
    specs = plan_runs(config, "cpu")
    assert len(specs) == 2 * 2 * 3 * 2
    assert {(s["lr"], s["weight_decay"], s["seed"]) for s in specs if s["mixer"] == "hla2"} == {
        (lr, wd, seed) for lr in (1e-3, 3e-3) for wd in (0.0, 0.1, 0.3) for seed in (0, 1)}
    groups = plan_groups(specs, 32)
    assert sorted(len(g) for g in groups) == [12, 12]
    # without the grid: each setting's own train.weight_decay, as before
    single = validate_config({"mixers": ["hla2"], "lrs": [1e-3], "train": {"weight_decay": 0.2},
                              "settings": [{"task": "mqar"},
                                           {"task": "mqar", "train": {"weight_decay": 0.0}}]})
    assert [s["weight_decay"] for s in plan_runs(single, "cpu")] == [0.2, 0.0]
    # a file gives one or the other; the command line's grid replaces the file's decay
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({"mixers": ["hla2"], "weight_decays": [0.0, 0.1],
                                    "train": {"weight_decay": 0.2}}))
    with pytest.raises(ConfigError, match="give `weight_decays` .a grid. or train.weight_decay"):
        load_config(str(path), {})
    path.write_text(yaml.safe_dump({"mixers": ["hla2"], "train": {"weight_decay": 0.2}}))
    assert load_config(str(path), {"weight_decays": [0.0, 0.5]})["weight_decays"] == [0.0, 0.5]


def test_settings_are_told_apart_by_their_overrides_or_named():
    from hla_bench.recall.plan import plan_runs, setting_label

    config = validate_config({
        "mixers": ["hla2"], "lrs": [1e-3],
        "settings": [{"task": "in_context_recall"},
                     {"task": "in_context_recall", "train": {"num_train": 6400}},
                     {"task": "in_context_recall", "params": {"vocab_size": 32},
                      "model": {"n_layers": 4}},
                     {"task": "in_context_recall", "train": {"num_train": 800}, "name": "icr-800"}]})
    labels = [spec["setting"] for spec in plan_runs(config, "cpu")]
    assert labels == ["in_context_recall", "in_context_recall num_train=6400",
                      "in_context_recall vocab_size=32 n_layers=4", "icr-800"]
    assert setting_label("mqar", {"seq_len": 8}) == "mqar seq_len=8"  # no overrides: as before
    # task parameters never share a name with a train or model key, so labels stay unambiguous
    from hla_bench.recall.plan import MODEL_FIELDS, TRAIN_FIELDS
    for task in tasks.all_tasks():
        assert not set(task.params) & (set(MODEL_FIELDS) | set(TRAIN_FIELDS)), task.name


def test_mixer_model_overrides_the_model_of_one_mixer(tmp_path):
    from hla_bench.recall.plan import plan_runs

    config = validate_config({
        "mixers": ["hla2", "mamba2-ssd"], "lrs": [1e-3],
        "model": {"n_layers": 2, "state_mixer": "swiglu"},
        "mixer_model": {"mamba2-ssd": {"n_layers": 4, "state_mixer": "none"}},
        "settings": [{"task": "mqar", "model": {"n_heads": 2}}]})
    by_mixer = {spec["mixer"]: spec for spec in plan_runs(config, "cpu")}
    assert (by_mixer["hla2"]["n_layers"], by_mixer["hla2"]["state_mixer"]) == (2, "swiglu")
    assert (by_mixer["mamba2-ssd"]["n_layers"], by_mixer["mamba2-ssd"]["state_mixer"]) == (4, "none")
    assert by_mixer["mamba2-ssd"]["n_heads"] == by_mixer["hla2"]["n_heads"] == 2
    model = build_model(by_mixer["mamba2-ssd"])
    assert len(model.blocks) == 4 and model.blocks[0].state_mixer is None
    # --mixers on the command line keeps the file's per-mixer entries of those mixers only
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"mixers": ["hla2", "mamba2-ssd"],
                                    "mixer_options": {"mamba2-ssd": {"d_state": 4}},
                                    "mixer_model": {"mamba2-ssd": {"n_layers": 4}}}))
    narrowed = load_config(str(path), {"mixers": ["hla2"]})
    assert narrowed["mixer_options"] == {} and narrowed["mixer_model"] == {}
    assert load_config(str(path), {})["mixer_model"] == {"mamba2-ssd": {"n_layers": 4}}


def test_mixer_d_model_gives_a_mixer_or_label_its_own_widths(tmp_path):
    """`mixer_d_model` replaces `d_model` for the mixers and labels it names (a label's
    entry before its mixer's); `--d-model` replaces every mixer's widths, `--mixers` keeps
    the entries of those mixers; unknown names and bad widths are ConfigErrors."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "mixers": ["sdpa", "hla2", "hla2:label=hla2-wide"], "d_model": [32, 64],
        "mixer_d_model": {"hla2": [16], "hla2-wide": [128]}, "lrs": [1e-3]}))
    config = load_config(str(path), {})
    widths = {}
    for spec in plan_runs(config, "cpu"):
        widths.setdefault(spec["variant"] or spec["mixer"], []).append(spec["d_model"])
    assert widths == {"sdpa": [32, 64], "hla2": [16], "hla2-wide": [128]}
    overridden = load_config(str(path), {"d_model": [48]})
    assert overridden["mixer_d_model"] == {}
    assert {spec["d_model"] for spec in plan_runs(overridden, "cpu")} == {48}
    assert load_config(str(path), {"mixers": ["sdpa", "hla2"]})["mixer_d_model"] == {
        "hla2": [16]}
    for bad, message in (({"mamba2-ssd": [64]}, "names mixers not in `mixers`: mamba2-ssd"),
                         ({"hla2": []}, "mixer_d_model.hla2 must be a non-empty list"),
                         ({"hla2": [0]}, "mixer_d_model.hla2 must be")):
        path.write_text(yaml.safe_dump({"mixers": ["hla2"], "mixer_d_model": bad}))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(str(path), {})


def test_run_key_reads_a_field_a_stored_run_lacks_as_its_default():
    from hla_bench.recall.plan import run_key

    spec = tiny_spec()
    stored = {k: v for k, v in spec.items() if k not in ("norm", "head", "metric", "decoder",
                                                          "swiglu_hidden", "test_at_best_val")}
    assert run_key(stored) == run_key(spec)
    assert run_key(stored) != run_key({**spec, "norm": "rms"})


def recall_args(tmp_path, *extra):
    return ["recall", "--task", "mqar", "--mixers", "test-softmax", "--d-model", "32",
            "--seq-len", "8", "--num-kv-pairs", "2", "--vocab-size", "16", "--lrs", "3e-3,1e-2",
            "--epochs", "1", "--num-train", "128", "--num-val", "32", "--num-test", "64",
            "--device", "cpu", "--workers", "1", "--out", str(tmp_path / "recall.yaml"), *extra]


def test_recall_cli_writes_yaml_that_round_trips_into_the_report(tmp_path):
    result = CliRunner().invoke(main, recall_args(tmp_path, "--plots-dir", str(tmp_path / "plots"),
                                                  "--seeds", "0,1"))
    assert result.exit_code == 0, result.output
    assert "recall sweep: 4 runs (4 to train in 1 groups) on cpu" in result.output
    data = yaml.safe_load((tmp_path / "recall.yaml").read_text())
    assert data["kind"] == "recall" and data["schema_version"] == 2 and data["end_of_results"] is True
    assert data["config"]["lrs"] == [3e-3, 1e-2] and len(data["runs"]) == 4
    assert all(run["status"] == "ok" and run["curve"] and run["group_size"] == 4
               for run in data["runs"])
    assert {"python", "torch"} <= set(data["environment"]) and data["complete"] is True
    assert data["config"]["graphs"] is False  # nothing is replayed on the CPU
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "recall_accuracy_vs_d_model.png", "recall_accuracy_vs_state.png"]
    console = Console(record=True, width=200)
    render_recall(data, console)
    text = console.export_text()
    cell = summarize(data["runs"])[data["runs"][0]["setting"]]["test-softmax"][32]
    assert "test-softmax" in text and f"{cell['score']['mean']:.3f}" in text
    report = CliRunner().invoke(main, ["report", str(tmp_path / "recall.yaml")])
    assert report.exit_code == 0, report.output
    assert "test-softmax" in report.output
    markdown = CliRunner().invoke(main, ["report", str(tmp_path / "recall.yaml"), "--markdown"])
    assert markdown.exit_code == 0, markdown.output
    assert "| mixer | d_model | state | val-picked |" in markdown.output
    assert f"| test-softmax | 32 | 4.0 KiB | {cell['score']['mean']:.3f}±" in markdown.output


@pytest.mark.slow
def test_resume_keeps_every_run_and_adds_only_the_missing(tmp_path):
    assert CliRunner().invoke(main, recall_args(tmp_path)).exit_code == 0
    path = tmp_path / "recall.yaml"
    data = yaml.safe_load(path.read_text())
    kept = data["runs"][0]
    data["runs"] = [kept]  # as if killed after the first run
    data["complete"] = False
    path.write_text(dump_results(data))
    result = CliRunner().invoke(main, recall_args(tmp_path, "--resume"))
    assert result.exit_code == 0, result.output
    assert "resuming: 1 finished run(s) kept" in result.output
    runs = yaml.safe_load(path.read_text())["runs"]
    assert len(runs) == 2 and runs[0]["curve"] == kept["curve"] and runs[1]["status"] == "ok"
    assert runs[0]["seconds"] == kept["seconds"]  # not trained again
    # another plan on resume keeps what the file holds
    other = CliRunner().invoke(main, recall_args(tmp_path, "--resume", "--lrs", "1e-3"))
    assert other.exit_code == 0, other.output
    assert len(yaml.safe_load(path.read_text())["runs"]) == 3


@pytest.mark.slow
def test_each_part_of_a_resumed_sweep_is_recorded_and_each_run_names_its_device(tmp_path):
    assert CliRunner().invoke(main, recall_args(tmp_path)).exit_code == 0
    path = tmp_path / "recall.yaml"
    data = yaml.safe_load(path.read_text())
    (first,) = data["parts"]
    assert first["runs"] == 2 and first["seconds"] == data["seconds"] >= 0
    assert first["utc_time"] == data["environment"]["utc_time"]
    assert {run["device_name"] for run in data["runs"]} == {"cpu"}
    assert {run["gpu_memory_mib"] for run in data["runs"]} == {None}
    del data["parts"]  # a file from before parts were recorded, its second run lost
    data["runs"], data["complete"] = data["runs"][:1], False
    data["environment"]["gpu"] = "an earlier machine"
    path.write_text(dump_results(data))
    resumed = CliRunner().invoke(main, recall_args(tmp_path, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    again = yaml.safe_load(path.read_text())
    earlier, latest = again["parts"]
    assert (earlier["gpu"], earlier["runs"], earlier["seconds"]) == (
        "an earlier machine", 1, data["seconds"])
    assert latest["runs"] == 1 and latest["gpu"] == again["environment"]["gpu"]
    assert again["seconds"] == pytest.approx(earlier["seconds"] + latest["seconds"], abs=0.11)
    shown = CliRunner().invoke(main, ["report", str(path)], env={"COLUMNS": "200"})
    assert f"in 2 parts on an earlier machine, {latest['gpu']}" in shown.output, shown.output


def test_resume_refuses_a_file_whose_runs_the_plan_repeats_with_other_mixer_options(tmp_path):
    """Resuming under other mixer options (a config switched impl=triton to parallel) would
    put two runs of one (mixer, d_model, lr, seed) into one cell: a usage error, file as it
    was."""
    assert CliRunner().invoke(main, recall_args(tmp_path)).exit_code == 0
    path = tmp_path / "recall.yaml"
    data = yaml.safe_load(path.read_text())
    data["runs"][0]["mixer_options"] = {"impl": "triton"}
    path.write_text(dump_results(data))
    before = path.read_text()
    result = CliRunner().invoke(main, recall_args(tmp_path, "--resume"))
    assert result.exit_code == 2, result.output
    assert "1 run(s) that the plan repeats with other mixer options" in result.output
    assert "stored {'impl': 'triton'}, planned {}" in result.output
    assert path.read_text() == before and not (tmp_path / "recall.yaml.lock").exists()


def test_existing_out_needs_resume_or_overwrite_and_protocols_must_match(tmp_path):
    path = tmp_path / "recall.yaml"
    assert CliRunner().invoke(main, recall_args(tmp_path)).exit_code == 0
    again = CliRunner().invoke(main, recall_args(tmp_path))
    assert again.exit_code == 2 and "already exists; resume it (--resume)" in again.output
    assert CliRunner().invoke(main, recall_args(tmp_path, "--overwrite")).exit_code == 0
    changed = CliRunner().invoke(main, recall_args(tmp_path, "--resume", "--batch-size", "32"))
    assert changed.exit_code == 2 and "train.batch_size: file 64, this run 32" in changed.output
    config = tmp_path / "c.yaml"
    config.write_text("mixers: [sdpa]\n")
    for target in (config, tmp_path / "notes.md"):
        target.write_text("mixers: [sdpa]\n") if target.suffix == ".md" else None
        refused = CliRunner().invoke(main, recall_args(tmp_path, "--overwrite", "--out", str(target)))
        assert refused.exit_code == 2 and "refusing to overwrite it" in refused.output
        assert target.read_text() == "mixers: [sdpa]\n"
    resumed = CliRunner().invoke(main, recall_args(tmp_path, "--resume", "--out", str(config)))
    assert resumed.exit_code == 2 and "not a results file" in resumed.output
    assert "refusing to resume it" in resumed.output and config.read_text() == "mixers: [sdpa]\n"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # cut while being written
    cut = CliRunner().invoke(main, recall_args(tmp_path, "--resume"))
    assert cut.exit_code == 2 and "the file was cut short" in cut.output
    no_out = [arg for arg in recall_args(tmp_path) if arg not in ("--out", str(path))]
    bad = CliRunner().invoke(main, no_out + ["--resume"])
    assert bad.exit_code == 2 and "--resume needs --out" in bad.output


@pytest.mark.slow
def test_time_limit_checkpoints_and_resume_finishes(tmp_path):
    path = tmp_path / "recall.yaml"
    stopped = CliRunner().invoke(main, recall_args(tmp_path, "--time-limit", "0.001",
                                                   "--epochs", "3"))
    assert stopped.exit_code == 0, stopped.output
    assert "stopped at --time-limit" in stopped.output
    data = yaml.safe_load(path.read_text())
    assert data["complete"] is False
    resumed = CliRunner().invoke(main, recall_args(tmp_path, "--resume", "--epochs", "3"))
    assert resumed.exit_code == 0, resumed.output
    data = yaml.safe_load(path.read_text())
    assert data["complete"] is True and len(data["runs"]) == 2
    assert not list((tmp_path / "recall.yaml.checkpoints").glob("*.pt"))


@pytest.mark.slow
def test_progress_into_a_pipe_is_whole_lines(tmp_path):
    """Not a terminal (CliRunner's output, a log file): no bars, and no line cut to the
    width, however narrow."""
    result = CliRunner().invoke(main, recall_args(tmp_path, "--epochs", "2"),
                                env={"COLUMNS": "30"})
    assert result.exit_code == 0, result.output
    group = "test-softmax d=32 x2 [mqar num_kv_pairs=2 seq_len=8 vocab_size=16]"
    lines = result.output.splitlines()
    assert f"{group}: started, at most 4 steps" in lines
    assert any(line.startswith(f"{group}: step 2 of 4, best val ") for line in lines)
    assert any(line.startswith("  test-softmax d=32 lr=0.003 wd=0.1 seed=0 [mqar "
                               "num_kv_pairs=2 seq_len=8 vocab_size=16]: test ") for line in lines)
    assert "…" not in result.output and "━" not in result.output
    # the report's table does not fit 30 columns: its rows as lines of whole items
    assert "mqar num_kv_pairs=2 seq_len=8" in lines and "    vocab_size=16" in lines
    assert "test-softmax d 32" in lines


@pytest.mark.parametrize("option,value,message", [
    ("--lrs", "-1", "--lrs must be a list of a number"), ("--d-model", "0", "--d-model must be"),
    ("--epochs", "0", "--epochs must be an int from 1 to 2147483647"), ("--batch-size", "0", "--batch-size must be"),
    ("--workers", "-3", "--workers must be an int from 1 to 2147483647"), ("--lrs", "1e-3,,3e-3", "empty item"),
    ("--mixers", "no-such-mixer", "unknown mixer 'no-such-mixer'"),
    ("--seq-len", "15", "seq_len must be an even"), ("--time-limit", "-1", "--time-limit must be"),
    ("--lrs", "nan", "--lrs must be a list of a finite number"),
    ("--lrs", "inf", "--lrs must be a list of a finite number"),
    ("--weight-decays", "nan", "--weight-decays must be a list of a finite number"),
    ("--time-limit", "nan", "--time-limit must be"), ("--time-limit", "inf", "--time-limit must be"),
    ("--seeds", "99999999999999999999", "--seeds must be a list of an int from 0"),
    ("--d-model", "99999999999999999999", "--d-model must be a list of an int from 1"),
])
def test_recall_cli_rejects_bad_input_before_any_run(tmp_path, option, value, message):
    bad = CliRunner().invoke(main, recall_args(tmp_path, option, value))
    assert bad.exit_code == 2 and message in bad.output, bad.output
    assert not (tmp_path / "recall.yaml").exists()


@pytest.mark.parametrize("options,message", [
    ({"impl": "trtion"}, "impl must be one of"), ({"decay": 1.5}, "decay must lie in"),
    ({"chunk_size": "abc"}, "chunk_size")])
def test_option_values_a_layer_rejects_stop_the_sweep_before_any_run(tmp_path, options, message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"mixers": ["hla2"], "mixer_options": {"hla2": options},
                                      "device": "cpu", "workers": 1}))
    bad = CliRunner().invoke(main, ["recall", "--config", str(config), "--out", str(tmp_path / "o.yaml")])
    assert bad.exit_code == 2 and message in bad.output, bad.output
    assert not (tmp_path / "o.yaml").exists()



@pytest.mark.parametrize("extra,message", [
    ({"model": {"n_heads": 3}}, "sdpa at d_model 64 with 3 head(s): d_model (64) must be divisible"),
    ({"mixer_model": {"sdpa": {"n_heads": 5}}}, "sdpa at d_model 64 with 5 head(s)")])
def test_a_width_its_heads_do_not_divide_stops_the_sweep_before_any_run(tmp_path, extra,
                                                                        message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"mixers": ["sdpa", "hla2"], "d_model": [64],
                                      "device": "cpu", "workers": 1, **extra}))
    for dry_run in ([], ["--dry-run"]):
        bad = CliRunner().invoke(main, ["recall", "--config", str(config), "--out",
                                        str(tmp_path / "o.yaml"), *dry_run])
        assert bad.exit_code == 2 and message in bad.output, bad.output
        assert not (tmp_path / "o.yaml").exists()


@pytest.mark.slow
def test_ctrl_c_keeps_the_finished_runs_says_how_to_resume_and_exits_130(tmp_path,
                                                                          monkeypatch):
    from hla_bench.recall import pool as recall_pool

    original = recall_pool.run_groups

    def interrupted_after_the_first_group(groups, workers, on_event, on_group, **options):
        original(groups[:1], workers, on_event, on_group, **options)
        raise KeyboardInterrupt

    monkeypatch.setattr(recall_pool, "run_groups", interrupted_after_the_first_group)
    args = recall_args(tmp_path, "--d-model", "16,32")
    result = CliRunner().invoke(main, args)
    out = tmp_path / "recall.yaml"
    assert result.exit_code == 130, result.output
    assert f"interrupted: 2 run(s) kept in {out}" in " ".join(result.output.split())
    data = yaml.safe_load(out.read_text())
    assert data["complete"] is False and [r["d_model"] for r in data["runs"]] == [16, 16]
    monkeypatch.setattr(recall_pool, "run_groups", original)
    fresh = tmp_path / "fresh.yaml"
    monkeypatch.setattr(recall_pool, "run_groups",
                        lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    early = CliRunner().invoke(main, [*args, "--out", str(fresh)])
    assert early.exit_code == 130 and "interrupted before any run was written" in early.output
    assert not fresh.exists()
    monkeypatch.setattr(recall_pool, "run_groups", original)
    resumed = CliRunner().invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0 and "resuming: 2 finished run(s) kept" in resumed.output
    assert sorted(r["d_model"] for r in yaml.safe_load(out.read_text())["runs"]) == [16, 16, 32, 32]


@pytest.mark.parametrize("flag, widths", [([], [16, 32, 64]), (["--largest-first"], [64, 32, 16])])
def test_groups_start_cheapest_first_or_with_largest_first_costliest_first(tmp_path, monkeypatch,
                                                                           flag, widths):
    from hla_bench.recall import pool as recall_pool

    started = []

    def record(groups, workers, on_event, on_group, **options):
        started.extend(group[0]["d_model"] for group in groups)
        raise KeyboardInterrupt

    monkeypatch.setattr(recall_pool, "run_groups", record)
    result = CliRunner().invoke(main, recall_args(tmp_path, "--d-model", "32,64,16", *flag))
    assert result.exit_code == 130 and started == widths, result.output


def test_order_groups_by_width_times_length_keeps_the_plan_order_of_a_size():
    from hla_bench.recall.plan import order_groups

    def group(d_model, seq_len, tag):
        return [{"d_model": d_model, "task": "mqar", "tag": tag,
                 "params": {"seq_len": seq_len, "num_kv_pairs": 4, "vocab_size": 64}}]

    groups = [group(64, 64, "a"), group(32, 256, "b"), group(128, 32, "c"), group(16, 64, "d")]
    tags = lambda ordered: [g[0]["tag"] for g in ordered]  # noqa: E731
    assert tags(order_groups(groups)) == ["d", "a", "c", "b"]
    assert tags(order_groups(groups, largest_first=True)) == ["b", "a", "c", "d"]


@pytest.mark.parametrize("text, message", [
    ("settings: [{task: mqar, params: 5}]", "params must be a mapping of task parameters"),
    ("settings: [{task: 5}]", "task must be a task name, got 5"),
    ("settings: [{task: mqar, params: {power_a: abc}}]", "a task parameter of the wrong type"),
    (b"\xff\xfe", "not UTF-8 text")])
def test_a_recall_config_of_wrong_types_is_a_usage_error_even_in_a_dry_run(tmp_path, text,
                                                                           message):
    config = tmp_path / "c.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    bad = CliRunner().invoke(main, ["recall", "--config", str(config), "--dry-run"])
    assert bad.exit_code == 2 and message in bad.output, bad.output


@pytest.mark.parametrize("param, message", [("x=[", "is not a YAML value"),
                                            ("seq_len=8", "seq_len is given twice")])
def test_a_param_that_is_not_a_value_is_a_usage_error(tmp_path, param, message):
    bad = CliRunner().invoke(main, recall_args(tmp_path, "--param", param, "--param", param))
    assert bad.exit_code == 2 and message in bad.output, bad.output


def test_a_param_in_exponent_form_is_a_number(tmp_path):
    from hla_bench.options import parse_params

    assert parse_params(None, None, ["power_a=1e-2", "name=abc"]) == {"power_a": 0.01,
                                                                       "name": "abc"}

def test_unwritable_out_is_refused_before_any_run(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")  # its "subfolder" cannot exist, even for root
    bad = CliRunner().invoke(main, recall_args(tmp_path, "--out", str(blocker / "r.yaml")))
    assert bad.exit_code == 2 and "a-file" in bad.output, bad.output
    assert "recall sweep" not in bad.output  # refused before any run
    plots = CliRunner().invoke(main, recall_args(tmp_path, "--plots-dir", str(blocker / "p")))
    assert plots.exit_code == 2 and "cannot create the plots folder" in plots.output
    assert "recall sweep" not in plots.output and not (tmp_path / "recall.yaml").exists()


def test_recall_cli_from_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "mixers": ["test-softmax"], "d_model": [32], "lrs": [3e-3], "device": "cpu", "workers": 1,
        "train": {"epochs": 1, "num_train": 64, "num_val": 16, "num_test": 32},
        "settings": [{"task": "compression", "params": {"seq_len": 8}, "train": {"batch_size": 16}}]}))
    result = CliRunner().invoke(main, ["recall", "--config", str(config), "--out", str(tmp_path / "o.yaml")])
    assert result.exit_code == 0, result.output
    run_ = yaml.safe_load((tmp_path / "o.yaml").read_text())["runs"][0]
    assert run_["task"] == "compression" and run_["status"] == "ok" and run_["seq_len"] == 8
    assert run_["batch_size"] == 16 and run_["in_context_rate"] is None
    config.write_text("mixers: [sdpa]\nbogus: 1\n")
    bad = CliRunner().invoke(main, ["recall", "--config", str(config)])
    assert bad.exit_code == 2 and "unknown key bogus" in bad.output


def test_tasks_show_and_list():
    runner = CliRunner()
    shown = runner.invoke(main, ["tasks", "show", "mqar", "--seq-len", "64", "--num-kv-pairs", "4"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.count("→") == 4 + 1 and "4 labelled positions of 64" in shown.output
    listed = runner.invoke(main, ["tasks", "list"])
    assert listed.exit_code == 0 and "mqar" in listed.output and "memorization" in listed.output
    bad = runner.invoke(main, ["tasks", "show", "mqar", "--seq-len", "63"])
    assert bad.exit_code == 2 and "seq_len must be an even" in bad.output
    huge = runner.invoke(main, ["tasks", "show", "mqar", "--index", "99999999"])
    assert huge.exit_code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the test mixer is available with CUDA")
def test_unavailable_mixer_is_recorded_not_run(tmp_path):
    result = CliRunner().invoke(main, recall_args(tmp_path, "--mixers", "test-needs-cuda", "--lrs", "1e-3"))
    assert result.exit_code == 0, result.output
    run_ = yaml.safe_load((tmp_path / "recall.yaml").read_text())["runs"][0]
    assert run_["status"] == "unavailable" and "CUDA" in run_["error"] and run_["curve"] == []
    assert "unavailable" in result.output


@pytest.mark.slow
def test_mad_config_smoke_on_the_cpu_through_the_cli(tmp_path):
    """The shipped mad config's protocol at tiny sizes: one task setting, two mixers (one with a
    per-mixer model), its lr x weight-decay grid, MAD-lab's metric and test pick."""
    out = tmp_path / "mad.yaml"
    result = CliRunner().invoke(main, [
        "recall", "--config", "mad", "--task",
        "in_context_recall",
        "--seq-len", "16", "--mixers", "sdpa,mamba2-ssd", "--d-model", "32", "--epochs", "1",
        "--num-train", "64", "--num-val", "32", "--num-test", "32", "--batch-size", "64",
        "--device", "cpu", "--workers", "1", "--out", str(out)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(out.read_text())
    runs = data["runs"]
    assert len(runs) == 2 * 3 * 2 and all(r["status"] == "ok" for r in runs)
    assert {(r["lr"], r["weight_decay"]) for r in runs} == {
        (lr, wd) for lr in (1e-4, 5e-4, 1e-3) for wd in (0.0, 0.1)}
    assert all(r["metric"] == "mad-macro" and r["test_accuracy_at_best_val_loss"] is not None
               and r["norm"] == "rms" and r["head"] == "untied" and r["swiglu_hidden"] == 352
               for r in runs)
    by_mixer = {r["mixer"]: r for r in runs}
    assert (by_mixer["mamba2-ssd"]["n_layers"], by_mixer["mamba2-ssd"]["state_mixer"]) == (4, "none")
    assert by_mixer["sdpa"]["n_heads"] == 16 and by_mixer["sdpa"]["n_layers"] == 2
    assert {r["group_size"] for r in runs} == {6}  # the grid of a mixer trains as one stack
    text = " ".join(result.output.split())
    assert "MAD scores" in text and "(1/11)" in text and "as MAD-lab" in text
    assert "MAD-lab: Hyena + SwiGLU" in text and "none of its architectures is an hla-bench mixer" in text


def test_dry_run_prints_the_plan_and_trains_and_writes_nothing(tmp_path):
    out = tmp_path / "plan.yaml"
    result = CliRunner().invoke(main, ["recall", "--config", "zoology-smoke", "--device", "cpu",
                                       "--mixers", "linear-attn,hla2", "--seeds", "0,1",
                                       "--out", str(out), "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    # zoology-smoke: MQAR 64/4 at d_model 128, 4 lrs; 100,000 examples in batches of 512
    # for 64 epochs = 196 x 64 steps a run; 2 mixers x 4 lrs x 2 seeds = 16 runs
    assert "recall plan: 16 runs" in result.output
    assert "12,544" in result.output and f"{16 * 12_544:,}" in result.output
    flops = 12_544 * 2 * sum(step_flops(spec) for spec in plan_runs(load_config(
        str(configs.find("zoology-smoke")), {"mixers": ["linear-attn", "hla2"],
                                             "device": "cpu"}), "cpu"))
    assert f"{flops:.3g}" in result.output                # 2 seeds: each spec's runs twice
    assert not out.exists() and not list(tmp_path.iterdir())
    bad = CliRunner().invoke(main, ["recall", "--config", "zoology-smoke", "--device", "cpu",
                                    "--lrs", "0", "--dry-run"])
    assert bad.exit_code == 2 and "lrs must be" in bad.output


def test_a_dry_run_with_resume_plans_only_the_runs_the_file_lacks(tmp_path):
    trained = CliRunner().invoke(main, recall_args(tmp_path))
    assert trained.exit_code == 0, trained.output
    before = (tmp_path / "recall.yaml").read_text()
    more = recall_args(tmp_path, "--lrs", "3e-3,1e-2,3e-2", "--resume", "--dry-run")
    planned = CliRunner().invoke(main, more, env={"COLUMNS": "200"})
    assert planned.exit_code == 0, planned.output
    assert "2 of the 3 planned runs finished there; the plan below is the 1 left" in planned.output
    assert "recall plan: 1 runs" in planned.output
    assert (tmp_path / "recall.yaml").read_text() == before
    other = CliRunner().invoke(main, [*recall_args(tmp_path, "--resume", "--dry-run"),
                                      "--epochs", "2"])
    assert other.exit_code == 2 and "settings differ" in other.output, other.output


def test_only_tasks_keeps_the_configs_settings_of_those_tasks_and_resume_adds_the_rest(tmp_path):
    config = tmp_path / "two-tasks.yaml"
    config.write_text(yaml.safe_dump({
        "name": "two-tasks", "device": "cpu", "workers": 1, "mixers": ["test-softmax"],
        "d_model": [32], "lrs": [1e-2], "model": {"n_layers": 1, "n_heads": 1},
        "train": {"epochs": 1, "num_train": 64, "num_val": 32, "num_test": 32,
                  "batch_size": 32},
        "settings": [{"task": "mqar", "params": {"vocab_size": 16, "seq_len": 8,
                                                  "num_kv_pairs": 2}},
                     {"task": "mqar", "params": {"vocab_size": 32, "seq_len": 16,
                                                  "num_kv_pairs": 2}},
                     {"task": "memorization", "params": {"vocab_size": 16}}]}))
    out = tmp_path / "r.yaml"
    first = CliRunner().invoke(main, ["recall", "--config", str(config), "--only-tasks", "mqar",
                                      "--out", str(out)])
    assert first.exit_code == 0, first.output
    assert {run["task"] for run in yaml.safe_load(out.read_text())["runs"]} == {"mqar"}
    assert len(yaml.safe_load(out.read_text())["runs"]) == 2
    rest = CliRunner().invoke(main, ["recall", "--config", str(config), "--out", str(out),
                                     "--resume", "--dry-run"], env={"COLUMNS": "200"})
    assert rest.exit_code == 0, rest.output
    assert "2 of the 3 planned runs finished there" in rest.output
    assert "memorization" in rest.output and "recall plan: 1 runs" in rest.output
    for args, message in ((["--only-tasks", "compression"], "no setting of the config has"),
                          (["--only-tasks", "mqar", "--task", "mqar"], "not both")):
        bad = CliRunner().invoke(main, ["recall", "--config", str(config), "--dry-run", *args])
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_a_layer_that_does_not_implement_a_shape_is_left_to_the_sweep_to_record(monkeypatch):
    """check_layers: a shape a layer does not implement (NotImplementedError, as fla's delta
    rule a key head dim over 256) is no config error: the sweep records its runs as
    unsupported. A ValueError stays one."""
    from hla_bench import registry
    from hla_bench.recall.plan import ConfigError, check_layers

    class Refusing:
        name = "refusing"
        build_decoder = None  # no decoder: no state bytes either

        def __init__(self, error):
            self.error = error

        def unavailable_reason(self, options):
            return None

        def state_bytes(self, d_model, n_heads, seq_len, **options):
            return None

        def layer(self, d_model, n_heads, **options):
            raise self.error

    spec = tiny_spec(mixer="refusing", d_model=512)
    monkeypatch.setattr(registry, "get", lambda name: Refusing(NotImplementedError("up to 256")))
    check_layers([spec])
    monkeypatch.setattr(registry, "get", lambda name: Refusing(ValueError("3 heads")))
    with pytest.raises(ConfigError, match="refusing at d_model 512 with 1 head.*3 heads"):
        check_layers([spec])


def test_step_flops_scale_with_the_batch_and_count_depthwise_convolutions_by_their_groups():
    """A step's FLOPs are one example's times the batch size; the short convolution's
    backward counts twice its forward (torch's counter alone takes a depthwise convolution's
    backward for a dense one: 32x here)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mixers.layer import ShortConv

    def flops(**changes):
        return step_flops(tiny_spec(mixer="linear-attn", n_layers=2, **changes))

    assert flops(batch_size=8) == 8 * flops(batch_size=1) > 0
    with FlopCounterMode(display=False) as counter:
        ShortConv(3 * 32, 4)(torch.randn(1, 8, 3 * 32))
    forward = counter.get_total_flops()
    with_conv = flops(batch_size=1, mixer_options={"short_conv": 4})
    without = flops(batch_size=1, mixer_options={"short_conv": 0})
    assert with_conv - without == 2 * 3 * forward     # 2 layers, forward and 2 gradients
    assert step_flops(tiny_spec(mixer="fla-gla")) is None or torch.cuda.is_available()


def test_step_flops_count_on_the_cpu_where_the_meta_device_cannot_run_a_step_and_else_none(
        monkeypatch):
    from hla_bench.recall import plan

    spec = tiny_spec(mixer="linear-attn", batch_size=3)
    on_meta = step_flops(spec)
    counted = plan._counted_step

    def meta_refused(spec, inputs, labels, count, device):
        if device == "meta":
            raise NotImplementedError("an op without a meta kernel")
        return counted(spec, inputs, labels, count, device)

    monkeypatch.setattr(plan, "_counted_step", meta_refused)
    monkeypatch.setattr(plan, "_STEP_FLOPS", {})
    assert step_flops(spec) == on_meta > 0
    on_cuda_only = tiny_spec(mixer="linear-attn", mixer_options={"impl": "triton"})
    assert step_flops(on_cuda_only) is None or torch.cuda.is_available()


@pytest.mark.slow
def test_a_gpu_config_is_planned_without_a_gpu_and_refused_to_run(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    planned = CliRunner().invoke(main, ["recall", "--config", "zoology-fig2", "--dry-run"],
                                 env={"COLUMNS": "200"})
    assert planned.exit_code == 0, planned.output
    assert "recall plan: 432 runs" in planned.output and "7,216,128" in planned.output
    assert "not counted: fla-delta-rule, fla-gla" in " ".join(planned.output.split())
    assert "planned for cuda, which is not visible here" in " ".join(planned.output.split())
    out = tmp_path / "grid.yaml"
    refused = CliRunner().invoke(main, ["recall", "--config", "zoology-fig2", "--out", str(out)])
    assert refused.exit_code == 2 and "no CUDA device is visible" in refused.output
    assert not out.exists()


def test_an_option_is_blamed_by_its_own_name_and_an_empty_config_is_refused(tmp_path):
    bad = CliRunner().invoke(main, ["recall", "--config", "recall-cpu", "--d-model", "64,64",
                                    "--dry-run"])
    assert bad.exit_code == 2 and "--d-model must be a list without duplicates" in bad.output
    empty = tmp_path / "empty.yaml"
    empty.write_text("\n")
    refused = CliRunner().invoke(main, ["recall", "--config", str(empty), "--dry-run"])
    assert refused.exit_code == 2 and "is empty" in refused.output
    graphs = CliRunner().invoke(main, ["recall", "--config", "recall-cpu", "--device", "cpu",
                                       "--graphs", "--dry-run"])
    assert graphs.exit_code == 2 and "--graphs replays CUDA graphs" in graphs.output


def test_checking_a_plan_leaves_no_meta_tensor_in_any_cache():
    """check_layers builds every layer on the meta device and step_flops runs a step there;
    a cache filled there (Mamba-2's dt and A) would hand meta tensors to every later layer
    of that shape."""
    from hla_bench import registry
    from hla_bench.recall.plan import check_layers, load_config, plan_runs

    config = load_config(None, {"mixers": ["mamba2-ssd", "sdpa"], "d_model": [48],
                                "device": "cpu"})
    specs = plan_runs(config, "cpu")
    check_layers(specs)
    for spec in specs[:1] + specs[-1:]:  # step_flops runs a step on the meta device
        step_flops(spec)
    layer = registry.get("mamba2-ssd").layer(48, config["model"]["n_heads"])
    assert {p.device.type for p in layer.parameters()} == {"cpu"}
    assert layer(torch.randn(1, 8, 48)).device.type == "cpu"


def test_recall_throughput_cells_name_a_setting_by_its_length_or_its_label():
    """benchmarks/recall_throughput.py --cells: a length picks Zoology's panel; in a MAD
    config, where many settings share a length, a length is refused naming them and a
    label picks one."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "recall_throughput.py"
    spec = importlib.util.spec_from_file_location("recall_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    zoology = plan_runs(load_config(str(configs.find("zoology-fig2")), {}), "cpu")
    runs = module.cell_runs(zoology, "256:128")
    assert len(runs) == 9 * 4 and {r["params"]["seq_len"] for r in runs} == {256}
    mad = plan_runs(load_config(str(configs.find("mad")), {}), "cpu")
    runs = module.cell_runs(mad, "in_context_recall vocab_size=32:128")
    assert len(runs) == 9 * 6 and {r["setting"] for r in runs} == {"in_context_recall vocab_size=32"}
    for cell, message in (("128:128", "names 28 settings"), ("in_context:128", "no setting"),
                          ("in_context_recall:64", "no runs"), ("128", "not SETTING:D_MODEL"),
                          ("128:x", "not SETTING:D_MODEL")):
        with pytest.raises(ValueError, match=message):
            module.cell_runs(mad, cell)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_recall_throughput_refuses_bad_arguments_and_a_machine_without_a_gpu_with_exit_2():
    """benchmarks/recall_throughput.py: a bad --cells or --option is a usage error, and so
    is a machine without CUDA (checked after the arguments); none of them a traceback."""
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "recall_throughput.py"
    base = [sys.executable, str(script), "--config", "zoology-fig2", "--mixers", "mamba2-ssd",
            "--modes", "profile", "--out", "unused.yaml"]
    for extra, message in ((["--cells", "99:64"], "--cells: no runs"),
                           (["--cells", "64:64", "--option", "mamba2-ssd.impl=bogus"],
                            "impl must be one of"),
                           (["--cells", "64:64"], "no CUDA device visible")):
        result = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_recall_grid_time_sums_each_cells_groups_and_takes_the_sweeps_seconds(tmp_path):
    """benchmarks/recall_grid_time.py: a group's seconds are its longest run's, a cell's the
    sum over its groups; failed runs count in `runs` only; the total is the file's seconds."""
    import os
    import subprocess
    import sys

    def run(mixer, lr, steps, seconds, status="ok", d_model=64, memory=None):
        return {**RunSpec(task="mqar", mixer=mixer, lr=lr, d_model=d_model, setting="s").as_dict(),
                "status": status, "steps": steps, "seconds": seconds, "gpu_memory_mib": memory}

    data = {"kind": "recall", "seconds": 90.0, "complete": True,
            "environment": {"gpu": "GPU"},
            "runs": [run("a", 1e-3, 100, 5.0, memory=900), run("a", 1e-2, 300, 7.0, memory=900),
                     run("b", 1e-3, 50, 2.0, memory=1500),
                     run("b", 1e-2, 0, 1.0, status="error", memory=9999),
                     run("a", 1e-3, 40, 4.0, d_model=128)]}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "time.yaml"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "recall_grid_time.py"),
                           str(path), "--yaml", str(out)], capture_output=True, text=True,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    summary = yaml.safe_load(out.read_text())
    assert (summary["runs"], summary["runs_ok"], summary["sweep_seconds"]) == (5, 4, 90.0)
    assert summary["model_steps"] == 490 and summary["model_steps_per_second"] == round(490 / 90, 1)
    d64, d128 = summary["cells"]
    assert (d64["runs"], d64["groups"], d64["model_steps"], d64["group_seconds"]) == (3, 2, 450, 9.0)
    assert (d128["runs"], d128["groups"], d128["model_steps"], d128["group_seconds"]) == (1, 1, 40, 4.0)
    assert (d64["gpu_memory_mib"], d128["gpu_memory_mib"]) == (1500, None)  # ok runs' groups
    assert summary["gpus"] == ["GPU"] and summary["parts"][0]["seconds"] == 90.0  # no parts
    data["parts"] = [{"utc_time": "t0", "gpu": "GPU", "seconds": 60.0, "runs": 3},
                     {"utc_time": "t1", "gpu": "other GPU", "seconds": 30.0, "runs": 2}]
    path.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "recall_grid_time.py"),
                           str(path)], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and "runs ok on GPU, other GPU" in done.stdout, done.stderr
    assert "part from t1 on other GPU: 30.0 s, 2 runs\n" in done.stdout
    assert "steps per group-second, 1,500 MiB of GPU memory a group at most\n" in done.stdout
    data["parts"][0]["gpu_use"] = [{"index": 0, "samples": 30, "utilization_mean": 81.5,
                                    "utilization_median": 90.0, "memory_used_max_mib": 20480.0}]
    data["parts"][1]["gpu_use"] = {"unavailable": "nvidia-smi not found"}
    path.write_text(yaml.safe_dump(data))
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "recall_grid_time.py"),
                           str(path)], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert ("part from t0 on GPU: 60.0 s, 3 runs; GPU use 0: 81.5% mean, 90.0% median, "
            "20,480 MiB at most\n") in done.stdout, done.stdout
    assert "2 runs; GPU use not sampled: nvidia-smi not found\n" in done.stdout
    refused = subprocess.run([sys.executable, str(root / "benchmarks" / "recall_grid_time.py"),
                              str(root / "results" / "h100-2026-12-05" / "h200-a.yaml")],
                             capture_output=True, text=True, cwd=root,
                             env={**os.environ, "PYTHONPATH": str(root)})
    assert refused.returncode == 2 and "not a recall results file" in refused.stderr
