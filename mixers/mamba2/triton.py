"""mamba_ssm's Triton SSD kernel, loaded without `mamba_ssm/__init__.py`.

`import mamba_ssm` imports its compiled CUDA extension (selective scan) and fails where that
extension is missing or built for another torch, although the SSD kernels are pure Triton.
So we register bare package modules for `mamba_ssm`, `mamba_ssm.ops` and
`mamba_ssm.ops.triton` that point at the installed directories, then import
`mamba_ssm.ops.triton.ssd_combined` normally. (`importlib.util.find_spec` of a top-level
name only locates it; it does not run its `__init__`.)
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types

_PACKAGES = ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton")


def _register_bare_packages() -> None:
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mamba-ssm is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name in _PACKAGES:
        if name in sys.modules:
            continue
        path = os.path.join(root, *name.split(".")[1:])
        module = types.ModuleType(name)
        module.__path__ = [path]
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__spec__.submodule_search_locations = [path]
        sys.modules[name] = module


def load_chunk_scan():
    """`mamba_chunk_scan_combined` from the installed mamba_ssm (ImportError if absent)."""
    _register_bare_packages()
    return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined


def ssd_triton(x, dt, A, B, C, *, D=None, chunk_size=64, initial_state=None):
    """Same contract as `ssd_chunk` (state `[b, h, N, P]`), on mamba_ssm's Triton kernel."""
    chunk_scan = load_chunk_scan()
    if initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).contiguous()   # mamba: [b, h, P, N]
    y, final = chunk_scan(x, dt.contiguous(), A, B, C, chunk_size=chunk_size, D=D,
                          initial_states=initial_state, return_final_states=True)
    return y, final.transpose(-1, -2)
