"""Forward, first stage: the start state of every chunk. One program per (key block, value
block, batch x head) walks the chunks in order:

    S <- g^n S + K^T (g_out * V)        (n the chunk's real tokens, g_out[i] = g^(n - 1 - i))

storing each chunk's start state before its update, and the final state after the last.
The loop's bound is a compile-time power of two (one compile per bucket of T; the Triton
interpreter cannot loop to a runtime bound): steps past the last chunk load zeros, decay by
g^0 and change nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.chain.terms import decay_terms, load_state, state_offsets, walk_program
from mixers.hla.tiles import load_rows, load_values


@triton.jit
def chain_states_kernel(K, V, LOG_G, S0, STARTS, S1, T, H, DK, DV, W, NT,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        NT_BOUND: tl.constexpr, ONES: tl.constexpr, HAS_DECAY: tl.constexpr,
                        HAS_S0: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = S1.dtype.element_ty
    b, h, bh, rk, rv, tile_ok, final = walk_program(H, DK, W, BK, BV)
    S = load_state(S0, final, tile_ok, HAS_S0, BK, BV, acc)
    for chunk in range(NT_BOUND):
        tl.store(STARTS + state_offsets(bh, NT, chunk, DK, W, rk, rv), S,
                 mask=tile_ok & (chunk < NT))
        t = chunk * C + tl.arange(0, C)
        t_ok = t < T
        k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk,
                      t_ok[:, None] & (rk < DK)[None, :], acc)
        v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV, ONES, acc)
        _, _, g_out, g_n = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
        S = S * g_n + tl.dot(tl.trans(k * g_out[:, None]), v, input_precision=PRECISION)
    tl.store(S1 + final, S, mask=tile_ok)
