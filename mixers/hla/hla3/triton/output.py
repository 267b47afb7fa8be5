"""The causal hla3 forward's third stage: every chunk's outputs at once from its start
states (scan.py), one program per (chunk, value block, batch x head):

    r = Q P0 + LA V,   Bm = L * ((Q S0) Q^T + A LA^T),   O = Q F0 + Bm r
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_block, chunk_offsets, packed_offsets
from mixers.hla.hla3.triton.increments import hla3_chunk_rows


@triton.jit
def hla3_output_kernel(Q, K, V, SS, PS, FS, O, T, H, D, DV, DVP, NT,
                       stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh,
                       C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                       NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, LA, t, t_ok = hla3_chunk_rows(
        Q, K, V, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh, stride_kb,
        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE, PRECISION, acc)
    d_ok = dk < D
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    ok = d_ok[:, None] & (cols < DVP)[None, :]
    S = tl.load(SS + at_m, mask=d_ok[:, None] & d_ok[None, :], other=0.0).to(acc)
    P = tl.load(PS + at, mask=ok, other=0.0).to(acc)
    F = tl.load(FS + at, mask=ok, other=0.0).to(acc)
    rows = tl.arange(0, C)
    r = tl.dot(q, P, input_precision=PRECISION) + tl.dot(LA, v, input_precision=PRECISION)
    Bm = tl.dot(tl.dot(q, S, input_precision=PRECISION), tl.trans(q),
                input_precision=PRECISION)
    Bm += tl.dot(A, tl.trans(LA), input_precision=PRECISION)
    Bm = tl.where(rows[:, None] >= rows[None, :], Bm, 0.0).to(acc)
    out = tl.dot(q, F, input_precision=PRECISION) + tl.dot(Bm, r, input_precision=PRECISION)
    tl.store(O + packed_offsets(b, t, h, T, H, DVP, cols),
             out.to(acc), mask=t_ok[:, None] & (cols < DVP)[None, :])
