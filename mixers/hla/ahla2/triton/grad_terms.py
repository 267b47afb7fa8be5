"""The ahla2 backward's first stage (key dims up to 128): what each chunk adds to the
gradients of its start states, all chunks at once, one program per (chunk, value block,
batch x head). From the chunk's gradients (chunk_grads in terms.py), with dP', dE' the
gradients of its end states:

    dE0 = g^n dE' + Q^T (g_in dO)                 = g^n dE' + S
    dP0 = g^n dP' + Q^T (g_in dU)                 = g^n dP' + M^T dE' + R
    S = Q^T (g_in dO),  R = Q^T (g_in (A^T dO)),  M = K^T (g_out g_in Q) (as the forward's)

The reverse scan (grad_scan.py) applies them from the last chunk to the first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_block, chunk_offsets, packed_offsets
from mixers.hla.ahla2.triton.terms import chunk_terms


@triton.jit
def ahla2_grad_terms_kernel(Q, K, V, LOG_G, DO, XS, XR, MS, T, H, D, DV, DVP, NT,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh,
                            C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                            NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                            PRECISION: tl.constexpr):
    acc: tl.constexpr = XS.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, weights, g_in, g_out, g_n, t, t_ok = chunk_terms(
        Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
        HAS_DECAY, PRECISION, acc)
    c_ok = cols < DVP
    out_at = packed_offsets(b, t, h, T, H, DVP, cols)
    dO = tl.load(DO + out_at, mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
    qg = tl.trans(q * g_in[:, None])
    S = tl.dot(qg, dO, input_precision=PRECISION)
    R = tl.dot(qg, tl.dot(tl.trans(A), dO, input_precision=PRECISION),
               input_precision=PRECISION)
    d_ok = dk < D
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    ok = d_ok[:, None] & c_ok[None, :]
    tl.store(XS + at, S, mask=ok)
    tl.store(XR + at, R, mask=ok)
    if pid_v == 0:
        M = tl.dot(tl.trans(k * g_out[:, None]), q * g_in[:, None], input_precision=PRECISION)
        tl.store(MS + at_m, M, mask=d_ok[:, None] & d_ok[None, :])
