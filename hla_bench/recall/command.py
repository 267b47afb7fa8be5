"""`hla-bench recall`: train and score mixers on synthetic recall tasks.

The options become a plan in one call (`hla_bench.recall.plan.plan_sweep`: every check and
lookup, the runs and their groups); a dry run prints it. Otherwise the command opens a locked
results store and hands the groups still missing there to the worker pool
(`hla_bench.recall.pool.run_sweep`): runs that differ only in learning rate, weight decay and
seed train together as one stacked model (`hla_bench.recall.train`), and finished runs go to
the store as each group ends, so a killed or cut sweep keeps them and `--resume` goes on from
there.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hla_bench.gpu_use import GpuUse
from hla_bench.processes import cuda_mps_active
from hla_bench.recall.plan import (ConfigError, check_recall_file, check_repeats, kept_keys,
                                   plan_sweep, protocol, run_key)
from hla_bench.recall.report import render_recall, summarize
from hla_bench.recall.schema import with_config_options
from hla_bench.results.load import RecallFileError
from hla_bench.results.store import ResultsStore, StoreError, default_out_path, exit_on_interrupt
from hla_bench.results.tables import print_table
from hla_bench.options import comma_list, parse_params
from hla_bench.safe_files import refuse_symlink
from hla_bench.recall.pool import STOP_GRACE_S, remove_checkpoints, run_sweep

SCHEMA_VERSION = 2

# --- the results file --------------------------------------------------------------------

def open_results(out: str | None, mode: str, config: dict, device: str, workers: int,
                 env: dict) -> ResultsStore:
    """The locked recall results store (a new file in runs/ without --out). A file that
    exists without --resume / --overwrite, is not a recall results file, is cut short, is
    written by another process, or holds another protocol is refused here, before any run."""
    path = Path(out) if out else default_out_path("recall")
    header = {"schema_version": SCHEMA_VERSION,
              "config": {**config, "device": device, "workers": workers},
              "environment": env, "seconds": 0.0}
    try:
        return ResultsStore.open(path, kind="recall", key=run_key, mode=mode, header=header,
                                 settings=protocol(config),
                                 validate=check_recall_file)
    except StoreError as error:
        raise ConfigError(str(error)) from None


def part_record(env: dict, seconds: float, runs: int) -> dict:
    """One invocation's share of a results file: when and on what it ran (from its
    environment), its seconds and the runs it trained."""
    return {"utc_time": env.get("utc_time"), "gpu": env.get("gpu"),
            "gpu_count": env.get("gpu_count"), "cuda_mps": env.get("cuda_mps"),
            "git_commit": env.get("git_commit"), "seconds": seconds, "runs": runs}


def previous_parts(header: dict | None, finished: int) -> list[dict]:
    """The parts of a resumed file: its own list, or, for a file written before parts were
    recorded, one part made of its header (its last invocation's environment, its seconds,
    its `finished` runs)."""
    if header is None:
        return []
    if header.get("parts"):
        return [dict(part) for part in header["parts"]]
    return [part_record(header.get("environment") or {}, header.get("seconds") or 0.0,
                        finished)]


def environment(device: str) -> dict:
    from hla_bench.results.bench_files import capture_environment

    return capture_environment(device)


# --- the command -------------------------------------------------------------------------

def run_with_progress(groups: list[list[dict]], workers: int, console: Console,
                      on_results, client=None, **options) -> bool:
    """The groups under a rich display: an overall bar of runs, a bar per running group,
    and a line per finished run. Where the output is not a terminal (a pipe, a log file)
    the bars give way to whole lines: a group's start, its progress at every tenth of its
    steps and whenever a run of it stops, and each finished run."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    total = sum(len(group) for group in groups)
    names = {tuple(spec["run_id"] for spec in group):
             escape(f"{group[0].get('variant') or group[0]['mixer']} d={group[0]['d_model']} "
                    f"x{len(group)} "
                    f"[{group[0]['setting']}]") for group in groups}
    plain = not console.is_terminal

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False)

    with Progress(*columns, console=console, transient=False, disable=plain) as progress:
        overall = progress.add_task("[bold]all runs", total=total, info="")
        bars: dict[tuple, int] = {}
        told: dict[tuple, tuple[int, int]] = {}  # group -> (tenths of its steps, runs training)

        def on_event(ids: list[int], event: dict) -> None:
            key = tuple(ids)
            if event["event"] == "retry" and key in names:
                if key in bars:
                    progress.remove_task(bars.pop(key))
                told_why = ("a CUDA fault beside other groups; queued again, to run alone "
                            "in a fresh worker" if event.get("alone") else
                            f"out of memory beside other groups; queued again, "
                            f"{event['at_once']} group(s) at once until it is done")
                progress.console.print(f"  {names[key]}: {told_why}", soft_wrap=plain,
                                       highlight=False)
            elif event["event"] == "at_once" and key in names:
                progress.console.print(f"  {names[key]}: done; {event['at_once']} group(s) "
                                       "at once again", soft_wrap=plain, highlight=False)
            elif event["event"] == "checkpoint_ignored" and key in names:
                progress.console.print(f"  {names[key]}: {escape(event['reason'])}",
                                       soft_wrap=plain, highlight=False)
            elif event["event"] == "start" and key in names:
                bars[key] = progress.add_task(names[key], total=event["total"], info="")
                told[key] = (0, event["runs"])
                if plain:
                    say(f"{names[key]}: started, at most {event['total']:,} steps")
            elif event["event"] in ("eval", "resumed") and key in bars:
                info = (f"best val {event['accuracy']:.3f}, {event['active']} training"
                        if event["event"] == "eval" else "resumed")
                progress.update(bars[key], completed=event["step"], info=info)
                if not plain:
                    return
                if event["event"] == "resumed":
                    say(f"{names[key]}: resumed at step {event['step']:,}")
                    return
                tenths = 10 * event["step"] // max(1, event["total"])
                if (tenths, event["active"]) != told[key]:
                    told[key] = (tenths, event["active"])
                    say(f"{names[key]}: step {event['step']:,} of {event['total']:,}, {info}")

        def on_group(results: list[dict]) -> None:
            key = tuple(r["run_id"] for r in results)
            if key in bars:
                progress.remove_task(bars.pop(key))
            for result in results:
                where = escape(f"{result.get('variant') or result['mixer']} "
                               f"d={result['d_model']} lr={result['lr']:g} "
                               f"wd={result['weight_decay']:g} seed={result['seed']} "
                               f"[{result['setting']}]")
                outcome = (f"test {result['test_accuracy']:.3f} (val {result['val_accuracy']:.3f}) "
                           f"in {result['steps']} steps" if result["status"] == "ok" else
                           f"[red]{result['status']}: {escape(result.get('error', ''))}[/]")
                progress.console.print(f"  {where}: {outcome}", soft_wrap=plain,
                                       highlight=not plain)
            progress.advance(overall, len(results))
            on_results(results)

        return run_sweep(groups, workers, on_event, on_group, client=client, **options)


