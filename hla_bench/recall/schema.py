"""The recall config: every key, its default, its check and its help, declared once.

`RecallConfig` is the config file's top level; its `model` and `train` keys are the
sections `ModelConfig` and `TrainConfig` (a task setting, and `mixer_model` per mixer, may
override their keys), `settings` the task settings. Each key is a field made by `key`
(`hla_bench.options.config_field`, the mechanism bench's sweep settings share): the field's
default is the key's default, its check says what a value must be, its help is what the
command line and this module show, and `option` says whether, and how, `hla-bench recall`
takes it as an option (`--NAME-WITH-DASHES`, derived by `with_config_options`). A value
given as an option replaces the file's (`hla_bench.recall.plan.load_config`).

The tables `TOP_FIELDS`, `MODEL_FIELDS` and `TRAIN_FIELDS` (key -> (default, check)) and
`default_config` are derived from the dataclasses; a run spec's defaults are those of the
sections (`hla_bench.recall.train.RunSpec`).
"""

from __future__ import annotations

import math
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Callable

import click

from hla_bench.options import comma_list, config_field, field_default, option_flag, \
    with_field_options
from hla_bench.recall.model import DECODERS, HEADS, INITS, NORMS, STATE_MIXERS

MAX_INT = 2**31 - 1  # beyond int32 a count, width or seed is a typo
# "auto": learned positions for softmax attention only; "learned": for every mixer; "none"
POSITIONS = ("auto", "learned", "none")
SCHEDULES = ("warmup-cosine", "epoch-cosine", "constant")
METRICS = ("micro", "mad-macro")

Check = Callable[[Any], "str | None"]  # a value -> what it must be, None when it is that


# --- the checks ---------------------------------------------------------------------------

def int_from(minimum: int) -> Check:
    def check(value):
        if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
                or value > MAX_INT):
            return f"an int from {minimum} to {MAX_INT}"
        return None
    return check


