"""Timing and memory of one call, and the time limit of a point.

Timing: `warmup` untimed calls, then `repeats` timed calls; CUDA events on a GPU,
`time.perf_counter` on the CPU (CPU ops are synchronous). Python's garbage collector is
paused while timed calls run. Median and 20th/80th percentiles.

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
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (as numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_times(times_ms: list[float]) -> dict[str, float]:
    """The record's time fields: median and 20th/80th percentiles, in milliseconds."""
    return {"median_ms": percentile(times_ms, 50), "p20_ms": percentile(times_ms, 20),
            "p80_ms": percentile(times_ms, 80)}


def time_calls(fn: Callable[[], Any], *, warmup: int, repeats: int, device: str,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Milliseconds for each of `repeats` calls of `fn` after `warmup` untimed ones. Python's
    garbage collector is paused while they run (as timeit does): a collection of a process
    holding torch and Triton takes milliseconds, and whichever timed call it fell into
    (a host-bound decode run, say) would carry it."""
    for _ in range(warmup):
        fn()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    with gc_paused():
        return timed(fn, repeats, cuda, clock)


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


def timed(fn: Callable[[], Any], repeats: int, cuda: bool,
          clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Milliseconds for each of `repeats` calls of `fn`, nothing else (no warm-up, no
    synchronisation before the first, the garbage collector as the caller left it)."""
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = clock()
            fn()
            times.append((clock() - begin) * 1e3)
    return times


def cuda_graph_replay(fn: Callable[[], Any]) -> Callable[[], None]:
    """Capture one call of `fn` (already warmed up, so nothing compiles or autotunes during
    capture) as a CUDA graph; return its replay. A step that cannot be captured raises
    NotImplementedError, which the runner records as unsupported."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:
        raise NotImplementedError(f"the decode run cannot be captured as a CUDA graph: "
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


def memory_method(device: str) -> str:
    """How `peak_memory_bytes` measures on `device`, as the results file's environment says."""
    if device.startswith("cuda"):
        return "cuda max_memory_allocated minus memory_allocated before the call"
    return "cpu peak-RSS rise (VmHWM after clear_refs, minus VmRSS before); approximate lower bound"


class PointTimeout(Exception):
    """A point ran past its sweep's point_timeout_s."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise PointTimeout in this thread once `seconds` have passed (checked between Python
    steps, so a long kernel or autotuning loop ends at its next one). No limit when seconds is
    None, off the main thread, or where SIGALRM does not exist."""
    if (seconds is None or not hasattr(signal, "SIGALRM")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def expire(signum, frame):
        raise PointTimeout(f"stopped after {seconds:g} s (the sweep's point_timeout_s); a "
                           "first call that autotunes kernels can take minutes")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
