"""Dask distributed as the executor of a sweep (`--executor dask`).

The client process plans the work and owns the results file; Dask workers run the tasks:
a recall group (`hla_bench.recall.pool.run_groups_dask`) or a bench point group (one
mixer's points of one sweep, measured in a fresh process on its worker:
`hla_bench.speed.isolate.run_points_dask`). Every finished task comes back to the client,
which stores its records at once, as the local executor does, so `--resume` works across
executors. This module is what both wings share: the cluster (`connect`), its checks and
its description; it imports neither wing.

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
from typing import Any

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


def load_distributed():
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
    load_distributed()
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
    distributed = load_distributed()
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
    distributed = load_distributed()
    return {"cls": distributed.Scheduler, "options": {
        "host": LOOPBACK, "dashboard": dashboard,
        "dashboard_address": DASHBOARD_ADDRESS if dashboard else f"{LOOPBACK}:0"}}


def connect(scheduler: str | None, *, gpus: int, workers: int, dashboard: bool = False):
    """A client of the scheduler at `scheduler`, or of a new local cluster of `workers`
    workers over `gpus` GPUs, or on the CPU without (see `worker_specs`), listening on the
    loopback interface only, with a dashboard when `dashboard`; close it with `.close()` (a
    local cluster is closed with it). What a `scheduler` exposes is its own configuration."""
    distributed = load_distributed()
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


def restart_worker_of(client, future) -> None:
    """Restart the worker that computed `future`: it returned a CUDA fault, after which its
    process cannot use the GPU (a task given to it meanwhile is run again elsewhere)."""
    try:
        holders = client.who_has([future]).get(future.key, ())
        if holders:
            client.restart_workers(list(holders), raise_for_error=False)
    except Exception:  # noqa: BLE001 - a worker already gone needs no restart
        pass


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def describe(client) -> dict[str, Any]:
    """The cluster a sweep ran on, for its results file."""
    info = client.scheduler_info()
    return {"executor": "dask", "scheduler": info.get("address"),
            "workers": len(info.get("workers", {}))}