@click.command()
@click.option("--config", "config_file", metavar="CONFIG",
              help="YAML sweep config: a file, or the name of a shipped one (recall-cpu, "
                   "zoology-fig2, zoology-smoke, zoology-frontier, mad, mad-budget); the "
                   "options below override it.")
@click.option("--task", help="Task name (see `hla-bench tasks list`): one setting of it replaces "
              "the config's settings. Without it, the task options below apply to every setting.")
@click.option("--only-tasks", "only_tasks", callback=comma_list(str), metavar="TASKS",
              help="Keep only the config's settings of these tasks (comma-separated, e.g. "
                   "in_context_recall,noisy_recall): a suite run task by task; a later "
                   "--resume without it adds the other settings.")
@click.option("--seq-len", type=int, help="Task sequence length.")
@click.option("--num-kv-pairs", type=int, help="MQAR key-value pairs.")
@click.option("--vocab-size", type=int, help="Task vocabulary size.")
@click.option("--param", "extra_params", multiple=True, callback=parse_params,
              help="Any other task parameter, KEY=VALUE (repeatable).")
@with_config_options
@click.option("--out", type=click.Path(dir_okay=False), help="Write the results YAML here.")
@click.option("--resume", is_flag=True, help="Continue the --out file: keep its runs, run "
              "the missing ones (a group cut at --time-limit continues from its checkpoint).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out results file.")
@click.option("--time-limit", type=float, help="Stop after this many seconds: running groups "
              "stop at their next step and save a checkpoint; --resume continues them. A "
              f"worker process not back {STOP_GRACE_S:g} s later (compiling) is killed; its "
              "group resumes from its last checkpoint.")
@click.option("--plots-dir", type=click.Path(file_okay=False), help="Also write plots here.")
@click.option("--executor", type=click.Choice(["local", "dask"]), default="local",
              show_default=True, help="local: worker processes on this host; dask: tasks on a "
              "Dask cluster (without --scheduler a local one of --workers workers, spread over "
              "the GPUs, or CPU workers without one).")
@click.option("--scheduler", metavar="ADDRESS", help="An existing Dask scheduler "
              "(tcp://host:8786) for --executor dask.")
