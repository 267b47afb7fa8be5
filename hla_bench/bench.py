"""The speed commands: `hla-bench list`, `hla-bench bench` and `hla-bench run [CONFIG]`.

Exit codes: 0 when the sweep completed (failed points are results, recorded with their
status); 2 for usage errors, all found before any point runs (unknown mixer or option,
malformed lengths, bad config, an --out file that exists without --resume / --overwrite,
is not a bench results file, is cut short, has other settings, or is being written by
another process); 1 when a results file cannot be written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import click
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hla_bench import configs, registry
from hla_bench.results import bench_files as results_io
from hla_bench.options import is_required, option_flag, with_field_options
from hla_bench.speed.sweeps import (MAX_COUNT, MAX_SECONDS, SweepConfig, default_text, plan,
                                     load_config, looks_like_recall, settings_of,
                                     parse_mixer_specs, parse_modes, parse_seq_lens,
                                     setting_fields)
from hla_bench.results.records import point_key
from hla_bench.report import render_bench
from hla_bench.results.store import ResultsStore, StoreError, default_out_path, exit_on_interrupt
from hla_bench.results.tables import print_table



def mixer_rows() -> list[dict[str, Any]]:
    return [{"name": m.name, "family": m.family, "forms": list(m.forms),
             "options": dict(m.options), "available": m.available,
             "reason": m.unavailable_reason(), "description": m.description}
            for m in registry.all_mixers()]


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_(as_json: bool) -> None:
    """List the registered mixers and whether they run on this machine."""
    rows = mixer_rows()
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    console = Console()
    print_table(console, mixer_table(rows), lambda: mixer_lines(rows))


def _options_text(row: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in row["options"].items())


def mixer_table(rows: list[dict[str, Any]]) -> Table:
    """The mixers as a table: names whole, forms and options wrapped between items."""
    table = Table(title="mixers")
    # each part of a reason on a line of its own, and the column wide enough for the
    # longest part, so a part is never broken across lines
    parts = [part for row in rows if not row["available"] for part in row["reason"].split("; ")]
    for column in ("name", "family", "forms", "options (defaults)"):
        table.add_column(column, no_wrap=column in ("name", "family"))
    table.add_column("available", min_width=max((len(part) for part in parts), default=0) + 5)
    for row in rows:
        available = "[green]yes[/green]" if row["available"] else (
            "[red]no[/red]: " + ";\n".join(escape(part) for part in row["reason"].split("; ")))
        table.add_row(escape(row["name"]), escape(row["family"]), ", ".join(row["forms"]),
                      escape(_options_text(row)), available)
    return table


def mixer_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The mixers as plain lines, for a console too narrow for the table: a line per
    mixer, then its forms and its options."""
    lines = ["mixers"]
    for row in rows:
        if row["available"]:
            lines.append(f"{row['name']} ({row['family']}): available")
        else:  # each part of the reason on a line of its own
            lines.append(f"{row['name']} ({row['family']}): not available:")
            lines += [f"  {part}" for part in row["reason"].split("; ")]
        lines += [f"  forms: {', '.join(row['forms'])}", f"  options: {_options_text(row)}"]
    return lines


def _check(sweeps: list[SweepConfig]) -> None:
    """Usage errors for unknown mixers or options, options of layers only, option values a
    mixer rejects, or an absent device: every spec of every sweep, before anything runs."""
    from hla_bench.speed.runner import check_options

    for sweep in sweeps:
        try:
            sweep.check_device()
            mixers = sweep.check_mixers()
            check_options(sweep, mixers)
        except ValueError as error:
            raise click.UsageError(str(error)) from None


def _mode(out: str | None, resume: bool, overwrite: bool) -> str:
    """The store mode of --out with --resume / --overwrite (without --out, a new file)."""
    if out is not None and not out.strip():
        raise click.UsageError("--out is empty: give a file, or leave --out out for a new "
                               "file in runs/")
    if resume and overwrite:
        raise click.UsageError("give --resume or --overwrite, not both")
    if out is None:
        if resume or overwrite:
            flag = "--resume" if resume else "--overwrite"
            raise click.UsageError(f"{flag} needs --out: the results file to "
                                   f"{'continue' if resume else 'replace'}")
        return "new"
    return "resume" if resume else "overwrite" if overwrite else "new"


