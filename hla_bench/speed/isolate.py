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
from hla_bench.speed.sweeps import SweepConfig
from hla_bench.results.records import KEPT_STATUSES, empty_record, point_key
from hla_bench.speed.runner import Point, plan, run_sweeps
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


def watched_points(sweeps: list[SweepConfig]) -> list[Point]:
    """The CPU points of `sweeps` big enough to be measured under the watchdog, in plan
    order: a kernel out-of-memory kill there would otherwise end the command."""
    limit = watch_threshold_bytes()
    return [point for point in plan(list(sweeps))
            if not str(point.sweep.resolved_device()).startswith("cuda")
            and point_bytes(point) >= limit]


def _first_to_kill() -> None:
    """Make this process the kernel's first choice when memory runs out (best effort)."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def point_groups(sweeps: list[SweepConfig]) -> list[dict[str, Any]]:
    """One sweep per (sweep, mixer spec), as a config mapping: the unit measured alone."""
    groups = []
    for sweep in sweeps:
        data = sweep.to_dict()
        for spec in sweep.mixers:
            groups.append({**data, "mixers": [spec.to_dict()]})
    return groups


def group_records(group: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of `records` that belong to the point group `group`."""
    return [r for r in records if r.get("sweep") == group["name"]
            and r.get("mixer") == group["mixers"][0]["label"]]


def _measure_in_child(group: dict[str, Any], previous: list[dict[str, Any]], send,
                      parent: int) -> None:
    exit_with_parent(parent)
    _first_to_kill()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    run_sweeps([SweepConfig.from_dict(group)], previous=previous, on_measured=send.send)
    send.close()


def _run_child(context, group: dict[str, Any], previous: list[dict[str, Any]],
               arrived: Callable[[dict[str, Any]], None]) -> int | None:
    """Measure the point group in a new child, passing each record to `arrived` as it comes;
    the child's exit code (negative: the signal that ended it)."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_measure_in_child, daemon=True,
                              args=(group, previous, send, os.getpid()))
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


def run_sweeps_isolated(sweeps: list[SweepConfig], *, previous: list[dict[str, Any]] = (),
                        on_measured: Callable[[dict[str, Any]], None] | None = None,
                        on_point: Callable[[int, int, Point], None] | None = None,
                        ) -> list[dict[str, Any]]:
    """`hla_bench.speed.runner.run_sweeps` with each (sweep, mixer) point group in a fresh
    process; `on_point(index, total, point)` as each measured record arrives. Returns every
    record of the plan (kept and measured), in plan order."""
    context = multiprocessing.get_context("spawn")
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    planned = plan(list(sweeps))
    index = {point_key(empty_record(point)): i for i, point in enumerate(planned)}
    records: dict[str, dict[str, Any]] = {}

    def arrived(record: dict[str, Any]) -> None:
        key = point_key(record)
        records[key] = record
        if on_measured is not None:
            on_measured(record)
        if on_point is not None and key in index:
            on_point(index[key], len(planned), planned[index[key]])

    for group in point_groups(list(sweeps)):
        label = group["mixers"][0]["label"]
        group_plan = plan([SweepConfig.from_dict(group)])
        while True:  # a new child after each out-of-memory kill, for the points left
            known = {point_key(r): r for r in group_records(group, list(previous))}
            known.update((key, records[key]) for key in
                         map(point_key, map(empty_record, group_plan)) if key in records)
            before = oom_kills()
            exitcode = _run_child(context, group, list(known.values()), arrived)
            if exitcode == 0:
                break
            left = [point for point in group_plan
                    if point_key(empty_record(point)) not in records
                    and point_key(empty_record(point)) not in kept]
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
            reason = (f"the process measuring mixer {label!r} of sweep {group['name']!r} "
                      f"ended ({how_it_ended(exitcode)}) before this point was measured")
            for point in left:
                arrived({**empty_record(point), "status": "error", "reason": reason})
            break
    return [records.get(key) or kept.get(key) or empty_record(point)
            for key, point in ((point_key(empty_record(p)), p) for p in planned)]


# --- on a Dask cluster (`--executor dask`) ------------------------------------------------

def _bench_task(sweep: dict, previous: list[dict]) -> list[dict]:
    """A bench point group on a worker, measured in a fresh child process
    (`hla_bench.speed.isolate`): a fault there (an illegal address, a hung kernel, a
    poisoned CUDA context, a kill for memory) stays out of the worker and of the other
    mixers' points, and the child dies with its worker. The points it measured before a
    crash come back with the ones the crash cost (errors, or `oom` for a memory kill)."""
    measured: list[dict] = []
    run_sweeps_isolated([SweepConfig.from_dict(sweep)], previous=previous,
                        on_measured=measured.append)
    return measured


def run_sweeps_dask(sweeps, scheduler: str | None, *, previous: list[dict],
                    on_measured: Callable[[dict], None], dashboard: bool = False,
                    on_connected: Callable[[Any], Any] | None = None) -> list[dict]:
    """`run_sweeps` on a Dask cluster (`hla_bench.dask_executor`): each (sweep, mixer)
    point group is one task; its measured points reach `on_measured` as the task finishes.
    A task whose worker died twice is recorded as an error point per planned point. A local
    cluster (no `scheduler`) serves a dashboard when `dashboard` (see `connect`);
    `on_connected(client)` is called once connected. Returns every record of the plan (kept
    and measured), as run_sweeps does."""
    from hla_bench.dask_executor import connect, cuda_device_count, load_distributed

    distributed = load_distributed()
    groups = point_groups(sweeps)
    cuda = any(str(sweep.resolved_device()).startswith("cuda") for sweep in sweeps)
    # timings do not share a GPU: one worker per GPU
    gpus = cuda_device_count() if cuda else 0
    client = connect(scheduler, gpus=gpus,
                     workers=gpus or min(len(groups), max(1, (os.cpu_count() or 2) // 2)),
                     dashboard=dashboard)
    if on_connected is not None:
        on_connected(client)
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    records: dict = {}
    try:
        futures = {}
        for group in groups:
            on_gpu = str(SweepConfig.from_dict(group).resolved_device()).startswith("cuda")
            futures[client.submit(_bench_task, group, group_records(group, previous), pure=False,
                                  resources={"GPU": 1} if on_gpu else None)] = group
        for future in distributed.as_completed(list(futures)):
            group = futures[future]
            try:
                measured = future.result()
            except Exception as error:  # noqa: BLE001 - its worker died twice
                reason = f"{type(error).__name__}: {error}"
                measured = []
                for point in plan([SweepConfig.from_dict(group)]):
                    record = empty_record(point)
                    if point_key(record) not in kept:
                        measured.append({**record, "status": "error", "reason": reason})
            for record in measured:
                records[point_key(record)] = record
                on_measured(record)
    finally:
        client.close()
    planned = []
    for point in plan(list(sweeps)):
        key = point_key(empty_record(point))
        planned.append(records.get(key) or kept.get(key) or empty_record(point))
    return planned
