"""How an hla3 Triton call launches its kernels (a frozen plan). What the kernels support is
ahla2's rule (mixers/hla/ahla2/triton/plan.py): the same dtypes and head dims up to 256, by
power-of-two blocks with masked loads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.hla.ahla2.triton.plan import block, unsupported_reason

__all__ = ["HLA3Plan", "plan_launch", "unsupported_reason"]


@dataclass(frozen=True)
class HLA3Plan:
    """Tokens per chunk, the padded key dim, the value columns each program carries (the
    d x d moment S^K is carried whole by every program), warps."""

    chunk: int
    block_d: int
    block_v: int
    warps: int


def plan_launch(D: int, packed_width: int, dtype: torch.dtype) -> HLA3Plan:
    """Chunk 64 (32 at head dim 128, 16 above it or in float64); value blocks of 64, 32 or
    16 columns as the key dim grows (a program carries S^K, d x d, beside P and F)."""
    block_d = block(D)
    chunk = 64 if block_d <= 64 else 32 if block_d <= 128 else 16
    if dtype == torch.float64:
        chunk = 16
    block_v = min(block(packed_width), 64 if block_d <= 32 else 32 if block_d <= 64 else 16)
    return HLA3Plan(chunk=chunk, block_d=block_d, block_v=block_v,
                    warps=4 if block_d <= 64 else 8)
