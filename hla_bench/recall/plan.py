"""What a recall sweep is: its config (defaults, then a YAML file, then command-line options,
every key and value checked before any run starts), the labels of its task settings, and the
runs it plans.

`plan_sweep` is the one way from a config file and the command's options to a sweep's
plan (`SweepPlan`): every check, every registry lookup, the runs, their groups and a dry
run's table rows, before any work starts.

A config names the mixers, widths, learning rates, weight decays, seeds, the model (with
per-mixer overrides in `mixer_model`), the training protocol and the task settings
(configs/: recall-cpu, zoology-*, mad); its keys, their defaults and checks are declared in
`hla_bench.recall.schema`. A setting is `{task, params, train, model,
name}` (all but `task` optional); its label, which names it in the results and the report,
is its `name`, else the task with its params and its `train` / `model` overrides
(`setting_label`). Labels must differ between settings.
"""

from __future__ import annotations

import copy
import math
import os
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import yaml

import tasks
from tasks import IGNORE
from hla_bench import configs, registry
from hla_bench.results.load import validate_recall
from hla_bench.results.plots import planned_plots_problem, plots_dir_problem
from hla_bench.results.store import StoreError, read_resumable
from hla_bench.recall.pool import build_model, failed_result
from hla_bench.recall.schema import (MODEL_FIELDS, SECTIONS, TOP_FIELDS, TRAIN_FIELDS,
                                     default_config, int_from, list_of, nonempty_text)
from hla_bench.recall.train import RunSpec, group_key, seq_lens, steps_per_epoch


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


def validate_config(loaded: Any, where: str = "config") -> dict:
    """Defaults overridden by `loaded` (a parsed YAML mapping), every key and value checked;
    ConfigError names the first problem. Given `weight_decays`, that grid replaces
    `train.weight_decay` (a setting may then not set its own; `load_config` refuses a file
    that gives both)."""
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values")
    allowed = set(TOP_FIELDS) | set(SECTIONS) | {"settings"}
    unknown = sorted(set(loaded) - allowed)
    if unknown and ({"sweeps", "seq_lens", "modes"} & set(loaded)):
        raise ConfigError(f"{where} is a bench config (it has "
                          f"{', '.join(sorted({'sweeps', 'seq_lens', 'modes'} & set(loaded)))}): "
                          "run it with `hla-bench run`")
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
    accepted = ("task", "params", "train", "model", "name", *MIX_KEYS)
    for index, setting in enumerate(settings):
        at = f"{where}.settings[{index}]"
        if not isinstance(setting, dict) or "task" not in setting:
            raise ConfigError(f"{at} must be a mapping with a `task`")
        unknown = sorted(set(setting) - set(accepted))
        if unknown:
            raise ConfigError(f"{at}: unknown key {', '.join(unknown)} "
                              f"(accepted: {', '.join(accepted)})")
        if not isinstance(setting["task"], str) or not setting["task"]:
            raise ConfigError(f"{at}.task must be a task name, got {setting['task']!r}")
        params = setting.get("params") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{at}.params must be a mapping of task parameters, got "
                              f"{params!r}")
        entry = {"task": setting["task"], "params": dict(params)}
        if "name" in setting:
            problem = nonempty_text(setting["name"])
            if problem:
                raise ConfigError(f"{at}.name must be {problem}, got {setting['name']!r}")
            entry["name"] = setting["name"]
        for section, fields in SECTIONS.items():
            if section in setting:
                entry[section] = _check_section(f"{at}.{section}", setting[section], fields)
        for key in MIX_KEYS:
            if key in setting:
                entry[key] = _check_mix(f"{at}.{key}", setting[key])
        checked.append(entry)
    return checked


def check_given_params(settings: list[dict], given: dict[str, str], task: str | None,
                       source: str) -> None:
    """ConfigError naming the command-line options (`given`: parameter -> the option as
    typed) when the task parameters they set make a setting invalid: the task refuses them,
    or two settings of `source` (the config file) end with one label. The file's own settings
    were checked without them, so a problem found here is the options'."""
    options = " ".join(given.values())
    labels: dict[str, int] = {}
    for index, setting in enumerate(settings):
        try:
            entry = tasks.get(setting["task"])
            entry.make("test", 1, 0, **setting["params"])
        except (ValueError, TypeError) as error:
            if task:
                raise ConfigError(f"{' '.join(['--task', task, *given.values()])}: "
                                  f"{error}") from None
            raise ConfigError(f"{options}: {error} (these command-line values apply to every "
                              f"setting of {source}; the first refused is settings[{index}], "
                              f"task {setting['task']!r})") from None
        label = setting_label(entry.name, setting["params"], setting.get("train"),
                              setting.get("model"), setting.get("name"))
        if label in labels:
            raise ConfigError(f"{options}: these command-line values apply to every setting "
                              f"of {source} and make settings[{labels[label]}] and "
                              f"settings[{index}] one setting ({label!r}); pick one with "
                              "--task or --only-tasks")
        labels[label] = index


# A setting's training and test mixes: lists of slices, each task parameters and `count`
MIX_KEYS = ("train_mix", "test_mix")
# What a mix's count replaces: a setting with a training (test) mix gives no num_train
# (num_test)
MIX_COUNTS = {"train_mix": "num_train", "test_mix": "num_test"}


