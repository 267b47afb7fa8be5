"""The harness side of recall training: models from the registry, groups of runs on a pool
of worker processes, and the summary of a sweep's runs.

`hla_bench.recall.train.train_group` trains one group (runs that differ only in lr, weight
decay and seed) as one stacked model. Here the groups a sweep's plan made
(`hla_bench.recall.plan.plan_groups`) go to worker processes (spawned: CUDA needs it) or to a Dask
cluster (`run_sweep`, the one entry for either), and every finished run comes back as an
event so the caller can store it at once. A group that runs
out of memory beside other groups waits for them: it goes back to the head of the queue and,
until it has finished, the pool starts no more groups at once than were still running
(memory, not the worker count, then bounds the groups on a GPU; the smaller groups after it
run side by side again). A group counts as beside others when any other may run during its
run, including groups started after it. Out of memory with no other group running splits the
group in two and retries; any other failure is recorded on each of its runs (a
NotImplementedError, a shape its mixer refuses, as unsupported). A CUDA fault (a device-side
assert, an illegal address) leaves its process unable to use the GPU again and, under CUDA
MPS, may break the groups running beside it: the worker is replaced, and a group that
faulted beside others runs again alone before the fault is recorded as its own.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import os
import queue as queue_module
import signal
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

import torch

import tasks
from hla_bench import registry
from hla_bench.processes import exit_with_parent
from hla_bench.safe_files import path_in, refuse_symlink
from mixers import dispatch
from mixers.common import inputs_trusted_finite
from hla_bench.recall.model import TinyLM
from hla_bench.recall.train import Interrupted, RunSpec, seq_lens, train_group

def build_model(spec: dict) -> TinyLM:
    """The tiny LM of one run, its mixer layers from the registry. Positions (`positions`):
    "auto" gives softmax attention learned positions (the other families carry order in
    their state), "learned" every mixer, "none" no mixer. Its length is the longest of
    the run's sequences (every slice of its mixes)."""
    run = RunSpec(**spec)
    task = tasks.get(run.task)
    params = task.resolve_params(run.params)
    entry = registry.get(run.mixer)
    positions = run.positions == "learned" or (run.positions == "auto"
                                               and entry.family == "softmax")
    return TinyLM(params["vocab_size"], run.d_model,
                  lambda: entry.layer(run.d_model, run.n_heads, **run.mixer_options),
                  n_layers=run.n_layers, state_mixer=run.state_mixer,
                  positions=positions, embed_dropout=run.embed_dropout,
                  max_len=max(seq_lens(spec)), readout=task.readout, init=run.init,
                  norm=run.norm, head=run.head, swiglu_hidden=run.swiglu_hidden,
                  decoder=run.decoder)


def group_name(group: list[dict]) -> str:
    """A stable file name for a group's checkpoint (from its runs' specs)."""
    text = "\n".join(repr(sorted((k, repr(v)) for k, v in spec.items() if k != "device"))
                     for spec in group)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# The code that decides what a checkpoint holds and how training goes on from it: whole
# packages, and files of hla_bench.
_CODE_PACKAGES = ("mixers", "tasks", "hla_bench.recall.kernels")
_CODE_FILES = ("recall/pool.py", "recall/model.py", "recall/stacked.py", "recall/train.py",
               "registry.py")
_code_version: str | None = None


def code_version() -> str:
    """The version of the code a checkpoint is continued with: a sha256 (first 20 hex
    digits) of the source of the mixers, tasks and recall kernels packages, of this module,
    the model, the stacked model, the training step and the registry, computed once per
    process. A checkpoint written by other code (an edit, a checkout of another commit, a
    dirty tree) has another version and is never loaded."""
    global _code_version
    if _code_version is None:
        root = Path(__file__).resolve().parents[1]
        sources = [root / name for name in _CODE_FILES]
        for package in _CODE_PACKAGES:
            module = importlib.import_module(package)
            sources += sorted(Path(module.__file__).resolve().parent.rglob("*.py"))
        digest = hashlib.sha256()
        for source in sources:
            digest.update(f"{source.parent.name}/{source.name}\0".encode())
            digest.update(source.read_bytes())
            digest.update(b"\0")
        _code_version = digest.hexdigest()[:20]
    return _code_version


def remove_checkpoints(folder: str | Path) -> int:
    """Remove the checkpoints (`*.pt`) and their temporary files left in `folder` by an
    earlier run; the number removed. Nothing else in the folder is touched, and a
    `folder` that is a symbolic link is refused (UnsafePathError): its files are not ours."""
    folder = refuse_symlink(folder, "checkpoint folder")
    if not folder.is_dir():
        return 0
    removed = 0
    for leftover in [*folder.glob("*.pt"), *folder.glob("*.pt.*.tmp")]:
        if leftover.is_file() or leftover.is_symlink():
            leftover.unlink()
            removed += 1
    return removed


