"""The states of a link by walking the chunks, forward and backward: what states.py,
grad_states.py and scan.py compute in two stages, in one. One program per (key block,
value block, batch x head) carries its tile of the state through the chunks in order
(forward) or in reverse (backward):

    forward:   S <- g^n S + K^T (g_out * V)      storing each chunk's start state first
    backward:  dS <- g^n dS + (g_in * Q)^T dO    storing each chunk's end-state gradient first

(n the chunk's real tokens), from the start state (or the final state's gradient; zeros
when absent); the value after the last step is the final state (or the start state's
gradient). No per-chunk increments pass through memory, but each program's steps run one
after another: the walk pays where the programs of a launch fill the GPU (many batch x
heads, short T), the two stages where they do not (ChainPlan.walk_from chooses).
The loop's bound is a compile-time power of two (one compile per bucket of NT; the
Triton interpreter cannot loop to a runtime bound): steps past the last chunk load zeros,
decay by 1 and change nothing. Non-finite entries follow states.py and grad_states.py: a
non-finite k or v makes the forward states from its chunk on non-finite; non-finite
entries of Q read as 0 in the backward."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import decay_terms, load_state, state_offsets, walk_program
from mixers.tiles import finite, load_rows, load_values, mm, packed_offsets


@triton.jit
def chain_walk_kernel(K, V, LOG_G, S0, STARTS, S1, T, H, DK, DV, W, NT,
                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      NT_BOUND: tl.constexpr, ONES: tl.constexpr, HAS_DECAY: tl.constexpr,
                      HAS_S0: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = S1.dtype.element_ty
    b, h, bh, rk, rv, tile_ok, final = walk_program(H, DK, W, BK, BV)
    S = load_state(S0, final, tile_ok, HAS_S0, BK, BV, acc)
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
    for chunk in range(NT_BOUND):
        tl.store(STARTS + state_offsets(bh, NT, chunk, DK, W, rk, rv), S,
                 mask=tile_ok & (chunk < NT))
        t = chunk * C + tl.arange(0, C)
        t_ok = t < T
        k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk,
                      t_ok[:, None] & (rk < DK)[None, :], acc)
        v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV, ONES, acc)
        _, _, g_out = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
        if HAS_DECAY:
            S = S * tl.exp(tl.maximum(tl.minimum(T - chunk * C, C), 0).to(acc) * log_g)
        S = S + mm(tl.trans(k * g_out[:, None]), v, PRECISION)
    tl.store(S1 + final, S, mask=tile_ok)


@triton.jit
def chain_grad_walk_kernel(Q, LOG_G, DO, DS1, ENDS, DS0, T, H, DK, W, NT,
                           stride_qb, stride_qt, stride_qh,
                           C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           NT_BOUND: tl.constexpr, HAS_DECAY: tl.constexpr,
                           HAS_DS1: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = DS0.dtype.element_ty
    b, h, bh, rk, rv, tile_ok, final = walk_program(H, DK, W, BK, BV)
    dS = load_state(DS1, final, tile_ok, HAS_DS1, BK, BV, acc)
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
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
        _, g_in, _ = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
        if HAS_DECAY:
            n = tl.where(real, tl.minimum(T - chunk * C, C), 0)
            dS = dS * tl.exp(n.to(acc) * log_g)
        dS = dS + mm(tl.trans(q * g_in[:, None]), dO, PRECISION)
    tl.store(DS0 + final, dS, mask=tile_ok)