def _check_mix(where: str, mix: Any) -> list[dict]:
    """A mix as written: a non-empty list of mappings, each with a positive int `count`
    and task parameters (checked against the task in `_check_plan`)."""
    if not isinstance(mix, list) or not mix:
        raise ConfigError(f"{where} must be a non-empty list of slices, each task parameters "
                          "and a count (e.g. {seq_len: 64, num_kv_pairs: 4, count: 1000})")
    for index, entry in enumerate(mix):
        if not isinstance(entry, dict) or "count" not in entry:
            raise ConfigError(f"{where}[{index}] must be a mapping of task parameters with a "
                              f"`count`, got {entry!r}")
        problem = int_from(1)(entry["count"])
        if problem:
            raise ConfigError(f"{where}[{index}].count must be {problem}, got "
                              f"{entry['count']!r}")
    labels = [tasks.mix_label(entry) for entry in mix]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ConfigError(f"{where}: slice {twice[0]!r} is given twice; give each slice once "
                          "with its count")
    return [dict(entry) for entry in mix]


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
        except TypeError as error:
            raise ConfigError(f"{where}.settings[{index}]: a task parameter of the wrong type "
                              f"({error}); params: {setting['params']}") from None
        train = {**config["train"], **setting.get("train", {})}
        for key in MIX_KEYS:
            for slot, entry in enumerate(setting.get(key) or []):
                try:
                    params, _ = tasks.mix_entry(task, setting["params"], entry)
                    task.make("test", 1, 0, **params)
                except (ValueError, TypeError) as error:
                    raise ConfigError(f"{where}.settings[{index}].{key}[{slot}]: {error}") from None
            if setting.get(key) and train[MIX_COUNTS[key]] is not None:
                raise ConfigError(f"{where}.settings[{index}]: {key} gives each slice's count; "
                                  f"leave train.{MIX_COUNTS[key]} out (it is "
                                  f"{train[MIX_COUNTS[key]]})")
        if any(key in setting for key in MIX_KEYS) and train["metric"] != "micro":
            raise ConfigError(f"{where}.settings[{index}]: a mix is scored over every labelled "
                              f"position of its slices: metric must be micro, not "
                              f"{train['metric']}")
        label = setting_label(task.name, setting["params"], setting.get("train"),
                              setting.get("model"), setting.get("name"),
                              {key: setting[key] for key in MIX_KEYS if key in setting})
        if label in labels:
            raise ConfigError(f"{where}.settings[{labels[label]}] and settings[{index}] have the "
                              f"same label {label!r}; give one a `name` or remove the duplicate")
        labels[label] = index
        if config["weight_decays"] is not None and "weight_decay" in setting.get("train", {}):
            raise ConfigError(f"{where}.settings[{index}].train.weight_decay: the config has a "
                              "`weight_decays` grid; give the weight decays there")
    variants = []
    for text in config["mixers"]:
        try:
            variants.append(mixer_variant(text))
        except ValueError as error:
            raise ConfigError(f"{where}.mixers: {error}") from None
    labels = [label for _, _, label in variants]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ConfigError(f"{where}.mixers: {twice[0]!r} is given twice")
    named = {name for name, _, _ in variants} | set(labels)
    for key in ("mixer_options", "mixer_model", "mixer_d_model"):
        unknown = sorted(set(config[key]) - named)
        if unknown:
            raise ConfigError(f"{where}.{key} names mixers not in `mixers`: {', '.join(unknown)}")
    for mixer, widths in config["mixer_d_model"].items():
        problem = list_of(int_from(1))(widths)
        if problem or not widths:
            raise ConfigError(f"{where}.mixer_d_model.{mixer} must be "
                              f"{problem or 'a non-empty list'} (model widths), got {widths!r}")
    for mixer, model in config["mixer_model"].items():
        checked = _check_section(f"{where}.mixer_model.{mixer}", model, MODEL_FIELDS)
        for index, setting in enumerate(config["settings"]):
            both = sorted(set(checked) & set(setting.get("model", {})))
            if both:
                raise ConfigError(f"{where}.settings[{index}].model and mixer_model.{mixer} both "
                                  f"set {', '.join(both)}")
    options = config["mixer_options"]
    for key, value in options.items():
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}.mixers: options of {key!r} must be a mapping")
    for mixer, own, label in variants:
        try:
            entry = registry.get(mixer)
            entry.resolve_options(variant_options(config, mixer, own, label))
        except (ValueError, registry.UnknownMixerError) as error:
            raise ConfigError(f"{where}.mixers: {error}") from None
        if entry.build_layer is None:
            raise ConfigError(f"{where}.mixers: mixer {mixer!r} has no layer form to train")


def mixer_variant(text: str) -> tuple[str, dict, str]:
    """A `mixers` entry, `NAME[:key=value...][:label=LABEL]` (as `hla-bench bench` writes
    mixer specs): (registry name, its options, its label: LABEL, else the entry as written
    when it has options, else the name). ValueError for a malformed entry."""
    from hla_bench.options import MixerSpec

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a mixer is a name or NAME:key=value, got {text!r}")
    spec = MixerSpec.parse(text)
    explicit = spec.label != spec.name
    label = spec.label if explicit else (spec.text() if spec.options else spec.name)
    return spec.name, dict(spec.options), label


