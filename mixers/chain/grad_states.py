"""Backward, first stage: every chunk's increment of the state gradient at once, one program
per (chunk, key block x value block, batch x head):

    dG_c = (g_in * Q_c)^T dO_c        (g_in[s] = g^(s + 1))

stored in the chunk's entry of the per-chunk buffer, which the reverse scan (scan.py) then
turns into the gradient of the chunk's end state. Non-finite entries of Q read as 0 (a zero
upstream gradient at a poisoned row stays zero instead of becoming 0 * NaN)."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import chunk_program, decay_terms, state_offsets
from mixers.tiles import finite, load_rows, mm, packed_offsets


@triton.jit
def chain_grad_states_kernel(Q, LOG_G, DO, ENDS, T, H, DK, W, NT, NV,
                             stride_qb, stride_qt, stride_qh,
                             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             HAS_DECAY: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = ENDS.dtype.element_ty
    chunk, block, b, h, bh, t, t_ok = chunk_program(H, T, C)
    rk = (block // NV) * BK + tl.arange(0, BK)
    rv = (block % NV) * BV + tl.arange(0, BV)
    q = finite(load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk,
                         t_ok[:, None] & (rk < DK)[None, :], acc))
    dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv),
                 mask=t_ok[:, None] & (rv < W)[None, :], other=0.0).to(acc)
    _, g_in, _ = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    increment = mm(tl.trans(q * g_in[:, None]), dO, PRECISION)
    tl.store(ENDS + state_offsets(bh, NT, chunk, DK, W, rk, rv), increment,
             mask=(rk < DK)[:, None] & (rv < W)[None, :])
