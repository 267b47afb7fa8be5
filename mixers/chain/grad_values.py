"""Backward, third stage: dv of every chunk at once, one program per (chunk, value block,
batch x head), from the gradient dS of the chunk's end state (grad_states.py), summing over
key blocks (NK of them):

    dV = g_out * (K dS) + (weights * Q K^T)^T dO

added into a `[B, T, H, DV]` buffer for the real value columns (a column of ones has no
gradient; hla3's first link, whose values are its keys, adds into dk). Non-finite entries
of Q and K read as 0 and the causal mask selects; POISON_V adds NaN to the rows of dv whose
v had a non-finite entry (set where v is the operator's own input). Without HAS_STATE dS is
zero and not read."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import causal, chunk_program, decay_terms, load_qk, state_offsets
from mixers.tiles import add_into, bad_rows, finite, load_rows, mm, packed_offsets, poison_rows


@triton.jit
def chain_grad_values_kernel(Q, K, V, LOG_G, ENDS, DO, DV_OUT, T, H, DK, DV, W, NT,
                             stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                             stride_vb, stride_vt, stride_vh,
                             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             NK: tl.constexpr, HAS_STATE: tl.constexpr,
                             HAS_DECAY: tl.constexpr,
                             POISON_V: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = DV_OUT.dtype.element_ty
    chunk, pid_v, b, h, bh, t, t_ok = chunk_program(H, T, C)
    rv = pid_v * BV + tl.arange(0, BV)
    scores = tl.zeros([C, C], dtype=acc)
    dv = tl.zeros([C, BV], dtype=acc)
    for i in range(NK):
        rk = i * BK + tl.arange(0, BK)
        q, k, rows_ok = load_qk(Q, K, b, t, h, t_ok, rk, DK, stride_qb, stride_qt, stride_qh,
                                 stride_kb, stride_kt, stride_kh, acc)
        q, k = finite(q), finite(k)
        scores += mm(q, tl.trans(k), PRECISION)
        if HAS_STATE:
            dS = tl.load(ENDS + state_offsets(bh, NT, chunk, DK, W, rk, rv),
                         mask=(rk < DK)[:, None] & (rv < DV)[None, :], other=0.0)
            dv += mm(k, dS, PRECISION)
    weights, _, g_out = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    values_ok = t_ok[:, None] & (rv < DV)[None, :]
    dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv), mask=values_ok, other=0.0).to(acc)
    dv = dv * g_out[:, None] + mm(tl.trans(causal(scores, weights, C)), dO, PRECISION)
    if POISON_V:
        v = load_rows(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, values_ok, acc)
        dv += poison_rows(bad_rows(v))[:, None]
    at = packed_offsets(b, t, h, T, H, DV, rv)
    add_into(DV_OUT, at, values_ok, dv)
