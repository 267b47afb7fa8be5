"""Aggregate training throughput of a recall sweep: one run per process (each model trained
alone, eagerly, with torch's fused AdamW) against stacked groups (the runs of a group as one
model, the step replayed as a CUDA graph), on the same runs; and where a group's time goes.

For each cell (task setting x d_model) of a recall config, the runs of `--mixers` at the
config's learning rates train exactly `--steps` steps each (no evaluation, no early stop) in
each mode, all at once on the GPU: one process per run alone, one process per group
stacked. Throughput is the runs' total steps over the wall time from the first timed step
to the last (setup, data generation and warm-up are excluded: each worker reports when its
timed steps began and ended, and the workers of a mode start their timed steps together,
once all have warmed up). Writes one YAML with both rates per cell and their ratio.

    python benchmarks/recall_throughput.py --config zoology-smoke \
        --cells 64:64,256:128 --steps 150 --out throughput.yaml

A cell names its setting by sequence length where that names one (Zoology's panels), else by
its label (`--config mad --cells "in_context_recall vocab_size=32:128"`).

Mode `groups` trains every group of a cell for real, all at once (hla_bench.recall.pool.run_group:
evaluation at the config's cadence, no early stop, `--steps` steps rounded up to whole
epochs): the cell's model-steps a second over the wall time from the first group's start to
the last one's end, and per group the shares of its wall time in setup (data, models),
warm-up (the steps before its graph replays: compilation, autotuning, capture), steady
steps and evaluation. Mode `profile` takes each group alone on the GPU (the groups build
and warm up at once, then one at a time): its replayed step's time beside the time its
matmul FLOPs take at the GPU's bf16 GEMM rate (measured at the start), and its costliest
kernels. `--mixers all` names every mixer of the config.

`--option MIXER.KEY=VALUE` sets a layer option of the config's mixer (`hla2.impl=parallel`
trains hla2 through its parallel form), so two runs of the benchmark compare two ways of
computing the same mixer. `--embedding-backward dense|sorted` forms the stacked embedding's weight
gradient by F.embedding's own backward or by sorted row sums (the default, as
hla_bench.recall.stacked.EMBEDDING_BACKWARD; every worker), so two runs time one against
the other.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import yaml

WARMUP_STEPS = 5


_START = None  # with every item of a pool at once: the barrier its workers pass after warm-up
_ALONE = None  # the lock a profiled group holds while it alone is timed on the GPU
EMBEDDING_BACKWARD = "sorted"  # every worker's stacked embedding backward (--embedding-backward)


def _init(threads: int, barrier=None, lock=None, embedding_backward: str = "sorted") -> None:
    global _START, _ALONE
    from hla_bench.recall import stacked

    torch.set_num_threads(threads)
    _START, _ALONE = barrier, lock
    stacked.EMBEDDING_BACKWARD = embedding_backward


def gemm_tflops(size: int = 8192, reps: int = 20) -> float:
    """The GPU's bf16 matrix-product rate on random data, TFLOP/s (after three warm-ups)."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size**3 * reps / (start.elapsed_time(end) / 1000) / 1e12


def _together() -> None:
    """Wait for every worker of the pool to finish its warm-up (compilation, capture), so
    that the timed steps of all of them overlap and the rate measures them sharing the GPU."""
    if _START is not None:
        _START.wait()


def _alone(spec: dict, steps: int) -> dict:
    """One run the way a one-run-per-process sweep trains it: TinyLM, fused AdamW, bf16
    autocast, a host loop over batches."""
    from hla_bench.recall.pool import build_model
    from hla_bench.recall.train import RunSpec, task_splits
    import tasks

    run = RunSpec(**spec)
    params = tasks.get(run.task).resolve_params(run.params)
    data = task_splits(run.task, run.seed, run.num_train, run.num_val, run.num_test, params)
    device = torch.device(run.device)
    x, y = (t.to(device) for t in data.train)
    torch.manual_seed(run.seed)
    model = build_model(spec).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay,
                                  fused=device.type == "cuda")
    count = int((data.train[1][:run.batch_size] != -100).sum())
    batches = math.ceil(run.num_train / run.batch_size)

    def step(index: int) -> None:
        rows = slice((index % batches) * run.batch_size, (index % batches + 1) * run.batch_size)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model.loss(x[rows], y[rows], count if rows.stop <= run.num_train else None)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for index in range(WARMUP_STEPS):
        step(index)
    torch.cuda.synchronize()
    _together()
    start = time.time()
    for index in range(steps):
        step(index)
    torch.cuda.synchronize()
    return {"start": start, "end": time.time(), "model_steps": steps}


