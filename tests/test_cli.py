"""The command group: every command listed, summaries true to the commands, a light --help."""

import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from hla_bench import cli

ROOT = Path(__file__).resolve().parents[1]


def test_every_command_is_listed_with_the_start_of_its_own_help():
    modules = {module for module, _ in cli.COMMANDS.values()}
    defined = {command.name: module for module in modules
               for command in __import__(module, fromlist=["commands"]).commands}
    assert defined == {name: module for name, (module, _) in cli.COMMANDS.items()}
    for name, (_, summary) in cli.COMMANDS.items():
        command = cli.load_command(name)
        own = " ".join((command.help or "").split())
        assert own.startswith(summary.removesuffix(".")), (name, summary, own)


def test_help_lists_every_command_whole_at_80_columns():
    result = CliRunner(env={"COLUMNS": "80"}).invoke(cli.main, ["--help"])
    assert result.exit_code == 0, result.output
    listed = [line.split()[0] for line in result.output.split("Commands:")[1].splitlines()
              if line.startswith("  ") and not line.startswith("    ")]
    assert listed == sorted(cli.COMMANDS)


def test_a_command_added_to_the_group_is_listed_and_runs():
    group = cli.LazyGroup(name="g")

    @group.command("extra")
    def extra():
        """An extra command."""
        click.echo("ran")

    runner = CliRunner()
    assert "extra   An extra command." in runner.invoke(group, ["--help"]).output
    assert runner.invoke(group, ["extra"]).output == "ran\n"
    assert runner.invoke(group, ["nope"]).exit_code == 2



def test_ctrl_c_in_any_command_exits_130():
    group = cli.LazyGroup(name="g")

    @group.command("slow")
    def slow():
        """A command the user stops."""
        raise KeyboardInterrupt

    result = CliRunner().invoke(group, ["slow"])
    assert result.exit_code == 130 and "interrupted" in result.output

def test_top_level_help_imports_neither_torch_nor_the_mixers():
    code = ("import sys; from hla_bench.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'matplotlib', 'mixers', 'tasks', 'numpy')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
