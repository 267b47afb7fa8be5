"""`hla-bench recall` (train and score mixers on synthetic recall tasks) and `hla-bench tasks`."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import click
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

import tasks
from hla_bench import registry
from hla_bench.recall_report import render_recall
from tasks.train import RunSpec, assign_devices, default_workers, run_sweep, summarize

SCHEMA_VERSION = 1
ROLE_STYLES = {"key": "bold cyan", "value": "bold green", "query": "bold magenta",
               "filler": "dim", "noise": "yellow", "special": "bold red"}
DEFAULTS = {
    "mixers": ["sdpa", "linear-attn", "hla2", "mamba2-ssd"],
    "mixer_options": {},
    "d_model": [64],
    "lrs": [1e-3, 3e-3],
    "model": {"n_layers": 2, "n_heads": 1, "mlp": True},
    "train": {"epochs": 8, "num_train": None, "num_test": None, "batch_size": 64, "eval_every": 0},
    "settings": [{"task": "mqar", "params": {}}],
    "device": "auto",
    "workers": None,
    "workers_per_gpu": 4,
    "seed": 0,
}


def comma_list(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return [kind(item) for item in value.split(",") if item.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}, got {value!r}")
    return parse


def parse_params(ctx, param, values) -> dict:
    params = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        params[key.replace("-", "_")] = yaml.safe_load(value)
    return params


def environment(device: str) -> dict:
    """The harness's environment capture when present, else a minimal one."""
    try:
        from hla_bench.results import capture_environment
    except ImportError:
        return {"python": platform.python_version(), "torch": str(torch.__version__),
                "platform": platform.platform(), "device": device,
                "gpu_count": torch.cuda.device_count()}
    return capture_environment(device)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise click.UsageError("--device cuda asked for, but no CUDA device is visible")
    return device


def setting_label(task: str, params: dict) -> str:
    return " ".join([task] + [f"{key}={value}" for key, value in sorted(params.items())])


def build_config(config_file: str | None, overrides: dict) -> dict:
    """Defaults, then the YAML config, then the command-line options given."""
    config = {key: (dict(value) if isinstance(value, dict) else value) for key, value in DEFAULTS.items()}
    if config_file:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        unknown = sorted(set(loaded) - set(DEFAULTS) - {"name", "description"})
        if unknown:
            raise click.UsageError(f"{config_file}: unknown keys {', '.join(unknown)}")
        for key, value in loaded.items():
            config[key] = {**config[key], **value} if key in ("model", "train") else value
    for key, value in overrides.items():
        if value is None:
            continue
        if key in DEFAULTS["model"]:
            config["model"][key] = value
        elif key in DEFAULTS["train"]:
            config["train"][key] = value
        else:
            config[key] = value
    return config


def plan_runs(config: dict, device: str) -> list[dict]:
    """One spec per (setting, mixer, d_model, lr), each checked against its task."""
    specs = []
    for setting in config["settings"]:
        task = tasks.get(setting["task"])
        params = dict(setting.get("params") or {})
        task.make("test", 1, 0, **params)  # bad parameters fail here, before any run starts
        for mixer in config["mixers"]:
            registry.get(mixer)
            for d_model in config["d_model"]:
                for lr in config["lrs"]:
                    specs.append(RunSpec(
                        task=task.name, mixer=mixer, d_model=int(d_model), lr=float(lr),
                        params=params, mixer_options=dict(config["mixer_options"].get(mixer) or {}),
                        seed=int(config["seed"]), device=device,
                        setting=setting_label(task.name, params), run_id=len(specs),
                        **config["model"], **config["train"]).as_dict())
    return specs


def run_key(run: dict) -> str:
    """What identifies a run across sweeps: its spec without the run id and device."""
    spec = {key: run[key] for key in RunSpec.__dataclass_fields__ if key not in ("run_id", "device")}
    return yaml.safe_dump(spec, sort_keys=True)


