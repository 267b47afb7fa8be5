"""Timing and memory of one call, and the time limit of a point.

Timing (one method for `hla-bench bench` and the scripts in benchmarks/):
- Warm-up: `warmup` untimed calls, and with a time budget (`min_time_s`) more of them until
  a quarter of the budget has passed after the first call (clocks, caches and autotuners
  settle; the first call, which compiles and autotunes, counts in neither). The last warm-up
  calls after the first, each synchronised, estimate the time of one call.
- Samples: `repeats` at least; with `min_time_s`, as many more as the estimate says fill the
  budget, at most MAX_SAMPLES. Each sample times one call.
- On CUDA each sample is a pair of CUDA events around the call, every pair queued with no
  host synchronisation between samples (one at the end); before each sample, outside its
  events, a write over a buffer twice the size of the device's L2 cache evicts what the
  previous call left there (`flush_cache`), so each call reads its inputs from memory as a
  call in a model does. On the CPU each sample is a `time.perf_counter` interval (CPU ops
  are synchronous) and nothing is flushed.
- Points timed together are sampled in interleaved rounds (`sample_rounds`): one sample of
  each point per round, so a drift of the machine's speed falls on all of them alike.
- Python's garbage collector is paused while samples are taken.
- Summary: median and 20th/80th percentiles; the spread is the interquartile range over the
  median (`spread`); the samples themselves are kept (`samples_ms`).

Peak memory above the inputs:
- CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus
  `memory_allocated()` before the call (exact for the caching allocator's tensors).
- CPU: torch's CPU allocator is invisible to tracemalloc, so the process's peak resident
  set is used: free heap pages are handed back (`malloc_trim`), the kernel's peak-RSS mark is
  reset (`/proc/self/clear_refs`), and the rise of VmHWM over VmRSS before the call is
  reported. Approximate: pages the allocator still holds are reused without being counted,
  so it is a lower bound; None where /proc is unavailable.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

# The most samples one point takes, whatever its budget (they are stored with the point).
MAX_SAMPLES = 500
# Warm-up calls whose synchronised times estimate one call.
ESTIMATE_CALLS = 3
# Stored samples are rounded to this many decimals of a millisecond (0.1 us).
SAMPLE_DECIMALS = 4


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (as numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(times_ms: list[float]) -> float | None:
    """Interquartile range over the median (None for a zero median)."""
    median = percentile(times_ms, 50)
    return (percentile(times_ms, 75) - percentile(times_ms, 25)) / median if median > 0 else None


def summarize_times(times_ms: list[float]) -> dict[str, Any]:
    """The record's time fields: median and 20th/80th percentiles in milliseconds, the
    spread, and the samples themselves (rounded to SAMPLE_DECIMALS)."""
    return {"median_ms": percentile(times_ms, 50), "p20_ms": percentile(times_ms, 20),
            "p80_ms": percentile(times_ms, 80), "spread": spread(times_ms),
            "samples_ms": [round(t, SAMPLE_DECIMALS) for t in times_ms]}


@dataclass(frozen=True)
class Sampling:
    """How a point is sampled: `warmup` untimed calls at least, `repeats` samples at least,
    and with `min_time_s` a time budget for the samples (a quarter of it for the warm-up);
    `flush_cache`: evict the L2 cache before each CUDA sample."""

    warmup: int = 3
    repeats: int = 10
    min_time_s: float | None = None
    flush_cache: bool = True

    def count(self, estimate_s: float | None) -> int:
        """Samples for a call estimated at `estimate_s` seconds."""
        if self.min_time_s is None or not estimate_s or estimate_s <= 0:
            return self.repeats
        wanted = math.ceil(self.min_time_s / estimate_s)
        return max(self.repeats, min(wanted, MAX_SAMPLES))


def warm_up(fn: Callable[[], Any], sampling: Sampling, cuda: bool,
            clock: Callable[[], float] = time.perf_counter) -> float | None:
    """The warm-up calls of `sampling`; returns the median seconds of the last
    ESTIMATE_CALLS of them, each synchronised (None when there were none).

    The first call (where kernels compile and autotuners try their configs, seconds to
    minutes) is neither part of the estimate nor of the budget: the budget's quarter starts
    after it, and with a budget at least ESTIMATE_CALLS more calls follow it, so a point
    whose first call compiles is sampled as many times as its later calls' time asks for."""
    budget = None if sampling.min_time_s is None else sampling.min_time_s / 4
    least = max(sampling.warmup, 1 + ESTIMATE_CALLS if budget is not None else 0)
    if least == 0:
        return None
    seconds: list[float] = []
    calls, started = 0, None
    while calls < least or (budget is not None and clock() - started < budget):
        if cuda:
            torch.cuda.synchronize()
        begin = clock()
        fn()
        if cuda:
            torch.cuda.synchronize()
        end = clock()
        calls += 1
        if calls == 1:
            started = end
            if least > 1:
                continue  # the first call only estimates when it is the only one
        seconds = (seconds + [end - begin])[-ESTIMATE_CALLS:]
    return percentile(seconds, 50)