@click.option("--dashboard", is_flag=True, help="Serve the local Dask cluster's dashboard, "
              "on 127.0.0.1 only (default: none; the cluster listens on 127.0.0.1 only "
              "either way).")
@click.option("--largest-first", "largest_first", is_flag=True, help="Start the widest, "
              "longest groups first (default: the cheapest first, so a sweep cut at "
              "--time-limit has finished the most runs). For a sweep continued in parts on one "
              "machine, where a cut group resumes from its checkpoint: its longest groups "
              "then have every part.")
@click.option("--dry-run", is_flag=True, help="Print the plan (runs, groups and the most "
              "training steps per task setting and width; with --resume, of the runs the "
              "--out file lacks) and exit: nothing is trained or written, and a config's "
              "CUDA device need not be visible.")
def recall(config_file, task, only_tasks, seq_len, num_kv_pairs, vocab_size, extra_params, out,
           resume, overwrite, time_limit, plots_dir, executor, scheduler, dashboard,
           largest_first, dry_run, **options):
    """Train tiny LMs per mixer on synthetic recall tasks; report per (task setting, mixer,
    d_model) the test accuracy of the (learning rate, weight decay) chosen on validation,
    with its spread over seeds, beside the one chosen on test as Zoology (or MAD-lab) does."""
    console = Console()
    try:
        params = {key: value for key, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                                                ("vocab_size", vocab_size)) if value is not None}
        plan = plan_sweep(config_file, options, task=task, only_tasks=only_tasks, params=params,
                          extra_params=extra_params, out=out, resume=resume,
                          overwrite=overwrite, time_limit=time_limit, executor=executor,
                          scheduler=scheduler, dashboard=dashboard, plots_dir=plots_dir,
                          dry_run=dry_run, largest_first=largest_first, busy=console.status)
        config, device, specs, workers = plan.config, plan.device, plan.specs, plan.workers
        if dry_run:
            print_plan(console, plan, out)
            return
        store = open_results(out, plan.mode, config, device, workers, environment(device))
    except (ConfigError, RecallFileError, OSError) as error:
        raise click.UsageError(str(error)) from None

    with store, exit_on_interrupt(store, "run", lambda text: console.print(
            f"[yellow]{escape(text)}[/]", soft_wrap=True)):
        checkpoints = Path(f"{store.path}.checkpoints")
        try:
            check_repeats(store.path, store.records(), specs)
            # a checkpoint continues only the results file it was written for: a new file
            # (--overwrite, a new --out, a --resume of a missing file) starts every group
            # afresh, so the checkpoints an earlier run left there go first
            refuse_symlink(checkpoints, "checkpoint folder")
            stale = remove_checkpoints(checkpoints) if store.previous_header is None else 0
        except ConfigError as error:
            raise click.UsageError(str(error)) from None
        except OSError as error:
            raise click.UsageError(f"{checkpoints}: {error.strerror or error}") from None
        if stale:
            console.print(f"removed {stale} checkpoint(s) of an earlier run from "
                          f"{escape(str(checkpoints))}: {escape(str(store.path))} starts afresh",
                          soft_wrap=True, highlight=False)
        finished = kept_keys(store.records())
        left = plan.left(finished)
        for record in left.failed:
            store.add(record)
        groups = left.groups
        console.print(f"[bold]recall sweep[/]: {len(specs)} runs ({left.runs} to train in "
                      f"{len(groups)} groups) on {device}, {workers} worker(s)")
        gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
        if gpus and min(workers, len(groups)) > gpus and not cuda_mps_active():
            console.print(f"[yellow]note[/]: {min(workers, len(groups))} workers share "
                          f"{gpus} GPU(s) without CUDA MPS, so they take turns on it; with "
                          "MPS (`nvidia-cuda-mps-control -d`) their kernels run side by side "
                          "(docs/method.md)")
        if finished:
            console.print(f"resuming: {len(finished)} finished run(s) kept from "
                          f"{escape(str(store.path))}")
        started = time.perf_counter()
        previous_seconds = float((store.previous_header or {}).get("seconds") or 0.0)
        earlier_parts = previous_parts(store.previous_header, len(finished))
        deadline = time.time() + time_limit if time_limit else None
        trained = [0]  # runs this part trained (finished or failed)
        gpu_use: GpuUse | None = None  # sampling this host's GPUs while the groups train

        def timed() -> dict:
            """The header's seconds (every part's) and parts (this one's so far appended)."""
            seconds = round(time.perf_counter() - started, 1)
            part = part_record(store.header["environment"], seconds, trained[0])
            if gpu_use is not None:
                part["gpu_use"] = gpu_use.summary()
            return {"seconds": round(previous_seconds + seconds, 1),
                    "parts": earlier_parts + [part]}

        store.update_header(timed(), write=False)

        def on_results(results: list[dict]) -> None:
            """Store each finished group at once: a killed sweep keeps what it finished."""
            trained[0] += len(results)
            for result in results:
                store.add(result)
            store.update_header(timed())

        client = None
        if executor == "dask" and groups:
            from hla_bench.dask_executor import connect, cuda_device_count, describe

            client = connect(scheduler, gpus=cuda_device_count() if device.startswith("cuda") else 0,
                             workers=workers, dashboard=dashboard)
            store.update_header({"executor": describe(client)}, write=False)
            console.print(f"dask: {describe(client)['workers']} worker(s) at "
                          f"{describe(client)['scheduler']}", highlight=False)
            if dashboard:
                console.print(f"dask dashboard: {client.dashboard_link}", highlight=False)
        try:
            if device.startswith("cuda") and groups and not scheduler:
                gpu_use = GpuUse()  # not a --scheduler's workers: they are elsewhere
            complete = run_with_progress(
                groups, min(workers, max(1, len(groups))), console, on_results, client=client,
                deadline=deadline, checkpoint_dir=str(checkpoints),
                graphs=config["graphs"], compile=config["compile"],
                state_bytes=left.state_bytes)
        finally:
            if client is not None:
                client.close()
            if gpu_use is not None:
                gpu_use.stop()
        store.update_header(timed(), write=False)
        data = store.close(complete=complete)
    render_recall(data, console, plots_dir=plots_dir)
    console.print(f"results written to {escape(str(store.path))}")
    if not complete:
        console.print("[yellow]stopped at --time-limit[/]: rerun with --resume to continue")


