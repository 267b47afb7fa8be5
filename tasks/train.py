"""Train the tiny LM on a task, score it, and run sweeps of independent runs in parallel.

A run is a plain dict (`RunSpec.as_dict()`), so it crosses process boundaries and lands in
the result YAML unchanged. `train_run` is deterministic given the spec's seed (model init
from `torch.manual_seed`, data and batch order from seeded generators).
"""

from __future__ import annotations

import math
import os
import queue as queue_module
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

import tasks
from hla_bench import registry
from tasks import IGNORE
from tasks.model import TinyLM

STOP_ACCURACY = 0.99


@dataclass
class RunSpec:
    """Everything one training run needs. `eval_every` is in steps (0: once per epoch)."""

    task: str
    mixer: str
    d_model: int
    lr: float
    params: dict = field(default_factory=dict)
    mixer_options: dict = field(default_factory=dict)
    n_layers: int = 2
    n_heads: int = 1
    mlp: bool = True
    epochs: int = 8
    num_train: int | None = None
    num_test: int | None = None
    batch_size: int = 64
    eval_every: int = 0
    warmup_frac: float = 0.1
    weight_decay: float = 0.1
    stop_accuracy: float = STOP_ACCURACY
    seed: int = 0
    device: str = "cpu"
    setting: str = ""
    run_id: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


_DATA_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def task_data(task: str, split: str, num_examples: int, seed: int, params: dict):
    """(inputs, labels) of one split, cached per process (runs of a sweep share data)."""
    key = (task, split, num_examples, seed, tuple(sorted(params.items())))
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = tasks.get(task).make(split, num_examples, seed, **params)
    return _DATA_CACHE[key]


def state_bytes(mixer: str, mixer_options: dict, d_model: int, n_heads: int, n_layers: int,
                seq_len: int) -> int | None:
    """Recurrent state (KV cache for softmax attention) per sequence of the whole layer stack,
    from the mixer's decoder; None when the mixer has no decoder or it cannot run here."""
    entry = registry.get(mixer)
    if entry.build_decoder is None:
        return None
    head_dim = d_model // n_heads
    try:
        decoder = entry.decoder(**mixer_options)
        state = decoder.init_state(1, n_heads, head_dim, head_dim, seq_len, "cpu", torch.float32)
        return int(decoder.state_bytes(state)) * n_layers
    except (registry.MixerUnavailableError, NotImplementedError, RuntimeError, ValueError):
        return None


@torch.no_grad()
def evaluate(model: TinyLM, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int,
             autocast: bool) -> float:
    """Accuracy over the labelled positions of a whole split."""
    model.eval()
    correct = total = 0
    for start in range(0, len(inputs), batch_size):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits, targets = model.labelled_logits(inputs[start:start + batch_size],
                                                    labels[start:start + batch_size])
        correct += int((logits.argmax(-1) == targets).sum())
        total += targets.numel()
    model.train()
    return correct / max(total, 1)


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warmup to 1, then cosine decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_run(spec: dict, progress: Callable[[dict], None] | None = None) -> dict:
    """Train and score one run; returns the spec's result: status, score (best test accuracy
    on labelled positions), curve (one point per evaluation), sizes and timings."""
    spec = RunSpec(**spec)
    task = tasks.get(spec.task)
    params = task.resolve_params(spec.params)
    num_train = spec.num_train or task.num_train
    num_test = spec.num_test or task.num_test
    device = torch.device(spec.device)
    autocast = device.type == "cuda"
    started = time.perf_counter()

    train_x, train_y = task_data(spec.task, "train", num_train, spec.seed, params)
    labelled_per_example = (train_y != IGNORE).sum(1)  # on the host: no GPU wait per step
    train_x, train_y = train_x.to(device), train_y.to(device)
    test_x, test_y = (t.to(device) for t in task_data(spec.task, "test", num_test, spec.seed, params))
    torch.manual_seed(spec.seed)
    model = TinyLM(params["vocab_size"], spec.d_model, spec.mixer, n_layers=spec.n_layers,
                   n_heads=spec.n_heads, mlp=spec.mlp, mixer_options=spec.mixer_options,
                   max_len=train_x.shape[1], readout=task.readout).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay,
                                  fused=device.type == "cuda")
    steps_per_epoch = math.ceil(num_train / spec.batch_size)
    total = spec.epochs * steps_per_epoch
    warmup = max(1, int(spec.warmup_frac * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, total, warmup))
    eval_every = spec.eval_every or steps_per_epoch
    order = torch.Generator().manual_seed(spec.seed)

    curve, losses, step, best = [], [], 0, 0.0
    if progress:
        progress({"event": "start", "total": total})
    while step < total:
        permutation = torch.randperm(num_train, generator=order)
        on_device = permutation.to(device)  # one copy per epoch (a copy syncs the stream)
        for batch, batch_on_device in zip(permutation.split(spec.batch_size),
                                          on_device.split(spec.batch_size)):
            count = int(labelled_per_example[batch].sum())
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(train_x[batch_on_device], train_y[batch_on_device], count)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.detach())
            step += 1
            if step % eval_every == 0 or step == total:
                accuracy = evaluate(model, test_x, test_y, 4 * spec.batch_size, autocast)
                best = max(best, accuracy)
                curve.append({"step": step, "epoch": round(step / steps_per_epoch, 3),
                              "loss": round(float(torch.stack(losses).mean()), 5),
                              "accuracy": round(accuracy, 5)})
                losses = []
                if progress:
                    progress({"event": "eval", "step": step, "total": total, "accuracy": accuracy})
                if accuracy > spec.stop_accuracy:
                    total = step  # early stop
            if step >= total:
                break

    seq_len = train_x.shape[1]
    return {
        **spec.as_dict(),  # the spec as planned, so a resumed sweep recognises the run
        "resolved": {"params": params, "num_train": num_train, "num_test": num_test},
        "status": "ok", "score": round(best, 5), "final_accuracy": curve[-1]["accuracy"],
        "steps": step, "early_stopped": best > spec.stop_accuracy,
        "seconds": round(time.perf_counter() - started, 2), "seq_len": seq_len,
        "n_params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state_bytes(spec.mixer, spec.mixer_options, spec.d_model, spec.n_heads,
                                   spec.n_layers, seq_len),
        "curve": curve,
    }


