"""Sweep configuration: mixer specs, the sweep settings and config files.

Every setting of a sweep is declared once, as a field of `SweepConfig`, with its default,
its kind and its help (see `setting`, on the mechanism of `hla_bench.options` that recall's
config shares). A config file accepts exactly these keys with these defaults; `hla-bench
bench` derives its command-line options from the same fields (the kind gives the option's
type); a resume must match the fields marked `matched`. The kinds:

    mixers    a list of mixer specs (`MixerSpec`), or one comma-separated string of them
    seq_lens  a list of sequence lengths (`1k` = 1024), or one comma-separated string
    modes     a list of some of MODES, or one comma-separated string
    count     a positive integer (null where the default is null)
    count0    a non-negative integer
    seconds   a positive number of seconds (null where the default is null)
    flag      true or false
    text      a string
    label     one of the sweep's mixer labels, or null

Nothing here imports torch (the device checks import it when they run), so a command can
parse its input before the heavy imports.
"""

from __future__ import annotations

import re
from dataclasses import MISSING, Field, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from hla_bench import registry
from hla_bench.configs import read_yaml
from hla_bench.options import MixerSpec, config_field, field_default, is_required
from hla_bench.results.records import MODES
from hla_bench.results.tables import format_seq_len
from hla_bench.safe_files import name_problem

DEFAULT_MODES = ("fwd", "fwdbwd", "decode")
LEVELS = ("op", "layer")
# Accepted dtype names -> the canonical name (torch's attribute for the dtype).
DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "float64": "float64", "double": "float64",
}
# Bounds of the scalar kinds: a count beyond int32 or a time budget beyond a day is a typo,
# not a measurement (and inf would never end).
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 86400.0
KINDS = ("mixers", "seq_lens", "modes", "count", "count0", "seconds", "flag", "text", "label")
_SEQ_LEN = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")
# Registry options only a mixer's layer reads (the recall command's models): the op and
# decoder builders ignore them, so an op benchmark given one would time something other
# than asked. d_state and expand size the Mamba-2 block around the SSD op.
LAYER_ONLY_OPTIONS = ("qk_norm", "short_conv", "output_norm", "bias", "dropout",
                      "feature_dim", "d_state", "expand")


# ---------------------------------------------------------------- parsing


def _is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's `true` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def parse_seq_len(text: str | int) -> int:
    """`1k` -> 1024, `64k` -> 65536, `1m` -> 1048576, `300` -> 300."""
    if _is_int(text):
        value = text
    else:
        match = _SEQ_LEN.match(str(text))
        if not match:
            raise ValueError(f"bad sequence length {text!r}: expected an integer, "
                             "optionally with a k (x1024) or m (x1048576) suffix")
        value = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[match.group(2).lower()]
    if not 0 < value <= MAX_COUNT:
        raise ValueError(f"sequence length must be from 1 to {MAX_COUNT}, got {text!r}")
    return value


def _items(text: str, what: str) -> list[str]:
    """The items of a comma-separated list; an empty one (`1k,,2k`, a trailing comma) is
    an error rather than dropped, as it is most likely a value left out."""
    items = [item.strip() for item in str(text).split(",")]
    if items == [""]:
        raise ValueError(f"no {what} given")
    if "" in items:
        raise ValueError(f"empty item in the {what} {text!r}")
    return items


def _no_duplicates(values: list, what: str, shown: Callable[[Any], str] = str) -> None:
    """A value given twice would be measured twice under one key: an error."""
    seen = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {shown(value)} is given twice")
        seen.add(value)


def parse_seq_lens(text: str) -> list[int]:
    """Comma-separated sequence lengths, e.g. `1k,4k,16k`."""
    return [parse_seq_len(item) for item in _items(text, "sequence lengths")]