def print_plan(console: Console, plan, out: str | None) -> None:
    """A dry run's plan (`plan_sweep` with `dry_run`): the runs --out lacks, the table of
    `plan.rows` (lines on a narrow console), what the FLOPs count and what was not tried."""
    if plan.resumed is not None:
        finished, planned = plan.resumed
        console.print(f"resuming {out}: {finished} of the {planned} "
                      f"planned runs finished there; the plan below is the "
                      f"{planned - finished} left", soft_wrap=True)
    rows = plan.rows
    print_table(console, plan_table(rows), lambda: plan_lines(rows))
    uncounted = sorted({mixer for row in rows for mixer in row["uncounted"]})
    console.print("FLOPs: the matmuls of a training step (forward and backward) as "
                  "the mixers' PyTorch forms compute them, times the steps"
                  + (f"; not counted: {', '.join(uncounted)} (not runnable on the "
                     "CPU here)" if uncounted else ""), soft_wrap=True)
    if plan.absent:
        console.print(f"[yellow]note[/]: planned for {plan.device}, which is not visible "
                      "here: the mixer options were not tried on it, and mixers "
                      "whose packages are missing here count as unstacked")


def _flops(flops: int) -> str:
    return f"{flops:.3g}"


def plan_table(rows: list[dict]) -> Table:
    """`plan_rows` as a table, with a total row."""
    runs = sum(row["runs"] for row in rows)
    table = Table(title=f"recall plan: {runs} runs (steps: at most, before early stops)")
    for column in ("setting", "d_model", "mixers", "runs", "groups", "stacks",
                   "steps a run", "model steps", "FLOPs"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for row in rows:
        table.add_row(escape(row["setting"]), *(f"{row[key]:,}" for key in
                      ("d_model", "mixers", "runs", "groups")), row["stacks"],
                      *(f"{row[key]:,}" for key in ("steps", "model_steps")),
                      _flops(row["flops"]))
    table.add_row("all", "", "", f"{runs:,}", f"{sum(r['groups'] for r in rows):,}", "", "",
                  f"{sum(r['model_steps'] for r in rows):,}",
                  _flops(sum(r["flops"] for r in rows)))
    return table


def plan_lines(rows: list[dict]) -> list[str]:
    """`plan_rows` as plain lines, for a console too narrow for the table."""
    runs = sum(row["runs"] for row in rows)
    return [f"recall plan: {runs} runs (steps: at most, before early stops)"] + [
        f"{row['setting']} d_model {row['d_model']}: {row['mixers']} mixers, {row['runs']} "
        f"runs in {row['groups']} groups (stacks {row['stacks']}), {row['steps']:,} steps a run, "
        f"{row['model_steps']:,} model steps, {_flops(row['flops'])} FLOPs" for row in rows] + [
        f"all: {sum(r['model_steps'] for r in rows):,} model steps, "
        f"{_flops(sum(r['flops'] for r in rows))} FLOPs"]


commands = [recall]
__all__ = ["recall", "summarize"]
