"""The ahla2 forward's first stage: every chunk's increments at once, one program per
(chunk, value block, batch x head). With the chunk's rows q, k, v (values packed with the
ones column when normalized), A = D * (Q K^T) (D the causal decay weights g^(s - i)),
g_in[s] = g^(s + 1), g_out[i] = g^(n - 1 - i) and n the chunk's real tokens:

    dP = K^T (g_out V)                       how the chunk adds to P
    N  = K^T (g_out (A V))                   what it adds to E for any start state ...
    M  = K^T (g_out g_in Q)                  ... plus M P0 (d x d, one per chunk)

so that the chunk's end states are P' = g^n P0 + dP and E' = g^n E0 + M P0 + N (the scan,
scan.py, applies them in order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_block, chunk_offsets
from mixers.hla.ahla2.triton.terms import chunk_terms


@triton.jit
def ahla2_increments_kernel(Q, K, V, LOG_G, DPS, NS, MS, T, H, D, DV, DVP, NT,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh,
                            C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                            NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                            PRECISION: tl.constexpr):
    acc: tl.constexpr = DPS.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, weights, g_in, g_out, g_n, t, t_ok = chunk_terms(
        Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
        HAS_DECAY, PRECISION, acc)
    ks = tl.trans(k * g_out[:, None])
    dP = tl.dot(ks, v, input_precision=PRECISION)
    N = tl.dot(ks, tl.dot(A, v, input_precision=PRECISION), input_precision=PRECISION)
    d_ok = dk < D
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    ok = d_ok[:, None] & (cols < DVP)[None, :]
    tl.store(DPS + at, dP, mask=ok)
    tl.store(NS + at, N, mask=ok)
    if pid_v == 0:  # M does not depend on the values: the first value block writes it
        M = tl.dot(ks, q * g_in[:, None], input_precision=PRECISION)
        tl.store(MS + at_m, M, mask=d_ok[:, None] & d_ok[None, :])
