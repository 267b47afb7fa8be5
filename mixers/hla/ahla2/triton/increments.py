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

from mixers.hla.tiles import load_rows, load_values


@triton.jit
def chunk_terms(Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                stride_vb, stride_vt, stride_vh,
                C: tl.constexpr, NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                PRECISION: tl.constexpr, acc: tl.constexpr):
    """(q, k, v, A, g_in, g_out, t, t_ok) of one chunk: its rows (zero past T and past the
    head dims), the decayed causal scores and the decay vectors (ones without decay)."""
    rows = tl.arange(0, C)
    t = chunk * C + rows
    t_ok = t < T
    qk_ok = t_ok[:, None] & (dk < D)[None, :]
    q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, dk, qk_ok, acc)
    k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, dk, qk_ok, acc)
    v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, cols, t_ok, DV, NORMALIZE,
                    acc)
    A = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    causal = rows[:, None] >= rows[None, :]
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
        gap = tl.maximum(rows[:, None] - rows[None, :], 0).to(acc)
        A = tl.where(causal, A * tl.exp(gap * log_g), 0.0).to(acc)
        n = tl.maximum(tl.minimum(T - chunk * C, C), 0)
        g_in = tl.exp((rows + 1).to(acc) * log_g)
        g_out = tl.where(t_ok, tl.exp((n - 1 - rows).to(acc) * log_g), 0.0).to(acc)
    else:
        A = tl.where(causal, A, 0.0).to(acc)
        g_in = tl.full([C], 1.0, acc)
        g_out = tl.full([C], 1.0, acc)
    return q, k, v, A, g_in, g_out, t, t_ok


@triton.jit
def ahla2_increments_kernel(Q, K, V, LOG_G, DPS, NS, MS, T, H, D, DV, DVP, NT,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh,
                            C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                            NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                            PRECISION: tl.constexpr):
    acc: tl.constexpr = DPS.dtype.element_ty
    chunk = tl.program_id(0)
    pid_v = tl.program_id(1)
    bh = tl.program_id(2)
    b, h = bh // H, bh % H
    dk = tl.arange(0, BD)
    cols = pid_v * BV + tl.arange(0, BV)
    q, k, v, A, g_in, g_out, t, t_ok = chunk_terms(
        Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
        HAS_DECAY, PRECISION, acc)
    ks = tl.trans(k * g_out[:, None])
    dP = tl.dot(ks, v, input_precision=PRECISION)
    N = tl.dot(ks, tl.dot(A, v, input_precision=PRECISION), input_precision=PRECISION)
    d_ok = dk < D
    at = (bh * NT + chunk).to(tl.int64) * D * DVP + dk[:, None] * DVP + cols[None, :]
    ok = d_ok[:, None] & (cols < DVP)[None, :]
    tl.store(DPS + at, dP, mask=ok)
    tl.store(NS + at, N, mask=ok)
    if pid_v == 0:  # M does not depend on the values: the first value block writes it
        M = tl.dot(ks, q * g_in[:, None], input_precision=PRECISION)
        at_m = (bh * NT + chunk).to(tl.int64) * D * D + dk[:, None] * D + dk[None, :]
        tl.store(MS + at_m, M, mask=d_ok[:, None] & d_ok[None, :])
