"""The runner: the plan of a sweep's points, the call that times each, and the sweep itself.

A sweep crosses mixers x modes x sequence lengths at fixed heads / head_dim / dtype; each
point gives one record (`hla_bench.results.records`). Mixers are reached only through
`hla_bench.registry`. A failure at one point (out of memory, an exception, a missing
package, running past the sweep's point_timeout_s) is recorded as that point's status and
the sweep goes on; once a mixer runs out of memory at some T in a mode, its larger T in
that mode are recorded as out of memory without being tried.

The mixers of a sweep are timed side by side at each shape: every mixer's call at one
(mode, T) is built and warmed up, then sampled in interleaved rounds (one sample of each per
round, `hla_bench.speed.timing`), so a drift of the machine's speed over seconds falls on
every mixer alike and their ratios are the mixers'. Points that replay CUDA graphs are timed
one at a time: a graph bakes in the addresses of the workspaces its kernels used, and a
graph replayed after a library has regrown and freed its workspace for another capture
(cuDNN SDPA does) would touch freed memory.
"""

from __future__ import annotations

import copy
import gc
import time
from typing import Any, Callable, Iterator, NamedTuple

import torch

from hla_bench import registry
from hla_bench.results.tables import format_seq_len
from hla_bench.speed.sweeps import Point, SweepConfig, plan
from hla_bench.results.records import KEPT_STATUSES, empty_record, point_key
from hla_bench.speed.timing import (ESTIMATE_CALLS, CacheFlusher, PointTimeout, Sampling,
                                     cuda_graph_replay, peak_memory_bytes, sample_rounds,
                                     summarize_times, time_limit, warm_up)
from mixers import dispatch

# (sweep name, mixer label, mode) -> the smallest T that ran out of memory
OomAt = dict[tuple[str, str, str], int]


def sampling(sweep: SweepConfig) -> Sampling:
    """How the sweep's points are warmed up and sampled."""
    return Sampling(sweep.warmup, sweep.repeats, sweep.min_time_s, not sweep.warm_cache)


# ---------------------------------------------------------------- inputs and calls


def input_generator(device: str) -> torch.Generator:
    """The seeded generator a point's inputs are drawn from, on the point's device."""
    return torch.Generator(device=device).manual_seed(0)


