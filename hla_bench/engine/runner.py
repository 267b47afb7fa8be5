"""The runner: the plan of a sweep's points, the call that times each, and the sweep itself.

A sweep crosses mixers x modes x sequence lengths at fixed heads / head_dim / dtype; each
point gives one record (`hla_bench.engine.records`). Mixers are reached only through
`hla_bench.registry`. A failure at one point (out of memory, an exception, a missing
package, running past the sweep's point_timeout_s) is recorded as that point's status and
the sweep goes on; once a mixer runs out of memory at some T in a mode, its larger T in
that mode are recorded as out of memory without being tried. The eager decode points of one
mixer are timed in interleaved rounds (one call of each T per round): a decode step is
mostly host work, whose speed drifts over seconds, and in rounds that drift falls on every
T alike, so a difference between them is the context's.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch

from hla_bench import registry
from hla_bench.engine.config import MixerSpec, SweepConfig, format_seq_len
from hla_bench.engine.records import KEPT_STATUSES, empty_record, point_key
from hla_bench.engine.timing import (PointTimeout, cuda_graph_replay, gc_paused,
                                     peak_memory_bytes, summarize_times, time_calls, time_limit,
                                     timed)

# (sweep name, mixer label, mode) -> the smallest T that ran out of memory
OomAt = dict[tuple[str, str, str], int]


@dataclass(frozen=True)
class Point:
    """One planned measurement."""

    sweep: SweepConfig
    spec: MixerSpec
    mode: str
    seq_len: int

    def describe(self) -> str:
        return f"{self.sweep.name} {self.spec.label} {self.mode} T={format_seq_len(self.seq_len)}"


def plan(sweeps: list[SweepConfig]) -> list[Point]:
    """Every point, in run order: sweep, mode, mixer, then increasing T."""
    return [Point(sweep, spec, mode, seq_len)
            for sweep in sweeps for mode in sweep.modes for spec in sweep.mixers
            for seq_len in sorted(sweep.seq_lens)]


# ---------------------------------------------------------------- inputs and calls


def _random(shape: tuple[int, ...], device: str, dtype: torch.dtype, generator: torch.Generator,
            *, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (same numbers on every device)."""
    x = torch.randn(*shape, generator=generator) * scale
    return x.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def _qkv(prefix: tuple[int, ...], head_dim: int, value_dim: int, device: str, dtype: torch.dtype,
         generator: torch.Generator, requires_grad: bool = False):
    """q, k scaled by head_dim**-0.5 (keeps higher-order products finite), v unit-variance."""
    scale = head_dim ** -0.5
    return (_random((*prefix, head_dim), device, dtype, generator, scale=scale, requires_grad=requires_grad),
            _random((*prefix, head_dim), device, dtype, generator, scale=scale, requires_grad=requires_grad),
            _random((*prefix, value_dim), device, dtype, generator, requires_grad=requires_grad))


def build_call(point: Point, mixer: registry.Mixer, options: dict[str, Any],
               record: dict) -> tuple[Callable[[], Any], int, int]:
    """The call that times `point`, warmed up (with decode_graph the replay of its CUDA
    graph), the steps one call makes and the tokens one step processes; fills the record's
    state size, decode fields and peak memory."""
    sweep = point.sweep
    device, dtype = record["device"], getattr(torch, record["dtype"])
    batch, heads, head_dim, value_dim = (record[k] for k in ("batch", "heads", "head_dim", "value_dim"))
    generator = torch.Generator().manual_seed(0)
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
            def call() -> Any:
                with torch.no_grad():
                    return op(q, k, v)
        tokens = batch * point.seq_len
        steps = 1

    for _ in range(sweep.warmup):
        call()
    if point.mode == "decode" and sweep.decode_graph:
        call = cuda_graph_replay(call)
    record["peak_memory_bytes"] = peak_memory_bytes(call, device)
    return call, steps, tokens


def _fill_times(point: Point, mixer: registry.Mixer, options: dict[str, Any], record: dict,
                times_ms: list[float], tokens: int) -> None:
    """Median and percentiles of per-step times, and the rates they give."""
    record.update(summarize_times(times_ms))
    seconds = record["median_ms"] / 1e3
    record["tokens_per_s"] = tokens / seconds if seconds > 0 else None
    batch, heads, head_dim, value_dim = (record[k] for k in ("batch", "heads", "head_dim", "value_dim"))
    flops = mixer.model_flops(batch, point.seq_len, heads, head_dim, value_dim, point.mode, **options)
    if flops is not None:
        record["flops"] = float(flops)
        record["tflops"] = flops / seconds / 1e12 if seconds > 0 else None


