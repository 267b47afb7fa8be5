"""Forward of a link in two launches, the layout of fla's chunked kernels (ChainPlan
layout "fla"): a state kernel that walks the chunks of one (batch, head) per [BK, BV] tile
of the state, and an output kernel, one program per (value block, chunk, batch x head),
that loops over the key blocks.

State kernel, grid (key block, value block, batch x head): the program carries its tile
through the chunks in order, storing each chunk's start state before it adds the chunk's
increment,

    S <- g^n S + K^T (g_out * V)        (n the chunk's real tokens)

so the increments never pass through memory and no scan runs. Output kernel: over the key
blocks it accumulates Q S (from the chunk's start state) and Q K^T, then takes one product
of the masked scores with the value block,

    O = g_in * (Q S) + (weights * Q K^T) V

Token tiles are kept in their input dtype. A product of two unmodified tiles of one 16-bit
dtype (Q K^T; K^T V without decay) is a tl.dot of 16-bit tiles with float32 accumulation:
its products are exact, as TF32 products of the same values are, so the plan's precision
is kept ("tf32" rounds nothing a 16-bit tile holds). Every product with a float32 side (the
states, the scores, decayed keys) goes through tiles.mm at the plan's precision on float32
tiles, as the chunk layout's kernels (states.py, scan.py, output.py, walk.py) compute it.
States, outputs and their dtypes are those of launch.forward; the start states are stored
in the `[B * H, NT, DK, W]` buffer the backward reads (bfloat16 under the plan's
`narrow_starts`, with precision "bf16": the products that read them round them so).
Non-finite entries follow output.py and walk.py: a non-finite k or v makes the states from
its chunk on non-finite; within a chunk the causal mask selects, non-finite values read as
0 and NaN is added to the rows from the first such row on. The state loop's bound is a compile-time
power of two under the interpreter (which cannot loop to a runtime bound; steps past the
last chunk load zeros, decay by 1 and change nothing) and the chunk count on a GPU."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.chain.terms import causal, decay_terms, load_state, state_offsets, walk_program
from mixers.tiles import (INTERPRETED, bad_rows, finite, load_rows, mm, packed_offsets,
                          poison_from)


@triton.jit
def exact_mm(a, b, RAW: tl.constexpr, PRECISION: tl.constexpr, acc: tl.constexpr):
    """a @ b accumulated in float32: with RAW (a and b unmodified tiles of one 16-bit dtype)
    a dot of the 16-bit tiles themselves, whose products are exact (under the interpreter,
    whose 16-bit dots are wrong, on float32 copies); else tiles.mm on `acc` copies."""
    if RAW:
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b)
    else:
        return mm(a.to(acc), b.to(acc), PRECISION)


@triton.jit
def load_columns(X, b, t, h, stride_b, stride_t, stride_h, index, mask):
    """Rows t of head h of a `[B, T, H, X]` tensor at columns `index`, as a transposed
    [columns, rows] tile in X's dtype (zero where masked)."""
    at = b * stride_b + t[None, :] * stride_t + h * stride_h + index[:, None]
    return tl.load(X + at, mask=mask, other=0.0)


@triton.jit
def load_raw_values(V, b, t, h, stride_b, stride_t, stride_h, cols, t_ok, DV,
                    ONES: tl.constexpr, acc: tl.constexpr):
    """tiles.load_values in V's dtype: the values at columns < DV and, with ONES, the
    column of ones at DV (set in `acc`, which holds V's values, as the interpreter forms
    no 16-bit scalar)."""
    v = tl.load(V + b * stride_b + t[:, None] * stride_t + h * stride_h + cols[None, :],
                mask=t_ok[:, None] & (cols < DV)[None, :], other=0.0)
    if ONES:
        v = tl.where(t_ok[:, None] & (cols == DV)[None, :], 1.0, v.to(acc)).to(v.dtype)
    return v


@triton.jit
def loop_bound(NT, NT_BOUND: tl.constexpr):
    """The state loop's steps: NT_BOUND (a compile-time power of two >= NT) under the
    interpreter, which cannot loop to a runtime bound; NT on a GPU. (Not an assignment in
    the kernel: the interpreter turns every assigned value into a tensor.)"""
    if INTERPRETED:
        return NT_BOUND
    else:
        return NT


