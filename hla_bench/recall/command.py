"""`hla-bench recall`: train and score mixers on synthetic recall tasks.

The sweep's config and its runs come from `hla_bench.recall.plan`; runs that differ only
in learning rate, weight decay and seed train together as one stacked model
(`hla_bench.recall.pool`, `hla_bench.recall.train`); finished runs go to a locked results
store as each group ends, so a killed or cut sweep keeps them and `--resume` goes on from
there.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hla_bench import configs, registry
from hla_bench.gpu_use import GpuUse
from hla_bench.results.plots import planned_plots_problem, plots_dir_problem
from hla_bench.processes import cuda_mps_active
from hla_bench.recall.plan import (ConfigError, check_given_params, check_layers,
                                   check_mixer_options, check_recall_file, load_config,
                                   option_conflicts, plan_rows, plan_runs, run_key,
                                   validate_config)
from hla_bench.recall.report import render_recall, summarize
from hla_bench.recall.schema import with_config_options
from hla_bench.results.load import RecallFileError
from hla_bench.results.store import (ResultsStore, StoreError, default_out_path, exit_on_interrupt,
                                     read_resumable)
from hla_bench.results.tables import print_table
from hla_bench.options import comma_list, parse_params
from hla_bench.safe_files import refuse_symlink
from hla_bench.recall.pool import (STOP_GRACE_S, assign_devices, default_workers,
                                   failed_result, plan_groups, remove_checkpoints, run_groups,
                                   run_groups_dask, seq_len_of, step_flops)

SCHEMA_VERSION = 2

# --- the results file --------------------------------------------------------------------

# What a resumed sweep must share with its file: runs of another protocol would mix.
PROTOCOL_KEYS = ("model", "train", "mixer_model")


def store_mode(out: str | None, resume: bool, overwrite: bool) -> str:
    """The results store's mode for --out with --resume / --overwrite."""
    if out is not None and not out.strip():
        raise ConfigError("--out is empty: give a file, or leave --out out for a new file in "
                          "runs/")
    if resume and overwrite:
        raise ConfigError("give --resume or --overwrite, not both")
    if out is None and (resume or overwrite):
        flag = "--resume" if resume else "--overwrite"
        raise ConfigError(f"{flag} needs --out: the results file to "
                          f"{'continue' if resume else 'replace'}")
    return "resume" if resume else "overwrite" if overwrite else "new"


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
                                 settings={key: config[key] for key in PROTOCOL_KEYS},
                                 validate=check_recall_file)
    except StoreError as error:
        raise ConfigError(str(error)) from None


def check_repeats(path: str | Path, records: list[dict], specs: list[dict]) -> None:
    """ConfigError when the file's runs hold one that the plan repeats under other mixer
    options (plan.option_conflicts): both would count in one cell."""
    conflicts = option_conflicts(records, specs)
    if conflicts:
        raise ConfigError(f"{path} holds {len(conflicts)} run(s) that the plan repeats with "
                          "other mixer options; both would count in one cell. Write the new "
                          "plan to another --out. First: " + conflicts[0])


def finished_keys(out: str, config: dict, specs: list[dict]) -> set[str]:
    """The keys of the runs finished (FINISHED_STATUSES) in the results file `out`, read
    without taking its lock, after the checks a resume makes (ConfigError otherwise)."""
    try:
        data = read_resumable(out, "recall", {key: config[key] for key in PROTOCOL_KEYS},
                              check_recall_file)
    except StoreError as error:
        raise ConfigError(str(error)) from None
    check_repeats(out, data["runs"], specs)
    return kept_keys(data["runs"])


# A run's outcomes that a resume keeps: trained, or refused by its mixer at its shape (a
# NotImplementedError, such as a head dim a kernel does not take), which another try repeats
FINISHED_STATUSES = ("ok", "unsupported")


def kept_keys(records: list[dict]) -> set[str]:
    """The keys of the runs among `records` that finished (FINISHED_STATUSES): a resume
    keeps them."""
    return {run_key(run) for run in records if run.get("status") in FINISHED_STATUSES}


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


