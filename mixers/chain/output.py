"""Forward, second stage: every chunk's outputs at once, one program per (chunk, value
block, batch x head), from the chunk's start state S (states.py):

    O = g_in * (Q S) + (weights * Q K^T) V

The key dim is summed over blocks of BK in a loop (NK of them). Without HAS_STATE (a link of
one chunk from a zero start state) the Q S term is skipped: STARTS is not read. With SCORES_ONCE one program
covers every value block of its chunk (NV of them, in a loop; grid (chunk, 1, batch x
head)): it forms Q K^T once instead of once per value block, rereading the q rows for each
block's Q S. Non-finite entries of V read
as 0 and NaN is added to the rows from the first such row of the chunk on; the causal mask
selects, so a NaN q or k row reaches only its own and later rows (a non-finite token of an
earlier chunk reaches this one through its start state)."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import causal, chunk_program, decay_terms, load_qk, state_offsets
from mixers.tiles import (bad_rows, finite, load_rows, load_values, mm, packed_offsets,
                              poison_from)


@triton.jit
def chain_output_kernel(Q, K, V, LOG_G, STARTS, O, T, H, DK, DV, W, NT,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_vb, stride_vt, stride_vh,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        NK: tl.constexpr, NV: tl.constexpr, SCORES_ONCE: tl.constexpr,
                        HAS_STATE: tl.constexpr, ONES: tl.constexpr, HAS_DECAY: tl.constexpr,
                        PRECISION: tl.constexpr):
    acc: tl.constexpr = STARTS.dtype.element_ty  # O may be narrower: rounded as stored
    chunk, pid_v, b, h, bh, t, t_ok = chunk_program(H, T, C)
    weights, g_in, _ = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    scores = tl.zeros([C, C], dtype=acc)
    if SCORES_ONCE:
        for i in range(NK):
            rk = i * BK + tl.arange(0, BK)
            q, k, rows_ok = load_qk(Q, K, b, t, h, t_ok, rk, DK, stride_qb, stride_qt,
                                     stride_qh, stride_kb, stride_kt, stride_kh, acc)
            scores += mm(q, tl.trans(k), PRECISION)
        scores = causal(scores, weights, C)
        for j in range(NV):
            rv = j * BV + tl.arange(0, BV)
            out = tl.zeros([C, BV], dtype=acc)
            if HAS_STATE:
                for i in range(NK):
                    rk = i * BK + tl.arange(0, BK)
                    q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk,
                                  t_ok[:, None] & (rk < DK)[None, :], acc)
                    S = tl.load(STARTS + state_offsets(bh, NT, chunk, DK, W, rk, rv),
                                mask=(rk < DK)[:, None] & (rv < W)[None, :], other=0.0)
                    out += mm(q, S, PRECISION)
            v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV, ONES,
                            acc)
            out = (out * g_in[:, None] + mm(scores, finite(v), PRECISION)
                   + poison_from(bad_rows(v))[:, None])
            tl.store(O + packed_offsets(b, t, h, T, H, W, rv), out,
                     mask=t_ok[:, None] & (rv < W)[None, :])
    else:
        rv = pid_v * BV + tl.arange(0, BV)
        out = tl.zeros([C, BV], dtype=acc)
        for i in range(NK):
            rk = i * BK + tl.arange(0, BK)
            q, k, rows_ok = load_qk(Q, K, b, t, h, t_ok, rk, DK, stride_qb, stride_qt,
                                     stride_qh, stride_kb, stride_kt, stride_kh, acc)
            if HAS_STATE:
                S = tl.load(STARTS + state_offsets(bh, NT, chunk, DK, W, rk, rv),
                            mask=(rk < DK)[:, None] & (rv < W)[None, :], other=0.0)
                out += mm(q, S, PRECISION)
            scores += mm(q, tl.trans(k), PRECISION)
        v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV, ONES, acc)
        out = (out * g_in[:, None]
               + mm(causal(scores, weights, C), finite(v), PRECISION)
               + poison_from(bad_rows(v))[:, None])
        tl.store(O + packed_offsets(b, t, h, T, H, W, rv), out,
                 mask=t_ok[:, None] & (rv < W)[None, :])
