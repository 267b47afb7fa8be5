"""README.md holds what users run: set-up commands as CI runs them, an operator example that
runs, links that resolve, and results sections that are the output of their commands."""

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from hla_bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language):
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_readme_is_short():
    assert len(README.splitlines()) <= 180


def test_setup_commands_are_the_ones_ci_runs():
    install, tests = _blocks("bash")[0].strip().splitlines()
    ci = [" ".join(line.replace("pip install -q", "pip install").split()) for line in
          (ROOT / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert install == 'pip install -e ".[test]" && hla-bench run'
    assert ci.index('pip install -e ".[test]"') + 1 == ci.index("hla-bench run")
    assert tests in ci


def test_ci_runs_the_slow_tests_after_the_fast_suite_and_readme_says_how_to_run_all():
    """README's test command is the fast suite (tests/conftest.py deselects the tests marked
    slow); .ci/run runs the slow ones after it, so CI runs every test."""
    tests = _blocks("bash")[0].strip().splitlines()[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci.index(tests + " -m slow") > ci.index(tests)
    assert f"`{tests} --full`" in README


def test_the_operator_example_runs():
    example = next(block for block in _blocks("python") if "from mixers.hla import" in block)
    exec(compile(example, "README.md", "exec"), {})


def test_local_links_resolve():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links and [link for link in links if not (ROOT / link).exists()] == []


@pytest.mark.slow
def test_results_sections_are_the_output_of_their_commands():
    sections = re.findall(r"```bash\n((?:hla-bench report [^\n]*\n)+)```\n\n<!-- output -->\n"
                          r"(.*?)<!-- end of output -->", README, re.S)
    assert sections
    for commands, shown in sections:
        output = ""
        for command in commands.splitlines():
            result = CliRunner().invoke(main, shlex.split(command)[1:])
            assert result.exit_code == 0, result.output
            output += result.output
        assert shown == output, f"rerun: {commands}"
