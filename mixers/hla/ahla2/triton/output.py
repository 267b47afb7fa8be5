"""The ahla2 forward's third stage: every chunk's outputs at once from its start states
(scan.py), one program per (chunk, value block, batch x head):

    U = g_in (Q P0) + A V,    O = g_in (Q E0) + A U
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_block, chunk_offsets, packed_offsets
from mixers.hla.ahla2.triton.terms import chunk_terms


@triton.jit
def ahla2_output_kernel(Q, K, V, LOG_G, PS, ES, O, T, H, D, DV, DVP, NT,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_vb, stride_vt, stride_vh,
                        C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                        NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                        PRECISION: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, weights, g_in, g_out, g_n, t, t_ok = chunk_terms(
        Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
        HAS_DECAY, PRECISION, acc)
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    ok = (dk < D)[:, None] & (cols < DVP)[None, :]
    P = tl.load(PS + at, mask=ok, other=0.0).to(acc)
    E = tl.load(ES + at, mask=ok, other=0.0).to(acc)
    qg = q * g_in[:, None]
    U = tl.dot(qg, P, input_precision=PRECISION) + tl.dot(A, v, input_precision=PRECISION)
    out = tl.dot(qg, E, input_precision=PRECISION) + tl.dot(A, U, input_precision=PRECISION)
    tl.store(O + packed_offsets(b, t, h, T, H, DVP, cols),
             out.to(acc), mask=t_ok[:, None] & (cols < DVP)[None, :])
