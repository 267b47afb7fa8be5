"""Per-chunk pieces the ahla2 kernels share: the chunk's decay weights, its rows and scores,
and the gradients of one chunk given its start states and the gradients of its end states.
Rows are the chunk's C tokens from `chunk * C`; past T they read as zero."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import load_qkv


@triton.jit
def decay_terms(chunk, T, LOG_G, h, C: tl.constexpr, HAS_DECAY: tl.constexpr,
                acc: tl.constexpr):
    """(weights, g_in, g_out, g_n) of one chunk with n real tokens: the causal weights
    g^(s - i) for i <= s (else 0), g_in[s] = g^(s + 1), g_out[i] = g^(n - 1 - i) (0 past T)
    and g^n; without decay, the causal mask and ones (g_out still 0 past T)."""
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    n = tl.maximum(tl.minimum(T - chunk * C, C), 0)
    t_ok = rows < n
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
        gap = tl.maximum(rows[:, None] - rows[None, :], 0).to(acc)
        weights = tl.where(causal, tl.exp(gap * log_g), 0.0).to(acc)
        g_in = tl.exp((rows + 1).to(acc) * log_g)
        g_out = tl.where(t_ok, tl.exp((n - 1 - rows).to(acc) * log_g), 0.0).to(acc)
        g_n = tl.exp(n.to(acc) * log_g)
    else:
        weights = tl.where(causal, 1.0, 0.0).to(acc)
        g_in = tl.full([C], 1.0, acc)
        g_out = tl.where(t_ok, 1.0, 0.0).to(acc)
        g_n = tl.full([], 1.0, acc)
    return weights, g_in, g_out, g_n


@triton.jit
def chunk_terms(Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                stride_vb, stride_vt, stride_vh,
                C: tl.constexpr, NORMALIZE: tl.constexpr, HAS_DECAY: tl.constexpr,
                PRECISION: tl.constexpr, acc: tl.constexpr):
    """(q, k, v, A, weights, g_in, g_out, g_n, t, t_ok) of one chunk: its rows (zero past T
    and past the head dims; values packed with the ones column when normalized), the
    decayed causal scores A = weights * (Q K^T) and decay_terms."""
    t = chunk * C + tl.arange(0, C)
    t_ok = t < T
    q, k, v = load_qkv(Q, K, V, b, t, h, t_ok, D, DV, dk, cols, stride_qb, stride_qt,
                       stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                       stride_vh, NORMALIZE, acc)
    weights, g_in, g_out, g_n = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    A = tl.dot(q, tl.trans(k), input_precision=PRECISION) * weights
    return q, k, v, A, weights, g_in, g_out, g_n, t, t_ok


@triton.jit
def chunk_grads(q, k, v, A, weights, g_in, g_out, dO, P0, E0, dP, dE,
                PRECISION: tl.constexpr):
    """(dQ, dK, dV, dU) of one chunk from its start states (P0, E0) and the gradients of
    its end states (dP, dE), with U = g_in (Q P0) + A V and O = g_in (Q E0) + A U:

        dU = A^T dO + g_out (K dE)          dV = A^T dU + g_out (K dP)
        dS = weights * (dO U^T + dU V^T)
        dQ = g_in (dO E0^T + dU P0^T) + dS K
        dK = dS^T Q + g_out (V dP^T + U dE^T)

    dQ and dK are this value block's parts (they sum over value columns)."""
    U = tl.dot(q, P0, input_precision=PRECISION) * g_in[:, None]
    U += tl.dot(A, v, input_precision=PRECISION)
    dU = tl.dot(tl.trans(A), dO, input_precision=PRECISION)
    dU += tl.dot(k, dE, input_precision=PRECISION) * g_out[:, None]
    dV = tl.dot(tl.trans(A), dU, input_precision=PRECISION)
    dV += tl.dot(k, dP, input_precision=PRECISION) * g_out[:, None]
    dS = tl.dot(dO, tl.trans(U), input_precision=PRECISION)
    dS += tl.dot(dU, tl.trans(v), input_precision=PRECISION)
    dS = dS * weights
    dQ = tl.dot(dO, tl.trans(E0), input_precision=PRECISION)
    dQ += tl.dot(dU, tl.trans(P0), input_precision=PRECISION)
    dQ = dQ * g_in[:, None] + tl.dot(dS, k, input_precision=PRECISION)
    dK = tl.dot(v, tl.trans(dP), input_precision=PRECISION)
    dK += tl.dot(U, tl.trans(dE), input_precision=PRECISION)
    dK = dK * g_out[:, None] + tl.dot(tl.trans(dS), q, input_precision=PRECISION)
    return dQ, dK, dV, dU
