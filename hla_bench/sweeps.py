"""Speed sweeps: mixer specs, sweep configs, and the runner that times every point.

A sweep crosses mixers x modes x sequence lengths at fixed heads / head_dim / dtype. Each
point is a plain dict (see `hla_bench.results` for the schema). Mixers are reached only
through `hla_bench.registry`; a failure at one point (OOM, an exception, a missing package,
running past the sweep's point_timeout_s) is recorded as that point's status and the sweep
goes on.

Timing: `warmup` untimed calls, then `repeats` timed calls; CUDA events on a GPU,
`time.perf_counter` on the CPU (CPU ops are synchronous). Median and 20th/80th percentiles.
The eager decode points of one mixer are timed in interleaved rounds (one call of each T
per round), so that the host's drift over time, which sets a host-bound step's speed, falls
on every T alike.

Peak memory above the inputs:
- CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, minus
  `memory_allocated()` before the call (exact for the caching allocator's tensors).
- CPU: torch's CPU allocator is invisible to tracemalloc, so the process's peak resident
  set is used: free heap pages are handed back (`malloc_trim`), the kernel's peak-RSS mark is
  reset (`/proc/self/clear_refs`), and the rise of VmHWM over VmRSS before the call is
  reported. Approximate: pages the allocator still holds are reused without being counted,
  so it is a lower bound; None where /proc is unavailable.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import math
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
import yaml

from hla_bench import registry

MODES = ("fwd", "fwdbwd", "decode")
STATUSES = ("ok", "oom", "error", "unavailable", "unsupported", "timeout")
DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}
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
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SEQ_LEN.match(str(text))
        if not match:
            raise ValueError(f"bad sequence length {text!r}: expected an integer, "
                             "optionally with a k (x1024) or m (x1048576) suffix")
        value = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"sequence length must be positive, got {text!r}")
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


def format_seq_len(value: int) -> str:
    """The inverse of `parse_seq_len` for display: 65536 -> `64k`."""
    for suffix, size in (("m", 1024 ** 2), ("k", 1024)):
        if value % size == 0:
            return f"{value // size}{suffix}"
    return str(value)


def parse_modes(text: str | list[str]) -> list[str]:
    modes = _items(text, "modes") if isinstance(text, str) else list(text)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"bad mode {bad[0] if bad else ''!r}: expected some of {', '.join(MODES)}")
    _no_duplicates(modes, "mode", repr)
    return modes


def dtype_name(name: str) -> str:
    """Canonical dtype name (`bf16` -> `bfloat16`); `auto` stays `auto`."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise ValueError(f"bad dtype {name!r}: expected auto or one of {', '.join(DTYPES)}")
    return str(DTYPES[name]).removeprefix("torch.")


