"""The ahla2 backward's third stage: dq, dk and dv of every chunk at once, one program per
(chunk, value block, batch x head), from the chunk's start states (kept by the forward) and
the gradients of its end states (grad_scan.py), by chunk_grads (terms.py). dq and dk sum
over value columns: each value block writes a part of its own."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import (chunk_block, chunk_offsets, packed_offsets,
                              store_token_grads)
from mixers.hla.ahla2.triton.terms import chunk_grads, chunk_terms


@triton.jit
def ahla2_grad_chunks_kernel(Q, K, V, LOG_G, PS, ES, GP, GE, DO, DQ, DK, DVAL,
                             B, T, H, D, DV, DVP, NT,
                             stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                             stride_vb, stride_vt, stride_vh,
                             C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                             NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                             PRECISION: tl.constexpr):
    acc: tl.constexpr = PS.dtype.element_ty
    chunk, pid_v, b, h, bh, dk, cols = chunk_block(H, BD, BV)
    q, k, v, A, weights, g_in, g_out, g_n, t, t_ok = chunk_terms(
        Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
        HAS_DECAY, PRECISION, acc)
    c_ok = cols < DVP
    d_ok = dk < D
    out_at = packed_offsets(b, t, h, T, H, DVP, cols)
    dO = tl.load(DO + out_at, mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
    at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
    ok = d_ok[:, None] & c_ok[None, :]
    P0 = tl.load(PS + at, mask=ok, other=0.0).to(acc)
    E0 = tl.load(ES + at, mask=ok, other=0.0).to(acc)
    dP = tl.load(GP + at, mask=ok, other=0.0).to(acc)
    dE = tl.load(GE + at, mask=ok, other=0.0).to(acc)
    dQ, dK, dV, dU = chunk_grads(q, k, v, A, weights, g_in, g_out, dO, P0, E0, dP, dE,
                                 PRECISION)
    store_token_grads(DQ, DK, DVAL, dQ, dK, dV, pid_v, b, h, t, t_ok, dk, cols, B, T, H, D, DV)