def failed_result(spec: dict, status: str, message: str) -> dict:
    return {**spec, "status": status, "error": message, "test_accuracy": None,
            "val_accuracy": None, "curve": []}


# What run_group returns for a group that ran out of memory while other groups may have run
# (`shared`): the caller runs it again once fewer groups run at once.
RETRY_WITH_FEWER = "out of memory beside other groups: retry with fewer at once"


# What run_group returns for a group whose CUDA context broke while other groups may have
# been running beside it (under MPS one client's fault can end the others'): the caller runs
# it again alone, in a fresh worker, to learn whether the fault is its own.
RETRY_ALONE = "CUDA fault beside other groups: retry alone"


class CudaFault(list):
    """A group's failed results after a CUDA fault of its own: its process can no longer use
    the GPU, so the caller replaces the worker that returns it."""


def is_cuda_fault(error: BaseException) -> bool:
    """Whether `error` is a CUDA error other than running out of memory (a device-side assert,
    an illegal address, a launch failure); most leave the CUDA context unusable."""
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return not is_oom(error) and (isinstance(error, accelerator_error)
                                  or "CUDA error" in str(error))


def is_oom(error: BaseException) -> bool:
    """Whether `error` says memory ran out (CUDA's allocator, cuBLAS's handle, the host)."""
    text = str(error)
    return (isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError))
            or "out of memory" in text.lower() or "can't allocate memory" in text
            or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def run_group(group: list[dict], progress: Callable[[dict], None], *,
              deadline: float | None = None, checkpoint_dir: str | None = None,
              graphs: bool = True, compile: bool = False, shared: bool = False,
              isolated: bool = True,
              state_bytes: dict[int, dict] | None = None) -> list[dict] | str | None:
    """Train one group; returns its results, or None when stopped at the deadline (its
    checkpoint holds the state). `state_bytes`: run_id -> the state bytes the plan counted
    for the run (`hla_bench.recall.plan.Shape.state`), which its record holds (None
    where the plan gave none). Out of memory: with `shared` (other groups may run during
    its run) RETRY_WITH_FEWER, else the group splits in two and retries. A CUDA
    fault: RETRY_ALONE unless `isolated` (no other group ran beside it), else its failed
    results as a CudaFault."""
    name = group_name(group)
    checkpoint = path_in(checkpoint_dir, name, "checkpoint name", ".pt") if checkpoint_dir else None
    split = False
    try:
        # what the group's first eager forward ran: its first training step's (eager on the
        # CPU, and on CUDA before the step is captured as a graph), or with `compile`, whose
        # steps note nothing, its first evaluation's (evaluations are never compiled)
        # a model's own activations are finite: the ops skip the non-finite rule's passes
        with dispatch.noting(keep="first") as notes, inputs_trusted_finite():
            results = train_group(group, build_model, progress=progress, graphs=graphs,
                                  compile=compile, deadline=deadline, checkpoint=checkpoint,
                                  code_version=code_version())
        ran = registry.what_ran(registry.get(group[0]["mixer"]), dict(notes))
        for result in results:
            result["mixer_path"] = ran
    except Interrupted:
        return None
    except Exception as error:  # noqa: BLE001 - a sweep records any failing group, goes on
        oom = is_oom(error)
        if oom and shared:
            return RETRY_WITH_FEWER
        split = oom and len(group) > 1
        unsupported = isinstance(error, NotImplementedError)
        if not oom and not unsupported:
            traceback.print_exc()
        fault = is_cuda_fault(error)
        if fault and not isolated:
            return RETRY_ALONE
        status = "oom" if oom else "unsupported" if unsupported else "error"
        message = (str(error).splitlines()[0] if oom or unsupported
                   else f"{type(error).__name__}: {error}")
        results = [failed_result(spec, status, message) for spec in group]
        if fault:
            results = CudaFault(results)
    finally:
        # outside the except clause: the error's traceback, which holds the failed group's
        # frames and through them its model, is gone, so its memory is freed here
        _release_memory()
    if split:  # out of memory alone: each half gets the memory the whole group had
        half = len(group) // 2
        parts = [run_group(part, progress, deadline=deadline, checkpoint_dir=checkpoint_dir,
                           graphs=graphs, compile=compile, state_bytes=state_bytes)
                 for part in (group[:half], group[half:])]
        return None if any(part is None for part in parts) else parts[0] + parts[1]
    first = group[0]  # the runs of a group share the mixer, its options and the shapes
    planned = (state_bytes[first["run_id"]] if state_bytes and first["run_id"] in state_bytes
               else {"per_layer": None, "slices": {}})
    size, per_layer = planned["per_layer"], planned["slices"]
    for result in results:
        result["state_bytes_per_layer"] = size
        result["state_bytes"] = None if size is None else size * first["n_layers"]
        for part in (result["test_slices"] if "test_slices" in result else None) or []:
            length = part["seq_len"]
            part["state_bytes_per_layer"] = per_layer[length] if length in per_layer else None
    return results


