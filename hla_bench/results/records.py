"""The point record: what a bench results file holds for each measured point.

A record is a plain mapping (a YAML mapping in the file). FIELDS declares every field once:
the types it accepts, whether it may be null, the values it may take, whether it is part of
the key that identifies a point across runs, whether files written before it existed may
lack it, and the value a new record takes from its planned point. `empty_record`, `KEY` and
`point_key`, and the schema `hla_bench.results.bench_files.validate` checks, all derive from it.

Invariant: a record whose status is not `ok` has null time, rate and memory fields (a
failure leaves the empty record's values, plus its status and reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import yaml

# The modes a point is measured in (a sweep runs some of them).
MODES = ("fwd", "fwdbwd", "decode", "prefill")
STATUSES = ("ok", "oom", "error", "unavailable", "unsupported", "timeout")
# Statuses a resumed sweep keeps; an error or a timeout is measured again.
KEPT_STATUSES = ("ok", "oom", "unavailable", "unsupported")

_INT, _NUM, _STR, _MAP, _BOOL = (int,), (int, float), (str,), (dict,), (bool,)


@dataclass(frozen=True)
class RecordField:
    """One field of a point record.

    types: the accepted types (a bool is accepted only where `bool` is listed); nullable:
    null is accepted; choices: the accepted values, when limited; key: part of what
    identifies the point across runs (a resumed sweep keeps a record with the same key);
    optional: files written before the field existed lack it, so it is checked only when
    present; planned: its value in a new record, from the planned point (None: null until
    measured); measure: a measured quantity (a time, an amount of memory, a rate, a count),
    which when not null is a finite number >= 0 (for a list: each item).
    """

    name: str
    types: tuple[type, ...]
    nullable: bool = False
    choices: tuple[str, ...] = ()
    key: bool = False
    optional: bool = False
    planned: Callable[[Any], Any] | None = None
    measure: bool = False


def _sweep(attribute: str) -> Callable[[Any], Any]:
    return lambda point: getattr(point.sweep, attribute)


FIELDS: tuple[RecordField, ...] = (
    RecordField("sweep", _STR, key=True, planned=_sweep("name")),
    RecordField("mixer", _STR, key=True, planned=lambda p: p.spec.label),
    RecordField("name", _STR, key=True, planned=lambda p: p.spec.name),
    RecordField("options", _MAP, key=True, planned=lambda p: dict(p.spec.options)),
    RecordField("mode", _STR, choices=MODES, key=True, planned=lambda p: p.mode),
    RecordField("seq_len", _INT, key=True, planned=lambda p: p.seq_len),
    RecordField("batch", _INT, key=True,
                planned=lambda p: p.sweep.batch_for(p.seq_len, p.mode)),
    RecordField("heads", _INT, key=True, planned=_sweep("heads")),
    RecordField("head_dim", _INT, key=True, planned=_sweep("head_dim")),
    RecordField("value_dim", _INT, key=True,
                planned=lambda p: p.sweep.value_dim or p.sweep.head_dim),
    RecordField("dtype", _STR, key=True, planned=lambda p: p.sweep.resolved_dtype()),
    RecordField("device", _STR, key=True, planned=lambda p: p.sweep.resolved_device()),
    RecordField("status", _STR, choices=STATUSES, planned=lambda p: "ok"),
    RecordField("reason", _STR, nullable=True),
    RecordField("repeats", _INT, planned=_sweep("repeats")),
    RecordField("warmup", _INT, planned=_sweep("warmup")),
    RecordField("median_ms", _NUM, nullable=True, measure=True),
    RecordField("p20_ms", _NUM, nullable=True, measure=True),
    RecordField("p80_ms", _NUM, nullable=True, measure=True),
    RecordField("tokens_per_s", _NUM, nullable=True, measure=True),
    RecordField("peak_memory_bytes", _INT, nullable=True, measure=True),
    RecordField("state_bytes", _INT, nullable=True, measure=True),
    RecordField("flops", _NUM, nullable=True, measure=True),
    RecordField("tflops", _NUM, nullable=True, measure=True),
    # the tokens per timed decode call (absent: 1), and whether it replayed a CUDA graph
    RecordField("decode_steps", _INT, nullable=True, optional=True, measure=True),
    RecordField("decode_graph", _BOOL, nullable=True, optional=True),
    # whether the samples timed CUDA-graph replays of the call (any mode)
    RecordField("cuda_graph", _BOOL, nullable=True, optional=True),
    # op or layer (absent in older files: op)
    RecordField("level", _STR, choices=("op", "layer"), optional=True, planned=_sweep("level")),
    # decode: bytes a step must move (its decoder's step_bytes, else 2 x state_bytes) per second
    RecordField("bytes_per_s", _NUM, nullable=True, optional=True, measure=True),
    # raw per-sample times, their spread ((p75 - p25) / median) and what ran: implementation,
    # kernel path, chunk size, SDPA backend, package versions (absent in older files)
    RecordField("samples_ms", (list,), nullable=True, optional=True, measure=True),
    RecordField("spread", _NUM, nullable=True, optional=True, measure=True),
    RecordField("resolved", _MAP, nullable=True, optional=True),
    # seconds spent building and warming up the point before its samples (compilation and
    # autotuning land here), so a sweep's time can be planned (absent in older files)
    RecordField("setup_s", _NUM, nullable=True, optional=True, measure=True),
)
KEY = tuple(each.name for each in FIELDS if each.key)


def empty_record(point: Any) -> dict[str, Any]:
    """A new record of `point`: its identity and settings, status ok, nothing measured."""
    return {each.name: each.planned(point) if each.planned else None for each in FIELDS}


def point_key(record: Mapping[str, Any]) -> str:
    """The KEY fields of a record as one hashable text (equal for equal values)."""
    return yaml.safe_dump({name: record[name] for name in KEY}, sort_keys=True)


def iter_groups(records: list[dict[str, Any]]) -> Iterator[tuple[tuple[str, str], list[dict]]]:
    """Records grouped by (sweep, mode), in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for record in records:
        groups.setdefault((record["sweep"], record["mode"]), []).append(record)
    yield from groups.items()
