"""What the ahla2 Triton kernels support, and how a call launches them (a frozen plan).

Block sizes are powers of two of at least 16 (tl.dot's smallest); a head dim that is not
one is padded inside the kernels by masked loads and stores, never by copying the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
MAX_STAGED_HEAD_DIM = 128


def block(size: int) -> int:
    """The smallest power of two >= size and >= 16."""
    return max(16, 1 << (size - 1).bit_length())


@dataclass(frozen=True)
class AHLA2Plan:
    """One ahla2_triton call's launch: tokens per chunk, the padded key dim, the value
    columns each program carries (the packed width, value dim plus the ones column of the
    denominator, is split over programs: each column's states are independent), warps, and
    whether the forward walks the chunks in one kernel (`walk`) or runs three chunk-parallel
    stages (increments, scan, output: its scan multiplies a d x d matrix per chunk, which a
    program holds up to a padded key dim of MAX_STAGED_HEAD_DIM)."""

    chunk: int
    block_d: int
    block_v: int
    warps: int
    walk: bool = False


def plan_launch(D: int, packed_width: int, dtype: torch.dtype) -> AHLA2Plan:
    """The default plan: chunk 64 (32 at head dim 128, 16 above it or in float64), value
    blocks of 64, 32 or 16 columns and 4 or 8 warps as the key dim grows, so that the two
    d x block_v states a program carries fit its registers (checked for sm_90a by
    benchmarks/family_resources.py)."""
    block_d = block(D)
    chunk = 64 if block_d <= 64 else 32 if block_d <= 128 else 16
    if dtype == torch.float64:
        chunk = 16
    block_v = min(block(packed_width), 64 if block_d <= 32 else 32 if block_d <= 128 else 16)
    return AHLA2Plan(chunk=chunk, block_d=block_d, block_v=block_v,
                     warps=4 if block_d <= 32 else 8, walk=block_d > MAX_STAGED_HEAD_DIM)


def at_requested_chunk(plan, chunk_size: int):
    """`plan` (an AHLA2Plan or HLA3Plan) at the chunk a call asked for, where that is a
    power of two in [16, 128] below the plan's own (the result does not depend on it, up to
    rounding; a larger chunk than the plan's would not fit its programs)."""
    if chunk_size in (16, 32, 64, 128) and chunk_size < plan.chunk:
        return replace(plan, chunk=chunk_size)
    return plan


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot run these inputs, or None."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (supported: {', '.join(str(d) for d in DTYPES)})"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k and v of different dtypes"
    D, Dv = q.shape[-1], v.shape[-1]
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        return f"head dims D={D}, Dv={Dv} above {MAX_HEAD_DIM}"
    if q.device.type != "cuda" and not _interpreted():
        return "the tensors are not on a CUDA device"
    return None


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