def variant_options(config: dict, mixer: str, own: dict, label: str) -> dict:
    """A variant's mixer options: `mixer_options` of its mixer, then of its label, then its
    own."""
    return {**(config["mixer_options"].get(mixer) or {}),
            **((config["mixer_options"].get(label) or {}) if label != mixer else {}), **own}


def variant_model(config: dict, mixer: str, label: str) -> dict:
    """A variant's `mixer_model` keys: its mixer's, then its label's."""
    return {**config["mixer_model"].get(mixer, {}),
            **(config["mixer_model"].get(label, {}) if label != mixer else {})}


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
    n_heads = config["model"]["n_heads"]
    for text in config["mixers"]:
        mixer, own, label = mixer_variant(text)
        d_model = min(variant_widths(config, mixer, label))
        options = variant_options(config, mixer, own, label)
        if not options or registry.get(mixer).unavailable_reason(options):
            continue
        problem = _layer_rejects(mixer, options, d_model, n_heads, device)
        if problem and _layer_rejects(mixer, {}, d_model, n_heads, device) is None:
            where = f"mixer_options.{mixer}" if label == mixer else f"mixers: {label}"
            raise ConfigError(f"{where}: the layer rejects {options}: {problem}")


def check_layers(specs: list[dict]) -> dict[int, str]:
    """Every (mixer, d_model, n_heads, options) the plan trains builds its layer (on the meta
    device), or the layer's ValueError or TypeError (say d_model 64 in 3 heads, or a head dim its kernel
    refuses) is a ConfigError before any run. Mixers that cannot run here are skipped: the
    sweep records them as unavailable (returned: run_id -> why, for each such run); so are
    shapes a layer says it does not implement (a NotImplementedError, say a head dim above its
    kernel's largest), recorded as unsupported. The checks of `resolve_shapes`."""
    return {run_id: shape.unavailable for run_id, shape in resolve_shapes(specs).items()
            if shape.unavailable}


def read_config_file(config_file: str | None) -> tuple[str | None, dict]:
    """The recall config file that `config_file` names (a file or a shipped config's name)
    and its YAML, read in one call (`configs.read_config`): (its path, the parsed YAML);
    (None, {}) without a file. ConfigError for a missing, empty or unreadable file."""
    if config_file is None:
        return None, {}
    try:
        path, loaded = configs.read_config(config_file)
    except configs.EmptyConfigError as error:
        raise ConfigError(f"{error}: a recall config is a mapping of keys to values "
                          "(configs/recall-cpu.yaml is one)") from None
    except configs.UnreadableConfigError as error:
        raise ConfigError(str(error)) from None
    except ValueError as error:
        raise ConfigError(f"--config {error}") from None
    return str(path), loaded or {}


def load_config(path: str | None, overrides: dict) -> dict:
    """Defaults, then the YAML file at `path` (`read_config_file`), then the command-line
    options given (`merge_config`)."""
    path, loaded = read_config_file(path)
    return merge_config(path, loaded, overrides)


def merge_config(path: str | None, loaded: Any, overrides: dict) -> dict:
    """Defaults, then `loaded` (the YAML of the file at `path`), then the command-line
    options given (checked alike).
    Options replace what the file gives: `mixers` keeps the file's `mixer_options`,
    `mixer_model` and `mixer_d_model` of those mixers only, `d_model` replaces every
    mixer's widths (the file's `mixer_d_model` too), `weight_decays` replaces the file's
    grid or `train.weight_decay`. A file that gives both `weight_decays` and `train.weight_decay`
    is refused (one of them would be ignored)."""
    for key, value in overrides.items():  # an option's own problem names the option
        fields = {**TOP_FIELDS, **MODEL_FIELDS, **TRAIN_FIELDS}
        problem = fields[key][1](value) if value is not None and key in fields else None
        if problem:
            raise ConfigError(f"--{key.replace('_', '-')} must be {problem}, got {value!r}")
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
        kept = set()
        for text in overrides["mixers"]:
            try:
                name, _, label = mixer_variant(text)
            except ValueError as error:
                raise ConfigError(f"--mixers: {error}") from None
            kept |= {name, label}
        for key in ("mixer_options", "mixer_model", "mixer_d_model"):
            if isinstance(merged.get(key), dict):
                merged[key] = {mixer: value for mixer, value in merged[key].items()
                               if mixer in kept}
    if overrides.get("d_model") is not None:
        merged.pop("mixer_d_model", None)
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
                  name: str | None = None, mixes: dict | None = None) -> str:
    """A setting's name in results and reports: `name` when given, else the task, its params
    and then its train and model overrides, each `key=value` in key order (task parameters
    and train / model keys do not share names, so distinct settings get distinct labels),
    then its mixes, `train_mix=[slice, ...]` with each slice's parameters and count."""
    if name:
        return name
    mix_parts = [f"{key}=[" + ", ".join(f"{tasks.mix_label(entry)} x{entry['count']}"
                                         for entry in mix) + "]"
                 for key, mix in sorted((mixes or {}).items())]
    return " ".join([task] + _assignments(params) + _assignments(train) + _assignments(model)
                    + mix_parts)


def variant_widths(config: dict, mixer: str, label: str) -> list[int]:
    """A variant's model widths: its label's `mixer_d_model`, else its mixer's, else the
    config's `d_model`."""
    widths = config["mixer_d_model"]
    if label != mixer and label in widths:
        return widths[label]
    return widths[mixer] if mixer in widths else config["d_model"]


