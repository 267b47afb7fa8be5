"""The causal hla3 forward's first stage (key dims up to 64): every chunk's terms at once,
one program per (chunk, value block, batch x head). With r = Q P0 + LA V (LA = L * Q K^T),
the chunk's end states are

    S' = S0 + dS,   P' = P0 + dP,   F' = F0 + S0 (G P0 + Hm) + J P0 + Lm

    dS = K^T K,  G = Q^T Q,  J = K^T LA^T Q        (d x d: the first value block writes them)
    dP = K^T V,  Hm = Q^T (LA V),  Lm = K^T LA^T (LA V)

which the scan (scan.py) applies in chunk order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_block, chunk_offsets, load_qkv


@triton.jit
def hla3_chunk_rows(Q, K, V, chunk, b, h, T, D, DV, dk, cols,
                    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                    stride_vb, stride_vt, stride_vh,
                    C: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr,
                    acc: tl.constexpr):
    """(q, k, v, A, LA, t, t_ok) of one chunk: rows zero past T and the head dims, values
    packed with the ones column when normalized, A = Q K^T and LA its lower triangle."""
    rows = tl.arange(0, C)
    t = chunk * C + rows
    t_ok = t < T
    q, k, v = load_qkv(Q, K, V, b, t, h, t_ok, D, DV, dk, cols, stride_qb, stride_qt,
                       stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                       stride_vh, NORMALIZE, acc)
    A = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    LA = tl.where(rows[:, None] >= rows[None, :], A, 0.0).to(acc)
    return q, k, v, A, LA, t, t_ok


@triton.jit
def hla3_increments_kernel(Q, K, V, XS, XG, XJ, XP, XH, XL, T, H, D, DV, DVP, NT,
                           stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                           stride_vb, stride_vt, stride_vh,
                           C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                           NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = XP.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, LA, t, t_ok = hla3_chunk_rows(
        Q, K, V, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh, stride_kb,
        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE, PRECISION, acc)
    kt = tl.trans(k)
    LAV = tl.dot(LA, v, input_precision=PRECISION)
    d_ok = dk < D
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    ok = d_ok[:, None] & (cols < DVP)[None, :]
    tl.store(XP + at, tl.dot(kt, v, input_precision=PRECISION), mask=ok)
    tl.store(XH + at, tl.dot(tl.trans(q), LAV, input_precision=PRECISION), mask=ok)
    KLA = tl.dot(kt, tl.trans(LA), input_precision=PRECISION)  # K^T LA^T, d x C
    tl.store(XL + at, tl.dot(KLA, LAV, input_precision=PRECISION), mask=ok)
    if pid_v == 0:
        m_ok = d_ok[:, None] & d_ok[None, :]
        tl.store(XS + at_m, tl.dot(kt, k, input_precision=PRECISION), mask=m_ok)
        tl.store(XG + at_m, tl.dot(tl.trans(q), q, input_precision=PRECISION), mask=m_ok)
        tl.store(XJ + at_m, tl.dot(KLA, q, input_precision=PRECISION), mask=m_ok)
