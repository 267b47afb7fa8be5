"""The `hla-bench` command line: one click group, subcommands from the harness modules."""

import importlib

import click

from hla_bench import __version__

# Each module exports `commands`, a list of click commands added to the group.
COMMAND_MODULES = ("hla_bench.verify", "hla_bench.bench", "hla_bench.report", "hla_bench.recall")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hla-bench")
def main() -> None:
    """Benchmark Higher-order Linear Attention beside softmax attention, linear attention and Mamba.

    Speed (throughput, memory, decode) and recall (synthetic tasks), on the same mixers.
    """


for _module_name in COMMAND_MODULES:
    for _command in importlib.import_module(_module_name).commands:
        main.add_command(_command)