def finished_runs(out: str | None, resume: bool) -> dict[str, dict]:
    """The successful runs of the results file a resumed sweep continues, by run key."""
    if not resume:
        return {}
    if not out:
        raise click.UsageError("--resume needs --out: the results file to continue")
    if not Path(out).exists():
        return {}
    try:
        runs = yaml.safe_load(Path(out).read_text())["runs"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as error:
        raise click.UsageError(f"cannot resume from {out}: {error}") from None
    return {run_key(run): run for run in runs if run.get("status") == "ok"}


def unavailable_result(spec: dict, reason: str) -> dict:
    return {**spec, "status": "unavailable", "error": reason, "score": None, "curve": []}


def run_with_progress(specs: list[dict], workers: int, console: Console,
                      on_result=lambda result: None) -> list[dict]:
    """The sweep under a rich display: an overall bar, one bar per running run, and a line
    per finished run; `on_result(result)` sees each finished run."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("[bold]all runs", total=len(specs), info="")
        bars: dict[int, int] = {}
        by_id = {spec["run_id"]: spec for spec in specs}

        def on_event(run_id: int, event: dict) -> None:
            spec = by_id[run_id]
            name = escape(f"{spec['mixer']} d={spec['d_model']} lr={spec['lr']:g} [{spec['setting']}]")
            if event["event"] == "start":
                bars[run_id] = progress.add_task(name, total=event["total"], info="")
            elif event["event"] == "eval" and run_id in bars:
                progress.update(bars[run_id], completed=event["step"], total=event["total"],
                                info=f"acc {event['accuracy']:.3f}")
            elif event["event"] == "done":
                if run_id in bars:
                    progress.remove_task(bars.pop(run_id))
                result = event["result"]
                outcome = (f"acc {result['score']:.3f} in {result['steps']} steps, {result['seconds']:.0f}s"
                           if result["status"] == "ok" else f"[red]{result['status']}: {escape(result.get('error', ''))}")
                progress.console.print(f"  {name}: {outcome}")
                progress.advance(overall)
                on_result(result)

        return run_sweep(specs, workers, on_event)


@click.command()
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="YAML sweep config (see configs/recall-*.yaml); options below override it.")
@click.option("--task", help="Task name (see `hla-bench tasks list`); replaces the config's settings.")
@click.option("--mixers", callback=comma_list(str), help="Comma-separated mixer names.")
@click.option("--d-model", "d_model", callback=comma_list(int), help="Comma-separated model widths.")
@click.option("--seq-len", type=int, help="Task sequence length.")
@click.option("--num-kv-pairs", type=int, help="MQAR key-value pairs.")
@click.option("--vocab-size", type=int, help="Task vocabulary size.")
@click.option("--param", "extra_params", multiple=True, callback=parse_params,
              help="Any other task parameter, KEY=VALUE (repeatable).")
@click.option("--lrs", callback=comma_list(float), help="Comma-separated learning rates.")
@click.option("--epochs", type=int)
@click.option("--num-train", type=int, help="Training examples (default: the task's).")
@click.option("--num-test", type=int, help="Test examples (default: the task's).")
@click.option("--batch-size", type=int)
@click.option("--eval-every", type=int, help="Evaluate every N steps (0: once per epoch).")
@click.option("--n-layers", type=int)
@click.option("--n-heads", type=int)
@click.option("--mlp/--no-mlp", default=None, help="MLP after each mixer (default on).")
@click.option("--device", help="cpu, cuda or auto (default).")
@click.option("--workers", type=int, help="Parallel worker processes (default: 1 per 2 CPU cores, "
                                          "or --workers-per-gpu per GPU).")
@click.option("--workers-per-gpu", type=int)
@click.option("--seed", type=int)
@click.option("--out", type=click.Path(dir_okay=False), help="Write the results YAML here.")
@click.option("--plots-dir", type=click.Path(file_okay=False), help="Also write PNG plots here.")
@click.option("--resume", is_flag=True,
              help="Keep the finished runs of the --out file (a sweep cut short); run the rest.")
def recall(config_file, task, seq_len, num_kv_pairs, vocab_size, extra_params, out, plots_dir,
           resume, **options):
    """Train a tiny LM per mixer on synthetic recall tasks; report the best test accuracy over
    learning rates per (task setting, mixer, d_model), as Zoology does."""
    console = Console()
    try:
        config = build_config(config_file, options)
        if task or seq_len or num_kv_pairs or vocab_size or extra_params:
            params = {key: value for key, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                                                    ("vocab_size", vocab_size)) if value is not None}
            config["settings"] = [{"task": task or "mqar", "params": {**params, **extra_params}}]
        device = resolve_device(config["device"])
        specs = assign_devices(plan_runs(config, device), device)
    except (ValueError, registry.UnknownMixerError) as error:
        raise click.UsageError(str(error))
    workers = config["workers"] or default_workers(device, config["workers_per_gpu"])
    console.print(f"[bold]recall sweep[/]: {len(specs)} runs on {device}, {workers} worker(s)")

    finished = finished_runs(out, resume)
    runnable, results = [], {}
    for spec in specs:
        reason = registry.get(spec["mixer"]).unavailable_reason()
        if reason:
            results[spec["run_id"]] = unavailable_result(spec, reason)
        elif run_key(spec) in finished:
            results[spec["run_id"]] = {**finished[run_key(spec)], "run_id": spec["run_id"]}
        else:
            runnable.append(spec)
    if finished:
        console.print(f"resuming: {len(finished)} finished run(s) kept from {out}")
    started = time.perf_counter()
    env = environment(device)

    def results_data(complete: bool) -> dict:
        """The results so far; written after every finished run, so a killed sweep keeps
        what it finished."""
        runs = [results[spec["run_id"]] for spec in specs if spec["run_id"] in results]
        data = {"kind": "recall", "schema_version": SCHEMA_VERSION,
                "config": {**config, "device": device, "workers": workers},
                "environment": {**env, "complete": complete},
                "seconds": round(time.perf_counter() - started, 1),
                "summary": summarize(runs), "runs": runs}
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(yaml.safe_dump(data, sort_keys=False))
        return data

    def on_result(result: dict) -> None:
        results[result["run_id"]] = result
        results_data(complete=False)

    run_with_progress(runnable, min(workers, max(1, len(runnable))), console, on_result)
    data = results_data(complete=True)
    render_recall(data, console, plots_dir=plots_dir)
    if out:
        console.print(f"results written to {out}")


@click.group("tasks")
def tasks_group():
    """The synthetic tasks: list them, show an example."""


@tasks_group.command("list")
def list_tasks():
    """Every registered task with its default parameters."""
    table = Table(title="synthetic tasks")
    for column in ("name", "description", "defaults", "train/test", "source"):
        table.add_column(column)
    for task in tasks.all_tasks():
        defaults = ", ".join(f"{key}={value}" for key, value in task.params.items())
        table.add_row(task.name, task.description, defaults, f"{task.num_train}/{task.num_test}",
                      task.source)
    Console().print(table)


@tasks_group.command("show")
@click.argument("name")
@click.option("--seq-len", type=int)
@click.option("--num-kv-pairs", type=int)
@click.option("--vocab-size", type=int)
@click.option("--param", "extra_params", multiple=True, callback=parse_params,
              help="Any other task parameter, KEY=VALUE (repeatable).")
@click.option("--split", type=click.Choice(["train", "test"]), default="test", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--index", type=int, default=0, show_default=True, help="Which example to show.")
def show_task(name, seq_len, num_kv_pairs, vocab_size, extra_params, split, seed, index):
    """Decode one example: tokens colored by role, each scored label after its position."""
    try:
        task = tasks.get(name)
        params = {key: value for key, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                                                ("vocab_size", vocab_size)) if value is not None}
        params = task.resolve_params({**params, **extra_params})
        inputs, labels = task.make(split, index + 1, seed, **params)
    except ValueError as error:
        raise click.UsageError(str(error))
    inputs, labels = inputs[index], labels[index]
    roles = task.roles(inputs, labels, **params)
    console = Console()
    console.print(f"[bold]{task.name}[/] ({split}, seed {seed}, example {index}): "
                  + ", ".join(f"{key}={value}" for key, value in params.items()))
    text = Text()
    for position, (token, label, role) in enumerate(zip(inputs.tolist(), labels.tolist(), roles)):
        text.append(str(token), style=ROLE_STYLES[role])
        if label != tasks.IGNORE:
            text.append(f"→{label}", style="bold underline")
        text.append(" ")
    console.print(text)
    legend = Text("roles: ")
    for role, style in ROLE_STYLES.items():
        legend.append(role, style=style).append("  ")
    console.print(legend)
    scored = int((labels != tasks.IGNORE).sum())
    console.print(f"{scored} labelled positions of {len(labels)} (tok→label: the target there)")


commands = [recall, tasks_group]
