"""Reading results files: the one loader (`load`) and the checks every file passes.

Every results file is read here, whatever its kind and whoever reads it (report, index,
a resume, bench and recall loads): `load` reads the file, parses it (`parse_results`:
YAML, `check_structure`, the completion marker) and then runs the caller's check of the
kind's own schema (bench: `bench_files.validate`; recall: `validate_recall`, below). Any
problem is a StoreError whose message starts with the path. The layout of a file and the
invariants of writing it are in `hla_bench.results.store`, which writes what this module
reads.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

import yaml

RECORDS_KEY = {"bench": "points", "recall": "runs"}
# The kinds a file's first line may name: the store's, and verify's output (written whole).
FILE_KINDS = (*RECORDS_KEY, "verify")
MARKER_KEY = "end_of_results"
MARKER_LINE = f"{MARKER_KEY}: true\n"
# Schema versions from this one on are written by the store (and carry the marker).
FIRST_STORE_SCHEMA = 2
# The first two lines of every results file, legacy or not (yaml.safe_dump writes the keys
# in their order).
_HEADER_LINES = re.compile(r"\Akind: ([A-Za-z0-9_-]+)\nschema_version: (\d+)\n")

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class StoreError(ValueError):
    """A results file that cannot be read, resumed, overwritten or locked; the message names
    the file and the problem."""


def file_kind(path: str | Path) -> str | None:
    """The kind named by a file's first two lines (`kind: bench`, `schema_version: N`), or
    None for a file that does not start like a results file. Reads only the first bytes,
    so it also names the kind of a results file cut short after them."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(256).decode("utf-8", errors="replace")
    except OSError:
        return None
    match = _HEADER_LINES.match(head)
    return match.group(1) if match else None


def check_structure(data: Any, kind: str | None = None) -> dict[str, Any]:
    """The checks every results file passes, whatever its kind: a mapping with a known
    `kind` (equal to `kind` when given), an integer `schema_version`, its records as a list
    of mappings; from FIRST_STORE_SCHEMA on also `settings`, `complete` and the marker as the
    last key. Raises StoreError naming the first problem (without the file's name)."""
    if not isinstance(data, dict):
        raise StoreError(f"expected a mapping at the top level, got {type(data).__name__}")
    if "kind" not in data:
        raise StoreError("kind: missing field (not a results file?)")
    found = data["kind"]
    if found not in RECORDS_KEY:
        raise StoreError(f"unknown results kind {found!r} (expected {' or '.join(RECORDS_KEY)})")
    if kind is not None and found != kind:
        raise StoreError(f"kind: expected {kind!r}, got {found!r}")
    version = data.get("schema_version")
    if "schema_version" not in data:
        raise StoreError("schema_version: missing field")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise StoreError(f"schema_version: expected a positive integer, got {version!r}")
    records_key = RECORDS_KEY[found]
    if records_key not in data:
        raise StoreError(f"{records_key}: missing field")
    records = data[records_key]
    if not isinstance(records, list):
        raise StoreError(f"{records_key}: expected a list, got {records!r}"[:300])
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise StoreError(f"{records_key}[{index}]: expected a mapping, got {record!r}"[:300])
    if version < FIRST_STORE_SCHEMA:
        return data
    if list(data)[-1] != MARKER_KEY or data[MARKER_KEY] is not True:
        raise StoreError(f"no completion marker ({MARKER_LINE.strip()!r} as the last key): "
                         "the file was cut short while being written or copied")
    if not isinstance(data.get("settings"), dict):
        raise StoreError(f"settings: expected a mapping, got {data.get('settings')!r}")
    if not isinstance(data.get("complete"), bool):
        raise StoreError(f"complete: expected true or false, got {data.get('complete')!r}")
    return data


CUT_SHORT = f"the file was cut short (its last line is not {MARKER_LINE.strip()!r})"


def _cut_short(text: str) -> bool:
    """Whether `text` starts as a store-written results file but lacks its final line."""
    header = _HEADER_LINES.match(text)
    return (header is not None and int(header.group(2)) >= FIRST_STORE_SCHEMA
            and not text.endswith(MARKER_LINE))


def parse_results(text: str, kind: str | None = None) -> dict[str, Any]:
    """A results document from its text: YAML, `check_structure`, and for store-written
    schemas the text itself ending with the marker line (so that no byte is missing)."""
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        if _cut_short(text):
            raise StoreError(f"not valid YAML{line} ({problem}); {CUT_SHORT}") from None
        raise StoreError(f"not valid YAML{line} ({problem}); a file cut short while being "
                         "written?") from None
    try:
        data = check_structure(data, kind)
    except StoreError as error:
        if _cut_short(text):
            raise StoreError(f"{error}; {CUT_SHORT}") from None
        raise
    if data["schema_version"] >= FIRST_STORE_SCHEMA and not text.endswith(MARKER_LINE):
        raise StoreError(f"the file does not end with {MARKER_LINE.strip()!r}: it was cut short")
    return data