def _release_memory() -> None:
    """Free what a finished or failed group left on the GPU. A group's trainer and its
    captured step refer to each other, so only the cycle collector frees them (with their
    model, optimizer state and graph pools); then the allocator's cache goes back to the
    device, for the groups of other processes."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a CUDA fault breaks this too; the caller knows
            pass


# --- worker processes ----------------------------------------------------------------


_EVENTS = None  # a worker's queue of progress events to the parent (set at its start)


def _init_worker(threads: int, parent: int, events) -> None:
    global _EVENTS
    exit_with_parent(parent)
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    _EVENTS = events


def _worker(group: list[dict], options: dict) -> list[dict] | str | None:
    ids = [spec["run_id"] for spec in group]
    return run_group(group, lambda event: _EVENTS.put((ids, event)), **options)


# After a deadline, the seconds a worker's group gets to reach a step, save its checkpoint
# and return before its process is killed (a compilation or a CUDA graph capture does not
# look at the clock; a killed group resumes from its last checkpoint, or from the start).
STOP_GRACE_S = 45.0


def run_groups(groups: list[list[dict]], workers: int,
               on_event: Callable[[list[int], dict], None],
               on_results: Callable[[list[dict]], None], *, deadline: float | None = None,
               checkpoint_dir: str | None = None, graphs: bool = True,
               compile: bool = False, state_bytes: dict[int, dict] | None = None) -> bool:
    """Run every group (`run_group`, with the plan's `state_bytes`); `on_event(run_ids,
    event)` sees progress, `on_results(results)` each finished group. Returns False when the deadline stopped some group (checkpointed) or
    left some unstarted. One worker runs in this process; more are spawned processes, killed
    STOP_GRACE_S seconds after the deadline if they have not returned by then. A group that
    runs out of memory beside others goes back to the head of the queue, and until it has
    finished at most as many groups run at once as were still running (`on_event` gets a
    "retry" event naming that number, and an "at_once" event with the number that holds
    once the last such group has finished). A CUDA fault retires the pool once its running
    groups are back (a new one takes the rest); a group that faulted beside others goes back
    to the head of the queue and runs alone (a "retry" event with `alone`). In this process,
    a CUDA fault ends the sweep (False): the process cannot use the GPU again, and --resume
    continues in a fresh one."""
    options = {"deadline": deadline, "checkpoint_dir": checkpoint_dir, "graphs": graphs,
               "compile": compile, "state_bytes": state_bytes}
    complete = True
    if workers <= 1:
        for group in groups:
            if deadline is not None and time.time() > deadline:
                return False
            ids = [spec["run_id"] for spec in group]
            results = run_group(group, lambda event, ids=ids: on_event(ids, event), **options)
            if results is None:
                complete = False
            else:
                on_results(list(results))
                if isinstance(results, CudaFault):
                    return False
        return complete

    import multiprocessing

    context = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    # A plain queue inherited by the workers (no manager process to outlive the sweep).
    events = context.Queue()

    def new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                   initargs=(threads, os.getpid(), events))

    pool = new_pool()
    try:
        todo = list(groups)
        pending: dict = {}
        killed = False
        # id() of each group that ran out of memory beside others -> how many groups may
        # run at once until it has finished; the pool starts at most the least of them
        limits: dict[int, int] = {}

        def allowed() -> int:
            return min([workers, *limits.values()])

        alone: set[int] = set()  # id() of groups that run with no other group beside them
        retiring = False  # a worker of the pool faulted: start nothing more in this pool
        while todo or pending:
            at_once = allowed()
            while todo and len(pending) < at_once and not retiring:
                if deadline is not None and time.time() > deadline:
                    complete, todo = False, []
                    break
                if pending and (id(todo[0]) in alone
                                or any(id(g) in alone for g in pending.values())):
                    break
                group = todo.pop(0)
                # a group is shared when any other group may run during its run: one
                # already running, or one the pool may start beside it later
                isolated = not pending and (at_once == 1 or id(group) in alone)
                beside_others = {**options, "shared": not isolated, "isolated": isolated}
                pending[pool.submit(_worker, group, beside_others)] = group
            if not pending:
                if retiring and todo:
                    _retire(pool)
                    pool, retiring = new_pool(), False
                    continue
                break
            if (deadline is not None and not killed
                    and time.time() > deadline + STOP_GRACE_S):
                # a group still compiling (or otherwise not at a step) past the grace: its
                # process goes (the pool's processes are this one's only children), and the
                # group resumes from its last checkpoint
                killed = True
                for process in multiprocessing.active_children():
                    process.kill()
            done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(events, on_event)
            for future in done:
                group = pending.pop(future)
                ids = [spec["run_id"] for spec in group]
                try:
                    results = future.result()
                except BrokenProcessPool as error:
                    results = None if killed else [failed_result(spec, "crashed", str(error))
                                                   for spec in group]
                except Exception as error:  # noqa: BLE001 - a result that could not come back
                    results = [failed_result(spec, "crashed", f"{type(error).__name__}: {error}")
                               for spec in group]
                if results == RETRY_WITH_FEWER:
                    todo.insert(0, group)
                    limits[id(group)] = max(1, min(allowed() - 1, len(pending)))
                    on_event(ids, {"event": "retry", "at_once": limits[id(group)]})
                    continue
                if results == RETRY_ALONE:
                    retiring = True
                    todo.insert(0, group)
                    alone.add(id(group))
                    on_event(ids, {"event": "retry", "at_once": 1, "alone": True})
                    continue
                if limits.pop(id(group), None) is not None and not limits:
                    # the last group that needed fewer at once has finished, or stopped
                    on_event(ids, {"event": "at_once", "at_once": workers})
                if results is None:
                    complete = False
                else:
                    retiring = retiring or isinstance(results, CudaFault)
                    on_results(list(results))
        _drain(events, on_event)
    finally:
        _retire(pool)
    return complete


def _retire(pool: ProcessPoolExecutor) -> None:
    """Shut `pool` down; a worker not gone within seconds (a broken CUDA context can hang
    its exit) is killed."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.time() + 10.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.time()))
        if process.is_alive():
            process.kill()
            process.join()


def _drain(events, notify) -> None:
    while True:
        try:
            ids, event = events.get_nowait()
        except queue_module.Empty:
            return
        notify(ids, event)


def run_sweep(groups: list[list[dict]], workers: int,
              on_event: Callable[[list[int], dict], None],
              on_results: Callable[[list[dict]], None], *, client=None,
              **options) -> bool:
    """A sweep's groups, in their order: on `workers` local worker processes
    (`run_groups`), or on the Dask cluster of `client` (`run_groups_dask`); `options` are
    theirs (deadline, checkpoint_dir, graphs, compile, state_bytes). False when the deadline
    left work."""
    if client is not None:
        return run_groups_dask(client, groups, on_event, on_results, **options)
    return run_groups(groups, workers, on_event, on_results, **options)


# --- on a Dask cluster (`--executor dask`) ------------------------------------------------

def _recall_task(group: list[dict], options: dict) -> list[dict] | None:
    """One recall group on a worker (runs stopped by the deadline return None)."""
    if options["deadline"] is not None and time.time() > options["deadline"]:
        return None
    return run_group(group, lambda event: None, **options)


def run_groups_dask(client, groups: list[list[dict]],
                    on_event: Callable[[list[int], dict], None],
                    on_results: Callable[[list[dict]], None], *, deadline: float | None = None,
                    checkpoint_dir: str | None = None, graphs: bool = True,
                    compile: bool = False, state_bytes: dict[int, dict] | None = None,
                    task: Callable[[list[dict], dict], list[dict] | None] = _recall_task) -> bool:
    """`run_groups` on a Dask cluster (`hla_bench.dask_executor`): every group is one `task`;
    results reach `on_results` as each task finishes. Returns False when the deadline left
    work."""
    from hla_bench.dask_executor import load_distributed, restart_worker_of

    distributed = load_distributed()
    options = {"deadline": deadline, "checkpoint_dir": checkpoint_dir, "graphs": graphs,
               "compile": compile, "state_bytes": state_bytes}
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
            restart_worker_of(client, future)
        # report the planned device, not the worker's view of it
        on_results([{**result, "device": spec["device"]} for result, spec in zip(results, group)])
    return complete