def _random(shape: tuple[int, ...], device: str, dtype: torch.dtype, generator: torch.Generator,
            *, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Seeded normal values drawn on `generator`'s device (the same numbers for every mixer
    of a shape; drawing tens of millions on the CPU would take seconds a point)."""
    x = torch.randn(*shape, generator=generator, device=generator.device).mul_(scale)
    return x.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def _qkv(prefix: tuple[int, ...], head_dim: int, value_dim: int, device: str, dtype: torch.dtype,
         generator: torch.Generator, requires_grad: bool = False):
    """q, k scaled by head_dim**-0.5 (keeps higher-order products finite), v unit-variance."""
    scale = head_dim ** -0.5
    return (_random((*prefix, head_dim), device, dtype, generator, scale=scale, requires_grad=requires_grad),
            _random((*prefix, head_dim), device, dtype, generator, scale=scale, requires_grad=requires_grad),
            _random((*prefix, value_dim), device, dtype, generator, requires_grad=requires_grad))


class Built(NamedTuple):
    """A point's timed call, warmed up: the call (a CUDA graph's replay when graph-timed),
    the steps one call makes, the tokens one step processes, the seconds one call was
    estimated to take in the warm-up, and for decode the bytes a step moves."""

    call: Callable[[], Any]
    steps: int
    tokens: int
    estimate_s: float | None
    step_bytes: int | None  # decode: the bytes one step moves at least


def build_call(point: Point, mixer: registry.Mixer, options: dict[str, Any],
               record: dict) -> Built:
    """The call that times `point`, warmed up; fills the record's state size, decode
    fields, peak memory, `resolved` (what the mixer's dispatch chose, and the versions of
    the packages whose kernels ran) and `setup_s` (the seconds all this took: input
    creation, compilation and autotuning in the warm-up, the memory measurement)."""
    started = time.perf_counter()
    sweep = point.sweep
    device, dtype = record["device"], getattr(torch, record["dtype"])
    batch, heads, head_dim, value_dim = (record[k] for k in ("batch", "heads", "head_dim", "value_dim"))
    generator = input_generator(device)
    moved = None
    if point.mode == "decode":
        decoder = mixer.decoder(**options)
        state = decoder.init_state(batch, heads, head_dim, value_dim, point.seq_len, device, dtype)
        record["state_bytes"] = int(decoder.state_bytes(state))
        q, k, v = _qkv((batch, heads), head_dim, value_dim, device, dtype, generator)

        def call() -> Any:
            """`decode_steps` tokens from context T: a shallow copy keeps the state's tensors
            but not its bookkeeping, so every call sees the same lengths (a KV cache would
            otherwise grow with each repeat, and cuDNN plans anew for every new length)."""
            current = copy.copy(state)
            with torch.no_grad():
                for _ in range(sweep.decode_steps):
                    out, current = decoder.step(q, k, v, current)
            return out
        steps = sweep.decode_steps
        record["decode_steps"], record["decode_graph"] = sweep.decode_steps, sweep.decode_graph
        tokens = batch
        step_bytes = getattr(decoder, "step_bytes", None)
        moved = step_bytes(state) if step_bytes is not None else 2 * record["state_bytes"]
    elif sweep.level == "layer":
        call = _layer_call(point, mixer, options, batch, heads * head_dim, heads, device,
                           dtype, generator)
        tokens, steps = batch * point.seq_len, 1
    else:
        op = mixer.op(**options)
        backward = point.mode == "fwdbwd"
        q, k, v = _qkv((batch, point.seq_len, heads), head_dim, value_dim, device, dtype,
                       generator, requires_grad=backward)
        if backward:
            cotangent = _random((batch, point.seq_len, heads, value_dim), device, dtype, generator)

            def call() -> Any:
                out, _ = op(q, k, v)
                out.backward(cotangent)
                q.grad = k.grad = v.grad = None  # so the memory before each call is the inputs
        else:
            final_state = point.mode == "prefill"  # the state a decode would continue from

            def call() -> Any:
                with torch.no_grad():
                    return op(q, k, v, output_final_state=final_state)
        tokens = batch * point.seq_len
        steps = 1

    how = sampling(sweep)
    cuda = device.startswith("cuda")
    with dispatch.noting() as notes:
        estimate = warm_up(call, how, cuda)
        graph = point.graph_timed
        record["cuda_graph"] = graph
        if graph:
            call = cuda_graph_replay(call, f"the {point.mode} call")
            estimate = warm_up(call, Sampling(warmup=ESTIMATE_CALLS), cuda)
        record["peak_memory_bytes"] = peak_memory_bytes(call, device)
    record["resolved"] = registry.what_ran(mixer, notes)
    record["setup_s"] = round(time.perf_counter() - started, 3)
    return Built(call, steps, tokens, estimate, moved)


def _layer_call(point: Point, mixer: registry.Mixer, options: dict[str, Any], batch: int,
                d_model: int, heads: int, device: str, dtype: torch.dtype,
                generator: torch.Generator) -> Callable[[], Any]:
    """One call of the mixer's layer (d_model = heads x head dim) on a `[batch, T, d_model]`
    input: forward, or forward and backward of a fixed cotangent (parameter and input
    gradients dropped after each call)."""
    layer = mixer.layer(d_model, heads, **options).to(device=device, dtype=dtype)
    x = _random((batch, point.seq_len, d_model), device, dtype, generator,
                requires_grad=point.mode == "fwdbwd")
    if point.mode != "fwdbwd":
        layer.eval()

        def call() -> Any:
            with torch.no_grad():
                return layer(x)
        return call
    cotangent = _random((batch, point.seq_len, d_model), device, dtype, generator)

    def call() -> Any:
        layer(x).backward(cotangent)
        layer.zero_grad(set_to_none=True)
        x.grad = None
    return call


def _fill_times(point: Point, mixer: registry.Mixer, options: dict[str, Any], record: dict,
                times_ms: list[float], tokens: int) -> None:
    """Median, percentiles, spread and samples of per-step times, and the rates they give."""
    record.update(summarize_times(times_ms))
    seconds = record["median_ms"] / 1e3
    record["tokens_per_s"] = tokens / seconds if seconds > 0 else None
    batch, heads, head_dim, value_dim = (record[k] for k in ("batch", "heads", "head_dim", "value_dim"))
    flops = mixer.model_flops(batch, point.seq_len, heads, head_dim, value_dim, point.mode, **options)
    if flops is not None:
        record["flops"] = float(flops)
        record["tflops"] = flops / seconds / 1e12 if seconds > 0 else None


# ---------------------------------------------------------------- option checks


def check_options(sweep: SweepConfig, mixers: list[registry.Mixer]) -> None:
    """Option values a mixer rejects raise ValueError before anything runs.

    Only the op (and, when the sweep has decode points, the decoder) can tell a bad
    value, so each spec with options is built and called once on a few tokens, on the
    sweep's device and dtype (`mixers`: the registry's mixer of each of the sweep's specs,
    `SweepConfig.check_mixers`). A ValueError or TypeError counts against the options only
    when the same call with the mixer's defaults succeeds: a mixer that fails anyway
    is a result of its points, as in any sweep. Mixers that cannot run here (a missing
    package or device) are not probed; their points are recorded as unavailable."""
    modes = ("fwd", "decode") if "decode" in sweep.modes else ("fwd",)
    for spec, mixer in zip(sweep.mixers, mixers):
        if not spec.options or mixer.unavailable_reason(spec.options):
            continue
        for mode in modes:
            if mode == "decode" and mixer.build_decoder is None:
                continue
            error = _rejection(sweep, mixer, spec.options, mode)
            if error is not None:
                where = "its decoder" if mode == "decode" else "its op"
                raise ValueError(f"sweep {sweep.name!r}: mixer {spec.label!r} "
                                 f"({spec.text()}): {where} rejects the options: {error}")


def _rejection(sweep: SweepConfig, mixer: registry.Mixer, options: dict[str, Any],
               mode: str) -> str | None:
    """The message of the ValueError or TypeError that one small call with `options` raises
    where the same call with the mixer's defaults does not, else None."""
    device, dtype = sweep.resolved_device(), getattr(torch, sweep.resolved_dtype())
    heads, head_dim, value_dim = sweep.heads, sweep.head_dim, sweep.value_dim or sweep.head_dim
    seq_len = min(16, min(sweep.seq_lens))
    prefix = (1, heads) if mode == "decode" else (1, seq_len, heads)
    rejected = None
    for each in (options, {}):
        try:
            inputs = _qkv(prefix, head_dim, value_dim, device, dtype, input_generator(device))
            with time_limit(sweep.point_timeout_s), torch.no_grad():
                if mode == "decode":
                    decoder = mixer.decoder(**each)
                    state = decoder.init_state(1, heads, head_dim, value_dim, seq_len, device,
                                               dtype)
                    decoder.step(*inputs, state)
                else:
                    mixer.op(**each)(*inputs)
        except (ValueError, TypeError) as error:
            if rejected is not None:
                return None  # the defaults fail alike: not the options' fault
            rejected = (f"{type(error).__name__}: {error}" if isinstance(error, TypeError)
                        else str(error))
            continue
        except Exception:  # not the options' fault: left to the points to record
            free_memory()
        return rejected  # None once the options ran; their message once the defaults ran
    return None


