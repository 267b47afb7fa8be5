"""What the hla3 Triton forms support and how the decode step launches (a frozen plan; the
chunked op's plan is mixers/hla/chain/plan.py).

The chunked op takes ahla2's rule (the same dtypes, any head dim up to 256 by power-of-two
blocks with masked loads). The decode step's programs each carry the d x d moment S^K, so
it takes key dims up to 128: at 256 (256 KiB in float32) S^K exceeds an SM's shared memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.hla.ahla2.triton import plan as ahla2_plan
from mixers.hla.ahla2.triton.plan import block

__all__ = ["HLA3Plan", "plan_launch", "unsupported_reason", "step_unsupported_reason"]

MAX_STEP_KEY_DIM = 128


@dataclass(frozen=True)
class HLA3Plan:
    """One decode step's launch: the padded key dim, the value columns each program carries
    (the d x d moment S^K is carried whole by every program) and warps."""

    block_d: int
    block_v: int
    warps: int


def plan_launch(D: int, packed_width: int, dtype: torch.dtype) -> HLA3Plan:
    """Value blocks of 64, 32 or 16 columns and 4 or 8 warps as the key dim grows (a
    program carries S^K, d x d, beside P and F)."""
    block_d = block(D)
    block_v = min(block(packed_width), 64 if block_d <= 16 else 32 if block_d <= 32 else 16)
    return HLA3Plan(block_d=block_d, block_v=block_v, warps=4 if block_d <= 32 else 8)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the chunked op cannot run these inputs, or None."""
    return ahla2_plan.unsupported_reason(q, k, v)


def step_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the decode step cannot run these inputs, or None."""
    reason = ahla2_plan.unsupported_reason(q, k, v)
    if reason is None and q.shape[-1] > MAX_STEP_KEY_DIM:
        return (f"key head dim D={q.shape[-1]} above {MAX_STEP_KEY_DIM} (the d x d moment S^K "
                "of a decode program would not fit an SM)")
    return reason
