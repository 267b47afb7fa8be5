"""Backward, first stage: the gradient of every chunk's end state. One program per (key
block, value block, batch x head) walks the chunks last to first, from the gradient of the
final state (zero when none):

    dS <- g^n dS + (g_in * Q)^T dO

storing, for each chunk, the gradient of its end state before the update; after the first
chunk dS is the gradient of the start state S0. Steps of the power-of-two loop past the
chunks load zeros and decay by 1. Non-finite entries of Q read as 0 (a zero upstream
gradient at a poisoned row stays zero instead of becoming 0 * NaN)."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.chain.terms import decay_terms, load_state, state_offsets, walk_program
from mixers.hla.tiles import finite, load_rows, packed_offsets


@triton.jit
def chain_grad_states_kernel(Q, LOG_G, DO, DS1, ENDS, DS0, T, H, DK, W, NT,
                             stride_qb, stride_qt, stride_qh,
                             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                             NT_BOUND: tl.constexpr, HAS_DECAY: tl.constexpr,
                             HAS_DS1: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = DS0.dtype.element_ty
    b, h, bh, rk, rv, tile_ok, final = walk_program(H, DK, W, BK, BV)
    dS = load_state(DS1, final, tile_ok, HAS_DS1, BK, BV, acc)
    for step in range(NT_BOUND):
        real = step < NT
        chunk = tl.maximum(NT - 1 - step, 0)
        tl.store(ENDS + state_offsets(bh, NT, chunk, DK, W, rk, rv), dS, mask=tile_ok & real)
        t = chunk * C + tl.arange(0, C)
        t_ok = (t < T) & real
        q = finite(load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk,
                             t_ok[:, None] & (rk < DK)[None, :], acc))
        dO = tl.load(DO + packed_offsets(b, t, h, T, H, W, rv),
                     mask=t_ok[:, None] & (rv < W)[None, :], other=0.0).to(acc)
        _, g_in, _, g_n = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
        g_n = tl.where(real, g_n, 1.0)
        dS = dS * g_n + tl.dot(tl.trans(q * g_in[:, None]), dO, input_precision=PRECISION)
    tl.store(DS0 + final, dS, mask=tile_ok)
