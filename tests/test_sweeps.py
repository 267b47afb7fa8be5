"""Sweep parsing, timing statistics and the runner, with fake mixers registered here.

`fake_mixers` is also used by the other harness tests (imported from this module).
"""

import gc
import importlib.metadata
import time

import pytest
import torch

from hla_bench import registry
from hla_bench.speed import runner
from hla_bench.options import MixerSpec
from hla_bench.speed.sweeps import (SweepConfig, parse_config,
                                     parse_mixer_specs, parse_seq_len, parse_seq_lens,
                                     setting_fields)
from hla_bench.results.records import FIELDS, KEY, empty_record
from hla_bench.results.tables import format_seq_len
from hla_bench.speed.runner import plan, run_sweeps
from hla_bench.speed.timing import (MAX_SAMPLES, Sampling, percentile, sample_rounds,
                                     summarize_times, time_calls, warm_up)


def _fast_op(**options):
    scale = options["scale"]

    def op(q, k, v, initial_state=None, output_final_state=False):
        return v * (q * k).sum(-1, keepdim=True) * scale, None
    return op


class _FastDecoder:
    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        return torch.zeros(batch, heads, head_dim, value_dim, device=device, dtype=dtype)

    def step(self, q, k, v, state):
        state = state + k.unsqueeze(-1) * v.unsqueeze(-2)
        return torch.einsum("bhd,bhdv->bhv", q, state), state

    def state_bytes(self, state):
        return state.numel() * state.element_size()


