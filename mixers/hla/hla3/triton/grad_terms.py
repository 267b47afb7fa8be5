"""The causal hla3 backward's first stage (key dims up to 64): what each chunk adds to the
gradients of its start states, all chunks at once, one program per (chunk, value block,
batch x head). With dS', dP', dF' the gradients of the chunk's end states (dS' this value
block's part) and r, Bm, dBm as in grads.py, the walk's updates are

    dF0 = dF' + XF                  XF = Q^T dO
    dP0 = dP' + XP + M dF'          XP = Q^T (Bm^T dO),  M = Q^T (Q S0 + LA K)   (d x d)
    dS0 = dS' + Y + dF' Z^T         Y = Q^T dBm Q (d x d, per value block),  Z = Q^T r

which the reverse scan (grad_scan.py) applies from the last chunk to the first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_block, chunk_offsets, packed_offsets
from mixers.hla.hla3.triton.increments import hla3_chunk_rows


@triton.jit
def hla3_grad_terms_kernel(Q, K, V, SS, PS, DO, XF, XP, XZ, XY, XM, T, H, D, DV, DVP, NT,
                           BLOCKS,
                           stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                           stride_vb, stride_vt, stride_vh,
                           C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                           NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = XP.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, LA, t, t_ok = hla3_chunk_rows(
        Q, K, V, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh, stride_kb,
        stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE, PRECISION, acc)
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    d_ok = dk < D
    c_ok = cols < DVP
    ok = d_ok[:, None] & c_ok[None, :]
    m_ok = d_ok[:, None] & d_ok[None, :]
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    P0 = tl.load(PS + at, mask=ok, other=0.0).to(acc)
    S0 = tl.load(SS + at_m, mask=m_ok, other=0.0).to(acc)
    dO = tl.load(DO + packed_offsets(b, t, h, T, H, DVP, cols),
                 mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
    r = tl.dot(q, P0, input_precision=PRECISION) + tl.dot(LA, v, input_precision=PRECISION)
    QS = tl.dot(q, S0, input_precision=PRECISION)
    Bm = tl.dot(QS, tl.trans(q), input_precision=PRECISION)
    Bm += tl.dot(A, tl.trans(LA), input_precision=PRECISION)
    Bm = tl.where(causal, Bm, 0.0).to(acc)
    dBm = tl.where(causal, tl.dot(dO, tl.trans(r), input_precision=PRECISION), 0.0).to(acc)
    qt = tl.trans(q)
    tl.store(XF + at, tl.dot(qt, dO, input_precision=PRECISION), mask=ok)
    tl.store(XP + at, tl.dot(qt, tl.dot(tl.trans(Bm), dO, input_precision=PRECISION),
                             input_precision=PRECISION), mask=ok)
    tl.store(XZ + at, tl.dot(qt, r, input_precision=PRECISION), mask=ok)
    Y = tl.dot(tl.dot(qt, dBm, input_precision=PRECISION), q, input_precision=PRECISION)
    at_y = ((bh * NT + chunk) * BLOCKS + pid_v).to(tl.int64) * D * D + dk[:, None] * D \
        + dk[None, :]
    tl.store(XY + at_y, Y, mask=m_ok)
    if pid_v == 0:
        LAK = tl.dot(LA, k, input_precision=PRECISION)
        tl.store(XM + at_m, tl.dot(qt, QS + LAK, input_precision=PRECISION), mask=m_ok)