# ---------------------------------------------------------------- option checks


def check_options(sweep: SweepConfig) -> None:
    """Option values a mixer rejects raise ValueError before anything runs.

    Only the op (and, when the sweep has decode points, the decoder) can tell a bad
    value, so each spec with options is built and called once on a few tokens, on the
    sweep's device and dtype. A ValueError or TypeError counts against the options only
    when the same call with the mixer's defaults succeeds: a mixer that fails anyway
    is a result of its points, as in any sweep. Mixers that cannot run here (a missing
    package or device) are not probed; their points are recorded as unavailable."""
    modes = ("fwd", "decode") if "decode" in sweep.modes else ("fwd",)
    for spec in sweep.mixers:
        mixer = registry.get(spec.name)
        if not spec.options or mixer.unavailable_reason(spec.options):
            continue
        for mode in modes:
            if mode == "decode" and mixer.build_decoder is None:
                continue
            error = _probe(sweep, mixer, spec.options, mode)
            if error is not None and _probe(sweep, mixer, {}, mode) is None:
                where = "its decoder" if mode == "decode" else "its op"
                raise ValueError(f"sweep {sweep.name!r}: mixer {spec.label!r} "
                                 f"({spec.text()}): {where} rejects the options: {error}")


def _probe(sweep: SweepConfig, mixer: registry.Mixer, options: dict[str, Any],
           mode: str) -> str | None:
    """The message of the ValueError or TypeError one small call raises, else None."""
    device, dtype = sweep.resolved_device(), getattr(torch, sweep.resolved_dtype())
    heads, head_dim, value_dim = sweep.heads, sweep.head_dim, sweep.value_dim or sweep.head_dim
    seq_len = min(16, min(sweep.seq_lens))
    generator = torch.Generator().manual_seed(0)
    try:
        with time_limit(sweep.point_timeout_s), torch.no_grad():
            if mode == "decode":
                decoder = mixer.decoder(**options)
                state = decoder.init_state(1, heads, head_dim, value_dim, seq_len, device,
                                           dtype)
                decoder.step(*_qkv((1, heads), head_dim, value_dim, device, dtype,
                                   generator), state)
            else:
                mixer.op(**options)(*_qkv((1, seq_len, heads), head_dim, value_dim,
                                          device, dtype, generator))
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}" if isinstance(error, TypeError) else str(error)
    except Exception:  # not the options' fault: left to the points to record
        free_memory()
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
    if point.mode == "decode" and point.sweep.decode_graph and not record["device"].startswith("cuda"):
        return {**record, "status": "unsupported", "reason": "decode_graph needs a CUDA device"}, None
    if oom_at is not None and key in oom_at and point.seq_len > oom_at[key]:
        return {**record, "status": "oom",
                "reason": f"skipped: out of memory at T={format_seq_len(oom_at[key])}"}, None
    return record, (mixer, options)


def _attempt(points: list[Point], work: Callable[[], None], oom_at: OomAt | None,
             seconds: float | None) -> dict[str, Any] | None:
    """Run work() within `seconds`; None when it succeeds, else the failure's status and
    reason (an out-of-memory error marks the smallest of `points` in oom_at)."""
    failed = None
    try:
        with time_limit(seconds):
            work()
    except Exception as error:  # every failure is a result; the sweep goes on
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
        failed = {"status": status, "reason": message[:2000]}
    if failed:  # after the except block, so the traceback's tensors can be freed
        free_memory()
    return failed


# ---------------------------------------------------------------- measuring


def run_point(point: Point, oom_at: OomAt | None = None) -> dict[str, Any]:
    """Measure one point; every failure becomes the record's status and reason.

    `oom_at` remembers the smallest T that ran out of memory per (sweep, mixer, mode), so
    larger T for the same mixer and mode are recorded as oom without being tried.
    """
    record, prepared = prepare(point, oom_at)
    if prepared is None:
        return record

    def measure() -> None:
        call, steps, tokens = build_call(point, *prepared, record)
        times = time_calls(call, warmup=0, repeats=point.sweep.repeats, device=record["device"])
        _fill_times(point, *prepared, record, [t / steps for t in times], tokens)

    failed = _attempt([point], measure, oom_at, point.sweep.point_timeout_s)
    return {**empty_record(point), **failed} if failed else record


class _BuiltPoint(NamedTuple):
    """A decode point ready for the rounds: its record's index, the call and its figures."""

    index: int
    point: Point
    mixer: registry.Mixer
    options: dict[str, Any]
    call: Callable[[], Any]
    steps: int
    tokens: int