@dataclass(frozen=True)
class MixerSpec:
    """A registered mixer with option overrides, shown under `label`."""

    name: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "MixerSpec":
        """`NAME[:key=value...]`; values go through yaml.safe_load; `label=` names the variant."""
        name, *pairs = text.strip().split(":")
        if not name:
            raise ValueError(f"bad mixer spec {text!r}: missing mixer name")
        options: dict[str, Any] = {}
        label = None
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"bad mixer spec {text!r}: {pair!r} is not key=value")
            if key.strip() == "label":
                label = value.strip()
            else:
                options[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        return cls(name.strip(), label or name.strip(), options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> "MixerSpec":
        """A YAML entry: a spec string or {name, label, options}."""
        if isinstance(data, str):
            return cls.parse(data)
        if not isinstance(data, Mapping) or "name" not in data:
            raise ValueError(f"bad mixer entry {data!r}: expected a mapping with a 'name'")
        unknown = sorted(set(data) - {"name", "label", "options"})
        if unknown:
            raise ValueError(f"bad mixer entry {data!r}: unknown key {unknown[0]!r}")
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"mixer {data['name']!r}: options must be a mapping")
        return cls(str(data["name"]), str(data.get("label") or data["name"]), dict(options))


def _spec_text(spec: MixerSpec) -> str:
    """A spec as it is written on the command line: `hla2:impl=chunk`."""
    return ":".join([spec.name, *(f"{key}={value}" for key, value in spec.options.items())])


def parse_mixer_specs(text: str) -> list[MixerSpec]:
    """Comma-separated specs: `hla2:impl=chunk:label=hla2-chunk,sdpa:backend=cudnn`."""
    return [MixerSpec.parse(item) for item in _items(text, "mixers")]


# ---------------------------------------------------------------- sweep config


@dataclass
class SweepConfig:
    """One sweep: mixers x modes x seq_lens at fixed shape, dtype and device.

    Batch: `batch` fixed, or `tokens_per_batch` N giving batch = max(1, N // T) so the
    tokens per batch stay fixed across T. `decode_batch`, when set, replaces that rule for
    decode points (one token per sequence, so a fixed batch is the natural choice).
    `decode_steps`: consecutive tokens per timed decode call, each call starting again at
    context T; decode times are per token (a run of tokens, as in generation, averages out
    the per-call synchronisation that would otherwise dominate a step of a few microseconds).
    `decode_graph` (CUDA only): capture that run once as a CUDA graph and time its replays,
    as a serving loop does to take the host out of small steps; it then times the GPU work.
    `value_dim` None means `head_dim`. `dtype`/`device` `auto`: bf16 on CUDA, fp32 on CPU.
    """

    mixers: list[MixerSpec]
    seq_lens: list[int]
    name: str = "sweep"
    modes: list[str] = field(default_factory=lambda: ["fwd", "fwdbwd"])
    batch: int | None = None
    tokens_per_batch: int | None = None
    decode_batch: int | None = None
    decode_steps: int = 8
    decode_graph: bool = False
    heads: int = 16
    head_dim: int = 64
    value_dim: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    warmup: int = 3
    repeats: int = 10
    baseline: str | None = None
    point_timeout_s: float | None = None

    def __post_init__(self) -> None:
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
        self.modes = parse_modes(self.modes)
        if self.batch is not None and self.tokens_per_batch is not None:
            raise ValueError(f"sweep {self.name!r}: give batch or tokens_per_batch, not both")
        for key in ("batch", "tokens_per_batch", "decode_batch", "value_dim"):
            value = getattr(self, key)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"sweep {self.name!r}: {key} must be a positive integer, got {value!r}")
        for key in ("heads", "head_dim", "repeats", "decode_steps"):
            value = getattr(self, key)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"sweep {self.name!r}: {key} must be a positive integer, got {value!r}")
        if not isinstance(self.decode_graph, bool):
            raise ValueError(f"sweep {self.name!r}: decode_graph must be true or false, "
                             f"got {self.decode_graph!r}")
        if not _is_int(self.warmup) or self.warmup < 0:
            raise ValueError(f"sweep {self.name!r}: warmup must be a non-negative integer")
        timeout = self.point_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"sweep {self.name!r}: point_timeout_s must be a positive number "
                             f"of seconds, got {timeout!r}")
        for key in ("name", "dtype", "device"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"sweep {self.name!r}: {key} must be a string, "
                                 f"got {getattr(self, key)!r}")
        self.dtype = dtype_name(self.dtype)
        if self.baseline is not None and self.baseline not in labels:
            raise ValueError(f"sweep {self.name!r}: baseline {self.baseline!r} is not one of "
                             f"the mixer labels {', '.join(labels)}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SweepConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sweep key {unknown[0]!r} (accepted: {', '.join(sorted(known))})")
        for key in ("mixers", "seq_lens"):
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

    # What a resumed sweep must share with the points its results file holds under its
    # name: the shape and the timing (the plan's mixers, modes and lengths may change; the
    # point timeout too, since a point that timed out is measured again).
    SETTING_FIELDS = ("heads", "head_dim", "value_dim", "batch", "tokens_per_batch",
                      "decode_batch", "decode_steps", "decode_graph", "dtype", "device",
                      "warmup", "repeats")

    def settings(self) -> dict[str, Any]:
        """The SETTING_FIELDS, resolved (value_dim, dtype and device as the points record)."""
        values = {key: getattr(self, key) for key in self.SETTING_FIELDS}
        values.update(value_dim=self.value_dim or self.head_dim, dtype=self.resolved_dtype(),
                      device=self.resolved_device())
        return values

    def batch_for(self, seq_len: int, mode: str) -> int:
        if mode == "decode" and self.decode_batch is not None:
            return self.decode_batch
        if self.tokens_per_batch is not None:
            return max(1, self.tokens_per_batch // seq_len)
        return self.batch or 1

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def resolved_dtype(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"
        return self.dtype

    def check_mixers(self) -> None:
        """Unknown mixer names or options, and options only a layer uses, raise ValueError
        before anything runs."""
        for spec in self.mixers:
            registry.get(spec.name).resolve_options(spec.options)
            layer_only = [key for key in spec.options if key in LAYER_ONLY_OPTIONS]
            if layer_only:
                raise ValueError(
                    f"sweep {self.name!r}: mixer {spec.label!r}: option "
                    f"{', '.join(map(repr, layer_only))} of "
                    f"{spec.name!r} applies to layers only (the models of the recall command); "
                    "the fwd, fwdbwd and decode benchmarks time the op, which does not use it")

    def check_options(self) -> None:
        """Option values a mixer rejects raise ValueError before anything runs.

        Only the op (and, when the sweep has decode points, the decoder) can tell a bad
        value, so each spec with options is built and called once on a few tokens, on the
        sweep's device and dtype. A ValueError or TypeError counts against the options only
        when the same call with the mixer's defaults succeeds: a mixer that fails anyway
        is a result of its points, as in any sweep. Mixers that cannot run here (a missing
        package or device) are not probed; their points are recorded as unavailable."""
        modes = ("fwd", "decode") if "decode" in self.modes else ("fwd",)
        for spec in self.mixers:
            mixer = registry.get(spec.name)
            if not spec.options or mixer.unavailable_reason(spec.options):
                continue
            for mode in modes:
                if mode == "decode" and mixer.build_decoder is None:
                    continue
                error = self._probe(mixer, spec.options, mode)
                if error is not None and self._probe(mixer, {}, mode) is None:
                    where = "its decoder" if mode == "decode" else "its op"
                    raise ValueError(f"sweep {self.name!r}: mixer {spec.label!r} "
                                     f"({_spec_text(spec)}): {where} rejects the options: "
                                     f"{error}")

    def _probe(self, mixer: registry.Mixer, options: dict[str, Any], mode: str) -> str | None:
        """The message of the ValueError or TypeError one small call raises, else None."""
        device, dtype = self.resolved_device(), DTYPES[self.resolved_dtype()]
        heads, head_dim, value_dim = self.heads, self.head_dim, self.value_dim or self.head_dim
        seq_len = min(16, min(self.seq_lens))
        generator = torch.Generator().manual_seed(0)
        try:
            with time_limit(self.point_timeout_s), torch.no_grad():
                if mode == "decode":
                    decoder = mixer.decoder(**options)
                    state = decoder.init_state(1, heads, head_dim, value_dim, seq_len, device,
                                               dtype)
                    decoder.step(*_qkv((1, heads), head_dim, value_dim, device, dtype,
                                       generator), state)
                else:
                    mixer.op(**options)(*_qkv((1, seq_len, heads), head_dim, value_dim,
                                              device, dtype, generator))
        except (ValueError, TypeError) as error:
            return f"{type(error).__name__}: {error}" if isinstance(error, TypeError) else str(error)
        except Exception:  # not the options' fault: left to the points to record
            free_memory()
        return None

    def check_device(self) -> None:
        """A malformed device, one whose work cannot be timed (meta computes nothing), or
        CUDA asked for where there is none (or a CUDA index past the last) raise ValueError."""
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
    data = yaml.safe_load(Path(path).read_text())
    return data, parse_config(data)


# ---------------------------------------------------------------- timing and memory


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (as numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_times(times_ms: list[float]) -> dict[str, float]:
    return {"median_ms": percentile(times_ms, 50), "p20_ms": percentile(times_ms, 20),
            "p80_ms": percentile(times_ms, 80)}


def time_calls(fn: Callable[[], Any], *, warmup: int, repeats: int, device: str,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Milliseconds for each of `repeats` calls of `fn` after `warmup` untimed ones. Python's
    garbage collector is paused while they run (as timeit does): a collection of a process
    holding torch and Triton takes milliseconds, and whichever timed call it fell into
    (a host-bound decode run, say) would carry it."""
    for _ in range(warmup):
        fn()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    with _gc_paused():
        return _timed(fn, repeats, cuda, clock)


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _timed(fn: Callable[[], Any], repeats: int, cuda: bool, clock: Callable[[], float]) -> list[float]:
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = clock()
            fn()
            times.append((clock() - begin) * 1e3)
    return times


def cuda_graph_replay(fn: Callable[[], Any]) -> Callable[[], None]:
    """Capture one call of `fn` (already warmed up, so nothing compiles or autotunes during
    capture) as a CUDA graph; return its replay. A step that cannot be captured raises
    NotImplementedError, which the runner records as unsupported."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:
        raise NotImplementedError(f"the decode run cannot be captured as a CUDA graph: "
                                  f"{type(error).__name__}: {error}") from error
    return graph.replay


def _proc_status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise OSError(f"{field_name} not in /proc/self/status")


def _release_free_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_bytes(fn: Callable[[], Any], device: str) -> int | None:
    """Peak memory of one call of `fn` above what was allocated before it (see module doc)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before)
    if device != "cpu":
        fn()
        return None
    _release_free_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _proc_status_kib("VmRSS")
    except OSError:
        fn()
        return None
    fn()
    return max(0, _proc_status_kib("VmHWM") - before) * 1024


def memory_method(device: str) -> str:
    if device.startswith("cuda"):
        return "cuda max_memory_allocated minus memory_allocated before the call"
    return "cpu peak-RSS rise (VmHWM after clear_refs, minus VmRSS before); approximate lower bound"


# How allocation failures read: CUDA's caching allocator ("CUDA out of memory"), torch's
# CPU allocator ("DefaultCPUAllocator: can't allocate memory" or "... not enough memory"),
# and the OS's errno 12 as C libraries report it.
_OOM_MESSAGES = ("out of memory", "defaultcpuallocator", "can't allocate memory",
                 "cannot allocate memory", "not enough memory")


def is_oom(error: BaseException) -> bool:
    """An allocation failure on any device: a point that needs more memory than there is
    (larger T of the same mixer and mode need more still)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(text in message for text in _OOM_MESSAGES)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the runner


@dataclass(frozen=True)
class Point:
    """One planned measurement."""

    sweep: SweepConfig
    spec: MixerSpec
    mode: str
    seq_len: int

    def describe(self) -> str:
        return f"{self.sweep.name} {self.spec.label} {self.mode} T={format_seq_len(self.seq_len)}"


def plan(sweeps: list[SweepConfig]) -> list[Point]:
    """Every point, in run order: sweep, mode, mixer, then increasing T."""
    return [Point(sweep, spec, mode, seq_len)
            for sweep in sweeps for mode in sweep.modes for spec in sweep.mixers
            for seq_len in sorted(sweep.seq_lens)]


def _random(shape: tuple[int, ...], device: str, dtype: torch.dtype, generator: torch.Generator,
            *, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Seeded normal values drawn on the CPU (same numbers on every device)."""
    x = torch.randn(*shape, generator=generator) * scale
    return x.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def _qkv(prefix: tuple[int, ...], head_dim: int, value_dim: int, device: str, dtype: torch.dtype,
         generator: torch.Generator, requires_grad: bool = False):
    """q, k scaled by head_dim**-0.5 (keeps higher-order products finite), v unit-variance."""
    scale = head_dim ** -0.5
    return (_random((*prefix, head_dim), device, dtype, generator, scale=scale, requires_grad=requires_grad),
            _random((*prefix, head_dim), device, dtype, generator, scale=scale, requires_grad=requires_grad),
            _random((*prefix, value_dim), device, dtype, generator, requires_grad=requires_grad))


def _build_call(point: Point, mixer: registry.Mixer, options: dict[str, Any],
                record: dict) -> tuple[Callable[[], Any], int, int]:
    """The call that times `point`, warmed up (with decode_graph the replay of its CUDA
    graph), the steps one call makes and the tokens one step processes; fills the record's
    state size, decode fields and peak memory."""
    sweep = point.sweep
    device, dtype = record["device"], DTYPES[record["dtype"]]
    batch, heads, head_dim, value_dim = (record[k] for k in ("batch", "heads", "head_dim", "value_dim"))
    generator = torch.Generator().manual_seed(0)
    if point.mode == "decode":
        decoder = mixer.decoder(**options)
        state = decoder.init_state(batch, heads, head_dim, value_dim, point.seq_len, device, dtype)
        record["state_bytes"] = int(decoder.state_bytes(state))
        q, k, v = _qkv((batch, heads), head_dim, value_dim, device, dtype, generator)

        def call() -> Any:
            """`decode_steps` tokens from context T: a shallow copy keeps the state's tensors
            but not its bookkeeping, so every call sees the same lengths (a KV cache would
            otherwise grow with each repeat, and cuDNN plans anew for every new length)."""
            current = copy.copy(state)
            with torch.no_grad():
                for _ in range(sweep.decode_steps):
                    out, current = decoder.step(q, k, v, current)
            return out
        steps = sweep.decode_steps
        record["decode_steps"], record["decode_graph"] = sweep.decode_steps, sweep.decode_graph
        tokens = batch
    else:
        op = mixer.op(**options)
        backward = point.mode == "fwdbwd"
        q, k, v = _qkv((batch, point.seq_len, heads), head_dim, value_dim, device, dtype,
                       generator, requires_grad=backward)
        if backward:
            cotangent = _random((batch, point.seq_len, heads, value_dim), device, dtype, generator)

            def call() -> Any:
                out, _ = op(q, k, v)
                out.backward(cotangent)
                q.grad = k.grad = v.grad = None  # so the memory before each call is the inputs
        else:
            def call() -> Any:
                with torch.no_grad():
                    return op(q, k, v)
        tokens = batch * point.seq_len
        steps = 1

    for _ in range(sweep.warmup):
        call()
    if point.mode == "decode" and sweep.decode_graph:
        call = cuda_graph_replay(call)
    record["peak_memory_bytes"] = peak_memory_bytes(call, device)
    return call, steps, tokens


def _fill_times(point: Point, mixer: registry.Mixer, options: dict[str, Any], record: dict,
                times_ms: list[float], tokens: int) -> None:
    """Median and percentiles of per-step times, and the rates they give."""
    record.update(summarize_times(times_ms))
    seconds = record["median_ms"] / 1e3
    record["tokens_per_s"] = tokens / seconds if seconds > 0 else None
    batch, heads, head_dim, value_dim = (record[k] for k in ("batch", "heads", "head_dim", "value_dim"))
    flops = mixer.model_flops(batch, point.seq_len, heads, head_dim, value_dim, point.mode, **options)
    if flops is not None:
        record["flops"] = float(flops)
        record["tflops"] = flops / seconds / 1e12 if seconds > 0 else None


def empty_record(point: Point) -> dict[str, Any]:
    sweep = point.sweep
    return {
        "sweep": sweep.name, "mixer": point.spec.label, "name": point.spec.name,
        "options": dict(point.spec.options), "mode": point.mode, "seq_len": point.seq_len,
        "batch": sweep.batch_for(point.seq_len, point.mode), "heads": sweep.heads,
        "head_dim": sweep.head_dim, "value_dim": sweep.value_dim or sweep.head_dim,
        "dtype": sweep.resolved_dtype(), "device": sweep.resolved_device(),
        "status": "ok", "reason": None, "repeats": sweep.repeats, "warmup": sweep.warmup,
        "median_ms": None, "p20_ms": None, "p80_ms": None, "tokens_per_s": None,
        "peak_memory_bytes": None, "state_bytes": None, "flops": None, "tflops": None,
        "decode_steps": None, "decode_graph": None,
    }


class PointTimeout(Exception):
    """A point ran past its sweep's point_timeout_s."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise PointTimeout in this thread once `seconds` have passed (checked between Python
    steps, so a long kernel or autotuning loop ends at its next one). No limit when seconds is
    None, off the main thread, or where SIGALRM does not exist."""
    if (seconds is None or not hasattr(signal, "SIGALRM")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def expire(signum, frame):
        raise PointTimeout(f"stopped after {seconds:g} s (the sweep's point_timeout_s); a "
                           "first call that autotunes kernels can take minutes")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _start(point: Point, oom_at: dict | None) -> tuple[dict[str, Any], tuple | None]:
    """(record, (mixer, options)) for a point to measure, or (final record, None) for one that
    cannot run here (unavailable, unsupported, or past a smaller T that ran out of memory)."""
    record = empty_record(point)
    key = (point.sweep.name, point.spec.label, point.mode)
    mixer = registry.get(point.spec.name)
    options = mixer.resolve_options(point.spec.options)
    unavailable = mixer.unavailable_reason(options)
    if unavailable:
        return {**record, "status": "unavailable", "reason": unavailable}, None
    if point.mode == "decode" and mixer.build_decoder is None:
        return {**record, "status": "unsupported", "reason": f"{mixer.name} has no decode form"}, None
    if point.mode == "decode" and point.sweep.decode_graph and not record["device"].startswith("cuda"):
        return {**record, "status": "unsupported", "reason": "decode_graph needs a CUDA device"}, None
    if oom_at is not None and key in oom_at and point.seq_len > oom_at[key]:
        return {**record, "status": "oom",
                "reason": f"skipped: out of memory at T={format_seq_len(oom_at[key])}"}, None
    return record, (mixer, options)


def _attempt(points: list[Point], work: Callable[[], None], oom_at: dict | None,
             seconds: float | None) -> dict[str, Any] | None:
    """Run work() within `seconds`; None when it succeeds, else the failure's status and
    reason (an out-of-memory error marks the smallest of `points` in oom_at)."""
    failed = None
    try:
        with time_limit(seconds):
            work()
    except Exception as error:  # every failure is a result; the sweep goes on
        message = f"{type(error).__name__}: {error}".strip()
        if isinstance(error, PointTimeout):
            status, message = "timeout", str(error)
        elif is_oom(error):
            status = "oom"
            if oom_at is not None:
                first = points[0]
                key = (first.sweep.name, first.spec.label, first.mode)
                oom_at[key] = min(first.seq_len, oom_at.get(key, first.seq_len))
        elif isinstance(error, (registry.MixerUnavailableError, ImportError)):
            status = "unavailable"
        elif isinstance(error, NotImplementedError):
            status = "unsupported"
        else:
            status = "error"
        failed = {"status": status, "reason": message[:2000]}
    if failed:  # after the except block, so the traceback's tensors can be freed
        free_memory()
    return failed


def run_point(point: Point, oom_at: dict[tuple[str, str, str], int] | None = None) -> dict[str, Any]:
    """Measure one point; every failure becomes the record's status and reason.

    `oom_at` remembers the smallest T that ran out of memory per (sweep, mixer, mode), so
    larger T for the same mixer and mode are recorded as oom without being tried.
    """
    record, prepared = _start(point, oom_at)
    if prepared is None:
        return record

    def measure() -> None:
        call, steps, tokens = _build_call(point, *prepared, record)
        times = time_calls(call, warmup=0, repeats=point.sweep.repeats, device=record["device"])
        _fill_times(point, *prepared, record, [t / steps for t in times], tokens)

    failed = _attempt([point], measure, oom_at, point.sweep.point_timeout_s)
    return {**empty_record(point), **failed} if failed else record


def run_decode_points(points: list[Point], oom_at: dict[tuple[str, str, str], int] | None = None,
                      on_point: Callable[[Point], None] | None = None) -> list[dict[str, Any]]:
    """Measure the decode points of one mixer in one sweep (increasing T) side by side: each
    is built and warmed up, then `repeats` rounds time one call of every point in turn.
    A decode step is mostly host work, and the host's speed drifts over seconds: on the
    H200 machine the same hla2 step (its work does not depend on T) took 46 us per token
    at one context and 79-82 at the next three when each point was timed in one block
    (results/2026-12-03-h200-kernels-v6-d64.yaml). In rounds every context sees the same
    drift, so a difference between them is the context's. All points' states are held at
    once; failures are per point as in run_point (a failure while timing the rounds is
    every remaining point's). `on_point(point)` is called before each is built."""
    records: list[dict[str, Any]] = []
    built: list[_BuiltPoint] = []
    for point in points:
        if on_point is not None:
            on_point(point)
        record, prepared = _start(point, oom_at)
        if prepared is not None:
            made = []
            failed = _attempt([point], lambda: made.append(_build_call(point, *prepared, record)),
                              oom_at, point.sweep.point_timeout_s)
            if failed:
                record = {**empty_record(point), **failed}
            else:
                built.append(_BuiltPoint(len(records), point, *prepared, *made[0]))
        records.append(record)
    if not built:
        return records
    sweep = points[0].sweep
    cuda = records[built[0].index]["device"].startswith("cuda")
    times: list[list[float]] = [[] for _ in built]

    def rounds() -> None:
        if cuda:
            torch.cuda.synchronize()
        with _gc_paused():
            for _ in range(sweep.repeats):
                for each, times_of in zip(built, times):
                    times_of.extend(t / each.steps for t in
                                    _timed(each.call, 1, cuda, time.perf_counter))

    timeout = None if sweep.point_timeout_s is None else sweep.point_timeout_s * len(built)
    failed = _attempt([each.point for each in built], rounds, oom_at, timeout)
    for each, times_of in zip(built, times):
        if failed:
            records[each.index] = {**empty_record(each.point), **failed}
        else:
            _fill_times(each.point, each.mixer, each.options, records[each.index], times_of,
                        each.tokens)
    return records


class _BuiltPoint(NamedTuple):
    """A decode point ready for the rounds: its record's index, the call and its figures."""

    index: int
    point: Point
    mixer: registry.Mixer
    options: dict[str, Any]
    call: Callable[[], Any]
    steps: int
    tokens: int


# What identifies a point across runs: a resumed sweep keeps a record with the same key.
POINT_KEY = ("sweep", "mixer", "name", "options", "mode", "seq_len", "batch", "heads",
             "head_dim", "value_dim", "dtype", "device")
# Statuses a resumed sweep keeps; an error or a timeout is measured again.
KEPT_STATUSES = ("ok", "oom", "unavailable", "unsupported")


def point_key(record: Mapping[str, Any]) -> str:
    return yaml.safe_dump({key: record[key] for key in POINT_KEY}, sort_keys=True)


def run_sweeps(sweeps: list[SweepConfig],
               on_point: Callable[[int, int, Point], None] | None = None,
               on_record: Callable[[list[dict[str, Any]]], None] | None = None,
               previous: list[dict[str, Any]] = (),
               on_measured: Callable[[dict[str, Any]], None] | None = None,
               ) -> list[dict[str, Any]]:
    """Run every planned point; `on_point(index, total, point)` is called before each,
    `on_record(records_so_far)` after each, and `on_measured(record)` after each point
    measured here (not taken from `previous`), to save it as soon as it exists.
    A point with a record in `previous` (same key, a kept status) is not measured again:
    a sweep cut short can be resumed from its results file. The eager decode points of one
    mixer in a sweep are measured together, in rounds (see run_decode_points)."""
    kept = {point_key(r): r for r in previous if r.get("status") in KEPT_STATUSES}
    points = plan(sweeps)
    oom_at: dict[tuple[str, str, str], int] = {}
    for point in points:  # a kept out-of-memory point still rules out the larger T
        record = kept.get(point_key(empty_record(point)))
        if record is not None and record["status"] == "oom":
            key = (point.sweep.name, point.spec.label, point.mode)
            oom_at[key] = min(point.seq_len, oom_at.get(key, point.seq_len))
    records: list[dict[str, Any]] = []

    def add(record: dict[str, Any], measured: bool) -> None:
        records.append(record)
        if measured and on_measured is not None:
            on_measured(record)
        if on_record is not None:
            on_record(records)

    for start, group in _timing_groups(points):
        resumed = [kept.get(point_key(empty_record(p))) for p in group]
        todo = [p for p, record in zip(group, resumed) if record is None]
        if len(todo) > 1:
            measured = iter(run_decode_points(
                todo, oom_at,
                on_point and (lambda p: on_point(start + group.index(p), len(points), p))))
            for record in resumed:
                add(record or next(measured), record is None)
            continue
        for offset, (point, record) in enumerate(zip(group, resumed)):
            if on_point is not None:
                on_point(start + offset, len(points), point)
            add(record if record is not None else run_point(point, oom_at), record is None)
    return records


def _timing_groups(points: list[Point]) -> Iterator[tuple[int, list[Point]]]:
    """(index of the first, points) of consecutive points timed together: the eager decode
    points of one mixer in a sweep, every other point alone."""
    start = 0
    while start < len(points):
        end = start + 1
        while (_in_rounds(points[start]) and end < len(points)
               and _same_mixer(points[end], points[start])):
            end += 1
        yield start, points[start:end]
        start = end


def _in_rounds(point: Point) -> bool:
    """Eager decode points are timed in rounds. CUDA-graph replays are not host-bound, and
    they are timed one point at a time: a graph bakes in the addresses of the workspaces
    its kernels used, and on the H200 replaying cuDNN SDPA's graphs after other points had
    been captured ran into an illegal memory access (a library workspace regrown and freed
    in between, most likely)."""
    return point.mode == "decode" and not point.sweep.decode_graph


def _same_mixer(point: Point, other: Point) -> bool:
    return (point.sweep is other.sweep and point.spec == other.spec
            and point.mode == other.mode)


def iter_groups(records: list[dict[str, Any]]) -> Iterator[tuple[tuple[str, str], list[dict]]]:
    """Records grouped by (sweep, mode), in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["sweep"], record["mode"]), []).append(record)
    yield from groups.items()
