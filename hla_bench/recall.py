"""`hla-bench recall` (train and score mixers on synthetic recall tasks) and `hla-bench tasks`.

A recall config (YAML, see hla_bench/configs/: recall-cpu, zoology-*, mad)
names the mixers, widths, learning rates, weight decays, seeds, the model (with per-mixer
overrides in `mixer_model`), the training protocol and the task settings; `validate_config`
checks every key and value before any run starts. Runs that differ only in learning rate,
weight decay and seed train together as one stacked model (`hla_bench.training`,
`tasks.train`).

A setting is `{task, params, train, model, name}` (all but `task` optional); its label, which
names it in the results and the report, is its `name`, else the task with its params and its
`train` / `model` overrides (`setting_label`). Labels must differ between settings.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any, Callable

import click
import torch
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

import tasks
from hla_bench import configs, registry
from hla_bench.processes import cuda_mps_active
from hla_bench.recall_report import RecallFileError, render_recall, summarize, validate_recall
from hla_bench.store import ResultsStore, StoreError, default_out_path
from hla_bench.tables import print_table
from hla_bench.training import (assign_devices, default_workers, failed_result,
                                plan_groups, run_groups)
from tasks.model import DECODERS, HEADS, INITS, NORMS, STATE_MIXERS
from tasks.train import METRICS, SCHEDULES, RunSpec

SCHEMA_VERSION = 2
ROLE_STYLES = {"key": "bold cyan", "value": "bold green", "query": "bold magenta",
               "filler": "dim", "noise": "yellow", "special": "bold red"}


# --- config schema -----------------------------------------------------------------------

def _int(minimum: int) -> Callable[[Any], str | None]:
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return f"an int >= {minimum}"
        return None
    return check


def _number(low: float, high: float | None = None, *, open_low: bool = False,
            open_high: bool = True) -> Callable[[Any], str | None]:
    def check(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number"
        if (value <= low if open_low else value < low) or (
                high is not None and (value >= high if open_high else value > high)):
            left, right = "(" if open_low else "[", ")" if open_high else "]"
            return f"a number in {left}{low}, {'inf' if high is None else high}{right}"
        return None
    return check


def _choice(choices) -> Callable[[Any], str | None]:
    return lambda value: None if value in choices else f"one of {', '.join(choices)}"


def _optional(check):
    return lambda value: None if value is None else check(value)


def _bool(value) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _list(item_check, *, unique: bool = True):
    def check(value):
        if not isinstance(value, list) or not value:
            return "a non-empty list"
        for item in value:
            problem = item_check(item)
            if problem:
                return f"a list of {problem} (got {item!r})"
        if unique and len(set(map(repr, value))) != len(value):
            return "a list without duplicates"
        return None
    return check


def _str(value) -> str | None:
    return None if isinstance(value, str) and value else "a non-empty string"


MODEL_FIELDS = {
    "n_layers": (2, _int(1)),
    "n_heads": (1, _int(1)),
    "state_mixer": ("mlp", _choice(STATE_MIXERS)),
    "embed_dropout": (0.0, _number(0, 1)),
    "init": ("default", _choice(INITS)),
    "norm": ("layer", _choice(NORMS)),
    "head": ("tied", _choice(HEADS)),
    "swiglu_hidden": (None, _optional(_int(1))),
    "decoder": ("default", _choice(DECODERS)),
}
TRAIN_FIELDS = {
    "epochs": (8, _int(1)),
    "num_train": (None, _optional(_int(1))),
    "num_val": (1000, _int(1)),
    "num_test": (None, _optional(_int(1))),
    "batch_size": (64, _int(1)),
    "eval_every": (0, _int(0)),
    "schedule": ("warmup-cosine", _choice(SCHEDULES)),
    "warmup_frac": (0.1, _number(0, 1)),
    "weight_decay": (0.1, _number(0)),
    "stop_accuracy": (0.99, _number(0, open_low=True, high=None)),
    "shuffle": (True, _bool),
    "metric": ("micro", _choice(METRICS)),
    "test_at_best_val": (False, _bool),
}
TOP_FIELDS = {
    "name": ("recall", _str),
    "description": ("", lambda v: None if isinstance(v, str) else "a string"),
    "device": ("auto", lambda v: None if isinstance(v, str) and (
        v in ("auto", "cpu", "cuda") or v.startswith("cuda:")) else "auto, cpu, cuda or cuda:N"),
    "workers": (None, _optional(_int(1))),
    "workers_per_gpu": (2, _int(1)),
    "max_group": (32, _int(1)),
    "graphs": (True, _bool),
    "compile": (False, _bool),
    "seeds": ([0], _list(_int(0))),
    "mixers": (["sdpa", "linear-attn", "hla2", "mamba2-ssd"], _list(_str)),
    "mixer_options": ({}, lambda v: None if isinstance(v, dict) else "a mapping"),
    # per mixer, `model` keys that replace the config's for that mixer's runs
    "mixer_model": ({}, lambda v: None if isinstance(v, dict) else "a mapping"),
    "d_model": ([64], _list(_int(1))),
    "lrs": ([1e-3, 3e-3], _list(_number(0, open_low=True, high=None))),
    # the weight-decay grid; null: each setting's train.weight_decay alone
    "weight_decays": (None, _optional(_list(_number(0)))),
}
SECTIONS = {"model": MODEL_FIELDS, "train": TRAIN_FIELDS}
DEFAULT_SETTINGS = [{"task": "mqar", "params": {}}]


class ConfigError(ValueError):
    """A recall config key or value that is not allowed; the message names it."""


def _check_section(where: str, values: Any, fields: dict) -> dict:
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping, got {values!r}")
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key {', '.join(unknown)} "
                          f"(accepted: {', '.join(fields)})")
    for key, value in values.items():
        problem = fields[key][1](value)
        if problem:
            raise ConfigError(f"{where}.{key} must be {problem}, got {value!r}")
    return dict(values)


def default_config() -> dict:
    config = {key: copy.deepcopy(default) for key, (default, _) in TOP_FIELDS.items()}
    for section, fields in SECTIONS.items():
        config[section] = {key: default for key, (default, _) in fields.items()}
    config["settings"] = copy.deepcopy(DEFAULT_SETTINGS)
    return config


def validate_config(loaded: Any, where: str = "config") -> dict:
    """Defaults overridden by `loaded` (a parsed YAML mapping), every key and value checked;
    ConfigError names the first problem. Given `weight_decays`, that grid replaces
    `train.weight_decay` (a setting may then not set its own; `load_config` refuses a file
    that gives both)."""
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values")
    allowed = set(TOP_FIELDS) | set(SECTIONS) | {"settings"}
    unknown = sorted(set(loaded) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {', '.join(unknown)} "
                          f"(accepted: {', '.join(sorted(allowed))})")
    config = default_config()
    for key, value in loaded.items():
        if key in SECTIONS:
            config[key].update(_check_section(f"{where}.{key}", value, SECTIONS[key]))
        elif key == "settings":
            config["settings"] = _check_settings(value, where)
        else:
            problem = TOP_FIELDS[key][1](value)
            if problem:
                raise ConfigError(f"{where}.{key} must be {problem}, got {value!r}")
            config[key] = value
    _check_plan(config, where)
    return config


def _check_settings(settings: Any, where: str) -> list[dict]:
    if not isinstance(settings, list) or not settings:
        raise ConfigError(f"{where}.settings must be a non-empty list of task settings")
    checked = []
    accepted = ("task", "params", "train", "model", "name")
    for index, setting in enumerate(settings):
        at = f"{where}.settings[{index}]"
        if not isinstance(setting, dict) or "task" not in setting:
            raise ConfigError(f"{at} must be a mapping with a `task`")
        unknown = sorted(set(setting) - set(accepted))
        if unknown:
            raise ConfigError(f"{at}: unknown key {', '.join(unknown)} "
                              f"(accepted: {', '.join(accepted)})")
        entry = {"task": setting["task"], "params": dict(setting.get("params") or {})}
        if "name" in setting:
            problem = _str(setting["name"])
            if problem:
                raise ConfigError(f"{at}.name must be {problem}, got {setting['name']!r}")
            entry["name"] = setting["name"]
        for section, fields in SECTIONS.items():
            if section in setting:
                entry[section] = _check_section(f"{at}.{section}", setting[section], fields)
        checked.append(entry)
    return checked


def _check_plan(config: dict, where: str) -> None:
    """Names in the config that exist: tasks and their parameters, mixers and options;
    settings told apart by their labels; per-mixer model keys that no setting also sets."""
    labels: dict[str, int] = {}
    for index, setting in enumerate(config["settings"]):
        try:
            task = tasks.get(setting["task"])
            task.make("test", 1, 0, **setting["params"])
        except ValueError as error:
            raise ConfigError(f"{where}.settings[{index}]: {error}") from None
        label = setting_label(task.name, setting["params"], setting.get("train"),
                              setting.get("model"), setting.get("name"))
        if label in labels:
            raise ConfigError(f"{where}.settings[{labels[label]}] and settings[{index}] have the "
                              f"same label {label!r}; give one a `name` or remove the duplicate")
        labels[label] = index
        if config["weight_decays"] is not None and "weight_decay" in setting.get("train", {}):
            raise ConfigError(f"{where}.settings[{index}].train.weight_decay: the config has a "
                              "`weight_decays` grid; give the weight decays there")
    for key in ("mixer_options", "mixer_model"):
        unknown = sorted(set(config[key]) - set(config["mixers"]))
        if unknown:
            raise ConfigError(f"{where}.{key} names mixers not in `mixers`: {', '.join(unknown)}")
    for mixer, model in config["mixer_model"].items():
        checked = _check_section(f"{where}.mixer_model.{mixer}", model, MODEL_FIELDS)
        for index, setting in enumerate(config["settings"]):
            both = sorted(set(checked) & set(setting.get("model", {})))
            if both:
                raise ConfigError(f"{where}.settings[{index}].model and mixer_model.{mixer} both "
                                  f"set {', '.join(both)}")
    options = config["mixer_options"]
    for mixer in config["mixers"]:
        try:
            entry = registry.get(mixer)
            if options.get(mixer) is not None and not isinstance(options[mixer], dict):
                raise ValueError(f"options of {mixer!r} must be a mapping")
            entry.resolve_options(options.get(mixer) or {})
        except (ValueError, registry.UnknownMixerError) as error:
            raise ConfigError(f"{where}.mixers: {error}") from None
        if entry.build_layer is None:
            raise ConfigError(f"{where}.mixers: mixer {mixer!r} has no layer form to train")


def _layer_rejects(mixer: str, options: dict, d_model: int, n_heads: int,
                   device: str) -> str | None:
    """The ValueError or TypeError a small forward through `mixer`'s layer with `options`
    raises on `device`, else None (other failures are left to the runs to record)."""
    entry = registry.get(mixer)
    try:
        with torch.no_grad():
            layer = entry.layer(d_model, n_heads, **options).to(device)
            layer(torch.randn(1, 16, d_model, device=device))
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}" if isinstance(error, TypeError) else str(error)
    except Exception:  # noqa: BLE001 - not the options' fault: the runs record it
        return None
    return None


def check_mixer_options(config: dict, device: str) -> None:
    """Option values a mixer's layer rejects (say `impl: trtion`, `decay: 1.5`) are a
    ConfigError before any run: each mixer with options runs one small forward with them,
    and is blamed only when the same forward with its defaults succeeds."""
    d_model, n_heads = min(config["d_model"]), config["model"]["n_heads"]
    for mixer, options in config["mixer_options"].items():
        if not options or registry.get(mixer).unavailable_reason(options):
            continue
        problem = _layer_rejects(mixer, options, d_model, n_heads, device)
        if problem and _layer_rejects(mixer, {}, d_model, n_heads, device) is None:
            raise ConfigError(f"mixer_options.{mixer}: the layer rejects {options}: {problem}")


def load_config(path: str | None, overrides: dict) -> dict:
    """Defaults, then the YAML file, then the command-line options given (checked alike).
    Options replace what the file gives: `mixers` keeps the file's `mixer_options` and
    `mixer_model` of those mixers only, `weight_decays` replaces the file's grid or
    `train.weight_decay`. A file that gives both `weight_decays` and `train.weight_decay`
    is refused (one of them would be ignored)."""
    loaded: dict = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML ({error})") from None
    where = path or "options"
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values")
    merged = copy.deepcopy(loaded)
    train = merged.get("train")
    if isinstance(train, dict) and "weight_decay" in train:
        if overrides.get("weight_decays") is not None:
            del train["weight_decay"]
        elif merged.get("weight_decays") is not None:
            raise ConfigError(f"{where}: give `weight_decays` (a grid) or train.weight_decay, "
                              "not both")
    if overrides.get("mixers") is not None:
        for key in ("mixer_options", "mixer_model"):
            if isinstance(merged.get(key), dict):
                merged[key] = {mixer: value for mixer, value in merged[key].items()
                               if mixer in overrides["mixers"]}
    for key, value in overrides.items():
        if value is None:
            continue
        section = next((s for s, fields in SECTIONS.items() if key in fields), None)
        if section:
            merged.setdefault(section, {})
            if not isinstance(merged[section], dict):
                raise ConfigError(f"{where}.{section} must be a mapping")
            merged[section][key] = value
        else:
            merged[key] = value
    return validate_config(merged, where)


def _assignments(values: dict | None) -> list[str]:
    return [f"{key}={value}" for key, value in sorted((values or {}).items())]


def setting_label(task: str, params: dict, train: dict | None = None, model: dict | None = None,
                  name: str | None = None) -> str:
    """A setting's name in results and reports: `name` when given, else the task, its params
    and then its train and model overrides, each `key=value` in key order (task parameters
    and train / model keys do not share names, so distinct settings get distinct labels)."""
    if name:
        return name
    return " ".join([task] + _assignments(params) + _assignments(train) + _assignments(model))


def plan_runs(config: dict, device: str) -> list[dict]:
    """One spec per (setting, mixer, d_model, lr, weight decay, seed). A run's model is the
    config's, then the mixer's `mixer_model` keys, then the setting's `model` keys (the two
    never set the same key); its weight decays are `weight_decays`, else the setting's
    train.weight_decay."""
    specs = []
    for setting in config["settings"]:
        task = tasks.get(setting["task"])
        params = setting["params"]
        train = {**config["train"], **setting.get("train", {})}
        decays = config["weight_decays"] or [train["weight_decay"]]
        label = setting_label(task.name, params, setting.get("train"), setting.get("model"),
                              setting.get("name"))
        for mixer in config["mixers"]:
            model = {**config["model"], **config["mixer_model"].get(mixer, {}),
                     **setting.get("model", {})}
            for d_model in config["d_model"]:
                for lr in config["lrs"]:
                    for weight_decay in decays:
                        for seed in config["seeds"]:
                            specs.append(RunSpec(
                                task=task.name, mixer=mixer, d_model=int(d_model), lr=float(lr),
                                params=dict(params),
                                mixer_options=dict(config["mixer_options"].get(mixer) or {}),
                                seed=int(seed), device=device, setting=label,
                                run_id=len(specs),
                                **model, **{**train, "weight_decay": float(weight_decay)}).as_dict())
    return specs


_SPEC_DEFAULTS = RunSpec(task="", mixer="", d_model=1, lr=1.0).as_dict()


def run_key(run: dict) -> str:
    """What identifies a run across sweeps: its spec without the run id and device. A field
    a stored run lacks (it predates the field) counts as the field's default, which is what
    that run trained with."""
    spec = {key: run.get(key, _SPEC_DEFAULTS[key]) for key in RunSpec.__dataclass_fields__
            if key not in ("run_id", "device")}
    return yaml.safe_dump(spec, sort_keys=True)


# --- the results file --------------------------------------------------------------------

# What a resumed sweep must share with its file: runs of another protocol would mix.
PROTOCOL_KEYS = ("model", "train", "mixer_model")


def store_mode(out: str | None, resume: bool, overwrite: bool) -> str:
    """The results store's mode for --out with --resume / --overwrite."""
    if resume and overwrite:
        raise ConfigError("give --resume or --overwrite, not both")
    if out is None and (resume or overwrite):
        flag = "--resume" if resume else "--overwrite"
        raise ConfigError(f"{flag} needs --out: the results file to "
                          f"{'continue' if resume else 'replace'}")
    return "resume" if resume else "overwrite" if overwrite else "new"