class CacheFlusher:
    """A write over twice the L2 cache of a CUDA device (nothing elsewhere)."""

    _buffers: dict[int, torch.Tensor] = {}

    def __init__(self, device: str, enabled: bool = True):
        self.buffer = None
        if enabled and device.startswith("cuda"):
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
            if index not in self._buffers:
                size = 2 * max(torch.cuda.get_device_properties(index).L2_cache_size, 1 << 20)
                self._buffers[index] = torch.empty(size, dtype=torch.uint8,
                                                   device=f"cuda:{index}")
            self.buffer = self._buffers[index]

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


def sample_rounds(calls: list[Callable[[], Any]], counts: list[int], cuda: bool,
                  flush: Callable[[], None] = lambda: None,
                  clock: Callable[[], float] = time.perf_counter,
                  event: Callable[[], Any] | None = None,
                  ) -> tuple[list[list[float]], dict[int, BaseException]]:
    """Milliseconds of each sample of each call, taken in interleaved rounds: round r times
    once every call i with counts[i] > r, each after `flush()` (outside the timed interval).
    A call that raises takes no more samples: its error is returned by index (PointTimeout
    and interrupts propagate). On CUDA the samples are event pairs with one synchronisation
    at the end (`event` makes an event: a stand-in in tests)."""
    if cuda and event is None:
        event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    pairs: list[list[Any]] = [[] for _ in calls]
    failed: dict[int, BaseException] = {}
    with gc_paused():
        if cuda:
            torch.cuda.synchronize()
        for round_index in range(max(counts, default=0)):
            for index, (fn, count) in enumerate(zip(calls, counts)):
                if round_index >= count or index in failed:
                    continue
                flush()
                try:
                    if cuda:
                        start, end = event(), event()
                        start.record()
                        fn()
                        end.record()
                        pairs[index].append((start, end))
                    else:
                        begin = clock()
                        fn()
                        pairs[index].append((clock() - begin) * 1e3)
                except PointTimeout:
                    raise
                except Exception as error:  # noqa: BLE001 - that call's result
                    failed[index] = error
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return [[start.elapsed_time(end) for start, end in each] for each in pairs], failed
    return pairs, failed


def time_calls(fn: Callable[[], Any], *, warmup: int, repeats: int, device: str,
               clock: Callable[[], float] = time.perf_counter,
               min_time_s: float | None = None, flush_cache: bool = False) -> list[float]:
    """Milliseconds for each sample of `fn` under `Sampling(warmup, repeats, min_time_s,
    flush_cache)`, after its warm-up: the method above for a single call."""
    sampling = Sampling(warmup, repeats, min_time_s, flush_cache)
    cuda = device.startswith("cuda")
    estimate = warm_up(fn, sampling, cuda, clock)
    times, failed = sample_rounds([fn], [sampling.count(estimate)], cuda,
                                  CacheFlusher(device, flush_cache), clock)
    if failed:
        raise failed[0]
    return times[0]


def median_ms(fn: Callable[[], Any], device: str = "cuda", *, warmup: int = 3,
              repeats: int = 10, min_time_s: float | None = 0.25,
              flush_cache: bool = True) -> float:
    """The median of `time_calls` with the harness's defaults for a GPU script: a quarter
    second of samples, the L2 cache flushed between them (what benchmarks/ use, so their
    figures and `hla-bench bench`'s are measured alike)."""
    return percentile(time_calls(fn, warmup=warmup, repeats=repeats, device=device,
                                 min_time_s=min_time_s, flush_cache=flush_cache), 50)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect once, then keep the garbage collector off until the block ends."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cuda_graph_replay(fn: Callable[[], Any], what: str = "the call") -> Callable[[], None]:
    """Capture one call of `fn` (already warmed up, so nothing compiles or autotunes during
    capture) as a CUDA graph; return its replay. A call that cannot be captured raises
    NotImplementedError, which the runner records as unsupported."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:
        raise NotImplementedError(f"{what} cannot be captured as a CUDA graph: "
                                  f"{type(error).__name__}: {error}") from error
    return graph.replay


def _proc_status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise OSError(f"{field_name} not in /proc/self/status")


def _release_free_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_bytes(fn: Callable[[], Any], device: str) -> int | None:
    """Peak memory of one call of `fn` above what was allocated before it (see module doc)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before)
    if device != "cpu":
        fn()
        return None
    _release_free_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _proc_status_kib("VmRSS")
    except OSError:
        fn()
        return None
    fn()
    return max(0, _proc_status_kib("VmHWM") - before) * 1024


class PointTimeout(Exception):
    """A point ran past its sweep's point_timeout_s."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise PointTimeout in this thread once `seconds` have passed (checked between Python
    steps, so a long kernel or autotuning loop ends at its next one). Its message gives the
    time that really passed, which a call that holds the interpreter past the limit makes
    longer than `seconds`, and the limit. No limit when seconds is None, off the main
    thread, or where SIGALRM does not exist."""
    if (seconds is None or not hasattr(signal, "SIGALRM")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    started = time.perf_counter()

    def expire(signum, frame):
        elapsed = time.perf_counter() - started
        raise PointTimeout(f"stopped after {elapsed:.3g} s, past the limit of {seconds:g} s "
                           "(from the sweep's point_timeout_s; checked between Python steps, so "
                           "a call in progress runs to its end); a first call that "
                           "autotunes kernels can take minutes")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
