"""Any results file read with every check of its kind: the one loader the report and the
index read files through. `load.load` reads a file and checks the structure every results
file shares; the kinds' own schemas live beside their writers (`bench_files.validate`) or
in `load` (`validate_recall`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from hla_bench.results import bench_files
from hla_bench.results.load import load, validate_recall

# What identifies a recall run in a file (the recall wing's `hla_bench.recall.plan.run_key`).
RunKey = Callable[[dict], str]


def load_checked(path: str | Path, run_key: RunKey | None = None) -> dict[str, Any]:
    """A results file of any kind, checked: the structure every results file has
    (`check_structure`, the completion marker), then the kind's own schema (bench:
    `bench_files.validate`; recall: `validate_recall`, with `run_key` what identifies
    a recall run, so that no two runs share one). Any problem is a ValueError whose message
    starts with the path."""
    try:
        data = load(path)
        if data["kind"] == "bench":
            bench_files.validate(data)
        else:
            validate_recall(data, run_key)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if message.startswith(str(path))
                         else f"{path}: {message}") from None
    return data