def open_results(out: str | None, mode: str, config: dict, device: str, workers: int,
                 env: dict) -> ResultsStore:
    """The locked recall results store (a new file in runs/ without --out). A file that
    exists without --resume / --overwrite, is not a recall results file, is cut short, is
    written by another process, or holds another protocol is refused here, before any run."""
    path = Path(out) if out else default_out_path("recall")
    header = {"schema_version": SCHEMA_VERSION,
              "config": {**config, "device": device, "workers": workers},
              "environment": env, "seconds": 0.0}
    try:
        return ResultsStore.open(path, kind="recall", key=run_key, mode=mode, header=header,
                                 settings={key: config[key] for key in PROTOCOL_KEYS},
                                 validate=validate_recall)
    except StoreError as error:
        raise ConfigError(str(error)) from None


def environment(device: str) -> dict:
    from hla_bench.results import capture_environment

    return capture_environment(device)


def device_visible(device: str) -> bool:
    """Whether a config's device ("auto", "cpu", "cuda", "cuda:N") can run here."""
    return not device.startswith("cuda") or torch.cuda.is_available()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not device_visible(device):
        raise ConfigError("device cuda asked for, but no CUDA device is visible")
    return device


# --- the command -------------------------------------------------------------------------

def _comma_list(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [item.strip() for item in value.split(",")]
        if any(not item for item in items):
            raise click.BadParameter(f"empty item in {value!r}")
        try:
            return [kind(item) for item in items]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}, "
                                     f"got {value!r}") from None
    return parse


