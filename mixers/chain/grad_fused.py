"""Backward, second stage in one launch: what grad_keys.py and grad_values.py compute, one
program per (chunk, batch x head) for every key and value block of the chunk:

    scores = weights * (Q K^T),   M = weights * (dO V^T)      (each formed once)
    dQ = g_in * (dO S^T) + M K,   dK = g_out * (V dS^T) + M^T Q,   dV = g_out * (K dS) + scores^T dO

The two-kernel form forms M once per key block and Q K^T once per value block and reads
dO, the end-state gradients and the q and k rows in both kernels; here each is formed once
and the rows come from the L2 cache on their second and third reads. Non-finite entries
of Q, K and V read as 0 and the causal masks select; POISON_Q, POISON_K and POISON_V add
NaN to the rows of dq, dk and dv whose q, k or v had one (set for the operator's own
inputs), as in grad_keys.py and grad_values.py; without HAS_STATE, S and dS are zero and not
read."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import (add_key_grads, causal, chunk_program, decay_terms,
                                    state_key_terms, state_offsets)
from mixers.tiles import (add_into, bad_rows, finite, load_rows, load_values, mm,
                              packed_offsets, poison_rows)


@triton.jit
def chain_grad_fused_kernel(Q, K, V, LOG_G, STARTS, ENDS, DO, DQ, DK_OUT, DV_OUT,
                            T, H, DK, DV, W, NT,
                            stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh,
                            C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            NK: tl.constexpr, NV: tl.constexpr, HAS_STATE: tl.constexpr,
                            ONES: tl.constexpr,
                            HAS_DECAY: tl.constexpr, POISON_Q: tl.constexpr,
                            POISON_K: tl.constexpr, POISON_V: tl.constexpr,
                            PRECISION: tl.constexpr):
    acc: tl.constexpr = DQ.dtype.element_ty
    chunk, _, b, h, bh, t, t_ok = chunk_program(H, T, C)
    weights, g_in, g_out = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    scores = tl.zeros([C, C], dtype=acc)
    M = tl.zeros([C, C], dtype=acc)
    for i in range(NK):
        rk = i * BK + tl.arange(0, BK)
        rows_ok = t_ok[:, None] & (rk < DK)[None, :]
        q = finite(load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk, rows_ok, acc))
        k = finite(load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk, rows_ok, acc))
        scores += mm(q, tl.trans(k), PRECISION)
    for j in range(NV):
        rv = j * BV + tl.arange(0, BV)
        dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv),
                     mask=t_ok[:, None] & (rv < W)[None, :], other=0.0).to(acc)
        v = finite(load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV,
                               ONES, acc))
        M += mm(dO, tl.trans(v), PRECISION)
    scores = causal(scores, weights, C)
    M = causal(M, weights, C)
    for i in range(NK):
        rk = i * BK + tl.arange(0, BK)
        rows_ok = t_ok[:, None] & (rk < DK)[None, :]
        q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk, rows_ok, acc)
        k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk, rows_ok, acc)
        bad_q, bad_k = bad_rows(q), bad_rows(k)
        q, k = finite(q), finite(k)
        dq = tl.zeros([C, BK], dtype=acc)
        dk = tl.zeros([C, BK], dtype=acc)
        if HAS_STATE:
            for j in range(NV):
                rv = j * BV + tl.arange(0, BV)
                dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv),
                             mask=t_ok[:, None] & (rv < W)[None, :], other=0.0).to(acc)
                v = finite(load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok,
                                       DV, ONES, acc))
                dq, dk = state_key_terms(dq, dk, dO, v, STARTS, ENDS, bh, NT, chunk, DK, W,
                                         rk, rv, PRECISION)
        add_key_grads(DQ, DK_OUT, dq, dk, M, q, k, g_in, g_out, bad_q, bad_k, b, t, h, T, H,
                      DK, rk, rows_ok, POISON_Q, POISON_K, PRECISION)
    # hla3's first link adds its value gradient into dk (DV_OUT is DK_OUT): the program's
    # dk stores above are visible to all of its threads before the loads below
    tl.debug_barrier()
    for j in range(NV):
        rv = j * BV + tl.arange(0, BV)
        dv = tl.zeros([C, BV], dtype=acc)
        if HAS_STATE:
            for i in range(NK):
                rk = i * BK + tl.arange(0, BK)
                k = finite(load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk,
                                     t_ok[:, None] & (rk < DK)[None, :], acc))
                dS = tl.load(ENDS + state_offsets(bh, NT, chunk, DK, W, rk, rv),
                             mask=(rk < DK)[:, None] & (rv < DV)[None, :], other=0.0)
                dv += mm(k, dS, PRECISION)
        values_ok = t_ok[:, None] & (rv < DV)[None, :]
        dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv), mask=values_ok,
                     other=0.0).to(acc)
        dv = dv * g_out[:, None] + mm(tl.trans(scores), dO, PRECISION)
        if POISON_V:
            v = load_rows(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, values_ok, acc)
            dv += poison_rows(bad_rows(v))[:, None]
        at = packed_offsets(b, t, h, T, H, DV, rv)
        add_into(DV_OUT, at, values_ok, dv)