@triton.jit
def chain_tiled_states_kernel(K, V, LOG_G, S0, STARTS, S1, T, H, DK, DV, W, NT,
                              stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                              stride_vh, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              NT_BOUND: tl.constexpr, ONES: tl.constexpr,
                              HAS_DECAY: tl.constexpr, HAS_S0: tl.constexpr,
                              KV_RAW: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = S1.dtype.element_ty
    b, h, bh, rk, rv, tile_ok, final = walk_program(H, DK, W, BK, BV)
    S = load_state(S0, final, tile_ok, HAS_S0, BK, BV, acc)
    rows = tl.arange(0, C)
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
    for chunk in range(loop_bound(NT, NT_BOUND)):
        tl.store(STARTS + state_offsets(bh, NT, chunk, DK, W, rk, rv), S,
                 mask=tile_ok & (chunk < NT))
        t = chunk * C + rows
        t_ok = t < T
        kt = load_columns(K, b, t, h, stride_kb, stride_kt, stride_kh, rk,
                          (rk < DK)[:, None] & t_ok[None, :])
        v = load_raw_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV, ONES,
                                acc)
        if HAS_DECAY:
            n = tl.maximum(tl.minimum(T - chunk * C, C), 0)
            g_out = tl.where(t_ok, tl.exp(tl.maximum(n - 1 - rows, 0).to(acc) * log_g), 0.0)
            S = S * tl.exp(n.to(acc) * log_g) + mm(kt.to(acc) * g_out[None, :].to(acc),
                                                   v.to(acc), PRECISION)
        else:
            S = S + exact_mm(kt, v, KV_RAW, PRECISION, acc)
    tl.store(S1 + final, S, mask=tile_ok)


@triton.jit
def chain_tiled_output_kernel(Q, K, V, LOG_G, STARTS, ACC, O, T, H, DK, DV, W, NT,
                              stride_qb, stride_qt, stride_qh, stride_kb, stride_kt,
                              stride_kh, stride_vb, stride_vt, stride_vh,
                              C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                              NK: tl.constexpr, HAS_STATE: tl.constexpr, ONES: tl.constexpr,
                              HAS_DECAY: tl.constexpr, QK_RAW: tl.constexpr,
                              PRECISION: tl.constexpr):
    acc: tl.constexpr = ACC.dtype.element_ty  # the link's dtype (O, STARTS may be narrower)
    pid_v, chunk, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    t = chunk * C + tl.arange(0, C)
    t_ok = t < T
    rv = pid_v * BV + tl.arange(0, BV)
    weights, g_in, _ = decay_terms(chunk, T, LOG_G, h, C, HAS_DECAY, acc)
    out = tl.zeros([C, BV], dtype=acc)
    scores = tl.zeros([C, C], dtype=acc)
    for i in range(NK):
        rk = i * BK + tl.arange(0, BK)
        q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk,
                      t_ok[:, None] & (rk < DK)[None, :], Q.dtype.element_ty)
        kt = load_columns(K, b, t, h, stride_kb, stride_kt, stride_kh, rk,
                          (rk < DK)[:, None] & t_ok[None, :])
        if HAS_STATE:
            S = tl.load(STARTS + state_offsets(bh, NT, chunk, DK, W, rk, rv),
                        mask=(rk < DK)[:, None] & (rv < W)[None, :], other=0.0)
            out += mm(q.to(acc), S, PRECISION)
        scores += exact_mm(q, kt, QK_RAW, PRECISION, acc)
    v = load_raw_values(V, b, t, h, stride_vb, stride_vt, stride_vh, rv, t_ok, DV,
                        ONES, acc).to(acc)
    out = (out * g_in[:, None] + mm(causal(scores, weights, C), finite(v), PRECISION)
           + poison_from(bad_rows(v))[:, None])
    tl.store(O + packed_offsets(b, t, h, T, H, W, rv), out,
             mask=t_ok[:, None] & (rv < W)[None, :])