def safe_run(spec: dict, progress: Callable[[dict], None] | None = None) -> dict:
    """`train_run`, with a failure (error, out of memory) recorded as the run's status."""
    try:
        return train_run(spec, progress)
    except torch.cuda.OutOfMemoryError as error:
        status, message = "oom", str(error).splitlines()[0]
    except Exception as error:  # noqa: BLE001 - a sweep records any failing run and goes on
        status, message = "error", f"{type(error).__name__}: {error}"
        traceback.print_exc()
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {**spec, "status": status, "error": message, "score": None, "curve": []}


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _worker_run(spec: dict, events) -> dict:
    return safe_run(spec, lambda event: events.put((spec["run_id"], event)))


def default_workers(device: str, workers_per_gpu: int = 4) -> int:
    """Workers for a sweep: `workers_per_gpu` per visible GPU on CUDA, one per 2 cores on CPU."""
    if device.startswith("cuda"):
        return max(1, torch.cuda.device_count()) * workers_per_gpu
    return max(1, (os.cpu_count() or 2) // 2)


def assign_devices(specs: list[dict], device: str) -> list[dict]:
    """Spread runs over the visible GPUs round-robin when `device` is plain "cuda"."""
    if device != "cuda":
        return [{**spec, "device": device} for spec in specs]
    count = max(1, torch.cuda.device_count())
    return [{**spec, "device": f"cuda:{i % count}"} for i, spec in enumerate(specs)]


def run_sweep(specs: list[dict], workers: int = 1,
              on_event: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Run every spec; returns results in spec order. `on_event(run_id, event)` sees
    "start", "eval" and "done" events. With `workers` > 1 the runs go to spawned worker
    processes (so mixers must be importable there: built-ins or entry-point plugins)."""
    notify = on_event or (lambda run_id, event: None)
    results: dict[int, dict] = {}
    if workers <= 1:
        for spec in specs:
            results[spec["run_id"]] = safe_run(spec, lambda event, i=spec["run_id"]: notify(i, event))
            notify(spec["run_id"], {"event": "done", "result": results[spec["run_id"]]})
        return [results[spec["run_id"]] for spec in specs]

    import multiprocessing

    context = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    with context.Manager() as manager:
        events = manager.Queue()
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                 initargs=(threads,)) as pool:
            pending = {pool.submit(_worker_run, spec, events): spec for spec in specs}
            while pending:
                done, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                _drain(events, notify)
                for future in done:
                    spec = pending.pop(future)
                    try:
                        result = future.result()
                    except BrokenProcessPool as error:
                        result = {**spec, "status": "crashed", "error": str(error), "score": None,
                                  "curve": []}
                    results[spec["run_id"]] = result
                    notify(spec["run_id"], {"event": "done", "result": result})
            _drain(events, notify)
    return [results[spec["run_id"]] for spec in specs]


def _drain(events, notify) -> None:
    while True:
        try:
            run_id, event = events.get_nowait()
        except queue_module.Empty:
            return
        notify(run_id, event)


def summarize(runs: list[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    """Best run over learning rates: {setting: {mixer: {d_model: {score, lr, state_bytes}}}}.
    A (setting, mixer, d_model) whose runs all failed gets score None and the failure status."""
    table: dict[str, dict[str, dict[int, dict]]] = {}
    for run in runs:
        cell = table.setdefault(run["setting"], {}).setdefault(run["mixer"], {}).get(run["d_model"])
        score = run.get("score")
        if cell is None or (score is not None and (cell["score"] is None or score > cell["score"])):
            table[run["setting"]][run["mixer"]][run["d_model"]] = {
                "score": score, "lr": run["lr"], "status": run["status"],
                "state_bytes": run.get("state_bytes"), "steps": run.get("steps")}
    return table
