"""Benchmark results files: schema, environment capture, validated load and save.

A results file is YAML:

    kind: bench              # report dispatches on it (recall files say `recall`)
    schema_version: 1
    created: 2026-12-02T08:00:00+00:00
    config: {...}            # the sweep config as given (file contents or CLI options)
    sweeps: [{...}, ...]     # each sweep fully resolved (defaults filled in)
    environment: {...}       # versions, GPU, host, git commit, memory method
    points: [{...}, ...]     # one per (sweep, mode, mixer, T); fields in POINT_FIELDS

Every point has a status; time/memory/rate fields are null unless it is `ok`.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

import yaml

from hla_bench import __version__
from hla_bench.sweeps import MODES, STATUSES, memory_method

SCHEMA_VERSION = 1
KIND = "bench"
OPTIONAL_PACKAGES = ("triton", "flash-linear-attention", "mamba-ssm", "flash-attn",
                     "causal-conv1d", "numpy")

_INT, _NUM, _STR, _MAP, _BOOL = (int,), (int, float), (str,), (dict,), (bool,)
# field -> (accepted types, may be null)
POINT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "sweep": (_STR, False), "mixer": (_STR, False), "name": (_STR, False),
    "options": (_MAP, False), "mode": (_STR, False), "seq_len": (_INT, False),
    "batch": (_INT, False), "heads": (_INT, False), "head_dim": (_INT, False),
    "value_dim": (_INT, False), "dtype": (_STR, False), "device": (_STR, False),
    "status": (_STR, False), "reason": (_STR, True), "repeats": (_INT, False),
    "warmup": (_INT, False), "median_ms": (_NUM, True), "p20_ms": (_NUM, True),
    "p80_ms": (_NUM, True), "tokens_per_s": (_NUM, True), "peak_memory_bytes": (_INT, True),
    "state_bytes": (_INT, True), "flops": (_NUM, True), "tflops": (_NUM, True),
}
# Checked when present: files written before a field existed stay readable. decode_steps is
# the tokens per timed decode call (absent: 1); decode_graph, whether it replayed a CUDA graph.
OPTIONAL_POINT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "decode_steps": (_INT, True), "decode_graph": (_BOOL, True),
}
TOP_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "kind": (_STR, False), "schema_version": (_INT, False), "created": (_STR, False),
    "config": (_MAP, False), "sweeps": ((list,), False), "environment": (_MAP, False),
    "points": ((list,), False),
}


class ResultsSchemaError(ValueError):
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
    root = Path(__file__).resolve().parents[1]
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
        "gpu": None,
        "gpu_count": 0,
        "driver": None,
        "packages": {name: _package_version(name) for name in OPTIONAL_PACKAGES},
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = "unknown"
    return env


def make_results(config: Mapping[str, Any], sweeps: list[Mapping[str, Any]],
                 points: list[dict[str, Any]], environment: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "kind": KIND, "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": dict(config), "sweeps": [dict(s) for s in sweeps],
        "environment": dict(environment), "points": list(points),
    }


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


def validate(data: Any) -> dict[str, Any]:
    """Check `data` against the bench schema; ResultsSchemaError names the first bad field."""
    _check_fields("", data, TOP_FIELDS)
    if data["kind"] != KIND:
        raise ResultsSchemaError(f"kind: expected {KIND!r}, got {data['kind']!r}")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ResultsSchemaError(f"schema_version: expected {SCHEMA_VERSION}, "
                                 f"got {data['schema_version']!r}")
    for index, point in enumerate(data["points"]):
        where = f"points[{index}]"
        _check_fields(where, point, POINT_FIELDS, OPTIONAL_POINT_FIELDS)
        if point["status"] not in STATUSES:
            raise ResultsSchemaError(f"{where}.status: expected one of {', '.join(STATUSES)}, "
                                     f"got {point['status']!r}")
        if point["mode"] not in MODES:
            raise ResultsSchemaError(f"{where}.mode: expected one of {', '.join(MODES)}, "
                                     f"got {point['mode']!r}")
        if point["status"] == "ok" and point["median_ms"] is None:
            raise ResultsSchemaError(f"{where}.median_ms: required when status is ok")
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Any results file (bench or another kind) as a mapping, unvalidated."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ResultsSchemaError(f"{path}: expected a YAML mapping at the top level")
    return data


def load(path: str | Path) -> dict[str, Any]:
    """A validated bench results file."""
    try:
        return validate(read_yaml(path))
    except ResultsSchemaError as error:
        raise ResultsSchemaError(f"{path}: {error}") from None


def save(data: Mapping[str, Any], path: str | Path) -> Path:
    """Validate, then write YAML (parent folders created) through a temporary file, so an
    interrupted sweep never leaves a half-written file."""
    validate(dict(data))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=None,
                                      width=100))
    partial.replace(path)
    return path


def default_path(now: dt.datetime | None = None, host: str | None = None) -> Path:
    """results/<UTC timestamp>-<host>.yaml"""
    now = now or dt.datetime.now(dt.timezone.utc)
    host = (host or socket.gethostname()).split(".")[0] or "host"
    return Path("results") / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{host}.yaml"
