"""Backward, second stage: dq and dk of every chunk at once, one program per (chunk, key
block, batch x head), from the chunk's start state S (states.py) and the gradient dS of
its end state (grad_states.py), summing over value blocks (NV of them):

    M  = weights * (dO V^T)
    dQ = g_in * (dO S^T) + M K
    dK = g_out * (V dS^T) + M^T Q

added into `[B, T, H, DK]` buffers (the links of a chain share one dq and one dk).
Non-finite entries of Q, K and V read as 0 and the causal mask selects, so a zero upstream
gradient at the rows a non-finite token poisoned leaves every earlier row's gradient exact;
POISON_Q (POISON_K) adds NaN to the rows of dq (dk) whose q (k) had one: set for the
operator's own inputs, not for a link's inputs that an earlier link computed. Without
HAS_STATE (one chunk, zero start state and no final-state gradient) S and dS are zero and
not read."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import (add_key_grads, causal, chunk_program, decay_terms, load_qk,
                                    state_key_terms)
from mixers.tiles import bad_rows, finite, load_values, mm, packed_offsets


@triton.jit
def chain_grad_keys_kernel(Q, K, V, LOG_G, STARTS, ENDS, DO, DQ, DK_OUT, T, H, DK, DV, W, NT,
                           stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                           stride_vb, stride_vt, stride_vh,
                           C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           NV: tl.constexpr, HAS_STATE: tl.constexpr, ONES: tl.constexpr,
                           HAS_DECAY: tl.constexpr,
                           POISON_Q: tl.constexpr, POISON_K: tl.constexpr,
                           PRECISION: tl.constexpr):
    acc: tl.constexpr = DQ.dtype.element_ty
    chunk, pid_k, b, h, bh, t, t_ok = chunk_program(H, T, C)
    rk = pid_k * BK + tl.arange(0, BK)
    q, k, rows_ok = load_qk(Q, K, b, t, h, t_ok, rk, DK, stride_qb, stride_qt, stride_qh,
                             stride_kb, stride_kt, stride_kh, acc)
    bad_q, bad_k = bad_rows(q), bad_rows(k)
    q, k = finite(q), finite(k)
    M = tl.zeros([C, C], dtype=acc)
    dq = tl.zeros([C, BK], dtype=acc)
    dk = tl.zeros([C, BK], dtype=acc)
    for i in range(NV):
        rv = i * BV + tl.arange(0, BV)
        dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv),
                     mask=t_ok[:, None] & (rv < W)[None, :], other=0.0).to(acc)
        v = finite(load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV,
                               ONES, acc))
        M += mm(dO, tl.trans(v), PRECISION)
        if HAS_STATE:
            dq, dk = state_key_terms(dq, dk, dO, v, STARTS, ENDS, bh, NT, chunk, DK, W, rk, rv,
                                     PRECISION)
    weights, g_in, g_out = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    M = causal(M, weights, C)
    add_key_grads(DQ, DK_OUT, dq, dk, M, q, k, g_in, g_out, bad_q, bad_k, b, t, h, T, H, DK,
                  rk, rows_ok, POISON_Q, POISON_K, PRECISION)