def _stacked(group: list[dict], steps: int, compile: bool = False) -> dict:
    """One group the way `hla_bench.recall.train` trains it (stacked, CUDA graph, compiled with
    `compile`)."""
    from hla_bench.recall.pool import build_model
    from hla_bench.recall.train import RunSpec, _GroupTrainer

    from mixers.common import inputs_trusted_finite

    with inputs_trusted_finite():  # as a sweep's groups train (hla_bench.recall.pool.run_group)
        trainer = _GroupTrainer([RunSpec(**s) for s in group], build_model, graphs=True,
                                progress=None, compile=compile)
        started = time.perf_counter()
        trainer.train_to(WARMUP_STEPS)  # eager warm-up steps (compilation) and the capture
        warmup_s = time.perf_counter() - started
        _together()
        start = time.time()
        trainer.train_to(WARMUP_STEPS + steps)
    return {"start": start, "end": time.time(), "model_steps": steps * len(group),
            "graphed": trainer.graphed, "graph_failure": trainer.graph_failure,
            "mixer": group[0]["mixer"], "warmup_s": round(warmup_s, 1),
            "group_seconds": round(time.time() - start, 3)}


def _profile(group: list[dict], steps: int, compile: bool, gemm: float, rows: int = 16) -> dict:
    """Where one stacked step's GPU time goes, the group alone on the GPU (once every group
    has warmed up, one group at a time): the wall time of a replayed graph step, the time
    its matmul FLOPs take at `gemm` TFLOP/s (hla_bench.recall.plan.step_flops per run),
    then torch.profiler over `steps` steps of the same trainer without the graph (the graph
    replays the same kernels): its `rows` costliest kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from hla_bench.recall.plan import step_flops
    from hla_bench.recall.pool import build_model
    from mixers.common import inputs_trusted_finite
    from hla_bench.recall.train import RunSpec, _GroupTrainer, _Step

    with inputs_trusted_finite():
        trainer = _GroupTrainer([RunSpec(**s) for s in group], build_model, graphs=True,
                                progress=None, compile=compile)
        started = time.perf_counter()
        trainer.train_to(WARMUP_STEPS)
        warmup_s = time.perf_counter() - started
        _together()  # no group is timed while another still warms up (compiles, autotunes)
        with _ALONE:
            started = time.perf_counter()
            trainer.train_to(WARMUP_STEPS + 4 * steps)
            torch.cuda.synchronize()
            graph_ms = (time.perf_counter() - started) * 1000 / (4 * steps)
            trainer.program = _Step(trainer, graph=False)
            trainer.train_to(trainer.step + _Step.WARM_STEPS + 1)  # its warm-up, untimed
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                trainer.train_to(trainer.step + steps)
                torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    kernel_ms = sum(e.self_device_time_total for e in kernels) / 1000 / steps
    flops = step_flops(group[0])  # every run of a group computes the same step
    matmul_ms = None if flops is None else flops * len(group) / (gemm * 1e9)
    return {"mixer": group[0]["mixer"], "runs": len(group), "warmup_s": round(warmup_s, 1),
            "graph_ms_per_step": round(graph_ms, 3), "kernel_ms_per_step": round(kernel_ms, 3),
            "kernels_per_step": round(sum(e.count for e in kernels) / steps, 1),
            "flops_per_model_step": flops,
            "matmul_ms_at_gemm_rate": None if matmul_ms is None else round(matmul_ms, 3),
            "graph_tflops": None if flops is None else
            round(flops * len(group) / graph_ms / 1e9, 1),
            "kernels": [{"name": e.key[:160], "calls_per_step": round(e.count / steps, 1),
                         "gpu_ms_per_step": round(e.self_device_time_total / 1000 / steps, 4)}
                        for e in kernels[:rows]]}


def _group(group: list[dict], compile: bool) -> dict:
    """One group trained as a sweep trains it (run_group), timed from its worker's start."""
    from hla_bench.recall.pool import run_group

    start = time.time()
    results = run_group(group, lambda event: None, compile=compile)
    end = time.time()
    first = results[0]
    report = {"start": start, "end": end, "mixer": group[0]["mixer"], "status": first["status"],
              "model_steps": sum(r.get("steps") or 0 for r in results)}
    if first["status"] != "ok":
        return {**report, "error": first.get("error")}
    keys = ("seconds", "setup_seconds", "warmup_steps", "warmup_seconds", "compile_seconds",
            "train_seconds", "eval_seconds", "steps")
    report.update({key: first.get(key) for key in keys})
    steady = first["train_seconds"] - first["warmup_seconds"]
    report["steady_step_ms"] = round(1000 * steady / max(1, first["steps"]
                                                         - first["warmup_steps"]), 3)
    report["shares"] = {part: round(first[f"{part}_seconds"] / first["seconds"], 3)
                        for part in ("setup", "warmup", "eval")}
    report["shares"]["steps"] = round(steady / first["seconds"], 3)
    return report