def device_visible(device: str) -> bool:
    """Whether a config's device ("auto", "cpu", "cuda", "cuda:N") can run here."""
    return not device.startswith("cuda") or torch.cuda.is_available()


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not device_visible(device):
        raise ConfigError("device cuda asked for, but no CUDA device is visible")
    return device


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

        if client is not None:
            return run_groups_dask(client, groups, on_event, on_group, **options)
        return run_groups(groups, workers, on_event, on_group, **options)


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
        if config_file is not None:
            try:
                config_file = str(configs.find(config_file))
            except ValueError as error:
                raise ConfigError(f"--config {error}") from None
        if task is not None and not task.strip():
            raise ConfigError("--task is empty: give a task name (hla-bench tasks list)")
        config = load_config(config_file, options)
        params = {key: value for key, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                                                ("vocab_size", vocab_size)) if value is not None}
        given = {key: f"--{key.replace('_', '-')} {value}" for key, value in params.items()}
        given.update({key: f"--param {key}={value}" for key, value in extra_params.items()})
        params.update(extra_params)
        if task:  # one setting of this task instead of the config's
            config["settings"] = [{"task": task, "params": params}]
        elif params:  # these parameters in every setting of the config
            config["settings"] = [{**setting, "params": {**setting["params"], **params}}
                                  for setting in config["settings"]]
        if only_tasks:
            if task:
                raise ConfigError("give --task (one setting) or --only-tasks (the config's "
                                  "settings of those tasks), not both")
            present = list(dict.fromkeys(setting["task"] for setting in config["settings"]))
            missing = [name for name in only_tasks if name not in present]
            if missing:
                raise ConfigError(f"--only-tasks {missing[0]!r}: no setting of the config has "
                                  f"that task (its tasks: {', '.join(present)})")
            config["settings"] = [setting for setting in config["settings"]
                                  if setting["task"] in only_tasks]
        if task or params:
            check_given_params(config["settings"], given, task,
                               config_file or "the default recall config")
            config = validate_config(config, config_file or "options")
        if time_limit is not None and not 0 < time_limit < math.inf:
            raise ConfigError(f"--time-limit must be a finite number of seconds > 0, got "
                              f"{time_limit}")
        if scheduler and executor != "dask":
            raise ConfigError("--scheduler needs --executor dask")
        if dashboard and (executor != "dask" or scheduler):
            raise ConfigError("--dashboard is the dashboard of the local Dask cluster: it "
                              "needs --executor dask without --scheduler")
        if executor == "dask":
            from hla_bench.dask_executor import executor_problem

            problem = executor_problem(scheduler)
            if problem:
                raise ConfigError(problem)
        # a dry run plans for the config's device without needing it (a GPU grid is planned
        # on a laptop); its layers' options are then not tried
        absent = dry_run and not device_visible(config["device"])
        device = config["device"] if absent else resolve_device(config["device"])
        if not absent:
            check_mixer_options(config, device)
            if not device.startswith("cuda"):
                if options.get("graphs"):
                    raise ConfigError(f"--graphs replays CUDA graphs: the device is {device}")
                config["graphs"] = False  # nothing is replayed off CUDA: the header says so
        specs = assign_devices(plan_runs(config, device), device)
        check_layers(specs)
        mode = store_mode(out, resume, overwrite)
        problem = plots_dir_problem(plots_dir) if plots_dir is not None else None
        if plots_dir is not None and not problem:  # a plot there that is a symbolic link
            problem = planned_plots_problem([("recall", "recall", {})], plots_dir, "png")
        if problem:
            raise ConfigError(problem)
        if dry_run:
            left = specs
            if mode == "resume" and Path(out).exists():
                finished = finished_keys(out, config, specs)
                left = [spec for spec in specs if run_key(spec) not in finished]
                console.print(f"resuming {out}: {len(specs) - len(left)} of the {len(specs)} "
                              f"planned runs finished there; the plan below is the "
                              f"{len(left)} left", soft_wrap=True)
            with console.status("counting each step shape's FLOPs"):  # one traced step a shape
                rows = plan_rows(left, config["max_group"], step_flops)
            print_table(console, plan_table(rows), lambda: plan_lines(rows))
            uncounted = sorted({mixer for row in rows for mixer in row["uncounted"]})
            console.print("FLOPs: the matmuls of a training step (forward and backward) as "
                          "the mixers' PyTorch forms compute them, times the steps"
                          + (f"; not counted: {', '.join(uncounted)} (not runnable on the "
                             "CPU here)" if uncounted else ""), soft_wrap=True)
            if absent:
                console.print(f"[yellow]note[/]: planned for {device}, which is not visible "
                              "here: the mixer options were not tried on it, and mixers "
                              "whose packages are missing here count as unstacked")
            return
        workers = config["workers"] or default_workers(device, config["workers_per_gpu"])
        store = open_results(out, mode, config, device, workers, environment(device))
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
        runnable = []
        for spec in specs:
            reason = registry.get(spec["mixer"]).unavailable_reason(spec["mixer_options"])
            if run_key(spec) in finished:
                continue
            if reason:
                store.add(failed_result(spec, "unavailable", reason))
            else:
                runnable.append(spec)
        groups = order_groups(plan_groups(runnable, config["max_group"]), largest_first)
        console.print(f"[bold]recall sweep[/]: {len(specs)} runs ({len(runnable)} to train in "
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
                graphs=config["graphs"], compile=config["compile"])
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


def order_groups(groups: list[list[dict]], largest_first: bool = False) -> list[list[dict]]:
    """The order groups start in: by width x sequence length, the cheapest first (or with
    `largest_first` the costliest first); groups of one size keep the plan's order."""
    def size(group: list[dict]) -> int:
        spec = group[0]
        return spec["d_model"] * seq_len_of(spec)

    return sorted(groups, key=lambda group: -size(group) if largest_first else size(group))


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