def parse_params(ctx, param, values) -> dict:
    params = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        params[key.replace("-", "_")] = yaml.safe_load(value)
    return params


def run_with_progress(groups: list[list[dict]], workers: int, console: Console,
                      on_results, client=None, **options) -> bool:
    """The groups under a rich display: an overall bar of runs, a bar per running group,
    and a line per finished run. Where the output is not a terminal (a pipe, a log file)
    the bars give way to whole lines: a group's start, its progress at every tenth of its
    steps and whenever a run of it stops, and each finished run."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    total = sum(len(group) for group in groups)
    names = {tuple(spec["run_id"] for spec in group):
             escape(f"{group[0]['mixer']} d={group[0]['d_model']} x{len(group)} "
                    f"[{group[0]['setting']}]") for group in groups}
    plain = not console.is_terminal

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False)

    with Progress(*columns, console=console, transient=False, disable=plain) as progress:
        overall = progress.add_task("[bold]all runs", total=total, info="")
        bars: dict[tuple, int] = {}
        told: dict[tuple, tuple[int, int]] = {}  # group -> (tenths of its steps, runs training)

        def on_event(ids: list[int], event: dict) -> None:
            key = tuple(ids)
            if event["event"] == "start" and key in names:
                bars[key] = progress.add_task(names[key], total=event["total"], info="")
                told[key] = (0, event["runs"])
                if plain:
                    say(f"{names[key]}: started, at most {event['total']:,} steps")
            elif event["event"] in ("eval", "resumed") and key in bars:
                info = (f"best val {event['accuracy']:.3f}, {event['active']} training"
                        if event["event"] == "eval" else "resumed")
                progress.update(bars[key], completed=event["step"], info=info)
                if not plain:
                    return
                if event["event"] == "resumed":
                    say(f"{names[key]}: resumed at step {event['step']:,}")
                    return
                tenths = 10 * event["step"] // max(1, event["total"])
                if (tenths, event["active"]) != told[key]:
                    told[key] = (tenths, event["active"])
                    say(f"{names[key]}: step {event['step']:,} of {event['total']:,}, {info}")

        def on_group(results: list[dict]) -> None:
            key = tuple(r["run_id"] for r in results)
            if key in bars:
                progress.remove_task(bars.pop(key))
            for result in results:
                where = escape(f"{result['mixer']} d={result['d_model']} lr={result['lr']:g} "
                               f"wd={result['weight_decay']:g} seed={result['seed']} "
                               f"[{result['setting']}]")
                outcome = (f"test {result['test_accuracy']:.3f} (val {result['val_accuracy']:.3f}) "
                           f"in {result['steps']} steps" if result["status"] == "ok" else
                           f"[red]{result['status']}: {escape(result.get('error', ''))}[/]")
                progress.console.print(f"  {where}: {outcome}", soft_wrap=plain,
                                       highlight=not plain)
            progress.advance(overall, len(results))
            on_results(results)

        if client is not None:
            from hla_bench.dask_executor import run_groups_dask

            return run_groups_dask(client, groups, on_event, on_group, **options)
        return run_groups(groups, workers, on_event, on_group, **options)


@click.command()
@click.option("--config", "config_file", metavar="CONFIG",
              help="YAML sweep config: a file, or the name of a shipped one (recall-cpu, "
                   "zoology-fig2, zoology-smoke, mad); the options below override it.")
@click.option("--task", help="Task name (see `hla-bench tasks list`): one setting of it replaces "
              "the config's settings. Without it, the task options below apply to every setting.")
@click.option("--mixers", callback=_comma_list(str), help="Comma-separated mixer names.")
@click.option("--d-model", "d_model", callback=_comma_list(int), help="Comma-separated model widths.")
@click.option("--seq-len", type=int, help="Task sequence length.")
@click.option("--num-kv-pairs", type=int, help="MQAR key-value pairs.")
@click.option("--vocab-size", type=int, help="Task vocabulary size.")
@click.option("--param", "extra_params", multiple=True, callback=parse_params,
              help="Any other task parameter, KEY=VALUE (repeatable).")
@click.option("--lrs", callback=_comma_list(float), help="Comma-separated learning rates.")
@click.option("--weight-decays", "weight_decays", callback=_comma_list(float),
              help="Comma-separated weight decays (a grid axis like --lrs; replaces the "
                   "config's weight decays).")
@click.option("--seeds", callback=_comma_list(int), help="Comma-separated run seeds "
              "(initialisation, data and batch order); tables show mean and spread over them.")
@click.option("--epochs", type=int)
@click.option("--num-train", type=int, help="Training examples (default: the task's).")
@click.option("--num-val", type=int, help="Validation examples, drawn from the training "
              "stream (the lr is chosen on them).")
@click.option("--num-test", type=int, help="Test examples (default: the task's).")
@click.option("--batch-size", type=int)
@click.option("--eval-every", type=int, help="Evaluate every N steps (0: once per epoch).")
@click.option("--n-layers", type=int)
@click.option("--n-heads", type=int)
@click.option("--state-mixer", type=click.Choice(STATE_MIXERS),
              help="After each mixer: mlp, swiglu, identity (Zoology's) or none.")
@click.option("--device", help="cpu, cuda, cuda:N or auto (default).")
@click.option("--workers", type=int, help="Worker processes (default: 1 per 2 CPU cores, or "
                                          "--workers-per-gpu per GPU).")
@click.option("--workers-per-gpu", type=int)
@click.option("--max-group", type=int, help="Most runs trained as one stack (default 32).")
@click.option("--graphs/--no-graphs", default=None,
              help="Replay each training step as a CUDA graph (default on CUDA).")
@click.option("--compile/--no-compile", "compile", default=None,
              help="Compile each group's stacked forward and backward with torch.compile "
                   "(fused elementwise kernels; each stack size compiles once, tens of "
                   "seconds). Default off.")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the results YAML here.")
@click.option("--resume", is_flag=True, help="Continue the --out file: keep its runs, run "
              "the missing ones (a group cut at --time-limit continues from its checkpoint).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out results file.")
@click.option("--time-limit", type=float, help="Stop after this many seconds: running groups "
              "stop at their next step and save a checkpoint; --resume continues them.")
@click.option("--plots-dir", type=click.Path(file_okay=False), help="Also write plots here.")
@click.option("--executor", type=click.Choice(["local", "dask"]), default="local",
              show_default=True, help="local: worker processes on this host; dask: tasks on a "
              "Dask cluster (a local one, one worker per GPU or CPU slot, without --scheduler).")
@click.option("--scheduler", metavar="ADDRESS", help="An existing Dask scheduler "
              "(tcp://host:8786) for --executor dask.")
@click.option("--dry-run", is_flag=True, help="Print the plan (runs, groups and the most "
              "training steps per task setting and width) and exit: nothing is trained or "
              "written, and a config's CUDA device need not be visible.")
def recall(config_file, task, seq_len, num_kv_pairs, vocab_size, extra_params, out, resume,
           overwrite, time_limit, plots_dir, executor, scheduler, dry_run, **options):
    """Train tiny LMs per mixer on synthetic recall tasks; report per (task setting, mixer,
    d_model) the test accuracy of the (learning rate, weight decay) chosen on validation,
    with its spread over seeds, beside the one chosen on test as Zoology (or MAD-lab) does."""
    console = Console()
    try:
        if config_file is not None:
            try:
                config_file = str(configs.find(config_file))
            except ValueError as error:
                raise ConfigError(f"--config {error}") from None
        config = load_config(config_file, options)
        params = {key: value for key, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                                                ("vocab_size", vocab_size)) if value is not None}
        params.update(extra_params)
        if task:  # one setting of this task instead of the config's
            config["settings"] = [{"task": task, "params": params}]
        elif params:  # these parameters in every setting of the config
            config["settings"] = [{**setting, "params": {**setting["params"], **params}}
                                  for setting in config["settings"]]
        if task or params:
            config = validate_config(config, config_file or "options")
        if time_limit is not None and time_limit <= 0:
            raise ConfigError("--time-limit must be > 0 seconds")
        if scheduler and executor != "dask":
            raise ConfigError("--scheduler needs --executor dask")
        if executor == "dask":
            from hla_bench.dask_executor import unavailable_reason

            if unavailable_reason():
                raise ConfigError(unavailable_reason())
        # a dry run plans for the config's device without needing it (a GPU grid is planned
        # on a laptop); its layers' options are then not tried
        absent = dry_run and not device_visible(config["device"])
        device = config["device"] if absent else resolve_device(config["device"])
        if not absent:
            check_mixer_options(config, device)
        specs = assign_devices(plan_runs(config, device), device)
        if dry_run:
            rows = plan_rows(specs, config["max_group"])
            print_table(console, plan_table(rows), lambda: plan_lines(rows))
            if absent:
                console.print(f"[yellow]note[/]: planned for {device}, which is not visible "
                              "here: the mixer options were not tried on it, and mixers "
                              "whose packages are missing here count as unstacked")
            return
        mode = store_mode(out, resume, overwrite)
        workers = config["workers"] or default_workers(device, config["workers_per_gpu"])
        store = open_results(out, mode, config, device, workers, environment(device))
    except (ConfigError, RecallFileError, OSError) as error:
        raise click.UsageError(str(error)) from None

    with store:
        finished = {run_key(run) for run in store.records() if run.get("status") == "ok"}
        runnable = []
        for spec in specs:
            reason = registry.get(spec["mixer"]).unavailable_reason(spec["mixer_options"])
            if run_key(spec) in finished:
                continue
            if reason:
                store.add(failed_result(spec, "unavailable", reason))
            else:
                runnable.append(spec)
        # cheapest first (width x length), so a sweep cut at --time-limit has finished the most
        groups = sorted(plan_groups(runnable, config["max_group"]),
                        key=lambda g: g[0]["d_model"] * tasks.get(g[0]["task"]).resolve_params(
                            g[0]["params"])["seq_len"])
        console.print(f"[bold]recall sweep[/]: {len(specs)} runs ({len(runnable)} to train in "
                      f"{len(groups)} groups) on {device}, {workers} worker(s)")
        gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
        if gpus and min(workers, len(groups)) > gpus and not cuda_mps_active():
            console.print(f"[yellow]note[/]: {min(workers, len(groups))} workers share "
                          f"{gpus} GPU(s) without CUDA MPS, so they take turns on it; with "
                          "MPS (`nvidia-cuda-mps-control -d`) their kernels run side by side "
                          "(docs/method.md)")
        if finished:
            console.print(f"resuming: {len(finished)} finished run(s) kept from "
                          f"{escape(str(store.path))}")
        started = time.perf_counter()
        previous_seconds = float((store.previous_header or {}).get("seconds") or 0.0)
        deadline = time.time() + time_limit if time_limit else None

        def on_results(results: list[dict]) -> None:
            """Store each finished group at once: a killed sweep keeps what it finished."""
            store.update_header({"seconds": round(previous_seconds + time.perf_counter() - started, 1)},
                                write=False)
            for result in results:
                store.add(result)

        client = None
        if executor == "dask" and groups:
            from hla_bench.dask_executor import connect, cuda_device_count, describe

            client = connect(scheduler, gpus=cuda_device_count() if device.startswith("cuda") else 0,
                             cpu_workers=workers)
            store.update_header({"executor": describe(client)}, write=False)
            console.print(f"dask: {describe(client)['workers']} worker(s) at "
                          f"{describe(client)['scheduler']}", highlight=False)
        try:
            complete = run_with_progress(
                groups, min(workers, max(1, len(groups))), console, on_results, client=client,
                deadline=deadline, checkpoint_dir=f"{store.path}.checkpoints",
                graphs=config["graphs"], compile=config["compile"])
        finally:
            if client is not None:
                client.close()
        store.update_header({"seconds": round(previous_seconds + time.perf_counter() - started, 1)},
                            write=False)
        data = store.close(complete=complete)
    render_recall(data, console, plots_dir=plots_dir)
    console.print(f"results written to {escape(str(store.path))}")
    if not complete:
        console.print("[yellow]stopped at --time-limit[/]: rerun with --resume to continue")


def plan_rows(specs: list[dict], max_group: int) -> list[dict]:
    """Per (task setting, d_model): the mixers, runs, stacked groups, the most steps a run
    takes (every epoch, no early stop) and the most model steps of all its runs."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for spec in specs:
        cells.setdefault((spec["setting"], spec["d_model"]), []).append(spec)
    rows = []
    for (setting, d_model), runs in cells.items():
        first = runs[0]
        num_train = first["num_train"] or tasks.get(first["task"]).num_train
        steps = first["epochs"] * math.ceil(num_train / first["batch_size"])
        rows.append({"setting": setting, "d_model": d_model,
                     "mixers": len({spec["mixer"] for spec in runs}), "runs": len(runs),
                     "groups": len(plan_groups(runs, max_group)), "steps": steps,
                     "model_steps": steps * len(runs)})
    return rows