def _trained(chosen: list[dict], max_group: int, steps: int, compile: bool) -> dict:
    """Mode groups: the cell's groups trained at once for about `steps` steps each (whole
    epochs of the config's data, no early stop)."""
    from hla_bench.recall.plan import plan_groups
    from hla_bench.recall.train import RunSpec

    runs = []
    for spec in chosen:
        run = RunSpec(**spec)
        num_train = run.num_train or tasks_num_train(run)
        per_epoch = math.ceil(num_train / run.batch_size)
        runs.append({**spec, "stop_accuracy": 1.0, "epochs": max(1, math.ceil(steps / per_epoch))})
    groups = plan_groups(runs, max_group)
    started = time.time()
    reports = _pool(_group, groups, len(groups), compile)
    wall = time.time() - started
    model_steps = sum(r["model_steps"] for r in reports)
    return {"wall_seconds": round(wall, 2), "model_steps": model_steps,
            "steps_per_s": round(model_steps / wall, 1),
            "first_to_last_steps_per_s": _rate(reports)["steps_per_s"], "groups": reports}


def tasks_num_train(run) -> int:
    import tasks

    return tasks.get(run.task).num_train


def _rate(reports: list[dict]) -> dict:
    start, end = min(r["start"] for r in reports), max(r["end"] for r in reports)
    steps = sum(r["model_steps"] for r in reports)
    return {"model_steps": steps, "seconds": round(end - start, 3),
            "steps_per_s": round(steps / (end - start), 1)}