def number_in(low: float, high: float | None = None, *, open_low: bool = False,
              open_high: bool = True) -> Check:
    def check(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "a number"
        if not math.isfinite(value):
            return "a finite number"
        if (value <= low if open_low else value < low) or (
                high is not None and (value >= high if open_high else value > high)):
            left, right = "(" if open_low else "[", ")" if open_high else "]"
            return f"a number in {left}{low}, {'inf' if high is None else high}{right}"
        return None
    return check


def one_of(choices) -> Check:
    return lambda value: None if value in choices else f"one of {', '.join(choices)}"


def optional(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


def boolean(value) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def list_of(item_check: Check, *, unique: bool = True) -> Check:
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


def nonempty_text(value) -> str | None:
    return None if isinstance(value, str) and value else "a non-empty string"


def text(value) -> str | None:
    return None if isinstance(value, str) else "a string"


def mapping(value) -> str | None:
    return None if isinstance(value, dict) else "a mapping"


def device_name(value) -> str | None:
    return None if isinstance(value, str) and (
        value in ("auto", "cpu", "cuda") or value.startswith("cuda:")) else \
        "auto, cpu, cuda or cuda:N"


# --- the keys -----------------------------------------------------------------------------

# How an option reads its value: a click type (int, float, str, a click.Choice), a list
# ("list", kind: comma-separated items of kind) or "switch" (--NAME/--no-NAME).
SWITCH = "switch"


def key(default: Any, check: Check, help: str, option: Any = None) -> Any:
    """A recall config key: its `default`, its `check`, its `help` and, when the command
    line takes it, how its `option` reads a value (None: the file only)."""
    return config_field(default, help=help, cli=option is not None, check=check,
                        option=option)


@dataclass
class ModelConfig:
    """The model of every run (the `model` section)."""

    n_layers: int = key(2, int_from(1), "Mixer blocks of the model.", int)
    n_heads: int = key(1, int_from(1), "Heads of each mixer.", int)
    state_mixer: str = key("mlp", one_of(STATE_MIXERS),
                           "After each mixer: mlp, swiglu, identity (Zoology's) or none.",
                           click.Choice(STATE_MIXERS))
    embed_dropout: float = key(0.0, number_in(0, 1), "Dropout on the token embeddings.")
    init: str = key("default", one_of(INITS),
                    "Weight init: default (PyTorch's) or zoology (Zoology's N(0, 0.02), output "
                    "projections scaled by 1/sqrt(2 n_layers)).")
    norm: str = key("layer", one_of(NORMS), "The model's norms: layer or rms.")
    head: str = key("tied", one_of(HEADS), "The output head: tied to the embedding or untied.")
    swiglu_hidden: int | None = key(None, optional(int_from(1)),
                                    "The SwiGLU state mixer's inner width (null: from the "
                                    "model width).")
    decoder: str = key("default", one_of(DECODERS),
                       "The model's readout: default, or mad-lab (MAD-lab's).")
    positions: str = key("auto", one_of(POSITIONS),
                         "Position embeddings: auto (learned for softmax attention only), "
                         "learned (every mixer) or none.")


@dataclass
class TrainConfig:
    """How every run trains and is scored (the `train` section)."""

    epochs: int = key(8, int_from(1), "Passes over the training examples.", int)
    num_train: int | None = key(None, optional(int_from(1)),
                                "Training examples (default: the task's).", int)
    num_val: int = key(1000, int_from(1), "Validation examples, drawn from the training "
                       "stream (the lr is chosen on them).", int)
    num_test: int | None = key(None, optional(int_from(1)),
                               "Test examples (default: the task's).", int)
    batch_size: int = key(64, int_from(1), "Examples per training batch.", int)
    eval_every: int = key(0, int_from(0), "Evaluate every N steps (0: once per epoch).", int)
    schedule: str = key("warmup-cosine", one_of(SCHEDULES),
                        "warmup-cosine (a linear warmup, then cosine to 0, per step), "
                        "epoch-cosine (Zoology's: stepped once per epoch, no warmup) or "
                        "constant.")
    warmup_frac: float = key(0.1, number_in(0, 1), "The share of the steps warmed up "
                             "(warmup-cosine).")
    weight_decay: float = key(0.1, number_in(0), "AdamW's weight decay (a `weight_decays` "
                              "grid replaces it).")
    # an accuracy: 1 never stops early (no accuracy exceeds it); above 1 is a typo (99)
    stop_accuracy: float = key(0.99, number_in(0, 1, open_low=True, open_high=False),
                               "Stop a run once its validation accuracy exceeds this (1: "
                               "never early).")
    group_stop: bool = key(False, boolean, "A run's early stop also stops its group's runs "
                           "of the same seed (hla_bench/recall/train.py).")
    shuffle: bool = key(True, boolean, "A fresh batch order every epoch (false: the same "
                        "batches in the same order, as Zoology's loader).")
    metric: str = key("micro", one_of(METRICS), "micro: accuracy over the labelled "
                      "positions; mad-macro: MAD-lab's macro accuracy per batch of 128, "
                      "averaged.")
    test_at_best_val: bool = key(False, boolean, "Also score test at the evaluation of "
                                 "lowest validation loss (MAD-lab's pick).")


def _section(config_class: type, help: str) -> Any:
    return field(default_factory=config_class, metadata={"help": help, "cli": False})


@dataclass
class RecallConfig:
    """A recall sweep: the grid of mixers, widths, learning rates, weight decays and seeds
    over the task settings, the model and training of every run, and where they run."""

    name: str = key("recall", nonempty_text, "The sweep's name.")
    description: str = key("", text, "What the sweep is, in a line.")
    device: str = key("auto", device_name, "cpu, cuda, cuda:N or auto (CUDA when there is a "
                      "GPU).", str)
    workers: int | None = key(None, optional(int_from(1)), "Worker processes (default: 1 "
                              "per 2 CPU cores, or --workers-per-gpu per GPU).", int)
    workers_per_gpu: int = key(2, int_from(1), "Worker processes per GPU (without "
                               "--workers).", int)
    max_group: int = key(32, int_from(1), "Most runs trained as one stack.", int)
    graphs: bool = key(True, boolean, "Replay each training step as a CUDA graph (on CUDA "
                       "only).", SWITCH)
    compile: bool = key(False, boolean, "Compile each group's stacked forward and backward "
                        "with torch.compile (fused elementwise kernels; a group compiles at "
                        "most three times).", SWITCH)
    seeds: list[int] = key([0], list_of(int_from(0)), "Comma-separated run seeds "
                           "(initialisation, data and batch order); tables show mean and "
                           "spread over them.", ("list", int))
    mixers: list[str] = key(["sdpa", "linear-attn", "hla2", "mamba2-ssd"],
                            list_of(nonempty_text), "Comma-separated mixer names.",
                            ("list", str))
    mixer_options: dict = key({}, mapping, "Per mixer (or variant label), the registry "
                              "options of its layers.")
    # per mixer, `model` keys that replace the config's for that mixer's runs
    mixer_model: dict = key({}, mapping, "Per mixer, `model` keys that replace the config's "
                            "for that mixer's runs.")
    d_model: list[int] = key([64], list_of(int_from(1)), "Comma-separated model widths.",
                             ("list", int))
    # per mixer (or variant label), the widths of its runs in place of `d_model`
    mixer_d_model: dict = key({}, mapping, "Per mixer (or variant label), the model widths of "
                              "its runs, in place of `d_model`.")
    lrs: list[float] = key([1e-3, 3e-3], list_of(number_in(0, open_low=True, high=None)),
                           "Comma-separated learning rates.", ("list", float))
    # the weight-decay grid; null: each setting's train.weight_decay alone
    weight_decays: list[float] | None = key(None, optional(list_of(number_in(0))),
                                            "Comma-separated weight decays (a grid axis like "
                                            "--lrs; replaces the config's weight decays).",
                                            ("list", float))
    model: ModelConfig = _section(ModelConfig, "The model of every run.")
    train: TrainConfig = _section(TrainConfig, "How every run trains and is scored.")
    settings: list = key([{"task": "mqar", "params": {}}], None,
                         "The task settings: each a task, its params and its own train or "
                         "model keys, an optional name and training or test mixes.")


SECTIONS_OF = {"model": ModelConfig, "train": TrainConfig}


def _table(config_class: type) -> dict[str, tuple[Any, Check]]:
    return {each.name: (field_default(each), each.metadata["check"])
            for each in fields(config_class) if "check" in each.metadata
            and each.metadata["check"] is not None}


# key -> (default, check), as the config's checks read them
TOP_FIELDS = _table(RecallConfig)
MODEL_FIELDS = _table(ModelConfig)
TRAIN_FIELDS = _table(TrainConfig)
SECTIONS = {"model": MODEL_FIELDS, "train": TRAIN_FIELDS}
DEFAULT_SETTINGS = field_default(next(each for each in fields(RecallConfig)
                                      if each.name == "settings"))


def default_config() -> dict:
    """Every key with its default: the config of an empty file."""
    return asdict(RecallConfig())


def config_fields() -> list[Field]:
    """The keys of every level (top, model, train), in declaration order."""
    return [*fields(RecallConfig), *fields(ModelConfig), *fields(TrainConfig)]


def default_shown(each: Field) -> str | None:
    """A key's default as an option writes it (`1,2`, `on`); None where it has none."""
    default = field_default(each)
    if default is None:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list):
        return ",".join(map(str, default))
    return str(default)


def _option(each: Field) -> Callable:
    """The click option of a key: no default of its own (a value not given leaves the
    config file's), the key's help with the key's default, the value read as its `option`
    says."""
    how, flag, help = each.metadata["option"], option_flag(each), each.metadata["help"]
    shown = default_shown(each)
    if shown is not None:
        help = f"{help} Default: {shown}."
    if how == SWITCH:
        return click.option(f"{flag}/--no-{flag[2:]}", each.name, default=None, help=help)
    if isinstance(how, tuple):
        return click.option(flag, each.name, callback=comma_list(how[1]), help=help)
    return click.option(flag, each.name, type=how, help=help)


def with_config_options(command: Callable) -> Callable:
    """The options of every key the command line takes, derived from the fields."""
    return with_field_options(config_fields(), _option)(command)
