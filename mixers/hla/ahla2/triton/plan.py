"""What the ahla2 Triton forms support, and how the decode step launches (a frozen plan;
the chunked op's plan is mixers/chain/plan.py).

Block sizes are powers of two of at least 16 (tl.dot's smallest); a head dim that is not
one is padded inside the kernels by masked loads and stores, never by copying the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.chain.plan import MAX_HEAD_DIM, device_reason

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def block(size: int) -> int:
    """The smallest power of two >= size and >= 16."""
    return max(16, 1 << (size - 1).bit_length())


@dataclass(frozen=True)
class AHLA2Plan:
    """One decode step's launch: the padded key dim, the value columns each program
    carries (the packed width, value dim plus the ones column of the denominator, is split
    over programs: each column's states are independent) and warps."""

    block_d: int
    block_v: int
    warps: int


def plan_launch(D: int, packed_width: int, dtype: torch.dtype) -> AHLA2Plan:
    """Value blocks of 64, 32 or 16 columns and 4 or 8 warps as the key dim grows, so that
    the two d x block_v states a program carries fit its registers."""
    block_d = block(D)
    block_v = min(block(packed_width), 64 if block_d <= 32 else 32 if block_d <= 128 else 16)
    return AHLA2Plan(block_d=block_d, block_v=block_v, warps=4 if block_d <= 32 else 8)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot run these inputs, or None."""
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (supported: {', '.join(str(d) for d in DTYPES)})"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k and v of different dtypes"
    D, Dv = q.shape[-1], v.shape[-1]
    if D > MAX_HEAD_DIM or Dv > MAX_HEAD_DIM:
        return f"head dims D={D}, Dv={Dv} above {MAX_HEAD_DIM}"
    return device_reason(q)
