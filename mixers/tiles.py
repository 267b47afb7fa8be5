"""Tiles the family's Triton kernels share (mixers/hla/hla2/triton, mixers/chain and the
ahla2 and hla3 decode steps): a decode program's block of value columns, the masked loads of
token rows, the offsets of packed `[B, T, H, W]` rows, the non-finite rule's reads and
poisons (mixers/common.py), and the add into a shared gradient buffer."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETED: tl.constexpr = tl.constexpr(interpreted())


@triton.jit
def value_block(H, D, DVP, BD: tl.constexpr, BV: tl.constexpr):
    """(value block, b, h, b x H + h, key index, value columns, key index < D, offsets of
    this program's columns of a `[B, H, D, DVP]` state, their mask)."""
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    dk = tl.arange(0, BD)
    cols = pid_v * BV + tl.arange(0, BV)
    d_ok = dk < D
    state = bh * D * DVP + dk[:, None] * DVP + cols[None, :]
    state_ok = d_ok[:, None] & (cols < DVP)[None, :]
    return pid_v, bh // H, bh % H, bh, dk, cols, d_ok, state, state_ok


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32 (float64 for float64 tiles). PRECISION is tl.dot's
    input_precision ("ieee", "tf32"), or "bf16": both operands are rounded to bfloat16 first,
    which runs the tensor cores at twice TF32's rate and reads half the registers, at
    bfloat16's rounding of every operand (states and chained intermediates included). Under
    the interpreter the rounded operands are multiplied in float32: Triton 3.6's interpreter
    returns wrong values for a dot of bfloat16 tiles."""
    if PRECISION == "bf16":
        if INTERPRETED:
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                          input_precision="ieee")
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_rows(X, b, t, h, stride_b, stride_t, stride_h, index, mask, acc: tl.constexpr):
    """Rows t of head h of a `[B, T, H, X]` tensor (last dim contiguous) at columns `index`,
    zero where masked, in `acc`."""
    at = b * stride_b + t[:, None] * stride_t + h * stride_h + index[None, :]
    return tl.load(X + at, mask=mask, other=0.0).to(acc)


@triton.jit
def load_values(V, b, t, h, stride_b, stride_t, stride_h, cols, t_ok, DV,
                NORMALIZE: tl.constexpr, acc: tl.constexpr):
    """Packed value rows: the values at columns < DV and, when normalized, the column of
    ones of the denominator at DV (zero on rows past T)."""
    v = load_rows(V, b, t, h, stride_b, stride_t, stride_h, cols,
                  t_ok[:, None] & (cols < DV)[None, :], acc)
    if NORMALIZE:
        v = tl.where(t_ok[:, None] & (cols == DV)[None, :], 1.0, v).to(acc)
    return v


@triton.jit
def packed_offsets(b, t, h, T, H, DVP, cols):
    """Offsets of rows t, columns `cols` of head h of batch row b in a packed
    `[B, T, H, DVP]` tensor (the outputs and their gradients)."""
    return ((b * T + t[:, None]).to(tl.int64) * H + h) * DVP + cols[None, :]


@triton.jit
def finite(x):
    """x with its NaN and inf entries read as 0."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0).to(x.dtype)


@triton.jit
def bad_rows(x):
    """[rows] fp32: 1 where a row of x has a NaN or inf entry, else 0."""
    return tl.max(tl.where(tl.abs(x) < float("inf"), 0.0, 1.0), axis=1)


@triton.jit
def poison_rows(bad):
    """[rows] fp32: NaN at the bad rows, 0 elsewhere (bad: 1 at a bad row)."""
    return tl.where(bad > 0, float("nan"), 0.0)


@triton.jit
def poison_from(bad):
    """[rows] fp32: NaN from the first bad row on, 0 before it (bad: 1 at a bad row)."""
    return tl.where(tl.cumsum(bad, axis=0) > 0, float("nan"), 0.0)


@triton.jit
def add_into(X, at, mask, value):
    """X[at] += value where mask: a gradient buffer that several links (or a link's key and
    value gradients) add into, each program into rows of its own."""
    tl.store(X + at, tl.load(X + at, mask=mask, other=0.0) + value, mask=mask)
