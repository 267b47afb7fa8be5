"""Tiles the ahla2 and hla3 Triton kernels share: a program's block of value columns, the
masked loads of token rows, and the offsets of per-chunk state buffers. A program of a
walk or scan is (value block, batch x head): grid axis 0 the block of BV packed value
columns, axis 1 the batch row times heads plus head; a program of a chunk-parallel kernel
is (chunk, value block, batch x head)."""

from __future__ import annotations

import triton
import triton.language as tl


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
def load_qkv(Q, K, V, b, t, h, t_ok, D, DV, dk, cols,
             stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
             stride_vb, stride_vt, stride_vh, NORMALIZE: tl.constexpr, acc: tl.constexpr):
    """Rows t of q and k (columns dk, zero past T and past D) and the packed value rows
    (`load_values`) of head h of batch row b, in `acc`."""
    qk_ok = t_ok[:, None] & (dk < D)[None, :]
    q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, dk, qk_ok, acc)
    k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, dk, qk_ok, acc)
    v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, cols, t_ok, DV, NORMALIZE,
                    acc)
    return q, k, v


@triton.jit
def chunk_block(H, BD: tl.constexpr, BV: tl.constexpr):
    """(chunk, value block, b, h, b x H + h, key index, value columns) of a program of a
    chunk-parallel kernel: grid axis 0 the chunk, 1 the block of BV packed value columns,
    2 the batch row times heads plus head."""
    chunk = tl.program_id(0)
    pid_v = tl.program_id(1)
    bh = tl.program_id(2)
    return chunk, pid_v, bh // H, bh % H, bh, tl.arange(0, BD), pid_v * BV + tl.arange(0, BV)


@triton.jit
def chunk_offsets(bh, NT, chunk, D, DVP, dk, cols):
    """Offsets of one chunk's [D, DVP] tile (at this program's columns) and of its [D, D]
    tile in per-chunk buffers `[B * H, NT, D, DVP]` and `[B * H, NT, D, D]`."""
    base = (bh * NT + chunk).to(tl.int64) * D
    return (base * DVP + dk[:, None] * DVP + cols[None, :],
            base * D + dk[:, None] * D + dk[None, :])


@triton.jit
def packed_offsets(b, t, h, T, H, DVP, cols):
    """Offsets of rows t, columns `cols` of head h of batch row b in a packed
    `[B, T, H, DVP]` tensor (the outputs and their gradients)."""
    return ((b * T + t[:, None]).to(tl.int64) * H + h) * DVP + cols[None, :]


@triton.jit
def store_token_grads(DQ, DK, DVAL, dQ, dK, dV, pid_v, b, h, t, t_ok, dk, cols, B, T, H, D,
                      DV):
    """A chunk program's token gradients: its parts of dq and dk (they sum over value
    columns, so value block `pid_v` writes `[BLOCKS, B, T, H, D]` buffers at its own index)
    and its columns of dv (`[B, T, H, DV]`), rows past T and columns past D, DV masked."""
    qk_ok = t_ok[:, None] & (dk < D)[None, :]
    part = (((pid_v * B + b) * T + t[:, None]).to(tl.int64) * H + h) * D + dk[None, :]
    tl.store(DQ + part, dQ, mask=qk_ok)
    tl.store(DK + part, dK, mask=qk_ok)
    tl.store(DVAL + ((b * T + t[:, None]).to(tl.int64) * H + h) * DV + cols[None, :], dV,
             mask=t_ok[:, None] & (cols < DV)[None, :])