def plan_runs(config: dict, device: str) -> list[dict]:
    """One spec per (setting, mixer, d_model, lr, weight decay, seed), the widths those of
    `variant_widths`. A run's model is the
    config's, then the mixer's `mixer_model` keys, then the setting's `model` keys (the two
    never set the same key); its weight decays are `weight_decays`, else the setting's
    train.weight_decay."""
    specs = []
    for setting in config["settings"]:
        task = tasks.get(setting["task"])
        params = setting["params"]
        train = {**config["train"], **setting.get("train", {})}
        decays = config["weight_decays"] or [train["weight_decay"]]
        mixes = {key: setting[key] for key in MIX_KEYS if key in setting}
        label = setting_label(task.name, params, setting.get("train"), setting.get("model"),
                              setting.get("name"), mixes)
        for text in config["mixers"]:
            mixer, own, variant = mixer_variant(text)
            model = {**config["model"], **variant_model(config, mixer, variant),
                     **setting.get("model", {})}
            for d_model in variant_widths(config, mixer, variant):
                for lr in config["lrs"]:
                    for weight_decay in decays:
                        for seed in config["seeds"]:
                            specs.append(RunSpec(
                                task=task.name, mixer=mixer, d_model=int(d_model), lr=float(lr),
                                params=dict(params),
                                **{key: [dict(entry) for entry in mix]
                                   for key, mix in mixes.items()},
                                mixer_options=variant_options(config, mixer, own, variant),
                                variant="" if variant == mixer else variant,
                                seed=int(seed), device=device, setting=label,
                                run_id=len(specs),
                                **model, **{**train, "weight_decay": float(weight_decay)}).as_dict())
    return specs


_SPEC_DEFAULTS = RunSpec(task="", mixer="", d_model=1, lr=1.0).as_dict()


def option_conflicts(records: list[dict], specs: list[dict]) -> list[str]:
    """Stored runs that a planned run repeats under other mixer options (same setting,
    mixer, d_model, learning rate, weight decay and seed, say impl=triton then
    impl=parallel): resuming would add the new run beside the stored one, and both would
    count in one cell of the report. One line per such run."""
    def identity(run: dict) -> tuple:
        return (run["setting"], run.get("variant") or run["mixer"], int(run["d_model"]),
                float(run["lr"]),
                float(run.get("weight_decay", _SPEC_DEFAULTS["weight_decay"])),
                int(run.get("seed", 0)))

    planned = {identity(spec): spec for spec in specs}
    keys = {run_key(spec) for spec in specs}
    lines = []
    for run in records:
        spec = planned.get(identity(run))
        if (spec is not None and run_key(run) not in keys
                and (run.get("mixer_options") or {}) != spec["mixer_options"]):
            lines.append(f"{run['mixer']} d_model={run['d_model']} lr={float(run['lr']):g} "
                         f"seed={run.get('seed', 0)} [{run['setting']}]: stored "
                         f"{run.get('mixer_options') or {}}, planned {spec['mixer_options']}")
    return lines


def run_key(run: dict) -> str:
    """What identifies a run across sweeps: its spec without the run id and device. A field
    a stored run lacks (it predates the field) counts as the field's default, which is what
    that run trained with."""
    spec = {key: run.get(key, _SPEC_DEFAULTS[key]) for key in RunSpec.__dataclass_fields__
            if key not in ("run_id", "device")}
    return yaml.safe_dump(spec, sort_keys=True)


def check_recall_file(data: Any) -> None:
    """The checks of a recall results file (`hla_bench.results.load.validate_recall`) with
    this wing's run identity (`run_key`): RecallFileError on the first problem."""
    validate_recall(data, run_key)


def plan_rows(specs: list[dict], max_group: int,
              step_flops: Callable[[dict], int | None] | None = None,
              shapes: dict[int, Shape] | None = None) -> list[dict]:
    """Per (task setting, d_model): the mixers, runs, stacked groups and their sizes
    (`stacks`), the most steps a run
    takes (every epoch, no early stop) and the most model steps of all its runs; with
    `step_flops` (a run's FLOPs per training step, None where unknown) also the most FLOPs
    of its runs (`flops`) and the mixers not counted (`uncounted`). `shapes`: the plan's
    (`resolve_shapes`), else resolved for the groups."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for spec in specs:
        cells.setdefault((spec["setting"], spec["d_model"]), []).append(spec)
    rows = []
    for (setting, d_model), runs in cells.items():
        first = runs[0]
        steps = first["epochs"] * steps_per_epoch(first, tasks.get(first["task"]).num_train)
        groups = plan_groups(runs, max_group, shapes)
        sizes = Counter(len(group) for group in groups)
        row = {"setting": setting, "d_model": d_model,
               "mixers": len({spec.get("variant") or spec["mixer"] for spec in runs}),
               "runs": len(runs),
               "groups": len(groups), "steps": steps, "model_steps": steps * len(runs),
               # the stacks the groups train as: "9 x 4" is nine stacks of four models
               "stacks": ", ".join(f"{count} x {size}" for size, count in
                                   sorted(sizes.items(), reverse=True))}
        if step_flops is not None:
            flops, uncounted = 0, set()
            for spec in runs:
                per_step = step_flops(spec)
                if per_step is None:
                    uncounted.add(spec["mixer"])
                else:
                    flops += steps * per_step
            row.update(flops=flops, uncounted=sorted(uncounted))
        rows.append(row)
    return rows


# --- the groups and their costs ------------------------------------------------------

@dataclass
class Shape:
    """What the runs of one group shape (`group_key`: runs that differ only in learning
    rate, weight decay and seed) need from the registry and their task, resolved once when
    the sweep is planned (`resolve_shapes`)."""

    # the shape's `group_key` as planned: before the runs are placed on devices (the runs
    # of one shape are placed on one)
    key: str
    mixer: str  # the registry entry's name
    unavailable: str | None  # why the mixer cannot run here (`Mixer.unavailable_reason`)
    stackable: bool  # its runs can train stacked (`stackable`)
    seq_len: int  # its training sequence length (`seq_len_of`)
    # recurrent state of one layer per sequence in float32 bytes (`layer_state_bytes`), at
    # the test length (the longest test slice's) and at each test slice's own length
    state_bytes_per_layer: int | None
    slice_state_bytes: dict[int, int | None]

    def state(self) -> dict:
        """The state bytes a trained run's record holds, as `pool.run_group` takes them."""
        return {"per_layer": self.state_bytes_per_layer, "slices": self.slice_state_bytes}


