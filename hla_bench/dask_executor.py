"""Dask distributed as the executor of a sweep (`--executor dask`).

The client process plans the work and owns the results file; Dask workers run the tasks:
a recall group (`hla_bench.recall.pool.run_group`) or a bench point group (one mixer's points
of one sweep, measured in a fresh process on its worker). Every finished task comes back to
the client, which stores its records at once, as the local executor does, so `--resume`
works across executors.

A local cluster listens on the loopback interface only, without a dashboard unless asked
for (`connect`); its processes end with the command: each worker exits when the command's
process is gone (Dask's nanny pipe), and a bench task's child when its worker is
(`hla_bench.processes.exit_with_parent`).

Without `--scheduler` a local cluster is started: for a recall sweep its workers (the
config's `workers_per_gpu` a GPU) spread over the GPUs, for a bench sweep one worker per
GPU, each worker seeing only its GPU (`CUDA_VISIBLE_DEVICES`); without a GPU, one worker
per CPU slot. GPU tasks ask for the resource `GPU: 1`, so a worker runs one at a time. A
worker that dies loses only its task: the scheduler runs it once more elsewhere and then
gives up, and the task's runs or points are recorded as `crashed`.

`dask[distributed]` is an optional extra (`pip install "hla-bench[dask]"`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable

INSTALL_HINT = 'pip install "hla-bench[dask]"'
# How often a task may lose its worker before it is given up (Dask's allowed-failures):
# once retried, then recorded.
ALLOWED_FAILURES = 1


class DaskUnavailable(RuntimeError):
    """dask.distributed is not installed; the message says how to install it."""


def unavailable_reason() -> str | None:
    """Why --executor dask cannot run here (dask.distributed missing), or None."""
    import importlib.util

    if importlib.util.find_spec("distributed") is None:
        return f"--executor dask needs dask.distributed: {INSTALL_HINT}"
    return None


def _distributed():
    try:
        import distributed
    except ImportError:
        raise DaskUnavailable(unavailable_reason()) from None
    return distributed


def executor_problem(scheduler: str | None) -> str | None:
    """Why `--executor dask` (with `--scheduler`, when given) cannot run a sweep, or None."""
    return unavailable_reason() or (scheduler_problem(scheduler) if scheduler else None)


def scheduler_problem(address: str, timeout: float = 5.0) -> str | None:
    """Why `--scheduler ADDRESS` cannot serve a sweep, found before any work starts: an
    address Dask cannot parse, or (for tcp and tls) nothing accepting a connection there
    within `timeout` seconds. None when it looks usable (other schemes are left to Dask)."""
    _distributed()
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme not in ("tcp", "tls"):
            return None
        host, port = parse_host_port(location)
    except ValueError as error:
        return f"--scheduler {address!r}: {error} (expected tcp://HOST:PORT)"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        return f"--scheduler {address}: no scheduler answers there ({error})"
    return None


# A local cluster listens on the loopback interface only: its scheduler and workers accept
# unauthenticated connections that run code, so no other host may reach them.
LOOPBACK = "127.0.0.1"
# The dashboard of a local cluster, when asked for (`--dashboard`): on the loopback
# interface too (the next free port if this one is taken).
DASHBOARD_ADDRESS = f"{LOOPBACK}:8787"
# The HTTP routes of a local cluster's scheduler and workers without the dashboard: the
# health check alone (Dask always starts an HTTP server; it then listens on a free loopback
# port and serves nothing else).
HEALTH_ONLY = ["distributed.http.health"]


def worker_specs(gpus: int, workers: int, threads: int = 1) -> dict[str, dict]:
    """`workers` Nanny-supervised workers of one thread, listening on the loopback interface
    only. With GPUs they are spread over them round-robin: worker k sees GPU k % gpus alone
    and holds the resource GPU=1, so each runs one GPU task at a time and workers of one GPU
    share it (side by side under CUDA MPS). Without, they are CPU workers of `threads`
    OpenMP threads each."""
    distributed = _distributed()
    count = max(1, workers)
    if gpus:
        return {f"gpu-{k % gpus}" + (f"-{k // gpus}" if count > gpus else ""): {
                    "cls": distributed.Nanny, "options": {
                        "nthreads": 1, "resources": {"GPU": 1}, "host": LOOPBACK,
                        "env": {"CUDA_VISIBLE_DEVICES": str(k % gpus)}}}
                for k in range(count)}
    return {f"cpu-{index}": {"cls": distributed.Nanny, "options": {
                "nthreads": 1, "host": LOOPBACK, "env": {"OMP_NUM_THREADS": str(threads)}}}
            for index in range(count)}


def scheduler_spec(dashboard: bool = False) -> dict[str, Any]:
    """The local cluster's scheduler: on the loopback interface, with the dashboard (on the
    loopback interface too) only when asked for."""
    distributed = _distributed()
    return {"cls": distributed.Scheduler, "options": {
        "host": LOOPBACK, "dashboard": dashboard,
        "dashboard_address": DASHBOARD_ADDRESS if dashboard else f"{LOOPBACK}:0"}}


def connect(scheduler: str | None, *, gpus: int, workers: int, dashboard: bool = False):
    """A client of the scheduler at `scheduler`, or of a new local cluster of `workers`
    workers over `gpus` GPUs, or on the CPU without (see `worker_specs`), listening on the
    loopback interface only, with a dashboard when `dashboard`; close it with `.close()` (a
    local cluster is closed with it). What a `scheduler` exposes is its own configuration."""
    distributed = _distributed()
    import dask

    # A worker holds one task at a time (saturation 1.0): a dying worker then counts
    # against its own task only.
    dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                     "distributed.scheduler.worker-saturation": 1.0,
                     "distributed.worker.daemon": False})  # workers start their own processes
    if scheduler:
        return distributed.Client(scheduler, timeout="30s")
    threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    # the scheduler reads its routes as it starts, each Nanny takes the config its worker
    # processes get (restarts included) as it is made: both happen in SpecCluster()
    routes = {} if dashboard else {"distributed.scheduler.http.routes": HEALTH_ONLY,
                                   "distributed.worker.http.routes": HEALTH_ONLY}
    with dask.config.set(routes):
        cluster = distributed.SpecCluster(
            scheduler=scheduler_spec(dashboard), workers=worker_specs(gpus, workers, threads),
            asynchronous=False)
    client = distributed.Client(cluster)
    client.wait_for_workers(len(cluster.workers), timeout=120)
    original_close = client.close

    def close(*args, **kwargs):
        original_close(*args, **kwargs)
        cluster.close()

    client.close = close
    return client


def _recall_task(group: list[dict], options: dict) -> list[dict] | None:
    """One recall group on a worker (runs stopped by the deadline return None)."""
    from hla_bench.recall.pool import run_group

    if options["deadline"] is not None and time.time() > options["deadline"]:
        return None
    return run_group(group, lambda event: None, **options)


def run_groups_dask(client, groups: list[list[dict]], on_event: Callable[[list[int], dict], None],
                    on_results: Callable[[list[dict]], None], *, deadline: float | None = None,
                    checkpoint_dir: str | None = None, graphs: bool = True,
                    compile: bool = False,
                    task: Callable[[list[dict], dict], list[dict] | None] = _recall_task) -> bool:
    """`hla_bench.recall.pool.run_groups` on a Dask cluster: every group is one `task`;
    results reach `on_results` as each task finishes. Returns False when the deadline left
    work."""
    from hla_bench.recall.pool import CudaFault, failed_result

    distributed = _distributed()
    options = {"deadline": deadline, "checkpoint_dir": checkpoint_dir, "graphs": graphs,
               "compile": compile}
    futures = {}
    for group in groups:
        cuda = str(group[0]["device"]).startswith("cuda")
        # each worker sees one GPU: its device is cuda:0 whatever the plan said
        placed = [{**spec, "device": "cuda:0"} if cuda else spec for spec in group]
        future = client.submit(task, placed, options, pure=False,
                               resources={"GPU": 1} if cuda else None)
        futures[future] = group
        on_event([spec["run_id"] for spec in group], {"event": "submitted"})
    complete = True
    for future in distributed.as_completed(list(futures)):
        group = futures[future]
        try:
            results = future.result()
        except Exception as error:  # noqa: BLE001 - a lost worker (twice) or a dead task
            results = [failed_result(spec, "crashed", f"{type(error).__name__}: {error}")
                       for spec in group]
        if results is None:
            complete = False
            continue
        if isinstance(results, CudaFault):
            _restart_worker_of(client, future)
        # report the planned device, not the worker's view of it
        on_results([{**result, "device": spec["device"]} for result, spec in zip(results, group)])
    return complete


def _restart_worker_of(client, future) -> None:
    """Restart the worker that computed `future`: it returned a CUDA fault, after which its
    process cannot use the GPU (a task given to it meanwhile is run again elsewhere)."""
    try:
        holders = client.who_has([future]).get(future.key, ())
        if holders:
            client.restart_workers(list(holders), raise_for_error=False)
    except Exception:  # noqa: BLE001 - a worker already gone needs no restart
        pass


def _bench_task(sweep: dict, previous: list[dict]) -> list[dict]:
    """A bench point group on a worker, measured in a fresh child process
    (`hla_bench.speed.isolate`): a fault there (an illegal address, a hung kernel, a
    poisoned CUDA context, a kill for memory) stays out of the worker and of the other
    mixers' points, and the child dies with its worker. The points it measured before a
    crash come back with the ones the crash cost (errors, or `oom` for a memory kill)."""
    from hla_bench.speed.sweeps import SweepConfig
    from hla_bench.speed.isolate import run_sweeps_isolated

    measured: list[dict] = []
    run_sweeps_isolated([SweepConfig.from_dict(sweep)], previous=previous,
                        on_measured=measured.append)
    return measured


def run_sweeps_dask(sweeps, scheduler: str | None, *, previous: list[dict],
                    on_measured: Callable[[dict], None], dashboard: bool = False,
                    on_connected: Callable[[Any], Any] | None = None) -> list[dict]:
    """`hla_bench.speed.runner.run_sweeps` on a Dask cluster: each (sweep, mixer) point
    group is one task; its measured points reach `on_measured` as the task finishes. A task
    whose worker died twice is recorded as an error point per planned point. A local
    cluster (no `scheduler`) serves a dashboard when `dashboard` (see `connect`);
    `on_connected(client)` is called once connected. Returns every record of the plan (kept
    and measured), as run_sweeps does."""
    from hla_bench.speed.sweeps import SweepConfig
    from hla_bench.speed.isolate import group_records, point_groups
    from hla_bench.results.records import KEPT_STATUSES, empty_record, point_key
    from hla_bench.speed.runner import plan

    distributed = _distributed()
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


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def describe(client) -> dict[str, Any]:
    """The cluster a sweep ran on, for its results file."""
    info = client.scheduler_info()
    return {"executor": "dask", "scheduler": info.get("address"),
            "workers": len(info.get("workers", {}))}
