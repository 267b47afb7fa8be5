"""Benchmark results files: schema, environment capture, validated load and save.

A bench results file is YAML, written through `hla_bench.results.store` (atomic writes, a lock,
a completion marker):

    kind: bench              # report dispatches on it (recall files say `recall`)
    schema_version: 2
    created: 2026-12-02T08:00:00+00:00
    config: {...}            # the sweep config as given (file contents or CLI options)
    sweeps: [{...}, ...]     # each sweep fully resolved (defaults filled in)
    environment: {...}       # versions, GPU, host, git commit, memory method
    earlier_runs: [...]      # optional: config and environment of the runs a resume continued
    settings: {sweeps: {NAME: {...}}}   # per sweep, what a resume must match
    points: [{...}, ...]     # one per (sweep, mode, mixer, T); fields: speed.records.FIELDS
    complete: true           # the plan ran to its end
    end_of_results: true     # the completion marker

Every point has a status; time/memory/rate fields are null unless it is `ok`. Schema
version 1 files (no settings, complete or marker) are still read.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

from hla_bench import __version__
from hla_bench.processes import cuda_mps_active
from hla_bench.results import store
from hla_bench.results.load import MARKER_KEY, check_structure, load as load_file
from hla_bench.results import records

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
KIND = "bench"
OPTIONAL_PACKAGES = ("triton", "flash-linear-attention", "mamba-ssm", "flash-attn",
                     "causal-conv1d", "numpy")

_INT, _STR, _MAP = (int,), (str,), (dict,)
# field -> (accepted types, may be null)
TOP_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "kind": (_STR, False), "schema_version": (_INT, False), "created": (_STR, False),
    "config": (_MAP, False), "sweeps": ((list,), False), "environment": (_MAP, False),
    "points": ((list,), False),
}
# A point's fields, from the one record definition: those every file has, and those files
# written before the field existed may lack.
POINT_FIELDS = {f.name: (f.types, f.nullable) for f in records.FIELDS if not f.optional}
OPTIONAL_POINT_FIELDS = {f.name: (f.types, f.nullable) for f in records.FIELDS if f.optional}
OPTIONAL_TOP_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "earlier_runs": ((list,), False),
}


class ResultsSchemaError(store.StoreError):
    """A results file that does not follow the schema; the message names the field."""


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def git_commit() -> str:
    """HLA_BENCH_GIT_COMMIT when set (a copied tree on a benchmark machine, whose git
    metadata, if any, need not match the tree), else the checkout's commit (with `+dirty`
    when it has changes), else `unknown`."""
    if os.environ.get("HLA_BENCH_GIT_COMMIT"):
        return os.environ["HLA_BENCH_GIT_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "") if commit else "unknown"


def timing_method(device: str) -> str:
    """How `hla_bench.speed.timing` takes samples on `device`, as the results file's
    environment says (the sweeps' settings give the budget, the cache and graph choices)."""
    if device.startswith("cuda"):
        return ("CUDA event pair per sample, one synchronisation after all samples, the L2 "
                "cache flushed before each sample unless warm_cache; the mixers of a sweep "
                "sampled in interleaved rounds at each shape")
    return ("time.perf_counter per call; the mixers of a sweep sampled in interleaved rounds "
            "at each shape")


def memory_method(device: str) -> str:
    """How `hla_bench.speed.timing` measures `peak_memory_bytes` on `device`, as the
    results file's environment says."""
    if device.startswith("cuda"):
        return "cuda max_memory_allocated minus memory_allocated before the call"
    return "cpu peak-RSS rise (VmHWM after clear_refs, minus VmRSS before); approximate lower bound"


def capture_environment(device: str) -> dict[str, Any]:
    """What the numbers depend on: hardware, driver and library versions, code version."""
    import torch

    env: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "utc_time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "hla_bench": __version__,
        "git_commit": git_commit(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "device": device,
        "memory_method": memory_method(device),
        "timing_method": timing_method(device),
        "gpu": None,
        "gpu_count": 0,
        "driver": None,
        "packages": {name: _package_version(name) for name in OPTIONAL_PACKAGES},
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
        env["cudnn"] = torch.backends.cudnn.version()
        env["cuda_mps"] = cuda_mps_active()
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = "unknown"
    return env


def make_header(config: Mapping[str, Any], sweeps: list[Mapping[str, Any]],
                environment: Mapping[str, Any]) -> dict[str, Any]:
    """The header of a new bench results file (the fields before the settings)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": dict(config), "sweeps": [dict(s) for s in sweeps],
        "environment": dict(environment),
    }


def resumed_header(previous: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The header of a resumed file: this run's config and environment, the file's creation
    time, the sweeps of both (this run's definition where a name is in both, so that every
    point's sweep is described), and the earlier runs' config and environment, since the
    file holds their points too."""
    sweeps = {s.get("name"): s for s in previous.get("sweeps") or []}
    sweeps.update({s.get("name"): s for s in new["sweeps"]})
    earlier = list(previous.get("earlier_runs") or [])
    earlier.append({"config": previous.get("config"), "environment": previous.get("environment")})
    return {**new, "created": previous.get("created", new["created"]),
            "sweeps": list(sweeps.values()), "earlier_runs": earlier}


def make_results(config: Mapping[str, Any], sweeps: list[Mapping[str, Any]],
                 points: list[dict[str, Any]], environment: Mapping[str, Any],
                 settings: Mapping[str, Any] | None = None, complete: bool = True) -> dict[str, Any]:
    """A whole bench results document, in the store's layout."""
    return {"kind": KIND, **make_header(config, sweeps, environment),
            "settings": dict(settings or {}), "points": list(points), "complete": complete,
            MARKER_KEY: True}


def _check_fields(where: str, data: Any, fields: Mapping[str, tuple[tuple[type, ...], bool]],
                  optional: Mapping[str, tuple[tuple[type, ...], bool]] | None = None) -> None:
    if not isinstance(data, dict):
        raise ResultsSchemaError(f"{where or 'results'}: expected a mapping, got {type(data).__name__}")
    prefix = f"{where}." if where else ""
    present = {name: spec for name, spec in (optional or {}).items() if name in data}
    for name, (types, nullable) in {**fields, **present}.items():
        if name not in data:
            raise ResultsSchemaError(f"{prefix}{name}: missing field")
        value = data[name]
        if value is None and nullable:
            continue
        if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
            raise ResultsSchemaError(f"{prefix}{name}: expected {expected}, got {value!r}")


def describe_point(point: Mapping[str, Any]) -> str:
    """A point's identity in a message: sweep, mixer, mode and shape."""
    return (f"sweep {point.get('sweep')!r}, mixer {point.get('mixer')!r}, {point.get('mode')}, "
            f"T={point.get('seq_len')}, batch {point.get('batch')}, heads {point.get('heads')}, "
            f"head_dim {point.get('head_dim')}, {point.get('dtype')} on {point.get('device')}")


def measure_problem(value: Any) -> str | None:
    """Why `value` cannot be a measured quantity (a time, memory, a rate, a count, an item
    of a list of them): it must be a finite number >= 0. None when it can."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if (isinstance(item, bool) or not isinstance(item, (int, float))
                or not 0 <= item < math.inf):
            shown = f"{item!r} (an item of {value!r})"[:200] if item is not value else repr(item)
            return f"expected a finite number >= 0, got {shown}"
    return None


def _check_point(where: str, point: Any) -> None:
    """One point against `records.FIELDS`: types, nullability and choices (an optional field
    only where present), measured values finite and >= 0; an `ok` point must have its median
    time."""
    _check_fields(where, point, POINT_FIELDS, OPTIONAL_POINT_FIELDS)
    for field in records.FIELDS:
        value = point.get(field.name)
        if field.choices and value is not None and value not in field.choices:
            raise ResultsSchemaError(f"{where}.{field.name}: expected one of "
                                     f"{', '.join(field.choices)}, got {value!r}")
        problem = measure_problem(value) if field.measure and value is not None else None
        if problem:
            raise ResultsSchemaError(f"{where} ({describe_point(point)}): {field.name}: "
                                     f"{problem}")
    if point["status"] == "ok" and point["median_ms"] is None:
        raise ResultsSchemaError(f"{where}.median_ms: required when status is ok")


def validate(data: Any) -> dict[str, Any]:
    """Check `data` against the bench schema (after the structure every results file has,
    see `load.check_structure`); ResultsSchemaError names the first bad field."""
    try:
        check_structure(data, KIND)
    except ResultsSchemaError:
        raise
    except store.StoreError as error:
        raise ResultsSchemaError(str(error)) from None
    if data["schema_version"] not in READABLE_SCHEMA_VERSIONS:
        raise ResultsSchemaError(f"schema_version: expected {' or '.join(map(str, READABLE_SCHEMA_VERSIONS))}, "
                                 f"got {data['schema_version']!r}")
    _check_fields("", data, TOP_FIELDS, OPTIONAL_TOP_FIELDS)
    first: dict[str, int] = {}
    for index, point in enumerate(data["points"]):
        _check_point(f"points[{index}]", point)
        key = records.point_key(point)
        if key in first:
            raise ResultsSchemaError(
                f"points[{index}] ({describe_point(point)}) has the key of points[{first[key]}] "
                f"(the fields {', '.join(records.KEY)}): a point is recorded once per file, "
                "and reading it would replace the first without a word")
        first[key] = index
    return data


def load(path: str | Path) -> dict[str, Any]:
    """A validated bench results file; ResultsSchemaError names the file and the problem."""
    try:
        return load_file(path, KIND, validate)
    except ResultsSchemaError:
        raise
    except store.StoreError as error:
        raise ResultsSchemaError(str(error)) from None


def save(data: Mapping[str, Any], path: str | Path) -> Path:
    """Validate a whole document, then write it atomically (parent folders created). The
    commands write through `store.ResultsStore`, which also locks the file and refuses to
    replace what is not a results file; this is for documents built in one piece."""
    validate(dict(data))
    store.check_writable(path)
    return store.atomic_write_text(path, store.dump_results(data))