def resolve_shapes(specs: list[dict]) -> dict[int, Shape]:
    """run_id -> the `Shape` of each run of `specs`: every registry lookup the groups need,
    once per shape."""
    by_key: dict[str, Shape] = {}
    shapes = {}
    for spec in specs:
        key = group_key(spec)
        if key not in by_key:
            trained, tested = seq_lens(spec, "train"), seq_lens(spec, "test")
            by_key[key] = _resolve(registry.get(spec["mixer"]), spec, key, max(trained), tested)
        shapes[spec["run_id"]] = by_key[key]
    return shapes


def _resolve(entry: registry.Mixer, spec: dict, key: str, seq_len: int,
             tested: list[int]) -> Shape:
    """The `Shape` of `spec` from its registry entry: why it cannot run here, else its layer
    built on the meta device (a ValueError or TypeError is a ConfigError: say d_model 64 in
    3 heads, or a head dim its kernel refuses; a NotImplementedError, a shape it does not
    implement, is left to the run to record as unsupported); whether it trains stacked; its
    state bytes at each test length."""
    run = RunSpec(**spec)
    options = run.mixer_options
    reason = entry.unavailable_reason(options)
    if not reason:
        try:
            with torch.device("meta"):  # shapes and checks only: no memory, any width
                entry.layer(run.d_model, run.n_heads, **options)
        except NotImplementedError:
            pass
        except (ValueError, TypeError) as error:
            raise ConfigError(f"{run.mixer} at d_model {run.d_model} with "
                              f"{run.n_heads} head(s): {error}") from None
    per_layer = {length: _entry_state_bytes(entry, options, run.d_model, run.n_heads, length)
                 for length in set(tested)}
    return Shape(key=key, mixer=entry.name, unavailable=reason,
                 stackable=_entry_stackable(entry, run), seq_len=seq_len,
                 state_bytes_per_layer=per_layer[max(tested)], slice_state_bytes=per_layer)


def plan_groups(specs: list[dict], max_runs: int,
                shapes: dict[int, Shape] | None = None) -> list[list[dict]]:
    """Specs grouped by `group_key` (first-seen order), at most `max_runs` a group; runs of
    a mixer that cannot train stacked form groups of one. `shapes`: the plan's
    (`resolve_shapes`), else resolved here."""
    shapes = resolve_shapes(specs) if shapes is None else shapes
    groups: dict[str, list[dict]] = {}
    for spec in specs:
        groups.setdefault(shapes[spec["run_id"]].key, []).append(spec)
    planned = []
    for members in groups.values():
        size = max(1, max_runs) if shapes[members[0]["run_id"]].stackable else 1
        planned += [members[start:start + size] for start in range(0, len(members), size)]
    return planned


def stackable(spec: dict) -> bool:
    """Whether runs of `spec`'s shape can train stacked (their mixer layer says how)."""
    run = RunSpec(**spec)
    return _entry_stackable(registry.get(run.mixer), run)


def _entry_stackable(entry: registry.Mixer, run: RunSpec) -> bool:
    try:
        layer = entry.layer(run.d_model, run.n_heads, **run.mixer_options)
    except (registry.MixerUnavailableError, NotImplementedError):
        return False  # it cannot run here, or not at this shape; the sweep records why
    return callable(getattr(layer, "forward_stacked", None))


def seq_len_of(spec: dict) -> int:
    """A run's sequence length: its task's default where its setting leaves it out; with a
    training mix, the longest of its training slices."""
    return max(seq_lens(spec, "train"))


def layer_state_bytes(mixer: str, mixer_options: dict, d_model: int, n_heads: int,
                      seq_len: int) -> int | None:
    """Recurrent state (KV cache for softmax attention) of one layer per sequence after
    `seq_len` tokens, in float32 bytes: the registry entry's count (`Mixer.state_bytes`),
    else its decoder's state; None when neither is known."""
    try:
        entry = registry.get(mixer)
    except registry.UnknownMixerError:
        return None
    return _entry_state_bytes(entry, mixer_options, d_model, n_heads, seq_len)


