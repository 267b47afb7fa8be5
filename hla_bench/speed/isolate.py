"""Each mixer of a sweep measured in a process of its own (`--isolate`).

A fault that poisons a process (an illegal memory access leaves the CUDA context unusable; a
segmentation fault or an abort ends it) then costs only that mixer's remaining points of
that sweep: they are recorded as errors saying how the process ended, and the sweep goes on
with the next mixer. The child sends each record the moment it is measured, and the parent
stores it at once, so a crash loses no finished point and `--resume` works as usual.

The parent is also the watchdog of the memory its children use. A child the kernel kills
for memory (its out-of-memory killer sends SIGKILL, and counts the kill in /proc/vmstat)
leaves the point it was measuring recorded as `oom` with the reason, and a new child
measures the rest of the mixer's points (the larger T of that mode recorded `oom` untried,
as after an allocation failure); the command itself lives on, so the results file is
completed and its lock released. Children raise their own `oom_score_adj`, so the kernel
picks them before the command. A bench sweep on the CPU runs isolated by default when one
of its points holds a sizeable part of the host's memory (`watched_points`).

Mixers in separate processes are not sampled in interleaved rounds: each mixer's points are
timed in its own process, one after the other, so a drift of the machine between two
mixers' processes is not shared by them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any, Callable

import torch

from hla_bench.results.tables import format_seq_len
from hla_bench.speed.sweeps import Point, point_groups
from hla_bench.results.records import KEPT_STATUSES, empty_record, point_key
from hla_bench.speed.runner import run_points
from hla_bench.processes import exit_with_parent, how_it_ended

# Files with an `oom_kill N` line: the kernel's count of processes its out-of-memory killer
# ended (Linux 4.13 and later; memory-cgroup kills included).
OOM_KILL_COUNTERS: tuple[str, ...] = ("/proc/vmstat",)
# A CPU point whose inputs and outputs alone take this share of the host's memory is
# measured under the watchdog by default.
WATCHED_SHARE = 1 / 16
# The host's memory where /proc/meminfo cannot tell it.
FALLBACK_MEMORY_BYTES = 16 << 30


def oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills so far (the sum of the `oom_kill` lines of
    OOM_KILL_COUNTERS), or None where no counter can be read."""
    total = None
    for path in OOM_KILL_COUNTERS:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            name, _, value = line.partition(" ")
            if name == "oom_kill" and value.strip().isdigit():
                total = (total or 0) + int(value)
    return total


# The memory limit of this process's control group (v2, then v1), where one is visible.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """The memory this process may use: the host's physical memory (MemTotal), or its
    control group's limit where that is lower (a container, a Slurm job)."""
    sizes = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                sizes.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) is no limit
            sizes.append(int(text))
    return min(sizes) if sizes else FALLBACK_MEMORY_BYTES


def watch_threshold_bytes() -> int:
    """The input size past which a CPU point is measured under the watchdog."""
    return int(host_memory_bytes() * WATCHED_SHARE)


def point_bytes(point: Point) -> int:
    """A lower bound of the memory a point holds: q, k, v and the output (a decode point's
    cache of T tokens is as large), twice that with gradients (fwdbwd)."""
    record = empty_record(point)
    itemsize = torch.empty((), dtype=getattr(torch, record["dtype"])).element_size()
    per_token = record["heads"] * (2 * record["head_dim"] + 2 * record["value_dim"]) * itemsize
    return record["batch"] * point.seq_len * per_token * (2 if point.mode == "fwdbwd" else 1)


def watched_points(points: list[Point]) -> list[Point]:
    """The planned CPU points big enough to be measured under the watchdog, in plan order:
    a kernel out-of-memory kill there would otherwise end the command."""
    limit = watch_threshold_bytes()
    return [point for point in points
            if not str(point.sweep.resolved_device()).startswith("cuda")
            and point_bytes(point) >= limit]


def _first_to_kill() -> None:
    """Make this process the kernel's first choice when memory runs out (best effort)."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def _measure_in_child(points: list[Point], previous: list[dict[str, Any]], send,
                      parent: int) -> None:
    exit_with_parent(parent)
    _first_to_kill()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    run_points(points, previous=previous, on_measured=send.send)
    send.close()


def _run_child(context, points: list[Point], previous: list[dict[str, Any]],
               arrived: Callable[[dict[str, Any]], None]) -> int | None:
    """Measure the points of one group in a new child, passing each record to `arrived` as
    it comes; the child's exit code (negative: the signal that ended it)."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_measure_in_child, daemon=True,
                              args=(points, previous, send, os.getpid()))
    process.start()
    send.close()
    try:
        while True:
            try:
                arrived(receive.recv())
            except EOFError:
                break
        process.join()
    finally:
        receive.close()
        if process.is_alive():  # interrupted: the child goes with the command
            process.kill()
            process.join()
    return process.exitcode


def _keyed_groups(points: list[Point], keys: list[str]) -> list[tuple[list[Point], list[str]]]:
    """`point_groups` of the planned points, each with its points' record keys (`keys`:
    the key of each of `points`)."""
    key_of = {id(point): key for point, key in zip(points, keys)}
    return [(group, [key_of[id(point)] for point in group]) for group in point_groups(points)]


