"""What the hla3 Triton kernels support and how a call launches them (a frozen plan).

The rule is ahla2's (mixers/hla/ahla2/triton/plan.py: the same dtypes, any head dim by
power-of-two blocks with masked loads) with the key dim at most 128: every program carries
the d x d moment S^K, which at 256 (256 KiB in float32) exceeds an SM's shared memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.hla.ahla2.triton import plan as ahla2_plan
from mixers.hla.ahla2.triton.plan import block

__all__ = ["HLA3Plan", "plan_launch", "unsupported_reason"]


@dataclass(frozen=True)
class HLA3Plan:
    """Tokens per chunk, the padded key dim, the value columns each program carries (the
    d x d moment S^K is carried whole by every program), warps, and whether the forward
    walks the chunks in one kernel (`walk`) or runs three chunk-parallel stages (their scan
    reads three d x d matrices per chunk beside S^K: up to a padded key dim of
    MAX_STAGED_KEY_DIM)."""

    chunk: int
    block_d: int
    block_v: int
    warps: int
    walk: bool = False


def plan_launch(D: int, packed_width: int, dtype: torch.dtype) -> HLA3Plan:
    """Chunk 64, 32 at key dim 64, 16 at 128 or in float64; value blocks of 64, 32 or 16
    columns and 4 or 8 warps as the key dim grows (a program carries S^K, d x d, beside P and
    F), so that a program fits an sm_90a SM (benchmarks/family_resources.py)."""
    block_d = block(D)
    chunk = 64 if block_d <= 32 else 32 if block_d <= 64 else 16
    if dtype == torch.float64:
        chunk = 16
    block_v = min(block(packed_width), 64 if block_d <= 16 else 32 if block_d <= 32 else 16)
    return HLA3Plan(chunk=chunk, block_d=block_d, block_v=block_v,
                    warps=4 if block_d <= 32 else 8, walk=block_d > MAX_STAGED_KEY_DIM)


MAX_KEY_DIM = 128
MAX_STAGED_KEY_DIM = 64


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot run these inputs, or None."""
    reason = ahla2_plan.unsupported_reason(q, k, v)
    if reason is None and q.shape[-1] > MAX_KEY_DIM:
        return (f"key head dim D={q.shape[-1]} above {MAX_KEY_DIM} (the d x d moment S^K of a "
                "program would not fit an SM)")
    return reason