def _entry_state_bytes(entry: registry.Mixer, mixer_options: dict, d_model: int,
                       n_heads: int, seq_len: int) -> int | None:
    try:
        counted = entry.state_bytes(d_model, n_heads, seq_len, **mixer_options)
    except ValueError:
        return None
    if counted is not None:
        return int(counted)
    if entry.build_decoder is None:
        return None
    try:
        heads, head_dim, value_dim = entry.state_dims(d_model, n_heads, **mixer_options)
        decoder = entry.decoder(**mixer_options)
        state = decoder.init_state(1, heads, head_dim, value_dim, seq_len, "cpu", torch.float32)
        return int(decoder.state_bytes(state))
    except (registry.MixerUnavailableError, NotImplementedError, RuntimeError, ValueError):
        return None


def state_bytes(mixer: str, mixer_options: dict, d_model: int, n_heads: int, n_layers: int,
                seq_len: int) -> int | None:
    """Recurrent state (KV cache for softmax attention) per sequence of the whole layer stack
    after `seq_len` tokens, in float32 bytes (`layer_state_bytes` x the layers); None where
    unknown."""
    size = layer_state_bytes(mixer, mixer_options, d_model, n_heads, seq_len)
    return None if size is None else size * n_layers


def _conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding,
                         _dilation, transposed, _output_padding, _groups, output_mask,
                         out_shape=None, **_) -> int:
    """A convolution's backward as torch's flop counter should count it: the forward's
    FLOPs (which know the groups of a depthwise convolution) for each gradient asked for."""
    from torch.utils.flop_counter import conv_flop_count

    return conv_flop_count(x_shape, w_shape, grad_out_shape, transposed) * (
        int(output_mask[0]) + int(output_mask[1]))


# What a run's training step computes depends on these fields alone (not on its learning
# rate, seed, data sizes or schedule)
STEP_FIELDS = ("task", "params", "mixer", "mixer_options", "d_model", "n_layers", "n_heads",
               "state_mixer", "norm", "head", "swiglu_hidden", "decoder", "positions",
               "batch_size")
_STEP_FLOPS: dict[str, int | None] = {}


def step_flops(spec: dict) -> int | None:
    """The matmul FLOPs of one training step of `spec`'s model (forward and backward of a
    batch): one example of its task through the model, counted by torch.utils.flop_counter
    (matmuls, attention and convolutions; no elementwise work), times the batch size. The
    model runs on the meta device (shapes only, no arithmetic), or on the CPU where an op
    needs real tensors; either way its mixers run their PyTorch forms (on CUDA the Triton
    kernels compute the same sums). None where the mixer cannot run on the CPU. Remembered
    per step shape (STEP_FIELDS)."""
    if spec.get("train_mix"):  # a step of each slice, weighted by the slice's batches
        batches = [math.ceil(int(entry["count"]) / spec["batch_size"])
                   for entry in spec["train_mix"]]
        counts = []
        for entry in spec["train_mix"]:
            params = {**spec["params"], **{k: v for k, v in entry.items() if k != "count"}}
            counts.append(step_flops({**spec, "params": params, "train_mix": None,
                                      "test_mix": None}))
        if any(count is None for count in counts):
            return None
        return round(sum(c * b for c, b in zip(counts, batches)) / sum(batches))
    key = repr([(name, spec.get(name)) for name in STEP_FIELDS])
    if key not in _STEP_FLOPS:
        _STEP_FLOPS[key] = _step_flops(spec)
    return _STEP_FLOPS[key]


def _step_flops(spec: dict) -> int | None:
    run = RunSpec(**spec)
    inputs, labels = tasks.get(run.task).make("train", 1, run.seed, **run.params)
    count = int((labels != IGNORE).sum())  # the rows the head reads, known without data
    for device in ("meta", "cpu"):
        try:
            return _counted_step(spec, inputs, labels, count, device) * run.batch_size
        except registry.MixerUnavailableError:
            return None
        except (RuntimeError, NotImplementedError, ValueError):
            # an op without a meta kernel: count on the CPU; one that cannot run on the CPU
            # either (say impl="triton"): not counted
            if device == "cpu":
                return None


def _counted_step(spec: dict, inputs, labels, count: int, device: str) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        with torch.device(device):
            model = build_model(spec)
        counter = FlopCounterMode(display=False, custom_mapping={
            torch.ops.aten.convolution_backward: _conv_backward_flops})
        with counter:
            model.loss(inputs.to(device), labels.to(device), count).backward()
    return counter.get_total_flops()


# --- a sweep from the command line -------------------------------------------------------

# What a resumed sweep must share with its file: runs of another protocol would mix.
PROTOCOL_KEYS = ("model", "train", "mixer_model")

# A run's outcomes that a resume keeps: trained, or refused by its mixer at its shape (a
# NotImplementedError, such as a head dim a kernel does not take), which another try repeats
FINISHED_STATUSES = ("ok", "unsupported")


def protocol(config: dict) -> dict:
    """The keys of `config` that a resumed results file must hold alike (PROTOCOL_KEYS)."""
    return {key: config[key] for key in PROTOCOL_KEYS}


def store_mode(out: str | None, resume: bool, overwrite: bool) -> str:
    """The results store's mode for --out with --resume / --overwrite."""
    if out is not None and not out.strip():
        raise ConfigError("--out is empty: give a file, or leave --out out for a new file in "
                          "runs/")
    if resume and overwrite:
        raise ConfigError("give --resume or --overwrite, not both")
    if out is None and (resume or overwrite):
        flag = "--resume" if resume else "--overwrite"
        raise ConfigError(f"{flag} needs --out: the results file to "
                          f"{'continue' if resume else 'replace'}")
    return "resume" if resume else "overwrite" if overwrite else "new"


