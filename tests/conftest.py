"""Run Triton kernels in the interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at the
first point pytest loads project code; on a GPU machine the kernels run natively.
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