def parse_modes(text: str | list[str]) -> list[str]:
    """Comma-separated modes (or a list of them): some of MODES, each at most once."""
    modes = _items(text, "modes") if isinstance(text, str) else list(text)
    if not modes:
        raise ValueError(f"the list of modes is empty: give some of {', '.join(MODES)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"bad mode {bad[0]!r}: expected some of {', '.join(MODES)}")
    _no_duplicates(modes, "mode", repr)
    return modes


def dtype_name(name: str) -> str:
    """Canonical dtype name (`bf16` -> `bfloat16`); `auto` stays `auto`."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise ValueError(f"bad dtype {name!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_mixer_specs(text: str) -> list[MixerSpec]:
    """Comma-separated specs: `hla2:impl=chunk:label=hla2-chunk,sdpa:backend=cudnn`."""
    return [MixerSpec.parse(item) for item in _items(text, "mixers")]


# ---------------------------------------------------------------- the sweep settings


def setting(default: Any = MISSING, *, kind: str, help: str, cli: bool = True,
            matched: bool = False) -> Any:
    """A SweepConfig field (`hla_bench.options.config_field`): `default` (MISSING:
    required), its `kind` (see the module doc), the `help` shown by `hla-bench bench
    --help`, whether the command line takes it (`cli`), and whether a resume must match it
    (`matched`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown setting kind {kind!r}")
    return config_field(default, help=help, cli=cli, kind=kind, matched=matched)


@dataclass
class SweepConfig:
    """One sweep: mixers x modes x seq_lens at fixed shape, dtype and device.

    Batch: `batch` fixed, or `tokens_per_batch` N giving batch = max(1, N // T) so the
    tokens per batch stay fixed across T (neither: batch 1). `decode_batch`, when set,
    replaces that rule for decode points (one token per sequence, so a fixed batch is the
    natural choice). `decode_steps`: consecutive tokens per timed decode call, each call
    starting again at context T; decode times are per token (a run of tokens, as in
    generation, averages out the per-call synchronisation that would otherwise dominate a
    step of a few microseconds). `decode_graph` (CUDA only): capture that run once as a CUDA
    graph and time its replays, as a serving loop does to take the host out of small steps;
    it then times the GPU work. `value_dim` None means `head_dim`. `dtype`/`device` `auto`:
    bf16 on CUDA, fp32 on CPU.
    """

    mixers: list[MixerSpec] = setting(
        kind="mixers", help="Comma-separated NAME[:key=value...] specs; label= names a "
                            "variant, e.g. hla2:impl=chunk:label=hla2-chunk,sdpa:backend=cudnn")
    seq_lens: list[int] = setting([1024, 4096], kind="seq_lens",
                                  help="Sequence lengths, e.g. 1k,4k,16k,64k.")
    modes: list[str] = setting(list(DEFAULT_MODES), kind="modes",
                               help=f"Some of {','.join(MODES)} (prefill: the forward over T "
                                    "tokens that fills the state, at the decode batch: the "
                                    "time to first token).")
    batch: int | None = setting(None, kind="count", matched=True, help="Fixed batch size.")
    tokens_per_batch: int | None = setting(
        None, kind="count", matched=True,
        help="Keep batch*T fixed: batch = N // T (at least 1).")
    decode_batch: int | None = setting(None, kind="count", matched=True,
                                       help="Batch for decode points.")
    decode_steps: int = setting(8, kind="count", matched=True,
                                help="Consecutive tokens per timed decode call (times are per "
                                     "token).")
    decode_graph: bool = setting(False, kind="flag", matched=True,
                                 help="Replay each decode run as a CUDA graph (times the GPU "
                                      "work, not the host).")
    heads: int = setting(16, kind="count", matched=True, help="Attention heads.")
    head_dim: int = setting(64, kind="count", matched=True, help="Query and key dim per head.")
    value_dim: int | None = setting(None, kind="count", matched=True,
                                    help="Value dim per head (default: the head dim).")
    dtype: str = setting("auto", kind="text", matched=True,
                         help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32, fp64.")
    device: str = setting("auto", kind="text", matched=True,
                          help="auto, cpu, cuda, cuda:1, ...")
    warmup: int = setting(3, kind="count0", matched=True,
                          help="Untimed calls before the timed ones.")
    repeats: int = setting(10, kind="count", matched=True,
                           help="Timed calls per point (at least, with --min-time-s).")
    min_time_s: float | None = setting(
        None, kind="seconds", matched=True,
        help="Time budget per point: warm up for a quarter of it, then take samples until "
             "they fill it (at least --repeats, at most 500). Unset: exactly --repeats.")
    warm_cache: bool = setting(False, kind="flag", matched=True,
                               help="Keep the GPU's L2 cache warm between samples (default: "
                                    "evict it before each CUDA sample, as a model's call sees "
                                    "it).")
    cuda_graph: bool = setting(False, kind="flag", matched=True,
                               help="Capture each timed call, in every mode, as a CUDA graph "
                                    "and time its replays (times the GPU work, not the host).")
    level: str = setting("op", kind="text", matched=True,
                         help="op: time the bare operator on [B, T, H, D] q, k, v; layer: the "
                              "registry's layer (projections, convolution, norms and the "
                              "operator) on [B, T, heads x head_dim] inputs, as a model pays.")
    point_timeout_s: float | None = setting(
        None, kind="seconds", help="Record a point that runs longer as a timeout and go on.")
    baseline: str | None = setting(None, kind="label", cli=False,
                                   help="Mixer label whose ratios the tables show.")
    name: str = setting("sweep", kind="text", cli=False,
                        help="The sweep's name: its points' `sweep` field.")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"sweep {self.name!r}: name must be a string, got {self.name!r}")
        problem = name_problem(self.name)  # a plot's file name starts with it
        if problem:
            raise ValueError(f"sweep name {self.name!r} cannot be part of a file name: "
                             f"{problem}")
        if not self.mixers:
            raise ValueError(f"sweep {self.name!r}: mixers is empty")
        labels = [spec.label for spec in self.mixers]
        duplicate = next((label for label in labels if labels.count(label) > 1), None)
        if duplicate:
            raise ValueError(f"sweep {self.name!r}: mixer label {duplicate!r} is used twice "
                             "(give variants a label=)")
        for key in ("seq_lens", "modes"):
            value = getattr(self, key)
            if isinstance(value, str):
                setattr(self, key, parse_seq_lens(value) if key == "seq_lens" else value)
            elif not isinstance(value, (list, tuple)):
                raise ValueError(f"sweep {self.name!r}: {key} must be a list (or a "
                                 f"comma-separated string), got {value!r}")
        self.seq_lens = [parse_seq_len(t) for t in self.seq_lens]
        if not self.seq_lens:
            raise ValueError(f"sweep {self.name!r}: seq_lens is empty")
        try:
            _no_duplicates(self.seq_lens, "sequence length", format_seq_len)
        except ValueError as error:
            raise ValueError(f"sweep {self.name!r}: {error}") from None
        try:
            self.modes = parse_modes(self.modes)
        except ValueError as error:
            raise ValueError(f"sweep {self.name!r}: {error}") from None
        if self.batch is not None and self.tokens_per_batch is not None:
            raise ValueError(f"sweep {self.name!r}: give batch or tokens_per_batch, not both")
        for each in setting_fields():
            problem = _kind_problem(each.metadata["kind"], getattr(self, each.name),
                                    each.default is None)
            if problem:
                raise ValueError(f"sweep {self.name!r}: {each.name} must be {problem}, "
                                 f"got {getattr(self, each.name)!r}")
        self.dtype = dtype_name(self.dtype)
        if self.level not in LEVELS:
            raise ValueError(f"sweep {self.name!r}: level must be one of {', '.join(LEVELS)}, "
                             f"got {self.level!r}")
        other_modes = sorted(set(self.modes) - {"fwd", "fwdbwd"})
        if self.level == "layer" and other_modes:
            raise ValueError(f"sweep {self.name!r}: level layer times the modes fwd and "
                             f"fwdbwd only, not {', '.join(other_modes)}")
        if self.baseline is not None and self.baseline not in labels:
            raise ValueError(f"sweep {self.name!r}: baseline {self.baseline!r} is not one of "
                             f"the mixer labels {', '.join(labels)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SweepConfig":
        """A sweep from a config mapping: only the settings' keys, `mixers` required."""
        known = {each.name for each in setting_fields()}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sweep key {unknown[0]!r} (accepted: {', '.join(sorted(known))})")
        required = [each.name for each in setting_fields() if is_required(each)]
        for key in required:
            if key not in data:
                raise ValueError(f"sweep {data.get('name', 'sweep')!r}: missing key {key!r}")
        values = dict(data)
        mixers = values.pop("mixers")
        if isinstance(mixers, str):
            values["mixers"] = parse_mixer_specs(mixers)
        elif isinstance(mixers, list):
            values["mixers"] = [MixerSpec.from_dict(item) for item in mixers]
        elif mixers is None:
            values["mixers"] = []
        else:
            raise ValueError(f"sweep {data.get('name', 'sweep')!r}: mixers must be a list of "
                             f"specs (or a comma-separated string), got {mixers!r}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def settings(self) -> dict[str, Any]:
        """What a resumed sweep must share with the points its results file holds under its
        name: the `matched` settings (shape and timing; the plan's mixers, modes and lengths
        may change, the point timeout too, since a point that timed out is measured again),
        resolved (value_dim, dtype and device as the points record them)."""
        values = {each.name: getattr(self, each.name) for each in setting_fields()
                  if each.metadata["matched"]}
        values.update(value_dim=self.value_dim or self.head_dim, dtype=self.resolved_dtype(),
                      device=self.resolved_device())
        return values

    def graph_timed(self, mode: str) -> bool:
        """Whether points of `mode` time CUDA-graph replays (cuda_graph, or decode_graph for
        decode points)."""
        return self.cuda_graph or (mode == "decode" and self.decode_graph)

    def batch_for(self, seq_len: int, mode: str) -> int:
        if mode in ("decode", "prefill") and self.decode_batch is not None:
            return self.decode_batch
        if self.tokens_per_batch is not None:
            return max(1, self.tokens_per_batch // seq_len)
        return self.batch or 1

    def resolved_device(self) -> str:
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"
        return self.dtype

    def check_mixers(self) -> list[registry.Mixer]:
        """The registry's mixer of each spec; unknown mixer names or options, and options
        only a layer uses, raise ValueError before anything runs."""
        mixers = [registry.get(spec.name) for spec in self.mixers]
        for spec, mixer in zip(self.mixers, mixers):
            mixer.resolve_options(spec.options)
            layer_only = [key for key in spec.options if key in LAYER_ONLY_OPTIONS]
            if layer_only and self.level == "op":
                raise ValueError(
                    f"sweep {self.name!r}: mixer {spec.label!r}: option "
                    f"{', '.join(map(repr, layer_only))} of "
                    f"{spec.name!r} applies to layers only (the models of the recall command); "
                    "at level op the benchmarks time the op, which does not use it (level "
                    "layer times the layer)")
        return mixers

    def check_device(self) -> None:
        """A malformed device, one whose work cannot be timed (meta computes nothing), or
        CUDA asked for where there is none (or a CUDA index past the last) raise ValueError."""
        import torch

        try:
            device = torch.device(self.resolved_device())
        except RuntimeError as error:
            raise ValueError(f"sweep {self.name!r}: bad device {self.device!r} ({error})") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"sweep {self.name!r}: device {self.device!r} cannot be timed "
                             "(expected auto, cpu, cuda or cuda:N)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"sweep {self.name!r}: device {self.device!r} asked for, "
                             "but CUDA is not available here")
        if device.type == "cuda" and device.index is not None \
                and device.index >= torch.cuda.device_count():
            raise ValueError(f"sweep {self.name!r}: device {self.device!r} asked for, but "
                             f"there are {torch.cuda.device_count()} CUDA device(s)")
        graphs = [name for name, on in (("cuda_graph", self.cuda_graph),
                                        ("decode_graph", self.decode_graph and (
                                            "decode" in self.modes))) if on]
        if device.type != "cuda" and graphs:
            raise ValueError(f"sweep {self.name!r}: {' and '.join(graphs)} replay CUDA graphs, "
                             f"which need a CUDA device (the sweep's device is {device})")


def setting_fields() -> tuple[Field, ...]:
    """SweepConfig's fields, in declaration order: each has metadata kind, help, cli and
    matched (see `setting`)."""
    return fields(SweepConfig)


def _kind_problem(kind: str, value: Any, nullable: bool) -> str | None:
    """What `value` must be for a scalar kind, when it is not that; None when it is (list
    kinds are parsed, and so checked, by __post_init__)."""
    if value is None and nullable:
        return None
    if kind == "count" and not (_is_int(value) and 0 < value <= MAX_COUNT):
        return f"an integer from 1 to {MAX_COUNT}"
    if kind == "count0" and not (_is_int(value) and 0 <= value <= MAX_COUNT):
        return f"an integer from 0 to {MAX_COUNT}"
    if kind == "seconds" and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= MAX_SECONDS):
        return f"a number of seconds above 0, at most {MAX_SECONDS:g}"
    if kind == "flag" and not isinstance(value, bool):
        return "true or false"
    if kind in ("text", "label") and not isinstance(value, str):
        return "a string"
    return None


def default_text(each: Field) -> str | None:
    """A setting's default as a command line writes it (`1k,4k`); None for no default."""
    default = field_default(each)
    if default is MISSING or default is None:
        return None
    if each.metadata["kind"] == "seq_lens":
        return ",".join(format_seq_len(t) for t in default)
    if isinstance(default, list):
        return ",".join(map(str, default))
    return str(default)


# ---------------------------------------------------------------- config files


def parse_config(data: Mapping[str, Any]) -> list[SweepConfig]:
    """A config file's contents: one sweep, or `sweeps:` whose entries override top-level keys.

    Top-level `name`/`description` describe the file; a sweep without a name is called after
    the file (with its index when there are several).
    """
    if not isinstance(data, Mapping):
        raise ValueError("a sweep config must be a mapping")
    shared = {k: v for k, v in data.items() if k not in ("sweeps", "description")}
    file_name = shared.pop("name", "sweep")
    entries = data.get("sweeps") or [{}]
    if not isinstance(entries, list):
        raise ValueError("'sweeps' must be a list of mappings")
    sweeps = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ValueError(f"sweeps[{index}] must be a mapping")
        default_name = file_name if len(entries) == 1 else f"{file_name}-{index}"
        sweeps.append(SweepConfig.from_dict({"name": default_name, **shared, **entry}))
    names = [s.name for s in sweeps]
    if len(set(names)) != len(names):
        raise ValueError(f"sweep names must be distinct, got {names}")
    return sweeps


def load_config(path: str | Path) -> tuple[dict[str, Any], list[SweepConfig]]:
    """The raw mapping (kept verbatim in results) and the parsed sweeps."""
    data = read_yaml(path)
    return data, parse_config(data)


def looks_like_recall(path: str | Path) -> bool:
    """Whether a config file has the keys of a recall config (settings, lrs, d_model): a
    file `load_config` refuses is then named for `hla-bench recall`."""
    try:
        data = read_yaml(path)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and bool({"settings", "lrs", "d_model"} & set(data))


def settings_of(sweeps: list[SweepConfig]) -> dict[str, Any]:
    """What a resume must match: each sweep's shape and timing settings, by sweep name."""
    return {"sweeps": {sweep.name: sweep.settings() for sweep in sweeps}}


# --- the plan: the points that a list of sweeps measures ----------------------------------

@dataclass(frozen=True)
class Point:
    """One planned measurement. `graph_timed`: whether it times CUDA-graph replays (its
    sweep's cuda_graph, or decode_graph for a decode point)."""

    sweep: SweepConfig
    spec: MixerSpec
    mode: str
    seq_len: int
    graph_timed: bool = False

    def describe(self) -> str:
        return f"{self.sweep.name} {self.spec.label} {self.mode} T={format_seq_len(self.seq_len)}"


def plan(sweeps: list[SweepConfig]) -> list[Point]:
    """Every point, in run order: sweep, mode, increasing T, then the sweep's mixers (the
    points of one shape are timed together)."""
    return [Point(sweep, spec, mode, seq_len, sweep.graph_timed(mode))
            for sweep in sweeps for mode in sweep.modes for seq_len in sorted(sweep.seq_lens)
            for spec in sweep.mixers]


def point_groups(points: list[Point]) -> list[list[Point]]:
    """The points of each (sweep, mixer spec), in plan order: the unit that a process of
    its own measures (`hla_bench.speed.isolate`)."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.sweep.name, point.spec.label), []).append(point)
    return list(groups.values())
