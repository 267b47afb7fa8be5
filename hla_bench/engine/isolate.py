"""Each mixer of a sweep measured in a process of its own (`--isolate`).

A fault that poisons a process (an illegal memory access leaves the CUDA context unusable; a
segmentation fault or an abort ends it) then costs only that mixer's remaining points of
that sweep: they are recorded as errors saying how the process ended, and the sweep goes on
with the next mixer. The child sends each record the moment it is measured, and the parent
stores it at once, so a crash loses no finished point and `--resume` works as usual.

Mixers in separate processes are not sampled in interleaved rounds: each mixer's points are
timed in its own process, one after the other, so a drift of the machine between two
mixers' processes is not shared by them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any, Callable

from hla_bench.engine.config import SweepConfig
from hla_bench.engine.records import KEPT_STATUSES, empty_record, point_key
from hla_bench.engine.runner import Point, plan, run_sweeps
from hla_bench.processes import exit_with_parent, how_it_ended


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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    run_sweeps([SweepConfig.from_dict(group)], previous=previous, on_measured=send.send)
    send.close()


def run_sweeps_isolated(sweeps: list[SweepConfig], *, previous: list[dict[str, Any]] = (),
                        on_measured: Callable[[dict[str, Any]], None] | None = None,
                        on_point: Callable[[int, int, Point], None] | None = None,
                        ) -> list[dict[str, Any]]:
    """`hla_bench.engine.runner.run_sweeps` with each (sweep, mixer) point group in a fresh
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
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_measure_in_child, daemon=True,
                                  args=(group, group_records(group, list(previous)), send,
                                        os.getpid()))
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
            if process.is_alive():  # interrupted: the child goes with the command
                process.kill()
                process.join()
        if process.exitcode != 0:
            reason = (f"the process measuring mixer {group['mixers'][0]['label']!r} of sweep "
                      f"{group['name']!r} ended ({how_it_ended(process.exitcode)}) before "
                      "this point was measured")
            for point in plan([SweepConfig.from_dict(group)]):
                key = point_key(empty_record(point))
                if key not in records and key not in kept:
                    arrived({**empty_record(point), "status": "error", "reason": reason})
    return [records.get(key) or kept.get(key) or empty_record(point)
            for key, point in ((point_key(empty_record(p)), p) for p in planned)]
