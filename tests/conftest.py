"""Run Triton kernels in the interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at the
first point pytest loads project code; on a GPU machine the kernels run natively.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
