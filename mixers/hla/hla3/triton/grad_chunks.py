"""The causal hla3 backward's third stage: dq, dk and dv of every chunk at once, one program
per (chunk, value block, batch x head), from the chunk's start states (kept by the forward)
and the gradients of its end states (grad_scan.py), by hla3_chunk_grads (grads.py). dq and
dk sum over value columns: each value block writes a part of its own."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import (chunk_block, chunk_offsets, packed_offsets,
                              store_token_grads)
from mixers.hla.hla3.triton.grads import hla3_chunk_grads
from mixers.hla.hla3.triton.increments import hla3_chunk_rows


@triton.jit
def hla3_grad_chunks_kernel(Q, K, V, SS, PS, FS, GS, GP, GF, DO, DQ, DK, DVAL,
                            B, T, H, D, DV, DVP, NT, BLOCKS,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh,
                            C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                            NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = PS.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, LA, t, t_ok = hla3_chunk_rows(
        Q, K, V, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh, stride_kb,
        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE, PRECISION, acc)
    d_ok = dk < D
    c_ok = cols < DVP
    ok = d_ok[:, None] & c_ok[None, :]
    m_ok = d_ok[:, None] & d_ok[None, :]
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    at_y = ((bh * NT + chunk) * BLOCKS + pid_v).to(tl.int64) * D * D + dk[:, None] * D \
        + dk[None, :]
    S0 = tl.load(SS + at_m, mask=m_ok, other=0.0).to(acc)
    P0 = tl.load(PS + at, mask=ok, other=0.0).to(acc)
    F0 = tl.load(FS + at, mask=ok, other=0.0).to(acc)
    dS = tl.load(GS + at_y, mask=m_ok, other=0.0).to(acc)
    dP = tl.load(GP + at, mask=ok, other=0.0).to(acc)
    dF = tl.load(GF + at, mask=ok, other=0.0).to(acc)
    dO = tl.load(DO + packed_offsets(b, t, h, T, H, DVP, cols),
                 mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
    dQ, dK, dV, dBm, dr, r = hla3_chunk_grads(q, k, v, A, LA, dO, S0, P0, F0, dS, dP, dF, C,
                                              PRECISION, acc)
    store_token_grads(DQ, DK, DVAL, dQ, dK, dV, pid_v, b, h, t, t_ok, dk, cols, B, T, H, D, DV)