def open_store(out: str | None, mode: str, sweeps: list[SweepConfig], config: dict[str, Any],
               environment: dict[str, Any]) -> ResultsStore:
    """The locked results store of a bench run; its problems (a file that exists, is not
    a results file, is cut short, is written by another process, or whose settings differ)
    are usage errors, raised before any point runs."""
    path = Path(out) if out else default_out_path("bench")
    new_header = results_io.make_header(config, [s.to_dict() for s in sweeps], environment)
    try:
        return ResultsStore.open(
            path, kind="bench", key=point_key, settings=settings_of(sweeps),
            mode=mode, validate=results_io.validate,
            header=lambda previous: (new_header if previous is None
                                     else results_io.resumed_header(previous, new_header)))
    except StoreError as error:
        raise click.UsageError(str(error)) from None


def _check_executor(executor: str, scheduler: str | None, dashboard: bool = False) -> None:
    if scheduler and executor != "dask":
        raise click.UsageError("--scheduler needs --executor dask")
    if dashboard and (executor != "dask" or scheduler):
        raise click.UsageError("--dashboard is the dashboard of the local Dask cluster: it "
                               "needs --executor dask without --scheduler"
                               + (f" (the scheduler {scheduler} serves its own, if any)"
                                  if scheduler else ""))
    if executor == "dask":
        from hla_bench.dask_executor import executor_problem

        problem = executor_problem(scheduler)
        if problem:
            raise click.UsageError(problem)


def execute(config: dict[str, Any], sweeps: list[SweepConfig], out: str | None, output_format: str,
            baseline: str | None, resume: bool = False, overwrite: bool = False,
            executor: str = "local", scheduler: str | None = None,
            isolate: bool | None = False, dashboard: bool = False) -> dict[str, Any]:
    """Check everything, run the sweeps with a progress bar, keeping the results file
    current after every point; print tables or data. `isolate` None: isolated when a CPU
    point is big enough to need the memory watchdog (`hla_bench.speed.isolate`)."""
    from hla_bench.speed.runner import run_points

    _check_executor(executor, scheduler, dashboard)
    mode = _mode(out, resume, overwrite)
    _check(sweeps)
    points = plan(sweeps)
    errors = Console(stderr=True)
    if isolate is None:
        isolate = False
        if executor == "local":
            from hla_bench.speed.isolate import watch_threshold_bytes, watched_points

            watched = watched_points(points)
            if watched:
                isolate = True
                errors.print(f"{len(watched)} CPU point(s), the first {watched[0].describe()}, "
                             f"hold {watch_threshold_bytes() / 2**30:.2f} GiB or more (a "
                             "sixteenth of the memory here): each mixer is measured in a "
                             "process of its own, a kill for memory recorded oom (--isolate; "
                             "--no-isolate measures in this process)",
                             highlight=False, soft_wrap=True)
    started = time.perf_counter()
    devices = sorted({s.resolved_device() for s in sweeps})
    environment = results_io.capture_environment(",".join(devices))
    if isolate or executor == "dask":
        environment["timing_method"] += ("; each mixer in a process of its own (not "
                                         "interleaved with the others)")
    store = open_store(out, mode, sweeps, config, environment)
    path = store.path
    with store, exit_on_interrupt(store, "point", lambda text: errors.print(
            f"[yellow]{escape(text)}[/]", soft_wrap=True)):
        if store.kept:
            errors.print(f"resuming {path}: {store.kept} point(s) kept", highlight=False)

        def on_measured(record: dict[str, Any]) -> None:
            """Keep the file current (a killed sweep leaves its finished points); without
            a terminal the progress bar is silent, so log one line per point instead."""
            store.update_header({"environment": {
                **environment, "wall_s": round(time.perf_counter() - started, 2)}}, write=False)
            try:
                store.add(record)
            except OSError as error:
                raise click.ClickException(f"cannot write {path}: {error}")
            if not errors.is_terminal:
                r = record
                time_ms = f"{r['median_ms']:.3f} ms" if r.get("median_ms") is not None else ""
                errors.print(f"[{len(store)}] {r['sweep']} {r['mixer']} {r['mode']} "
                             f"T={r['seq_len']} {r['status']} {time_ms} {r.get('reason') or ''}",
                             markup=False, highlight=False, soft_wrap=True)

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=errors, transient=True) as progress:
            task = progress.add_task("sweep", total=None)

            def on_point(index: int, total: int, point) -> None:
                progress.update(task, completed=index, total=total, description=escape(point.describe()))

            if executor == "dask":
                from hla_bench.speed.isolate import run_points_dask

                def on_connected(client) -> None:
                    if dashboard:
                        errors.print(f"dask dashboard: {client.dashboard_link}",
                                     highlight=False)

                planned = run_points_dask(points, scheduler, previous=store.records(),
                                          on_measured=on_measured, dashboard=dashboard,
                                          on_connected=on_connected)
            elif isolate:
                from hla_bench.speed.isolate import run_points_isolated

                planned = run_points_isolated(points, previous=store.records(),
                                              on_measured=on_measured, on_point=on_point)
            else:
                planned = run_points(points, on_point, previous=store.records(),
                                     on_measured=on_measured)
            progress.update(task, completed=len(planned))
        store.update_header({"environment": {
            **environment, "wall_s": round(time.perf_counter() - started, 2)}}, write=False)
        try:
            data = store.close(complete=True)
        except OSError as error:
            raise click.ClickException(f"cannot write {path}: {error}")
    if output_format == "json":
        click.echo(json.dumps(data, indent=2, default=str))
    elif output_format == "yaml":
        click.echo(yaml.safe_dump(data, sort_keys=False))
    else:
        console = Console()
        render_bench(data, console, ("time", "memory"), baseline)
        kept = f" ({store.kept} kept from before)" if store.kept else ""
        console.print(f"{len(planned)} points in {data['environment']['wall_s']:.1f} s{kept}; "
                      f"results written to {path}")
    if output_format != "table":
        errors.print(f"results written to {path}")
    return data