def run_points_isolated(points: list[Point], *, previous: list[dict[str, Any]] = (),
                        on_measured: Callable[[dict[str, Any]], None] | None = None,
                        on_point: Callable[[int, int, Point], None] | None = None,
                        ) -> list[dict[str, Any]]:
    """`hla_bench.speed.runner.run_points` with each (sweep, mixer) point group in a fresh
    process; `on_point(index, total, point)` as each measured record arrives. Returns every
    record of the plan (kept and measured), in plan order."""
    context = multiprocessing.get_context("spawn")
    keys = [point_key(empty_record(point)) for point in points]
    index = {key: i for i, key in enumerate(keys)}
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    earlier = {point_key(r): r for r in previous}
    records: dict[str, dict[str, Any]] = {}

    def arrived(record: dict[str, Any]) -> None:
        key = point_key(record)
        records[key] = record
        if on_measured is not None:
            on_measured(record)
        if on_point is not None and key in index:
            on_point(index[key], len(points), points[index[key]])

    for group, group_keys in _keyed_groups(points, keys):
        label = group[0].spec.label
        while True:  # a new child after each out-of-memory kill, for the points left
            known = [records.get(key) or earlier[key] for key in group_keys
                     if key in records or key in earlier]
            before = oom_kills()
            exitcode = _run_child(context, group, known, arrived)
            if exitcode == 0:
                break
            left = [point for point, key in zip(group, group_keys)
                    if key not in records and key not in kept]
            if not left:
                break
            after = oom_kills() if exitcode == -signal.SIGKILL else None
            if before is not None and after is not None and after > before:
                arrived({**empty_record(left[0]), "status": "oom", "reason": (
                    f"out of memory: the kernel's out-of-memory killer ended the process "
                    f"measuring mixer {label!r} {left[0].mode} at "
                    f"T={format_seq_len(left[0].seq_len)} "
                    f"({how_it_ended(exitcode)}; its count of such kills went from {before} "
                    f"to {after})")})
                continue
            reason = (f"the process measuring mixer {label!r} of sweep {group[0].sweep.name!r} "
                      f"ended ({how_it_ended(exitcode)}) before this point was measured")
            for point in left:
                arrived({**empty_record(point), "status": "error", "reason": reason})
            break
    return [records.get(key) or kept.get(key) or empty_record(point)
            for key, point in zip(keys, points)]


# --- on a Dask cluster (`--executor dask`) ------------------------------------------------

def _bench_task(points: list[Point], previous: list[dict]) -> list[dict]:
    """A bench point group on a worker, measured in a fresh child process
    (`run_points_isolated`): a fault there (an illegal address, a hung kernel, a
    poisoned CUDA context, a kill for memory) stays out of the worker and of the other
    mixers' points, and the child dies with its worker. The points it measured before a
    crash come back with the ones the crash cost (errors, or `oom` for a memory kill)."""
    measured: list[dict] = []
    run_points_isolated(points, previous=previous, on_measured=measured.append)
    return measured


def run_points_dask(points: list[Point], scheduler: str | None, *, previous: list[dict],
                    on_measured: Callable[[dict], None], dashboard: bool = False,
                    on_connected: Callable[[Any], Any] | None = None) -> list[dict]:
    """`run_points` on a Dask cluster (`hla_bench.dask_executor`): each (sweep, mixer)
    point group is one task; its measured points reach `on_measured` as the task finishes.
    A task whose worker died twice is recorded as an error point per planned point not kept
    before. A local cluster (no `scheduler`) serves a dashboard when `dashboard` (see
    `connect`); `on_connected(client)` is called once connected. Returns every record of
    the plan (kept and measured), as run_points does."""
    from hla_bench.dask_executor import connect, cuda_device_count, load_distributed

    distributed = load_distributed()
    empty = [empty_record(point) for point in points]
    keys = [point_key(record) for record in empty]
    empty_of = dict(zip(keys, empty))
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    earlier = {point_key(r): r for r in previous}
    tasks = []  # (points, their earlier records, their empty records, on a GPU)
    for group, group_keys in _keyed_groups(points, keys):
        tasks.append((group, [earlier[key] for key in group_keys if key in earlier],
                      [empty_of[key] for key in group_keys],
                      str(group[0].sweep.resolved_device()).startswith("cuda")))
    # timings do not share a GPU: one worker per GPU
    gpus = cuda_device_count() if any(task[3] for task in tasks) else 0
    client = connect(scheduler, gpus=gpus,
                     workers=gpus or min(len(tasks), max(1, (os.cpu_count() or 2) // 2)),
                     dashboard=dashboard)
    if on_connected is not None:
        on_connected(client)
    records: dict = {}
    try:
        futures = {client.submit(_bench_task, group, before, pure=False,
                                 resources={"GPU": 1} if on_gpu else None): planned
                   for group, before, planned, on_gpu in tasks}
        for future in distributed.as_completed(list(futures)):
            try:
                measured = future.result()
            except Exception as error:  # noqa: BLE001 - its worker died twice
                reason = f"{type(error).__name__}: {error}"
                measured = [{**record, "status": "error", "reason": reason}
                            for record in futures[future] if point_key(record) not in kept]
            for record in measured:
                records[point_key(record)] = record
                on_measured(record)
    finally:
        client.close()
    return [records.get(key) or kept.get(key) or record for key, record in zip(keys, empty)]