def plan_table(rows: list[dict]) -> Table:
    """`plan_rows` as a table, with a total row."""
    runs = sum(row["runs"] for row in rows)
    table = Table(title=f"recall plan: {runs} runs (steps: at most, before early stops)")
    for column in ("setting", "d_model", "mixers", "runs", "groups", "steps a run",
                   "model steps"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(escape(row["setting"]), *(f"{row[key]:,}" for key in
                      ("d_model", "mixers", "runs", "groups", "steps", "model_steps")))
    table.add_row("all", "", "", f"{runs:,}", f"{sum(r['groups'] for r in rows):,}", "",
                  f"{sum(r['model_steps'] for r in rows):,}")
    return table


def plan_lines(rows: list[dict]) -> list[str]:
    """`plan_rows` as plain lines, for a console too narrow for the table."""
    runs = sum(row["runs"] for row in rows)
    return [f"recall plan: {runs} runs (steps: at most, before early stops)"] + [
        f"{row['setting']} d_model {row['d_model']}: {row['mixers']} mixers, {row['runs']} "
        f"runs in {row['groups']} groups, {row['steps']:,} steps a run, "
        f"{row['model_steps']:,} model steps" for row in rows] + [
        f"all: {sum(r['model_steps'] for r in rows):,} model steps"]


@click.group("tasks")
def tasks_group():
    """The synthetic tasks: list them, show an example."""


def _task_defaults(task) -> list[str]:
    return [f"{key}={value}" for key, value in task.params.items()]


def task_table(all_tasks: list) -> Table:
    """The tasks as a table: names and `parameter=default` items whole (one item a line),
    descriptions and sources wrapped between words."""
    table = Table(title="synthetic tasks")
    for column in ("name", "description", "defaults", "train/test", "source"):
        table.add_column(column, no_wrap=column in ("name", "train/test"))
    for task in all_tasks:
        table.add_row(escape(task.name), escape(task.description),
                      escape("\n".join(_task_defaults(task))),
                      f"{task.num_train}/{task.num_test}", escape(task.source))
    return table


def task_lines(all_tasks: list) -> list[str | list[str]]:
    """The tasks as plain lines, for a console too narrow for the table: per task its name
    and description, its defaults (each item whole) and its source."""
    lines: list[str | list[str]] = ["synthetic tasks"]
    for task in all_tasks:
        lines += [f"{task.name}: {task.description} (train/test {task.num_train}/"
                  f"{task.num_test})",
                  ["  defaults:", *_task_defaults(task)], f"  source: {task.source}"]
    return lines


@tasks_group.command("list")
def list_tasks():
    """Every registered task with its default parameters."""
    every = tasks.all_tasks()
    print_table(Console(), task_table(every), lambda: task_lines(every))


@tasks_group.command("show")
@click.argument("name")
@click.option("--seq-len", type=int)
@click.option("--num-kv-pairs", type=int)
@click.option("--vocab-size", type=int)
@click.option("--param", "extra_params", multiple=True, callback=parse_params,
              help="Any other task parameter, KEY=VALUE (repeatable).")
@click.option("--split", type=click.Choice(["train", "test"]), default="test", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--index", type=click.IntRange(0, 99_999), default=0, show_default=True,
              help="Which example to show.")
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
__all__ = ["recall", "tasks_group", "summarize"]