def _output_format(as_json: bool, as_yaml: bool) -> str:
    if as_json and as_yaml:
        raise click.UsageError("give --json or --yaml, not both")
    return "json" if as_json else "yaml" if as_yaml else "table"


def _setting_option(each) -> Callable:
    """The click option of one sweep setting (see `hla_bench.speed.sweeps`): its type from
    the setting's kind, its default and help from the setting itself. List kinds are taken
    as comma-separated text and parsed by the config, so one parser serves both."""
    kind, default = each.metadata["kind"], default_text(each)
    flag = option_flag(each)
    types = {"count": click.IntRange(min=1, max=MAX_COUNT),
             "count0": click.IntRange(min=0, max=MAX_COUNT),
             "seconds": click.FloatRange(min=0, max=MAX_SECONDS, min_open=True)}
    if kind == "flag":
        return click.option(flag, is_flag=True, default=each.default, help=each.metadata["help"])
    return click.option(flag, type=types.get(kind, str), required=is_required(each),
                        default=default, show_default=default is not None,
                        help=each.metadata["help"])


def _setting_named(name: str):
    return next(each for each in setting_fields() if each.name == name)


output_options = [
    click.option("--out", type=click.Path(dir_okay=False),
                 help="Results file (default runs/bench-<UTC time>-<pid>-<random>.yaml). An "
                      "existing file needs --resume or --overwrite."),
    click.option("--json", "as_json", is_flag=True, help="Print the results as JSON, not tables."),
    click.option("--yaml", "as_yaml", is_flag=True, help="Print the results as YAML, not tables."),
    _setting_option(_setting_named("baseline")),  # the tables' baseline, for `run` too
    click.option("--resume", is_flag=True,
                 help="Continue the --out file: keep every point it holds, measure only the "
                      "missing ones (its settings must match)."),
    click.option("--overwrite", is_flag=True,
                 help="Replace the --out file (only a bench results file is replaced)."),
    click.option("--executor", type=click.Choice(["local", "dask"]), default="local",
                 show_default=True, help="local: this process; dask: one task per (sweep, "
                 "mixer) on a Dask cluster, each in a fresh process on its worker (a local "
                 "cluster, one worker per GPU or CPU slot, without --scheduler)."),
    click.option("--scheduler", metavar="ADDRESS",
                 help="An existing Dask scheduler (tcp://host:8786) for --executor dask."),
    click.option("--dashboard", is_flag=True,
                 help="Serve the local Dask cluster's dashboard, on 127.0.0.1 only (default: "
                      "none; the cluster listens on 127.0.0.1 only either way)."),
    click.option("--isolate/--no-isolate", default=None,
                 help="Measure each mixer of a sweep in a process of its own, so a fault "
                      "that kills or poisons a process (an illegal memory access) costs only "
                      "that mixer's remaining points, recorded as errors, and a kill for "
                      "memory only its point, recorded oom. Its mixers are then not sampled "
                      "in interleaved rounds. Default: on when a CPU point's inputs take a "
                      "sixteenth of the host's memory. (--executor dask always isolates.)"),
]


