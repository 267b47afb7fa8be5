"""The `hla-bench` command line: one click group whose subcommands load on first use.

COMMANDS names each subcommand, the module whose `commands` list defines it, and the
summary `hla-bench --help` lists. A module is imported only when one of its commands runs
or shows its own help, so `hla-bench --help` imports neither torch nor the mixers. Each
summary is the start of its command's own help (tests/test_cli.py checks it, and that
every command of those modules is listed here).
"""

from __future__ import annotations

import importlib

import click

from hla_bench import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("hla_bench.bench", "Time mixers over sequence lengths and modes (fwd, fwdbwd, "
                                 "decode)."),
    "list": ("hla_bench.bench", "List the registered mixers and whether they run on this "
                                "machine."),
    "run": ("hla_bench.bench", "Run the sweeps of a config file (default: the shipped "
                               "cpu-smoke)."),
    "report": ("hla_bench.report", "Re-render results FILE(s): tables, comparisons (--compare) "
                                   "and plots (--plots)."),
    "verify": ("hla_bench.verify", "Check every HLA form against the explicit float64 sums."),
    "recall": ("hla_bench.recall.command", "Train tiny LMs per mixer on synthetic recall tasks."),
    "tasks": ("hla_bench.task_commands", "The synthetic tasks: list them, show an example."),
}


def load_command(name: str) -> click.Command:
    """The command `name` of COMMANDS, from its module's `commands` list."""
    module = importlib.import_module(COMMANDS[name][0])
    for command in module.commands:
        if command.name == name:
            return command
    raise LookupError(f"{COMMANDS[name][0]} defines no command {name!r}")


class LazyGroup(click.Group):
    """A group that lists COMMANDS from their summaries and imports one only when used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands or name not in COMMANDS:
            return super().get_command(ctx, name)
        return load_command(name)

    def invoke(self, ctx: click.Context):
        """Ctrl-C ends any command with status 130, as shells report SIGINT (click's own
        handling says "Aborted!" and exits 1); commands that write results say first what
        their file kept (`hla_bench.results.store.exit_on_interrupt`)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1] if name in COMMANDS and name not in self.commands
                 else self.commands[name].get_short_help_str(formatter.width))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hla-bench")
def main() -> None:
    """Benchmark Higher-order Linear Attention beside softmax attention, linear attention and Mamba.

    Speed (throughput, memory, decode) and recall (synthetic tasks), on the same mixers.
    """