def run_decode_points(points: list[Point], oom_at: OomAt | None = None,
                      on_point: Callable[[Point], None] | None = None) -> list[dict[str, Any]]:
    """Measure the decode points of one mixer in one sweep (increasing T) side by side: each
    is built and warmed up, then `repeats` rounds time one call of every point in turn (see
    the module doc for why). All points' states are held at once; failures are per point as
    in run_point (a failure while timing the rounds is every remaining point's), and the
    rounds' time limit is the sum of the points'. `on_point(point)` is called before each
    is built."""
    records: list[dict[str, Any]] = []
    built: list[_BuiltPoint] = []
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
                built.append(_BuiltPoint(len(records), point, *prepared, *made[0]))
        records.append(record)
    if not built:
        return records
    sweep = points[0].sweep
    cuda = records[built[0].index]["device"].startswith("cuda")
    times: list[list[float]] = [[] for _ in built]

    def rounds() -> None:
        if cuda:
            torch.cuda.synchronize()
        with gc_paused():
            for _ in range(sweep.repeats):
                for each, times_of in zip(built, times):
                    times_of.extend(t / each.steps for t in
                                    timed(each.call, 1, cuda, time.perf_counter))

    timeout = None if sweep.point_timeout_s is None else sweep.point_timeout_s * len(built)
    failed = _attempt([each.point for each in built], rounds, oom_at, timeout)
    for each, times_of in zip(built, times):
        if failed:
            records[each.index] = {**empty_record(each.point), **failed}
        else:
            _fill_times(each.point, each.mixer, each.options, records[each.index], times_of,
                        each.tokens)
    return records


def run_sweeps(sweeps: list[SweepConfig],
               on_point: Callable[[int, int, Point], None] | None = None,
               on_record: Callable[[list[dict[str, Any]]], None] | None = None,
               previous: list[dict[str, Any]] = (),
               on_measured: Callable[[dict[str, Any]], None] | None = None,
               ) -> list[dict[str, Any]]:
    """Run every planned point; `on_point(index, total, point)` is called before each,
    `on_record(records_so_far)` after each, and `on_measured(record)` after each point
    measured here (not taken from `previous`), to save it as soon as it exists.
    A point with a record in `previous` (same key, a kept status) is not measured again:
    a sweep cut short can be resumed from its results file. The eager decode points of one
    mixer in a sweep are measured together, in rounds (see run_decode_points)."""
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    points = plan(sweeps)
    oom_at: OomAt = {}
    for point in points:  # a kept out-of-memory point still rules out the larger T
        record = kept.get(point_key(empty_record(point)))
        if record is not None and record["status"] == "oom":
            _mark_oom(oom_at, point)
    records: list[dict[str, Any]] = []

    def add(record: dict[str, Any], measured: bool) -> None:
        records.append(record)
        if measured and on_measured is not None:
            on_measured(record)
        if on_record is not None:
            on_record(records)

    for start, group in _timing_groups(points):
        resumed = [kept.get(point_key(empty_record(p))) for p in group]
        todo = [p for p, record in zip(group, resumed) if record is None]
        if len(todo) > 1:
            measured = iter(run_decode_points(
                todo, oom_at,
                on_point and (lambda p: on_point(start + group.index(p), len(points), p))))
            for record in resumed:
                add(record or next(measured), record is None)
            continue
        for offset, (point, record) in enumerate(zip(group, resumed)):
            if on_point is not None:
                on_point(start + offset, len(points), point)
            add(record if record is not None else run_point(point, oom_at), record is None)
    return records


def _timing_groups(points: list[Point]) -> Iterator[tuple[int, list[Point]]]:
    """(index of the first, points) of consecutive points timed together: the eager decode
    points of one mixer in a sweep, every other point alone."""
    start = 0
    while start < len(points):
        end = start + 1
        while (_in_rounds(points[start]) and end < len(points)
               and _same_mixer(points[end], points[start])):
            end += 1
        yield start, points[start:end]
        start = end


def _in_rounds(point: Point) -> bool:
    """Eager decode points are timed in rounds. CUDA-graph replays are not host-bound, and
    they are timed one point at a time: a graph bakes in the addresses of the workspaces its
    kernels used, so a graph replayed after a library has regrown and freed its workspace
    for another point's capture (cuDNN SDPA does) would touch freed memory."""
    return point.mode == "decode" and not point.sweep.decode_graph


def _same_mixer(point: Point, other: Point) -> bool:
    return (point.sweep is other.sweep and point.spec == other.spec
            and point.mode == other.mode)
