"""Forward, first stage: every chunk's increment of the state at once, one program per
(chunk, key block x value block, batch x head):

    dS_c = K_c^T (g_out * V_c)        (g_out[i] = g^(n - 1 - i), n the chunk's real tokens)

stored in the chunk's entry of the per-chunk buffer, which the scan (scan.py) then turns
into the chunk's start state. A non-finite k or v makes its chunk's increment, and through
the scan every later chunk's state, non-finite."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import chunk_program, decay_terms, state_offsets
from mixers.tiles import load_rows, load_values, mm


@triton.jit
def chain_states_kernel(K, V, LOG_G, STATES, T, H, DK, DV, W, NT, NV,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        ONES: tl.constexpr, HAS_DECAY: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = STATES.dtype.element_ty
    chunk, block, b, h, bh, t, t_ok = chunk_program(H, T, C)
    rk = (block // NV) * BK + tl.arange(0, BK)
    rv = (block % NV) * BV + tl.arange(0, BV)
    k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk,
                  t_ok[:, None] & (rk < DK)[None, :], acc)
    v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV, ONES, acc)
    _, _, g_out = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    increment = mm(tl.trans(k * g_out[:, None]), v, PRECISION)
    tl.store(STATES + state_offsets(bh, NT, chunk, DK, W, rk, rv), increment,
             mask=(rk < DK)[:, None] & (rv < W)[None, :])