# ---------------------------------------------------------------- failures


# How allocation failures read: CUDA's caching allocator ("CUDA out of memory"), torch's
# CPU allocator ("DefaultCPUAllocator: can't allocate memory" or "... not enough memory"),
# and the OS's errno 12 as C libraries report it.
_OOM_MESSAGES = ("out of memory", "defaultcpuallocator", "can't allocate memory",
                 "cannot allocate memory", "not enough memory")


def is_oom(error: BaseException) -> bool:
    """An allocation failure on any device: a point that needs more memory than there is
    (larger T of the same mixer and mode need more still)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(text in message for text in _OOM_MESSAGES)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _oom_key(point: Point) -> tuple[str, str, str]:
    return (point.sweep.name, point.spec.label, point.mode)


def _mark_oom(oom_at: OomAt, point: Point) -> None:
    key = _oom_key(point)
    oom_at[key] = min(point.seq_len, oom_at.get(key, point.seq_len))


def prepare(point: Point, oom_at: OomAt | None) -> tuple[dict[str, Any], tuple | None]:
    """(record, (mixer, options)) for a point to measure, or (final record, None) for one that
    cannot run here (unavailable, unsupported, or past a smaller T that ran out of memory)."""
    record = empty_record(point)
    key = _oom_key(point)
    mixer = registry.get(point.spec.name)
    options = mixer.resolve_options(point.spec.options)
    unavailable = mixer.unavailable_reason(options)
    if unavailable:
        return {**record, "status": "unavailable", "reason": unavailable}, None
    if point.mode == "decode" and mixer.build_decoder is None:
        return {**record, "status": "unsupported", "reason": f"{mixer.name} has no decode form"}, None
    if point.sweep.level == "layer" and mixer.build_layer is None:
        return {**record, "status": "unsupported", "reason": f"{mixer.name} has no layer form"}, None
    if point.graph_timed and not record["device"].startswith("cuda"):
        setting = "cuda_graph" if point.sweep.cuda_graph else "decode_graph"
        return {**record, "status": "unsupported", "reason": f"{setting} needs a CUDA device"}, None
    if oom_at is not None and key in oom_at and point.seq_len > oom_at[key]:
        return {**record, "status": "oom",
                "reason": f"skipped: out of memory at T={format_seq_len(oom_at[key])}"}, None
    return record, (mixer, options)


def failure(error: Exception, points: list[Point], oom_at: OomAt | None) -> dict[str, Any]:
    """The status and reason an exception gives a point (an out-of-memory error marks the
    smallest of `points` in oom_at)."""
    message = f"{type(error).__name__}: {error}".strip()
    if isinstance(error, PointTimeout):
        status, message = "timeout", str(error)
    elif is_oom(error):
        status = "oom"
        if oom_at is not None:
            _mark_oom(oom_at, points[0])
    elif isinstance(error, (registry.MixerUnavailableError, ImportError)):
        status = "unavailable"
    elif isinstance(error, NotImplementedError):
        status = "unsupported"
    else:
        status = "error"
    return {"status": status, "reason": message[:2000]}


def _attempt(points: list[Point], work: Callable[[], None], oom_at: OomAt | None,
             seconds: float | None) -> dict[str, Any] | None:
    """Run work() within `seconds`; None when it succeeds, else the failure's status and
    reason (see `failure`)."""
    failed = None
    try:
        with time_limit(seconds):
            work()
    except Exception as error:  # every failure is a result; the sweep goes on
        failed = failure(error, points, oom_at)
    if failed:  # after the except block, so the traceback's tensors can be freed
        free_memory()
    return failed


# ---------------------------------------------------------------- measuring


def run_point(point: Point, oom_at: OomAt | None = None) -> dict[str, Any]:
    """Measure one point alone; every failure becomes the record's status and reason.

    `oom_at` remembers the smallest T that ran out of memory per (sweep, mixer, mode), so
    larger T for the same mixer and mode are recorded as oom without being tried.
    """
    return run_together([point], oom_at)[0]


class _Ready(NamedTuple):
    """A point built and warmed up, waiting for its samples."""

    index: int
    point: Point
    mixer: registry.Mixer
    options: dict[str, Any]
    built: Built


def run_together(points: list[Point], oom_at: OomAt | None = None,
                 on_point: Callable[[Point], None] | None = None) -> list[dict[str, Any]]:
    """Measure points of one sweep side by side: each is built and warmed up in turn, then
    all are sampled in interleaved rounds (see the module doc). All points' inputs and
    states are held at once; failures are per point as in run_point (a time limit reached
    while sampling is every remaining point's: the rounds' limit is the sum of the points').
    `on_point(point)` is called before each is built."""
    records: list[dict[str, Any]] = []
    ready: list[_Ready] = []
    for point in points:
        if on_point is not None:
            on_point(point)
        record, prepared = prepare(point, oom_at)
        if prepared is not None:
            made = []
            failed = _attempt([point], lambda: made.append(build_call(point, *prepared, record)),
                              oom_at, point.sweep.point_timeout_s)
            if failed:
                record = {**empty_record(point), **failed}
            else:
                ready.append(_Ready(len(records), point, *prepared, made[0]))
        records.append(record)
    if not ready:
        return records
    sweep = points[0].sweep
    device = records[ready[0].index]["device"]
    how = sampling(sweep)
    sampled = []

    def rounds() -> None:
        sampled.append(sample_rounds([each.built.call for each in ready],
                                     [how.count(each.built.estimate_s) for each in ready],
                                     device.startswith("cuda"),
                                     CacheFlusher(device, how.flush_cache)))

    timeout = None if sweep.point_timeout_s is None else sweep.point_timeout_s * len(ready)
    failed = _attempt([each.point for each in ready], rounds, oom_at, timeout)
    for position, each in enumerate(ready):
        if failed:
            records[each.index] = {**empty_record(each.point), **failed}
            continue
        times, errors = sampled[0]
        if position in errors:
            records[each.index] = {**empty_record(each.point),
                                   **failure(errors[position], [each.point], oom_at)}
            continue
        record = records[each.index]
        _fill_times(each.point, each.mixer, each.options, record,
                    [t / each.built.steps for t in times[position]], each.built.tokens)
        if each.built.step_bytes is not None and record["median_ms"] > 0:
            record["bytes_per_s"] = each.built.step_bytes / (record["median_ms"] / 1e3)
    if sampled and sampled[0][1]:  # a call failed while sampling: free what it left
        free_memory()
    return records


def run_sweeps(sweeps: list[SweepConfig],
               on_point: Callable[[int, int, Point], None] | None = None,
               on_record: Callable[[list[dict[str, Any]]], None] | None = None,
               previous: list[dict[str, Any]] = (),
               on_measured: Callable[[dict[str, Any]], None] | None = None,
               ) -> list[dict[str, Any]]:
    """`run_points` over the plan of `sweeps`."""
    return run_points(plan(sweeps), on_point, on_record, previous, on_measured)


def run_points(points: list[Point],
               on_point: Callable[[int, int, Point], None] | None = None,
               on_record: Callable[[list[dict[str, Any]]], None] | None = None,
               previous: list[dict[str, Any]] = (),
               on_measured: Callable[[dict[str, Any]], None] | None = None,
               ) -> list[dict[str, Any]]:
    """Measure planned points (`hla_bench.speed.sweeps.plan`), in their order;
    `on_point(index, total, point)` is called before each,
    `on_record(records_so_far)` after each, and `on_measured(record)` after each point
    measured here (not taken from `previous`), to save it as soon as it exists.
    A point with a record in `previous` (same key, a kept status) is not measured again:
    a sweep cut short can be resumed from its results file. The points of one shape are
    measured together, in rounds (see run_together)."""
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    keys = [point_key(empty_record(point)) for point in points]
    resumed = [kept[key] if key in kept else None for key in keys]
    oom_at: OomAt = {}
    for point, record in zip(points, resumed):
        if record is not None and record["status"] == "oom":
            _mark_oom(oom_at, point)  # a kept out-of-memory point still rules out the larger T
    records: list[dict[str, Any]] = []

    def add(record: dict[str, Any], measured: bool) -> None:
        records.append(record)
        if measured and on_measured is not None:
            on_measured(record)
        if on_record is not None:
            on_record(records)

    for start, group in _timing_groups(points):
        group_resumed = resumed[start:start + len(group)]
        todo = [p for p, record in zip(group, group_resumed) if record is None]
        measured = iter(run_together(
            todo, oom_at,
            on_point and (lambda p: on_point(start + group.index(p), len(points), p))))
        for point, record in zip(group, group_resumed):
            if record is None:
                add(next(measured), True)
            else:
                if on_point is not None:
                    on_point(start + group.index(point), len(points), point)
                add(record, False)
    return records


def _timing_groups(points: list[Point]) -> Iterator[tuple[int, list[Point]]]:
    """(index of the first, points) of consecutive points timed together: the points of one
    sweep, mode and T, except those timed as CUDA-graph replays, which are timed alone."""
    start = 0
    while start < len(points):
        end = start + 1
        while (end < len(points) and _same_shape(points[end], points[start])
               and not points[start].graph_timed):
            end += 1
        yield start, points[start:end]
        start = end


def _same_shape(point: Point, other: Point) -> bool:
    return (point.sweep is other.sweep and point.mode == other.mode
            and point.seq_len == other.seq_len)
