"""`hla-bench tasks`: the synthetic recall tasks, listed with their defaults, and one example
decoded with each token colored by its role."""

from __future__ import annotations

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

import tasks
from hla_bench.options import parse_params
from hla_bench.results.tables import print_table

ROLE_STYLES = {"key": "bold cyan", "value": "bold green", "query": "bold magenta",
               "filler": "dim", "noise": "yellow", "special": "bold red"}


@click.group("tasks")
def tasks_group():
    """The synthetic tasks: list them, show an example."""


def _task_defaults(task) -> list[str]:
    return [f"{key}={value}" for key, value in task.params.items()]


def task_table(all_tasks: list) -> Table:
    """The tasks as a table: names and `parameter=default` items whole (one item a line),
    descriptions and sources wrapped between words."""
    table = Table(title="synthetic tasks")
    for column in ("name", "description", "defaults", "train/test", "source"):
        table.add_column(column, no_wrap=column in ("name", "train/test"))
    for task in all_tasks:
        table.add_row(escape(task.name), escape(task.description),
                      escape("\n".join(_task_defaults(task))),
                      f"{task.num_train}/{task.num_test}", escape(task.source))
    return table


def task_lines(all_tasks: list) -> list[str | list[str]]:
    """The tasks as plain lines, for a console too narrow for the table: per task its name
    and description, its defaults (each item whole) and its source."""
    lines: list[str | list[str]] = ["synthetic tasks"]
    for task in all_tasks:
        lines += [f"{task.name}: {task.description} (train/test {task.num_train}/"
                  f"{task.num_test})",
                  ["  defaults:", *_task_defaults(task)], f"  source: {task.source}"]
    return lines


@tasks_group.command("list")
def list_tasks():
    """Every registered task with its default parameters."""
    every = tasks.all_tasks()
    print_table(Console(), task_table(every), lambda: task_lines(every))


@tasks_group.command("show")
@click.argument("name")
@click.option("--seq-len", type=int)
@click.option("--num-kv-pairs", type=int)
@click.option("--vocab-size", type=int)
@click.option("--param", "extra_params", multiple=True, callback=parse_params,
              help="Any other task parameter, KEY=VALUE (repeatable).")
@click.option("--split", type=click.Choice(["train", "test"]), default="test", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--index", type=click.IntRange(0, 99_999), default=0, show_default=True,
              help="Which example to show.")
def show_task(name, seq_len, num_kv_pairs, vocab_size, extra_params, split, seed, index):
    """Decode one example: tokens colored by role, each scored label after its position."""
    try:
        task = tasks.get(name)
        params = {key: value for key, value in (("seq_len", seq_len), ("num_kv_pairs", num_kv_pairs),
                                                ("vocab_size", vocab_size)) if value is not None}
        params = task.resolve_params({**params, **extra_params})
        inputs, labels = task.make(split, index + 1, seed, **params)
    except ValueError as error:
        raise click.UsageError(str(error))
    inputs, labels = inputs[index], labels[index]
    roles = task.roles(inputs, labels, **params)
    console = Console()
    console.print(f"[bold]{task.name}[/] ({split}, seed {seed}, example {index}): "
                  + ", ".join(f"{key}={value}" for key, value in params.items()))
    text = Text()
    for position, (token, label, role) in enumerate(zip(inputs.tolist(), labels.tolist(), roles)):
        text.append(str(token), style=ROLE_STYLES[role])
        if label != tasks.IGNORE:
            text.append(f"→{label}", style="bold underline")
        text.append(" ")
    console.print(text)
    legend = Text("roles: ")
    for role, style in ROLE_STYLES.items():
        legend.append(role, style=style).append("  ")
    console.print(legend)
    scored = int((labels != tasks.IGNORE).sum())
    console.print(f"{scored} labelled positions of {len(labels)} (tok→label: the target there)")


commands = [tasks_group]