def load(path: str | Path, kind: str | None = None,
         validate: Callable[[dict], Any] | None = None) -> dict[str, Any]:
    """A results file read and checked (`parse_results`, then `validate(data)` when given);
    any problem is a StoreError whose message starts with the path."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise StoreError(f"{path}: cannot read it ({error})") from None
    try:
        data = parse_results(text, kind)
        if validate is not None:
            validate(data)
    except StoreError as error:
        raise StoreError(f"{path}: {error}") from None
    return data


# The recall file's schema (bench's: `hla_bench.results.bench_files`).
REQUIRED_RUN_FIELDS = ("setting", "mixer", "d_model", "lr", "seed", "status")
# A run's shares of answers (accuracies, the in-context value rate): in [0, 1] when recorded;
# of them, those an evaluation in `curve` records too.
SHARE_FIELDS = ("val_accuracy", "test_accuracy", "test_accuracy_at_best_val_loss",
                "in_context_rate", "stop_accuracy")
CURVE_SHARE_FIELDS = ("accuracy", "val_accuracy", "test_accuracy")
# A run's counts (steps, parameters): numbers >= 0 when recorded; so are its times (the
# `seconds` field and every `*_seconds`) and its memory (every `*_bytes`).
COUNT_FIELDS = ("steps", "steps_to_0.5", "steps_to_0.9", "best_val_loss_step", "n_params")


class RecallFileError(ValueError):
    """A recall results file that does not follow the schema; the message names the field."""


def describe_run(run: dict) -> str:
    """A run's identity in a message: setting, mixer, width, lr, weight decay and seed."""
    return (f"setting {run.get('setting')!r}, mixer {run.get('mixer')!r}, d_model "
            f"{run.get('d_model')}, lr {run.get('lr')}, weight_decay {run.get('weight_decay')}, "
            f"seed {run.get('seed')}")


def _number_problem(value: Any, share: bool) -> str | None:
    """Why `value` is not a share (a number in [0, 1]) or, without `share`, not a finite
    number >= 0; None when it is one."""
    fits = (not isinstance(value, bool) and isinstance(value, (int, float))
            and (0 <= value <= 1 if share else 0 <= value < math.inf))
    if not fits:
        return f"expected a number {'in [0, 1]' if share else 'finite and >= 0'}, got {value!r}"
    return None


def _run_value_problem(run: dict) -> str | None:
    """`field: problem` for the first recorded share, time, memory or count of `run` out of
    its range, else None."""
    checks = [(key, True) for key in SHARE_FIELDS]
    checks += [(key, False) for key in run
               if key in COUNT_FIELDS or key == "seconds"
               or str(key).endswith(("_seconds", "_bytes"))]
    for key, share in checks:
        problem = _number_problem(run[key], share) if run.get(key) is not None else None
        if problem:
            return f"{key}: {problem}"
    curve = run.get("curve") or []
    for position, entry in enumerate(curve if isinstance(curve, list) else [curve]):
        if not isinstance(entry, dict):
            return f"curve[{position}]: expected a mapping, got {entry!r}"[:300]
        for key in CURVE_SHARE_FIELDS:
            problem = _number_problem(entry[key], True) if entry.get(key) is not None else None
            if problem:
                return f"curve[{position}].{key}: {problem}"
    return None


def validate_recall(data: Any, run_key: Callable[[dict], str] | None = None) -> None:
    """Raise RecallFileError unless `data` is a whole recall results file: its fields, each
    run's recorded shares in [0, 1] and times, memory and counts finite and >= 0, and, with
    `run_key` (what identifies a run: the recall wing's `hla_bench.recall.plan.run_key`), no
    two runs with one key (the resume would keep only the second)."""
    if not isinstance(data, dict) or data.get("kind") != "recall":
        raise RecallFileError("not a recall results file (no `kind: recall`)")
    for key, kind in (("config", dict), ("environment", dict), ("runs", list)):
        if not isinstance(data.get(key), kind):
            raise RecallFileError(f"field `{key}` must be a {kind.__name__}")
    problem = _number_problem(data["seconds"], False) if data.get("seconds") is not None else None
    if problem:
        raise RecallFileError(f"seconds: {problem}")
    first: dict[str, int] = {}
    for index, run in enumerate(data["runs"]):
        if not isinstance(run, dict):
            raise RecallFileError(f"runs[{index}] must be a mapping")
        missing = [key for key in REQUIRED_RUN_FIELDS if key not in run]
        if missing:
            raise RecallFileError(f"runs[{index}] lacks {', '.join(missing)}")
        problem = _run_value_problem(run)
        if problem:
            raise RecallFileError(f"runs[{index}] ({describe_run(run)}): {problem}")
        if run_key is None:
            continue
        key = run_key(run)
        if key in first:
            raise RecallFileError(
                f"runs[{index}] ({describe_run(run)}) has the key of runs[{first[key]}] (the "
                "same spec): a run is recorded once per file, and reading it would replace "
                "the first without a word")
        first[key] = index
