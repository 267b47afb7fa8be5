"""What a recall sweep cost, read from its results file: per (task setting, d_model) the
runs, the model steps they trained, the seconds of their groups (each group's longest run,
its set-up and compiling included), the model steps per group-second and the most GPU
memory a group held (`gpu_memory_mib`, where its runs recorded it); in all, the
sweep's own seconds (its wall time, the parts of a resumed sweep summed): on one GPU, the
grid's GPU time; and per part (each invocation that wrote the file, `parts`), its GPU,
seconds, runs and how busy it kept each GPU (`gpu_use`, where recorded). A file from before
parts were recorded counts as one part on its `environment.gpu`.

    python benchmarks/recall_grid_time.py results/h200-2026-12-05/zoology-fig2.yaml \
        [--yaml out.yaml]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import yaml

from hla_bench.recall.command import previous_parts
from hla_bench.recall.train import group_key


def grid_time(data: dict) -> dict:
    """The summary of a recall results file (`data`, as loaded): cells and totals."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for run in data["runs"]:
        if run.get("status") == "ok":
            groups[group_key(run)].append(run)
    cells: dict[tuple[str, int], dict] = {}
    for runs in groups.values():
        cell = cells.setdefault((runs[0]["setting"], runs[0]["d_model"]), {
            "setting": runs[0]["setting"], "d_model": runs[0]["d_model"], "runs": 0,
            "groups": 0, "model_steps": 0, "group_seconds": 0.0, "gpu_memory_mib": None})
        cell["runs"] += len(runs)
        memory = max((run.get("gpu_memory_mib") or 0 for run in runs), default=0)
        if memory:  # a group's runs share its process's figure
            cell["gpu_memory_mib"] = max(memory, cell["gpu_memory_mib"] or 0)
        cell["groups"] += 1
        cell["model_steps"] += sum(run["steps"] for run in runs)
        cell["group_seconds"] += max(run["seconds"] for run in runs)
    rows = sorted(cells.values(), key=lambda c: (c["setting"], c["d_model"]))
    for cell in rows:
        cell["group_seconds"] = round(cell["group_seconds"], 1)
        cell["model_steps_per_group_second"] = round(
            cell["model_steps"] / cell["group_seconds"], 1) if cell["group_seconds"] else None
    seconds = float(data.get("seconds") or 0.0)
    steps = sum(cell["model_steps"] for cell in rows)
    parts = [{key: part.get(key) for key in ("utc_time", "gpu", "seconds", "runs", "gpu_use")}
             for part in previous_parts(data, len(data["runs"]))]
    return {"gpu": data.get("environment", {}).get("gpu"),
            "gpus": sorted({str(part["gpu"]) for part in parts}), "parts": parts,
            "complete": bool(data.get("complete")),
            "runs_ok": sum(cell["runs"] for cell in rows), "runs": len(data["runs"]),
            "sweep_seconds": seconds, "sweep_minutes": round(seconds / 60, 1),
            "model_steps": steps,
            "model_steps_per_second": round(steps / seconds, 1) if seconds else None,
            "cells": rows}


def gpu_use_text(gpu_use) -> str:
    """A part's GPU utilisation (hla_bench.gpu_use) in words, or nothing where unrecorded."""
    if not gpu_use:
        return ""
    if isinstance(gpu_use, dict):
        return f"; GPU use not sampled: {gpu_use.get('unavailable')}"
    return "; GPU use " + ", ".join(
        f"{gpu['index']}: {gpu['utilization_mean']}% mean, {gpu['utilization_median']}% median, "
        f"{gpu['memory_used_max_mib']:,.0f} MiB at most" for gpu in gpu_use)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a recall results YAML")
    parser.add_argument("--yaml", help="also write the summary to this file")
    args = parser.parse_args(argv)
    with open(args.results) as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict) or data.get("kind") != "recall":
        print(f"{args.results}: not a recall results file", file=sys.stderr)
        return 2
    summary = {"results": args.results, **grid_time(data)}
    print(f"{summary['runs_ok']} of {summary['runs']} runs ok on {', '.join(summary['gpus'])}: "
          f"{summary['sweep_minutes']} min of sweep time, {summary['model_steps']:,} model "
          f"steps, {summary['model_steps_per_second']} a second"
          + ("" if summary["complete"] else " (incomplete)"))
    parts = summary["parts"]
    if len(parts) > 1 or any(part["gpu_use"] for part in parts):
        for part in parts:
            print(f"  part from {part['utc_time']} on {part['gpu']}: {part['seconds']} s, "
                  f"{part['runs']} runs{gpu_use_text(part['gpu_use'])}")
    for cell in summary["cells"]:
        print(f"  {cell['setting']}  d_model {cell['d_model']}: {cell['runs']} runs in "
              f"{cell['groups']} groups, {cell['model_steps']:,} model steps, "
              f"{cell['group_seconds']} group-seconds, "
              f"{cell['model_steps_per_group_second']} steps per group-second"
              + (f", {cell['gpu_memory_mib']:,} MiB of GPU memory a group at most"
                 if cell["gpu_memory_mib"] is not None else ""))
    if args.yaml:
        with open(args.yaml, "w") as handle:
            yaml.safe_dump(summary, handle, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