def check_repeats(path: str | Path, records: list[dict], specs: list[dict]) -> None:
    """ConfigError when the file's runs hold one that the plan repeats under other mixer
    options (`option_conflicts`): both would count in one cell."""
    conflicts = option_conflicts(records, specs)
    if conflicts:
        raise ConfigError(f"{path} holds {len(conflicts)} run(s) that the plan repeats with "
                          "other mixer options; both would count in one cell. Write the new "
                          "plan to another --out. First: " + conflicts[0])


def kept_keys(records: list[dict]) -> set[str]:
    """The keys of the runs among `records` that finished (FINISHED_STATUSES): a resume
    keeps them."""
    return {run_key(run) for run in records if run.get("status") in FINISHED_STATUSES}


def finished_keys(out: str, config: dict, specs: list[dict]) -> set[str]:
    """The keys of the runs finished (FINISHED_STATUSES) in the results file `out`, read
    without taking its lock, after the checks a resume makes (ConfigError otherwise)."""
    try:
        data = read_resumable(out, "recall", protocol(config), check_recall_file)
    except StoreError as error:
        raise ConfigError(str(error)) from None
    check_repeats(out, data["runs"], specs)
    return kept_keys(data["runs"])


def device_visible(device: str) -> bool:
    """Whether a config's device ("auto", "cpu", "cuda", "cuda:N") can run here."""
    return not device.startswith("cuda") or torch.cuda.is_available()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not device_visible(device):
        raise ConfigError("device cuda asked for, but no CUDA device is visible")
    return device