def _pool(function, items, workers: int, *args) -> list[dict]:
    """function(item, *args) for each item on `workers` processes; when they run every item
    at once, their timed steps start together (_together)."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(workers) if workers == len(items) > 1 else None
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init,
                                 initargs=(max(1, 16 // workers), barrier,
                                           manager.Lock(), EMBEDDING_BACKWARD)) as pool:
            return list(pool.map(function, items, *([a] * len(items) for a in args)))


def cell_runs(specs: list[dict], cell: str) -> list[dict]:
    """The runs of one `--cells` entry, `SETTING:D_MODEL`: SETTING is a sequence length,
    which must name one setting of the config (Zoology's panels differ in it), or a
    setting's label as the results name it (`in_context_recall vocab_size=32`: a MAD
    config has many settings of one length)."""
    from hla_bench.recall.plan import seq_len_of

    key, sep, width = cell.rpartition(":")
    if not (sep and key.strip() and width.strip().isdigit()):
        raise ValueError(f"{cell!r} is not SETTING:D_MODEL (a seq_len or a setting's label)")
    d_model, key = int(width), key.strip()
    if key.isdigit():
        chosen = [s for s in specs if seq_len_of(s) == int(key)]
        settings = list(dict.fromkeys(s["setting"] for s in chosen))
        if len(settings) > 1:
            raise ValueError(f"seq_len {key} names {len(settings)} settings of the config; "
                             f"give one's label instead: {'; '.join(settings)}")
    else:
        chosen = [s for s in specs if s["setting"] == key]
        if not chosen:
            labels = list(dict.fromkeys(s["setting"] for s in specs))
            raise ValueError(f"no setting of the config is labelled {key!r}; its settings: "
                             f"{'; '.join(labels)}")
    runs = [s for s in chosen if s["d_model"] == d_model]
    if not runs:
        raise ValueError(f"no runs of the config at {key}, d_model {d_model}")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="a recall config: a YAML file or a shipped config's name")
    parser.add_argument("--cells", required=True,
                        help="SETTING:D_MODEL,... with SETTING a seq_len that names one setting "
                             "of the config, or a setting's label (in_context_recall:128)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--num-train", type=int, default=20_000,
                        help="training examples generated per seed (throughput does not "
                             "depend on it)")
    parser.add_argument("--mixers", default="sdpa,linear-attn,hla2",
                        help="comma-separated mixers of the config to train, or all")
    parser.add_argument("--modes", default="stacked,alone",
                        help="comma-separated: stacked, alone (the two rates and their ratio), "
                             "profile (each group alone: graph step time, its matmul time at "
                             "the GEMM rate, kernels by GPU time), groups (real groups at "
                             "once: model-steps/s and where each group's time goes)")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="stacked mode: at most this many groups train at once (0: all "
                             "of a cell's groups; wide models may need fewer to fit the GPU; "
                             "with fewer, only each group's own rate is reported)")
    parser.add_argument("--copies", type=int, default=1,
                        help="stacked mode: train each group this many times at once (how "
                             "aggregate throughput grows with the processes sharing the GPU)")
    parser.add_argument("--compile", action="store_true",
                        help="stacked, profile and groups modes: compile each group's step "
                             "(torch.compile) before it is captured")
    parser.add_argument("--option", action="append", default=[], metavar="MIXER.KEY=VALUE",
                        help="set a layer option of a mixer of the config (repeatable; the "
                             "value is read as YAML: hla2.impl=parallel, hla2.chunk_size=32)")
    parser.add_argument("--embedding-backward", choices=("dense", "sorted"), default="sorted",
                        help="stacked, profile and groups modes: the embedding's weight "
                             "gradient by F.embedding's own backward (dense) or by sorted "
                             "row sums without atomics (sorted; "
                             "hla_bench.recall.kernels.stacked_embedding)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    global EMBEDDING_BACKWARD
    EMBEDDING_BACKWARD = args.embedding_backward
    options: dict[str, dict] = {}
    for text in args.option:
        target, sep, value = text.partition("=")
        mixer, dot, key = target.partition(".")
        if not (sep and dot and mixer and key):
            parser.error(f"--option takes MIXER.KEY=VALUE, got {text!r}")
        options.setdefault(mixer, {})[key] = yaml.safe_load(value)
    modes = set(args.modes.split(","))
    if not modes or modes - {"stacked", "alone", "profile", "groups"}:
        parser.error(f"--modes takes stacked, alone, profile and groups, got {args.modes!r}")
    if args.concurrency < 0:
        parser.error(f"--concurrency must be >= 0, got {args.concurrency}")
    if args.copies < 1:
        parser.error(f"--copies must be >= 1, got {args.copies}")

    from hla_bench import configs, registry
    from hla_bench.processes import cuda_mps_active
    from hla_bench.recall.plan import (ConfigError, check_layers, check_mixer_options,
                                       load_config, plan_runs)
    from hla_bench.recall.plan import plan_groups, seq_len_of

    config = load_config(str(configs.find(args.config)), {})
    if args.mixers != "all":
        config["mixers"] = args.mixers.split(",")
    for mixer, changes in options.items():
        if mixer not in config["mixers"]:
            parser.error(f"--option names {mixer!r}, which is not among --mixers")
        config["mixer_options"][mixer] = {**(config["mixer_options"].get(mixer) or {}),
                                          **changes}
        try:
            registry.get(mixer).resolve_options(config["mixer_options"][mixer])
        except ValueError as error:
            parser.error(f"--option: {error}")
    specs = plan_runs(config, "cuda:0")
    try:
        check_layers(specs)
        check_mixer_options(config, "cpu")
    except ConfigError as error:
        parser.error(str(error))
    specs = [s for s in specs if registry.get(s["mixer"]).unavailable_reason(s["mixer_options"]) is None]
    cells = []
    for cell in args.cells.split(","):
        try:
            cells.append(cell_runs(specs, cell))
        except ValueError as error:
            parser.error(f"--cells: {error}")
    if not torch.cuda.is_available():
        parser.error("no CUDA device visible: this benchmark times the training step on a GPU")
    from hla_bench.results.bench_files import git_commit

    report = {"config": args.config, "git_commit": git_commit(), "steps": args.steps,
              "num_train": args.num_train, "modes": sorted(modes), "mixers": config["mixers"],
              "gpu": torch.cuda.get_device_name(), "torch": str(torch.__version__),
              "mps": cuda_mps_active(), "compile": args.compile, "copies": args.copies,
              "embedding_backward": args.embedding_backward,
              "mixer_options": config["mixer_options"], "cells": []}
    if modes & {"profile"}:
        report["gemm_tflops"] = round(gemm_tflops(), 1)
    for chosen in cells:
        runs = [{**s, "num_train": args.num_train,
                 "epochs": math.ceil((args.steps + WARMUP_STEPS) * s["batch_size"]
                                     / args.num_train) + 1}
                for s in chosen]
        groups = plan_groups(runs, config["max_group"])
        seq_len, d_model = seq_len_of(runs[0]), runs[0]["d_model"]
        entry = {"seq_len": seq_len, "d_model": d_model, "setting": runs[0]["setting"],
                 "batch_size": runs[0]["batch_size"], "runs": len(runs), "groups": len(groups)}
        try:
            if "stacked" in modes:
                copies = [group for group in groups for _ in range(args.copies)]
                at_once = min(len(copies), args.concurrency or len(copies))
                entry["concurrency"] = at_once
                stacked = _pool(_stacked, copies, at_once, args.steps, args.compile)
                if at_once == len(copies):
                    entry["stacked"] = _rate(stacked)
                else:  # later groups compile while earlier ones are timed: no common window
                    entry["stacked"] = {"model_steps": sum(r["model_steps"] for r in stacked),
                                        "seconds": None, "steps_per_s": None,
                                        "note": f"{len(copies)} groups, at most {at_once} at "
                                                "once: no aggregate rate (see groups_stacked)"}
                entry["graph_failures"] = sorted({r["graph_failure"] for r in stacked
                                                  if r["graph_failure"]})
                entry["groups_stacked"] = [
                    {**{k: r[k] for k in ("mixer", "warmup_s", "group_seconds")},
                     "steps_per_s": round(r["model_steps"] / r["group_seconds"], 1)}
                    for r in stacked]
            if "alone" in modes:
                entry["alone"] = _rate(_pool(_alone, runs, len(runs), args.steps))
            if "stacked" in modes and "alone" in modes:
                entry["speedup"] = (None if entry["stacked"]["steps_per_s"] is None else
                                    round(entry["stacked"]["steps_per_s"]
                                          / entry["alone"]["steps_per_s"], 2))
            if "profile" in modes:
                entry["profiles"] = _pool(_profile, groups, len(groups), 5, args.compile,
                                          report["gemm_tflops"])
            if "groups" in modes:
                entry["groups_trained"] = _trained(chosen, config["max_group"], args.steps,
                                                   args.compile)
        except Exception as error:  # noqa: BLE001 - one cell's failure is recorded, the rest run
            entry["error"] = f"{type(error).__name__}: {error}"
        report["cells"].append(entry)
        print(entry, flush=True)
        Path(args.out).write_text(yaml.safe_dump(report, sort_keys=False))


if __name__ == "__main__":
    main()
