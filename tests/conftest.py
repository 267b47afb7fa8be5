"""Run Triton kernels in the interpreter when no CUDA device is present, and keep the default
run to the fast suite.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at the
first point pytest loads project code; on a GPU machine the kernels run natively.

Fast and slow tests
-------------------
`python -m pytest -q -n 2` (README's command) runs the fast suite: every test marked `slow`
is deselected. `-m slow` runs only the slow tests, `--full` runs both; any other `-m`
expression selects as written (`-m "cuda and not slow"`). `.ci/run` runs the fast suite and
then the slow one, so CI runs every test.

A test is slow when one case takes more than about a second on one CPU core: most Triton
forms under the interpreter, torch.compile, trainings of many steps. Mark it slow and keep a
fast representative of the behaviour it holds in the default run:

- a whole test: `@pytest.mark.slow` (its behaviour then has a fast test elsewhere in the
  module, a smaller shape or one form of the same rule);
- a parametrized grid: `@parametrize("a, b", CASES, fast=[0])` from tests/grids.py in
  place of `@pytest.mark.parametrize("a, b", CASES)`: the cases at the `fast` indices (or
  those for which a `fast` predicate holds) run by default, the others carry the slow mark.
  The test ids stay those of the full grid, so the fast and the slow runs together collect
  exactly the tests of `--full`.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hla_bench.registry import all_mixers  # noqa: E402 - after TRITON_INTERPRET is set

# The mixers of the project and its installed plugins, listed before any test module is
# imported: some register fixture mixers of their own at import (tests/test_recall.py's
# "test-*"), which tests over every registered mixer must not pick up, whatever the order
# in which pytest imports the modules.
PROJECT_MIXERS = tuple(m.name for m in all_mixers())


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the slow tests too (by default they are deselected)")


def split_slow(items, full, markexpr):
    """(kept, deselected) of the collected `items`: all kept with --full or an explicit -m
    expression (which then selects), else the tests marked slow are deselected."""
    if full or markexpr:
        return list(items), []
    kept, slow = [], []
    for item in items:
        (slow if item.get_closest_marker("slow") else kept).append(item)
    return kept, slow


def pytest_collection_modifyitems(config, items):
    kept, slow = split_slow(items, config.getoption("--full"), config.option.markexpr)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = kept