def with_output_options(command):
    for option in reversed(output_options):
        command = option(command)
    return command


def with_setting_options(command: Callable) -> Callable:
    """Every sweep setting the command line takes, as options, in declaration order."""
    return with_field_options(setting_fields(), _setting_option)(command)


@click.command()
@with_setting_options
@with_output_options
def bench(out: str | None, as_json: bool, as_yaml: bool, baseline: str | None,
          resume: bool, overwrite: bool, executor: str, scheduler: str | None, dashboard: bool,
          isolate: bool | None, **settings: Any) -> None:
    """Time mixers over sequence lengths and modes (fwd, fwdbwd, decode)."""
    output_format = _output_format(as_json, as_yaml)
    try:
        settings.update(name="bench", baseline=baseline,
                        mixers=[spec.to_dict() for spec in parse_mixer_specs(settings["mixers"])],
                        seq_lens=parse_seq_lens(settings["seq_lens"]),
                        modes=parse_modes(settings["modes"]))
        config = {each.name: settings[each.name] for each in setting_fields()}
        sweep = SweepConfig.from_dict(config)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    context = click.get_current_context()
    if not {"decode", "prefill"} & set(sweep.modes):
        for name in ("decode_batch", "decode_steps", "decode_graph"):
            if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.UsageError(f"--{name.replace('_', '-')} applies to decode and "
                                       f"prefill points; --modes is {','.join(sweep.modes)}")
    execute(config, [sweep], out, output_format, baseline, resume, overwrite, executor, scheduler,
            isolate, dashboard)


@click.command()
@click.argument("config_text", metavar="[CONFIG]", required=False)
@click.option("--sweep", "only", multiple=True, metavar="NAME",
              help="Run only this sweep of the config (repeatable; default: all).")
@with_output_options
def run(config_text: str | None, only: tuple[str, ...], out: str | None, as_json: bool,
        as_yaml: bool, baseline: str | None, resume: bool, overwrite: bool, executor: str,
        scheduler: str | None, dashboard: bool, isolate: bool | None) -> None:
    """Run the sweeps of a config file (default: the shipped cpu-smoke).

    CONFIG is a YAML file, or the name of a config shipped with hla-bench in
    configs/ (cpu-smoke, cpu-short-forms, gpu-mixers, gpu-kernels, gpu-decode,
    gpu-family), for example:

    \b
        hla-bench run gpu-kernels --sweep d64
    """
    output_format = _output_format(as_json, as_yaml)
    try:
        if config_text is not None and not config_text.strip():
            raise ValueError("CONFIG is empty: give a file or a shipped config's name, or "
                             "nothing for the default")
        path = configs.find(config_text) if config_text else configs.shipped(configs.DEFAULT)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    try:
        config, sweeps = load_config(path)
    except ValueError as error:
        if looks_like_recall(path):
            raise click.UsageError(f"{config_text} is a recall config: run it with "
                                   f"`hla-bench recall --config {config_text}`") from None
        raise click.UsageError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise click.UsageError(f"{path}: not valid YAML: {configs.yaml_problem(error)}") from None
    except OSError as error:
        raise click.UsageError(f"cannot read {path}: {error}") from None
    names = [s.name for s in sweeps]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise click.UsageError(f"--sweep {unknown[0]!r} is not a sweep of {path.name} "
                               f"({', '.join(names)})")
    if only:
        sweeps = [s for s in sweeps if s.name in only]
    labels = {spec.label for sweep in sweeps for spec in sweep.mixers}
    if baseline is not None and baseline not in labels:
        raise click.UsageError(f"--baseline {baseline!r} is not a mixer label of {path.name} "
                               f"({', '.join(sorted(labels))})")
    total = sum(len(s.mixers) * len(s.modes) * len(s.seq_lens) for s in sweeps)
    Console(stderr=True).print(f"{path.name}: {len(sweeps)} sweep(s), {total} points")
    execute(config, sweeps, out, output_format, baseline, resume, overwrite, executor, scheduler,
            isolate, dashboard)


commands = [list_, bench, run]
