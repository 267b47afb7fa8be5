"""What the hla3 Triton forms support and how the decode step launches (a frozen plan; the
chunked op's plan is mixers/chain/plan.py).

Both forms take ahla2's rule: the same dtypes, and head dims up to 512 by power-of-two blocks
with masked loads. The decode step's programs walk the key dim in blocks of rows and columns
(mixers/hla/hla3/triton/decode.py), so no tile grows with the head dim."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.hla.ahla2.triton import plan as ahla2_plan
from mixers.hla.ahla2.triton.plan import block

__all__ = ["HLA3Plan", "plan_launch", "unsupported_reason", "step_unsupported_reason"]


@dataclass(frozen=True)
class HLA3Plan:
    """One decode step's launch: the rows (and columns of S^K) a program takes at a time,
    the value columns it carries (the packed width is split over programs: each column's
    P and F are independent, while every program reads all of S^K) and warps."""

    block_rows: int
    block_v: int
    warps: int


def plan_launch(D: int, packed_width: int, dtype: torch.dtype) -> HLA3Plan:
    """Up to 128 value columns a program (each reads all of S^K, so fewer programs read it
    fewer times) and as many rows as keep a tile of P or F within 4,096 values (64 rows at
    most); 4 warps up to 32 rows of 32 columns, else 8."""
    block_v = min(block(packed_width), 128)
    block_rows = min(block(D), 64, max(16, 4096 // block_v))
    return HLA3Plan(block_rows=block_rows, block_v=block_v,
                    warps=4 if block_rows * block_v <= 1024 else 8)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the chunked op cannot run these inputs, or None."""
    return ahla2_plan.unsupported_reason(q, k, v)


def step_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the decode step cannot run these inputs, or None (the chunked op's rule)."""
    return ahla2_plan.unsupported_reason(q, k, v)