def default_workers(device: str, workers_per_gpu: int = 2) -> int:
    """Workers for a sweep: `workers_per_gpu` per visible GPU on CUDA, one per 2 cores on CPU."""
    if device.startswith("cuda"):
        return max(1, torch.cuda.device_count()) * workers_per_gpu
    return max(1, (os.cpu_count() or 2) // 2)


def assign_devices(specs: list[dict], device: str, shapes: dict[int, Shape]) -> list[dict]:
    """Spread groups over the visible GPUs round-robin when `device` is plain "cuda" (the
    runs of one group shape, `shapes` as `resolve_shapes` gave them, stay on one device)."""
    if device != "cuda":
        return [{**spec, "device": device} for spec in specs]
    count = max(1, torch.cuda.device_count())
    keys: dict[str, int] = {}
    placed = []
    for spec in specs:
        slot = keys.setdefault(shapes[spec["run_id"]].key, len(keys))
        placed.append({**spec, "device": f"cuda:{slot % count}"})
    return placed


def order_groups(groups: list[list[dict]], largest_first: bool = False,
                 shapes: dict[int, Shape] | None = None) -> list[list[dict]]:
    """The order groups start in: by width x sequence length, the cheapest first (or with
    `largest_first` the costliest first); groups of one size keep the plan's order.
    `shapes`: the plan's (`resolve_shapes`), else the lengths are found here."""
    def size(group: list[dict]) -> int:
        spec = group[0]
        return spec["d_model"] * (seq_len_of(spec) if shapes is None
                                  else shapes[spec["run_id"]].seq_len)

    return sorted(groups, key=lambda group: -size(group) if largest_first else size(group))


@dataclass
class SweepPlan:
    """A recall sweep as `plan_sweep` planned it, every check passed."""

    config: dict  # the checked config, as the results file's header holds it
    device: str  # where the runs train (a dry run's may be a device not visible here)
    mode: str  # the results store's: "new", "resume" or "overwrite"
    specs: list[dict]  # every planned run, each on its device
    # run_id -> why the run's mixer cannot run here (`check_layers`)
    unavailable: dict[int, str] = field(default_factory=dict)
    workers: int = 0  # the worker processes
    largest_first: bool = False  # groups start costliest first
    # a dry run: the planned device is not visible here (its layers' options were not tried)
    absent: bool = False
    # a dry run of --resume: (runs finished in --out, runs planned); None otherwise
    resumed: tuple[int, int] | None = None
    rows: list[dict] = field(default_factory=list)  # a dry run's `plan_rows` (with FLOPs)
    # run_id -> its shape, as the registry and its task give it (`resolve_shapes`)
    shapes: dict[int, Shape] = field(default_factory=dict)

    def left(self, finished: set[str]) -> "RunsLeft":
        """What the runs not in `finished` (their `run_key`s) come to: the failed records of
        those whose mixer cannot run here, and the groups of the others in start order."""
        failed, runnable = [], []
        for spec in self.specs:
            if run_key(spec) in finished:
                continue
            reason = self.unavailable.get(spec["run_id"])
            if reason:
                failed.append(failed_result(spec, "unavailable", reason))
            else:
                runnable.append(spec)
        groups = order_groups(plan_groups(runnable, self.config["max_group"], self.shapes),
                              self.largest_first, self.shapes)
        state_bytes = {spec["run_id"]: self.shapes[spec["run_id"]].state() for spec in runnable}
        return RunsLeft(failed=failed, groups=groups, runs=len(runnable),
                        state_bytes=state_bytes)


@dataclass
class RunsLeft:
    """The part of a plan that a results file still lacks (`SweepPlan.left`)."""

    failed: list[dict]  # records of runs whose mixer cannot run here, to store as they are
    groups: list[list[dict]]  # the runs to train, grouped, in the order they start
    runs: int  # the runs in `groups`
    # run_id -> the state bytes its record holds (`Shape.state`), for `pool.run_group`
    state_bytes: dict[int, dict] = field(default_factory=dict)


def plan_sweep(config_file: str | None, overrides: dict, *, task: str | None = None,
               only_tasks: list[str] | None = None, params: dict | None = None,
               extra_params: dict | None = None, out: str | None = None, resume: bool = False,
               overwrite: bool = False, time_limit: float | None = None,
               executor: str = "local", scheduler: str | None = None, dashboard: bool = False,
               plots_dir: str | None = None, dry_run: bool = False,
               largest_first: bool = False,
               busy: Callable[[str], ContextManager] = lambda _: nullcontext()) -> SweepPlan:
    """The plan of `hla-bench recall`: the config (`config_file`, a file or a shipped
    config's name, then `overrides`, the config options given), one setting of `task` or
    the config's settings of `only_tasks`, task `params` (the named options given,
    parameter -> value) and `extra_params` (--param) in each, every option checked, the runs
    and, for a dry run, its table rows (`busy(message)` is held while the FLOPs are
    counted). Every problem is a ConfigError (or a RecallFileError, an OSError) raised here,
    before any work starts, in the order the options are documented."""
    config_file, loaded = read_config_file(config_file)
    if task is not None and not task.strip():
        raise ConfigError("--task is empty: give a task name (hla-bench tasks list)")
    config = merge_config(config_file, loaded, overrides)
    params = dict(params or {})
    extra_params = extra_params or {}
    given = {key: f"--{key.replace('_', '-')} {value}" for key, value in params.items()}
    given.update({key: f"--param {key}={value}" for key, value in extra_params.items()})
    params.update(extra_params)
    if task:  # one setting of this task instead of the config's
        config["settings"] = [{"task": task, "params": params}]
    elif params:  # these parameters in every setting of the config
        config["settings"] = [{**setting, "params": {**setting["params"], **params}}
                              for setting in config["settings"]]
    if only_tasks:
        if task:
            raise ConfigError("give --task (one setting) or --only-tasks (the config's "
                              "settings of those tasks), not both")
        present = list(dict.fromkeys(setting["task"] for setting in config["settings"]))
        missing = [name for name in only_tasks if name not in present]
        if missing:
            raise ConfigError(f"--only-tasks {missing[0]!r}: no setting of the config has "
                              f"that task (its tasks: {', '.join(present)})")
        config["settings"] = [setting for setting in config["settings"]
                              if setting["task"] in only_tasks]
    if task or params:
        check_given_params(config["settings"], given, task,
                           config_file or "the default recall config")
        config = validate_config(config, config_file or "options")
    if time_limit is not None and not 0 < time_limit < math.inf:
        raise ConfigError(f"--time-limit must be a finite number of seconds > 0, got "
                          f"{time_limit}")
    if scheduler and executor != "dask":
        raise ConfigError("--scheduler needs --executor dask")
    if dashboard and (executor != "dask" or scheduler):
        raise ConfigError("--dashboard is the dashboard of the local Dask cluster: it "
                          "needs --executor dask without --scheduler")
    if executor == "dask":
        from hla_bench.dask_executor import executor_problem

        problem = executor_problem(scheduler)
        if problem:
            raise ConfigError(problem)
    # a dry run plans for the config's device without needing it (a GPU grid is planned
    # on a laptop); its layers' options are then not tried
    absent = dry_run and not device_visible(config["device"])
    device = config["device"] if absent else resolve_device(config["device"])
    if not absent:
        check_mixer_options(config, device)
        if not device.startswith("cuda"):
            if overrides.get("graphs"):
                raise ConfigError(f"--graphs replays CUDA graphs: the device is {device}")
            config["graphs"] = False  # nothing is replayed off CUDA: the header says so
    specs = plan_runs(config, device)
    shapes = resolve_shapes(specs)
    unavailable = {run_id: shape.unavailable for run_id, shape in shapes.items()
                   if shape.unavailable}
    specs = assign_devices(specs, device, shapes)
    mode = store_mode(out, resume, overwrite)
    problem = plots_dir_problem(plots_dir) if plots_dir is not None else None
    if plots_dir is not None and not problem:  # a plot there that is a symbolic link
        problem = planned_plots_problem([("recall", "recall", {})], plots_dir, "png")
    if problem:
        raise ConfigError(problem)
    workers = config["workers"] or default_workers(device, config["workers_per_gpu"])
    plan = SweepPlan(config=config, device=device, mode=mode, specs=specs,
                     unavailable=unavailable, workers=workers, largest_first=largest_first,
                     absent=absent, shapes=shapes)
    if dry_run:
        left = specs
        if mode == "resume" and Path(out).exists():
            finished = finished_keys(out, config, specs)
            left = [spec for spec in specs if run_key(spec) not in finished]
            plan.resumed = (len(specs) - len(left), len(specs))
        with busy("counting each step shape's FLOPs"):  # one traced step a shape
            plan.rows = plan_rows(left, config["max_group"], step_flops, plan.shapes)
    return plan