def _raising(error):
    def build(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            raise error
        return op
    return build


def _slow_op(**options):
    def op(q, k, v, initial_state=None, output_final_state=False):
        for _ in range(200):  # 10 s in short Python steps, as an autotuning loop would take
            time.sleep(0.05)
        return v, None
    return op


FAKES = [
    registry.Mixer("fake-fast", "fake", "elementwise stand-in", _fast_op,
                   build_decoder=lambda **o: _FastDecoder(), options={"scale": 1.0},
                   forms=("op", "decode"),
                   flops=lambda b, t, h, d, dv, mode, **o: 2.0 * b * t * h * (d + dv)),
    registry.Mixer("fake-oom", "fake", "always out of memory",
                   _raising(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")),
                   forms=("op",)),
    registry.Mixer("fake-oom-runtime", "fake", "out of memory as a RuntimeError",
                   _raising(RuntimeError("DefaultCPUAllocator: can't allocate: out of memory")),
                   forms=("op",)),
    registry.Mixer("fake-broken", "fake", "raises", _raising(ValueError("broken on purpose")),
                   forms=("op",)),
    registry.Mixer("fake-slow", "fake", "takes 10 s a call", _slow_op, forms=("op",)),
    registry.Mixer("fake-missing", "fake", "needs a package that is not here", _fast_op,
                   options={"scale": 1.0}, requires=("no_such_package_for_hla_bench",)),
]


@pytest.fixture
def fake_mixers():
    """Register the fakes for one test, then remove them."""
    for mixer in FAKES:
        registry.register(mixer, replace=True)
    yield {m.name: m for m in FAKES}
    for mixer in FAKES:
        registry._REGISTRY.pop(mixer.name, None)


def tiny_sweep(mixers, modes=("fwd",), seq_lens=(16, 32), **overrides):
    values = dict(mixers=[MixerSpec.parse(m) for m in mixers], seq_lens=list(seq_lens),
                  modes=list(modes), batch=2, heads=2, head_dim=8, warmup=1, repeats=3,
                  device="cpu")
    values.update(overrides)
    return SweepConfig(**values)


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("text, expected", [("1k", 1024), ("64k", 65536), ("4K", 4096),
                                            ("300", 300), (" 2k ", 2048), ("1m", 1048576), (7, 7)])
def test_parse_seq_len(text, expected):
    assert parse_seq_len(text) == expected


@pytest.mark.parametrize("text", ["4q", "k", "", "1.5k", "-3", "0", "1kk"])
def test_parse_seq_len_rejects(text):
    with pytest.raises(ValueError, match="sequence length"):
        parse_seq_len(text)


def test_parse_seq_lens_and_format():
    assert parse_seq_lens("1k,4k,16k,64k") == [1024, 4096, 16384, 65536]
    assert [format_seq_len(t) for t in (1024, 65536, 300, 1048576)] == ["1k", "64k", "300", "1m"]
    with pytest.raises(ValueError):
        parse_seq_lens("1k,4q")


def test_parse_mixer_specs():
    specs = parse_mixer_specs("hla2:impl=chunk:label=hla2-chunk,sdpa:backend=cudnn,x:n=3:f=0.5:b=true")
    assert specs[0] == MixerSpec("hla2", "hla2-chunk", {"impl": "chunk"})
    assert specs[1] == MixerSpec("sdpa", "sdpa", {"backend": "cudnn"})
    assert specs[2].options == {"n": 3, "f": 0.5, "b": True}
    assert MixerSpec.from_dict({"name": "hla2", "label": "a", "options": {"impl": "triton"}}) == \
        MixerSpec("hla2", "a", {"impl": "triton"})
    with pytest.raises(ValueError, match="key=value"):
        MixerSpec.parse("hla2:impl")
    assert MixerSpec.parse("x:eps=1e-6").options == {"eps": 1e-6}  # YAML 1.1 reads a string
    for text, message in (("hla2:impl=[", "is not a YAML value"),
                          ("hla2:impl=chunk:impl=scan", "impl is given twice"),
                          ("hla2:label=a:label=b", "label is given twice"),
                          ("hla2:label=", "label= is empty")):
        with pytest.raises(ValueError, match=message):
            MixerSpec.parse(text)
    with pytest.raises(ValueError, match="unknown key 'opts'"):
        MixerSpec.from_dict({"name": "hla2", "opts": {}})


def test_sweep_config_batch_rules_and_errors():
    sweep = tiny_sweep(["a"], batch=None, tokens_per_batch=4096, decode_batch=16,
                       modes=["fwd", "decode"])
    assert [sweep.batch_for(t, "fwd") for t in (1024, 4096, 8192)] == [4, 1, 1]
    assert sweep.batch_for(1024, "decode") == 16
    with pytest.raises(ValueError, match="not both"):
        tiny_sweep(["a"], tokens_per_batch=4096)
    with pytest.raises(ValueError, match="used twice"):
        tiny_sweep(["a", "a"])
    with pytest.raises(ValueError, match="bad mode 'bwd'"):
        tiny_sweep(["a"], modes=["bwd"])
    with pytest.raises(ValueError, match="baseline 'b'"):
        tiny_sweep(["a"], baseline="b")
    with pytest.raises(ValueError, match="bad dtype"):
        tiny_sweep(["a"], dtype="fp8")
    with pytest.raises(ValueError, match="sequence length 16 is given twice"):
        tiny_sweep(["a"], seq_lens=[16, 32, "16"])
    with pytest.raises(ValueError, match="mode 'fwd' is given twice"):
        tiny_sweep(["a"], modes=["fwd", "decode", "fwd"])


def test_parse_config_sweeps_inherit_top_level_keys():
    sweeps = parse_config({"name": "cfg", "heads": 4, "head_dim": 16, "seq_lens": ["1k"],
                           "sweeps": [{"mixers": ["a"]}, {"mixers": ["b"], "head_dim": 32,
                                                          "seq_lens": "2k,4k"}]})
    assert [s.name for s in sweeps] == ["cfg-0", "cfg-1"]
    assert [(s.heads, s.head_dim, s.seq_lens) for s in sweeps] == [(4, 16, [1024]), (4, 32, [2048, 4096])]
    with pytest.raises(ValueError, match="unknown sweep key 'head_dims'"):
        parse_config({"mixers": ["a"], "seq_lens": [1], "head_dims": 3})
    with pytest.raises(ValueError, match="missing key 'mixers'"):
        parse_config({"seq_lens": [1]})


def test_a_config_needs_only_mixers_and_resume_matches_the_matched_settings():
    sweep = SweepConfig.from_dict({"mixers": ["a"]})
    assert (sweep.seq_lens, sweep.modes, sweep.heads, sweep.head_dim) == \
        ([1024, 4096], ["fwd", "fwdbwd", "decode"], 16, 64)
    assert SweepConfig.from_dict({"mixers": ["a"]}).modes is not sweep.modes  # not shared
    matched = {each.name for each in setting_fields() if each.metadata["matched"]}
    assert set(sweep.settings()) == matched == {
        "heads", "head_dim", "value_dim", "batch", "tokens_per_batch", "decode_batch",
        "decode_steps", "decode_graph", "dtype", "device", "warmup", "repeats", "min_time_s",
        "warm_cache", "cuda_graph", "level"}
    assert sweep.settings()["value_dim"] == 64


@pytest.mark.parametrize("key, bad, message", [
    ("warmup", -1, "warmup must be an integer from 0 to 2147483647, got -1"),
    ("heads", 2.0, "heads must be an integer from 1 to 2147483647, got 2.0"),
    ("value_dim", 0, "value_dim must be an integer from 1 to 2147483647, got 0"),
    ("decode_batch", True, "decode_batch must be an integer from 1 to 2147483647, got True"),
    ("dtype", None, "dtype must be a string, got None"),
    ("baseline", 3, "baseline must be a string, got 3"),
])
def test_each_setting_is_checked_by_its_kind(key, bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_sweep(["a"], **{key: bad})


@pytest.mark.slow
def test_records_hold_exactly_the_declared_fields(fake_mixers):
    sweep = tiny_sweep(["fake-fast", "fake-broken", "fake-missing"], modes=["fwd", "decode"])
    records = run_sweeps([sweep])
    assert {r["status"] for r in records} == {"ok", "error", "unavailable", "unsupported"}
    assert all(list(r) == [each.name for each in FIELDS] for r in records)
    assert KEY == ("sweep", "mixer", "name", "options", "mode", "seq_len", "batch", "heads",
                   "head_dim", "value_dim", "dtype", "device")
    empty = empty_record(plan([sweep])[0])
    assert empty["status"] == "ok" and empty["batch"] == 2 and empty["value_dim"] == 8
    assert all(empty[each.name] is None for each in FIELDS if each.planned is None)


# ---------------------------------------------------------------- timing


def test_percentiles_match_numpy_linear():
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0]
    assert percentile(values, 50) == 3.5
    assert percentile(values, 20) == pytest.approx(2.0)
    assert percentile(values, 80) == pytest.approx(5.0)
    assert summarize_times([7.0]) == {"median_ms": 7.0, "p20_ms": 7.0, "p80_ms": 7.0,
                                      "spread": 0.0, "samples_ms": [7.0]}
    summary = summarize_times([1.0, 2.0, 3.0, 4.0, 5.0])
    assert summary["spread"] == pytest.approx((4.0 - 2.0) / 3.0)  # IQR over the median
    assert summary["samples_ms"] == [1.0, 2.0, 3.0, 4.0, 5.0]


class _FakeClock:
    """A clock that each call of the timed function advances by its next duration (s)."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def __call__(self):
        return self.now

    def fn(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


def test_time_calls_with_fake_clock():
    clock = _FakeClock([0.5, 0.5, 0.001, 0.003, 0.002])
    times = time_calls(clock.fn, warmup=2, repeats=3, device="cpu", clock=clock)
    assert clock.calls == 5  # two warm-up calls, then three samples
    assert times == pytest.approx([1.0, 3.0, 2.0])
    assert summarize_times(times)["median_ms"] == pytest.approx(2.0)


def test_a_time_budget_sets_the_warm_up_and_the_number_of_samples():
    clock = _FakeClock([0.01])  # 10 ms a call
    times = time_calls(clock.fn, warmup=1, repeats=3, device="cpu", clock=clock, min_time_s=1.0)
    # the warm-up runs a first call, then a quarter of the budget (25 calls); the samples
    # fill the budget (100)
    assert len(times) == 100 and clock.calls == 126
    assert Sampling(repeats=3, min_time_s=1.0).count(1e-6) == MAX_SAMPLES  # capped
    assert Sampling(repeats=30, min_time_s=1.0).count(0.5) == 30          # at least repeats
    assert Sampling(repeats=7).count(1e-6) == 7                           # no budget
    assert warm_up(lambda: None, Sampling(warmup=0), cuda=False) is None


def test_a_first_call_that_compiles_counts_in_neither_the_budget_nor_the_estimate():
    clock = _FakeClock([30.0, 0.01])  # 30 s of compilation, then 10 ms a call
    estimate = warm_up(clock.fn, Sampling(warmup=2, min_time_s=1.0), cuda=False, clock=clock)
    assert estimate == pytest.approx(0.01)
    assert clock.calls == 1 + 25  # the first call, then a quarter second of calls
    assert Sampling(repeats=3, min_time_s=1.0).count(estimate) == 100
    clock = _FakeClock([30.0, 0.01])
    assert warm_up(clock.fn, Sampling(warmup=1), cuda=False, clock=clock) == 30.0  # alone


class _FakeEvent:
    """A stand-in CUDA event: records the order of recordings in a shared log."""

    log: list = []

    def __init__(self):
        self.at = None

    def record(self):
        self.at = len(self.log)
        self.log.append("event")

    def elapsed_time(self, end):
        return float(end.at - self.at)


def test_cuda_samples_flush_between_event_pairs_and_synchronise_once(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    log = _FakeEvent.log = []
    calls = [lambda: log.append("a"), lambda: log.append("b")]
    times, failed = sample_rounds(calls, [2, 1], cuda=True, flush=lambda: log.append("flush"),
                                  event=_FakeEvent)
    assert not failed and len(syncs) == 2  # one before the samples, one after them all
    # each sample is flush, start, call, end: the flush is never inside a timed pair
    assert log == ["flush", "event", "a", "event", "flush", "event", "b", "event",
                   "flush", "event", "a", "event"]
    assert times == [[2.0, 2.0], [2.0]]


def test_a_call_that_fails_while_sampled_stops_only_its_samples():
    seen = []

    def broken():
        seen.append("x")
        raise ValueError("no")

    times, failed = sample_rounds([lambda: seen.append("a"), broken], [3, 3], cuda=False)
    assert seen == ["a", "x", "a", "a"] and len(times[0]) == 3
    assert list(failed) == [1] and str(failed[1]) == "no"


def test_time_calls_pause_the_garbage_collector_while_timing():
    seen = []
    time_calls(lambda: seen.append(gc.isenabled()), warmup=1, repeats=2, device="cpu")
    assert seen == [True, False, False]  # warm-up collects as usual, timed calls do not
    assert gc.isenabled()


# ---------------------------------------------------------------- the runner


@pytest.mark.slow
def test_runner_records_every_status_and_goes_on(fake_mixers):
    sweep = tiny_sweep(["fake-oom", "fake-oom-runtime", "fake-broken", "fake-missing",
                        "fake-fast:scale=2:label=fast2"], modes=["fwd", "fwdbwd", "decode"])
    seen = []
    points = run_sweeps([sweep], lambda i, n, p: seen.append((i, n, p.describe())))
    assert len(points) == len(plan([sweep])) == 5 * 3 * 2
    assert seen[0][:2] == (0, 30) and seen[-1][0] == 29
    by = {(p["mixer"], p["mode"], p["seq_len"]): p for p in points}

    oom = by["fake-oom", "fwd", 16]
    assert oom["status"] == "oom" and "out of memory" in oom["reason"] and oom["median_ms"] is None
    assert by["fake-oom", "fwd", 32]["reason"].startswith("skipped: out of memory at T=16")
    assert by["fake-oom-runtime", "fwdbwd", 16]["status"] == "oom"
    assert by["fake-broken", "fwd", 32]["status"] == "error"
    assert "ValueError: broken on purpose" in by["fake-broken", "fwd", 32]["reason"]
    assert by["fake-missing", "fwd", 16]["status"] == "unavailable"
    assert "no_such_package_for_hla_bench not installed" in by["fake-missing", "fwd", 16]["reason"]
    assert by["fake-oom", "decode", 16]["status"] == "unsupported"

    for mode in ("fwd", "fwdbwd", "decode"):
        for seq_len in (16, 32):
            ok = by["fast2", mode, seq_len]
            assert ok["status"] == "ok", ok["reason"]
            assert ok["options"] == {"scale": 2} and ok["name"] == "fake-fast"
            assert ok["p20_ms"] <= ok["median_ms"] <= ok["p80_ms"]
            tokens = 2 if mode == "decode" else 2 * seq_len
            assert ok["tokens_per_s"] == pytest.approx(tokens / (ok["median_ms"] / 1e3))
            assert ok["flops"] == 2.0 * 2 * seq_len * 2 * 16
            assert ok["tflops"] == pytest.approx(ok["flops"] / (ok["median_ms"] / 1e3) / 1e12)
            assert ok["peak_memory_bytes"] is None or ok["peak_memory_bytes"] >= 0
    assert by["fast2", "decode", 16]["state_bytes"] == 2 * 2 * 8 * 8 * 4


def test_point_timeout_is_a_result_and_the_sweep_goes_on(fake_mixers):
    # 3 s: room for the fast points on a loaded 2-core machine; a slow point takes 10 s, so
    # the sweep's two slow points alone would take 20 s without the timeout (the bound
    # leaves room for a loaded machine's process starts)
    sweep = tiny_sweep(["fake-slow", "fake-fast"], warmup=0, repeats=1, point_timeout_s=3)
    start = time.perf_counter()
    by = {(p["mixer"], p["seq_len"]): p for p in run_sweeps([sweep])}
    assert time.perf_counter() - start < 18
    slow = by["fake-slow", 16]
    assert slow["status"] == "timeout" and slow["median_ms"] is None
    assert "stopped after 3 s" in slow["reason"] and "point_timeout_s" in slow["reason"]
    assert by["fake-slow", 32]["status"] == "timeout"  # tried again: not a size limit
    assert by["fake-fast", 16]["status"] == by["fake-fast", 32]["status"] == "ok"


@pytest.mark.parametrize("bad", [0, -1, "soon", True, float("inf"), float("nan"), 1e300])
def test_point_timeout_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="point_timeout_s must be a number of seconds above 0"):
        tiny_sweep(["fake-fast"], point_timeout_s=bad)


def test_fwdbwd_runs_backward(fake_mixers, monkeypatch):
    grads = []
    original = torch.Tensor.backward

    def spy(self, gradient=None, *args, **kwargs):
        grads.append(gradient.shape)
        return original(self, gradient, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", spy)
    run_sweeps([tiny_sweep(["fake-fast"], modes=["fwdbwd"], seq_lens=[16])])
    assert grads and set(grads) == {torch.Size([2, 16, 2, 8])}


def test_decode_calls_run_decode_steps_tokens_from_context_t(monkeypatch):
    """A KV cache grows by one token per step: every timed call must still start at context T
    and run `decode_steps` consecutive tokens."""
    from mixers.attention import KVCacheDecoder

    lengths = []
    step = KVCacheDecoder.step

    def spy(self, q, k, v, state):
        lengths.append(state.length)
        return step(self, q, k, v, state)

    monkeypatch.setattr(KVCacheDecoder, "step", spy)
    records = run_sweeps([tiny_sweep(["sdpa:backend=math"], modes=["decode"], seq_lens=[16],
                                     decode_steps=3)])
    assert records[0]["status"] == "ok" and records[0]["decode_steps"] == 3
    assert len(lengths) >= 12 and lengths == [16, 17, 18] * (len(lengths) // 3)


def test_decode_times_are_per_token(fake_mixers, monkeypatch):
    def fixed_times(calls, counts, cuda, flush):
        return [[6.0] * count for count in counts], {}

    monkeypatch.setattr(runner, "sample_rounds", fixed_times)
    sweep = tiny_sweep(["fake-fast"], modes=["fwd", "decode"], seq_lens=[16], decode_steps=4)
    by = {p["mode"]: p for p in run_sweeps([sweep])}
    assert by["fwd"]["median_ms"] == 6.0 and by["fwd"]["decode_steps"] is None
    assert by["decode"]["median_ms"] == by["decode"]["p80_ms"] == 1.5
    assert by["decode"]["tokens_per_s"] == pytest.approx(2 / 1.5e-3)


class _ContextDecoder:
    """Logs the context of every step; runs out of memory from context `oom_from` on, and
    fails at its `fail_at`-th step."""

    def __init__(self, log, oom_from=None, fail_at=None):
        self.log, self.oom_from, self.fail_at = log, oom_from, fail_at

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        if self.oom_from is not None and context_len >= self.oom_from:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return {"context": context_len}

    def step(self, q, k, v, state):
        self.log.append(state["context"])
        if len(self.log) == self.fail_at:
            raise ValueError("step failed on purpose")
        return v, state

    def state_bytes(self, state):
        return 0


def _context_mixer(log, **failures):
    return registry.Mixer("fake-context", "fake", "logs its decode contexts", _fast_op,
                          build_decoder=lambda **o: _ContextDecoder(log, **failures),
                          options={"scale": 1.0})


@pytest.fixture
def context_mixer():
    """A function registering fake-context (with failures) that logs into the list it returns."""
    def register(**failures):
        log = []
        registry.register(_context_mixer(log, **failures), replace=True)
        return log
    yield register
    registry._REGISTRY.pop("fake-context", None)


def _logging_mixer(name, log, fail_at=None):
    """A mixer whose op and decode steps append (name, T) to `log`; its `fail_at`-th call
    raises."""
    calls = []

    def build(**options):
        def op(q, k, v, initial_state=None, output_final_state=False):
            calls.append(1)
            log.append((name, q.shape[1]))
            if len(calls) == fail_at:
                raise ValueError("failed on purpose")
            return v, None
        return op
    return registry.Mixer(name, "fake", "logs its calls", build, options={})


@pytest.fixture
def logging_mixers():
    """A function registering logging mixers by name; they are removed after the test."""
    names = []

    def register(name, log, **failures):
        names.append(name)
        registry.register(_logging_mixer(name, log, **failures), replace=True)
    yield register
    for name in names:
        registry._REGISTRY.pop(name, None)


def test_the_mixers_of_a_sweep_are_timed_in_interleaved_rounds_at_each_shape(logging_mixers):
    log = []
    logging_mixers("log-a", log)
    logging_mixers("log-b", log)
    seen = []
    sweep = tiny_sweep(["log-a", "log-b"], modes=["fwd"], seq_lens=[16, 32], warmup=1,
                       repeats=3)
    records = run_sweeps([sweep], lambda i, n, p: seen.append((i, n, p.spec.name, p.seq_len)))
    assert [(r["mixer"], r["seq_len"]) for r in records] == [
        ("log-a", 16), ("log-b", 16), ("log-a", 32), ("log-b", 32)]
    assert all(r["status"] == "ok" and len(r["samples_ms"]) == 3 for r in records)
    assert seen == [(0, 4, "log-a", 16), (1, 4, "log-b", 16), (2, 4, "log-a", 32),
                    (3, 4, "log-b", 32)]
    # at each T: built one after the other (a warm-up and a memory call each), then sampled
    # in rounds, one call of each mixer per round
    for T, part in ((16, log[:10]), (32, log[10:])):
        assert part == [("log-a", T)] * 2 + [("log-b", T)] * 2 + [("log-a", T), ("log-b", T)] * 3


@pytest.mark.slow
def test_a_failure_while_sampling_is_that_mixers_alone(logging_mixers, context_mixer):
    log = []
    logging_mixers("log-a", log)
    logging_mixers("log-b", log, fail_at=3)  # its first sample, after warm-up and memory call
    records = run_sweeps([tiny_sweep(["log-a", "log-b"], modes=["fwd"], seq_lens=[16],
                                     warmup=1, repeats=3)])
    assert [r["status"] for r in records] == ["ok", "error"]
    assert "failed on purpose" in records[1]["reason"] and records[1]["median_ms"] is None
    assert records[1]["samples_ms"] is None and len(records[0]["samples_ms"]) == 3

    context_mixer(oom_from=32)
    sweep = tiny_sweep(["fake-context"], modes=["decode"], seq_lens=[16, 32, 64])
    by = {r["seq_len"]: r for r in run_sweeps([sweep])}
    assert by[16]["status"] == "ok"
    assert by[32]["status"] == "oom" and "out of memory" in by[32]["reason"]
    assert by[64]["status"] == "oom" and by[64]["reason"].startswith("skipped: out of memory")


@pytest.mark.slow
def test_points_timed_as_graph_replays_are_timed_alone(fake_mixers, monkeypatch):
    grouped = []
    together = runner.run_together
    monkeypatch.setattr(runner, "run_together",
                        lambda points, *a: grouped.append(len(points)) or together(points, *a))
    run_sweeps([tiny_sweep(["fake-fast", "fake-fast:scale=2:label=f2"], modes=["fwd", "decode"],
                           seq_lens=[16, 32])])
    assert grouped == [2, 2, 2, 2]
    grouped.clear()
    records = run_sweeps([tiny_sweep(["fake-fast", "fake-fast:scale=2:label=f2"],
                                     modes=["fwd", "decode"], seq_lens=[16], decode_graph=True)])
    assert grouped == [2, 1, 1]
    assert [r["status"] for r in records] == ["ok", "ok", "unsupported", "unsupported"]
    grouped.clear()
    records = run_sweeps([tiny_sweep(["fake-fast", "fake-fast:scale=2:label=f2"],
                                     modes=["fwd"], seq_lens=[16], cuda_graph=True)])
    assert grouped == [1, 1] and {r["reason"] for r in records} == {
        "cuda_graph needs a CUDA device"}


def test_a_point_records_what_ran(fake_mixers):
    records = run_sweeps([tiny_sweep(["hla2", "mamba2-ssd", "sdpa", "fake-fast"], modes=["fwd"],
                                     seq_lens=[16])])
    by = {r["mixer"]: r["resolved"] for r in records}
    assert by["hla2"]["impl"] == "parallel"   # 16 tokens: within twice the head dim
    assert by["hla2"]["fallback"] == "not triton: no CUDA device"
    assert by["mamba2-ssd"]["impl"] == "chunk"
    assert by["mamba2-ssd"]["fallback"].startswith("not mamba_ssm's Triton kernel: ")
    assert by["sdpa"]["sdpa_backend"] in ("flash", "math", "efficient", "cudnn", "unknown")
    assert by["sdpa"]["packages"]["torch"] == importlib.metadata.version("torch")
    assert by["fake-fast"] == {"packages": by["sdpa"]["packages"]}


@pytest.mark.slow
def test_decode_rounds_keep_resumed_points(context_mixer):
    log = context_mixer()
    sweep = tiny_sweep(["fake-context"], modes=["decode"], seq_lens=[16, 32, 64], warmup=0,
                       repeats=2, decode_steps=1)
    first = run_sweeps([sweep])
    log.clear()
    previous = [first[0], {**first[1], "status": "error"}, first[2]]
    again = run_sweeps([sweep], previous=previous)
    assert again[0] is first[0] and again[2] is first[2] and again[1]["status"] == "ok"
    assert log == [32, 32, 32]  # the memory call and two timed calls, the error point only


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_decode_steps_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="decode_steps must be an integer from 1"):
        tiny_sweep(["fake-fast"], decode_steps=bad)


def test_decode_graph_needs_cuda_and_a_flag(fake_mixers):
    sweep = tiny_sweep(["fake-fast"], modes=["fwd", "decode"], seq_lens=[16], decode_graph=True)
    by = {p["mode"]: p for p in run_sweeps([sweep])}
    assert by["fwd"]["status"] == "ok"
    assert by["decode"]["status"] == "unsupported"
    assert by["decode"]["reason"] == "decode_graph needs a CUDA device"
    with pytest.raises(ValueError, match="decode_graph must be true or false"):
        tiny_sweep(["fake-fast"], decode_graph="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_runs_the_captured_work_and_refuses_host_syncs():
    from hla_bench.speed.timing import cuda_graph_replay

    x = torch.zeros(4, device="cuda")
    replay = cuda_graph_replay(lambda: x.add_(1))
    replay()
    replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4  # capture itself runs nothing
    with pytest.raises(NotImplementedError, match="cannot be captured as a CUDA graph"):
        cuda_graph_replay(lambda: x.sum().item())


def test_cpu_peak_memory_sees_a_large_allocation(fake_mixers):
    from hla_bench.speed.timing import peak_memory_bytes

    size = 64 * 2 ** 20
    measured = peak_memory_bytes(lambda: torch.ones(size // 4).sum(), "cpu")
    if measured is None:
        pytest.skip("/proc peak-RSS reset unavailable here")
    assert 0.8 * size <= measured <= 2 * size


def _allocating_op(**options):
    """Asks torch's CPU allocator for 4 PiB from T = 32 on (a real allocation failure)."""
    def op(q, k, v, initial_state=None, output_final_state=False):
        if q.shape[1] >= 32:
            torch.empty(2 ** 52, dtype=torch.uint8)
        return v, None
    return op


def _memory_error_op(**options):
    def op(q, k, v, initial_state=None, output_final_state=False):
        if q.shape[1] >= 32:
            raise MemoryError()
        return v, None
    return op


@pytest.mark.parametrize("build", [_allocating_op, _memory_error_op])
def test_cpu_allocation_failures_are_oom_and_skip_larger_t(build, monkeypatch):
    registry.register(registry.Mixer("fake-cpu-oom", "fake", "CPU allocation failure", build),
                      replace=True)
    try:
        sweep = tiny_sweep(["fake-cpu-oom"], seq_lens=[16, 32, 64, 128], warmup=0, repeats=1)
        tried = []
        original = runner.build_call
        monkeypatch.setattr(runner, "build_call",
                            lambda point, *a: tried.append(point.seq_len) or original(point, *a))
        records = run_sweeps([sweep])
        assert [r["status"] for r in records] == ["ok", "oom", "oom", "oom"]
        assert records[2]["reason"] == "skipped: out of memory at T=32"
        assert tried == [16, 32]  # larger T are not tried
        tried.clear()
        run_sweeps([sweep], previous=records)
        assert tried == []  # a resume measures nothing again
        run_sweeps([sweep], previous=records[:2])  # cut short after the failure
        assert tried == []  # the kept failure still rules out T = 64 and 128
    finally:
        registry._REGISTRY.pop("fake-cpu-oom", None)


@pytest.mark.slow
def test_prefill_fills_the_state_at_the_decode_batch():
    calls = []
    hla2 = registry.get("hla2")

    def spy(**options):
        inner = hla2.build_op(**options)

        def call(q, k, v, initial_state=None, output_final_state=False):
            calls.append((q.shape[0], output_final_state))
            return inner(q, k, v, initial_state=initial_state,
                         output_final_state=output_final_state)
        return call
    registry.register(registry.Mixer("spy-hla2", "fake", "hla2, logged", spy,
                                     options=dict(hla2.options), flops=hla2.flops))
    try:
        sweep = tiny_sweep(["spy-hla2"], modes=["fwd", "prefill"], seq_lens=[32], batch=None,
                           tokens_per_batch=128, decode_batch=3, warmup=0, repeats=2)
        by = {r["mode"]: r for r in run_sweeps([sweep])}
    finally:
        registry._REGISTRY.pop("spy-hla2", None)
    assert by["prefill"]["status"] == "ok" and by["prefill"]["batch"] == 3
    assert by["fwd"]["batch"] == 4
    assert (3, True) in calls and (4, False) in calls  # prefill keeps the final state
    assert by["prefill"]["flops"] == pytest.approx(by["fwd"]["flops"] * 3 / 4)


@pytest.mark.slow
def test_layer_level_times_the_registry_layer(fake_mixers):
    sweep = tiny_sweep(["linear-attn:short_conv=4", "hla2"], modes=["fwd", "fwdbwd"],
                       seq_lens=[16], level="layer")
    records = run_sweeps([sweep])
    assert [r["status"] for r in records] == ["ok"] * 4
    assert all(r["level"] == "layer" and r["samples_ms"] for r in records)
    assert {r["mixer"] for r in records} == {"linear-attn", "hla2"}
    with pytest.raises(ValueError, match="level layer times the modes fwd and fwdbwd only, "
                                         "not decode"):
        tiny_sweep(["hla2"], modes=["fwd", "decode"], level="layer")
    with pytest.raises(ValueError, match="level must be one of op, layer"):
        tiny_sweep(["hla2"], level="model")
    with pytest.raises(ValueError, match="applies to layers only"):
        tiny_sweep(["linear-attn:short_conv=4"], modes=["fwd"]).check_mixers()


def test_decode_points_record_the_bytes_a_step_moves_per_second(fake_mixers):
    sweep = tiny_sweep(["fake-fast", "sdpa:backend=math"], modes=["decode"], seq_lens=[32],
                       decode_steps=1)
    by = {r["mixer"]: r for r in run_sweeps([sweep])}
    fixed, cache = by["fake-fast"], by["sdpa"]
    assert fixed["bytes_per_s"] == pytest.approx(
        2 * fixed["state_bytes"] / (fixed["median_ms"] / 1e3))  # the state read and written
    per_token = cache["state_bytes"] // 32
    assert cache["bytes_per_s"] == pytest.approx(
        (cache["state_bytes"] + per_token) / (cache["median_ms"] / 1e3))  # the cache read
