"""A chunk's decay weights, shared by the chain's kernels."""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.tiles import add_into, load_rows, mm, packed_offsets, poison_rows


@triton.jit
def decay_terms(chunk, T, LOG_G, h, C: tl.constexpr, HAS_DECAY: tl.constexpr,
                acc: tl.constexpr):
    """(weights, g_in, g_out) of chunk `chunk` (n = its real tokens): the causal weights
    g^(s - i) for i <= s (else 0), g_in[s] = g^(s + 1) and g_out[i] = g^(n - 1 - i) (0 past
    T); without decay the causal mask, ones, and g_out still 0 past T. (The scan forms the
    chunk's g^n itself.)"""
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    n = tl.maximum(tl.minimum(T - chunk * C, C), 0)
    inside = rows < n
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
        gap = tl.maximum(rows[:, None] - rows[None, :], 0).to(acc)
        weights = tl.where(causal, tl.exp(gap * log_g), 0.0).to(acc)
        g_in = tl.exp((rows + 1).to(acc) * log_g)
        g_out = tl.where(inside, tl.exp(tl.maximum(n - 1 - rows, 0).to(acc) * log_g),
                         0.0).to(acc)
    else:
        weights = tl.where(causal, 1.0, 0.0).to(acc)
        g_in = tl.full([C], 1.0, acc)
        g_out = tl.where(inside, 1.0, 0.0).to(acc)
    return weights, g_in, g_out


@triton.jit
def causal(x, weights, C: tl.constexpr):
    """weights * x on and below the diagonal, 0 above it, by selection: a later row's NaN
    or inf reads 0 there, not 0 * NaN (the non-finite rule)."""
    rows = tl.arange(0, C)
    return tl.where(rows[:, None] >= rows[None, :], x * weights, 0.0)


@triton.jit
def state_offsets(bh, NT, chunk, DK, W, rk, rv):
    """Offsets of one chunk's `[DK, W]` tile (rows rk, columns rv) in a per-chunk state
    buffer `[B * H, NT, DK, W]`."""
    base = (bh * NT + chunk).to(tl.int64) * DK * W
    return base + rk[:, None] * W + rv[None, :]


@triton.jit
def walk_program(H, DK, W, BK: tl.constexpr, BV: tl.constexpr):
    """(b, h, b x H + h, key rows, value columns, their mask, their offsets in a
    `[B, H, DK, W]` state) of a walk's program: grid (key block, value block, batch x head)."""
    pid_k, pid_v, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rk = pid_k * BK + tl.arange(0, BK)
    rv = pid_v * BV + tl.arange(0, BV)
    tile_ok = (rk < DK)[:, None] & (rv < W)[None, :]
    at = bh.to(tl.int64) * DK * W + rk[:, None] * W + rv[None, :]
    return bh // H, bh % H, bh, rk, rv, tile_ok, at


@triton.jit
def load_state(X, at, ok, PRESENT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               acc: tl.constexpr):
    """A walk's starting tile: X's tile when PRESENT, else zeros."""
    if PRESENT:
        tile = tl.load(X + at, mask=ok, other=0.0).to(acc)
    else:
        tile = tl.zeros([BK, BV], dtype=acc)
    return tile


@triton.jit
def chunk_program(H, T, C: tl.constexpr):
    """(chunk, block, b, h, b x H + h, the chunk's token rows, rows < T) of a chunk program:
    grid (chunk, block of key or value columns, batch x head)."""
    chunk, block, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = chunk * C + tl.arange(0, C)
    return chunk, block, bh // H, bh % H, bh, t, t < T


@triton.jit
def load_qk(Q, K, b, t, h, t_ok, rk, DK, stride_qb, stride_qt, stride_qh, stride_kb,
            stride_kt, stride_kh, acc: tl.constexpr):
    """Rows t of q and k at key columns rk (zero past T and past DK), in `acc`, and their
    mask."""
    rows_ok = t_ok[:, None] & (rk < DK)[None, :]
    q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, rk, rows_ok, acc)
    k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, rk, rows_ok, acc)
    return q, k, rows_ok


@triton.jit
def state_key_terms(dq, dk, dO, v, STARTS, ENDS, bh, NT, chunk, DK, W, rk, rv,
                    PRECISION: tl.constexpr):
    """(dq + dO S^T, dk + V dS^T) over one (key block, value block) tile of the chunk's start
    state S (STARTS) and end-state gradient dS (ENDS): the state terms of dQ and dK."""
    at = state_offsets(bh, NT, chunk, DK, W, rk, rv)
    tile_ok = (rk < DK)[:, None] & (rv < W)[None, :]
    S = tl.load(STARTS + at, mask=tile_ok, other=0.0)
    dS = tl.load(ENDS + at, mask=tile_ok, other=0.0)
    dq += mm(dO, tl.trans(S), PRECISION)
    dk += mm(v, tl.trans(dS), PRECISION)
    return dq, dk


@triton.jit
def add_key_grads(DQ, DK_OUT, dq, dk, M, q, k, g_in, g_out, bad_q, bad_k, b, t, h, T, H, DK,
                  rk, rows_ok, POISON_Q: tl.constexpr, POISON_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """dQ = g_in * dq + M K and dK = g_out * dk + M^T Q for one key block of the chunk (NaN
    rows where q or k had a non-finite entry, if POISON_Q / POISON_K), added into the
    `[B, T, H, DK]` buffers DQ and DK_OUT."""
    dq = dq * g_in[:, None] + mm(M, k, PRECISION)
    dk = dk * g_out[:, None] + mm(tl.trans(M), q, PRECISION)
    if POISON_Q:
        dq += poison_rows(bad_q)[:, None]
    if POISON_K:
        dk += poison_rows(bad_k)[:, None]
    at = packed_offsets(b, t, h, T, H, DK, rk)
    add_into(DQ, at, rows_ok, dq)
    add_into(DK_OUT, at, rows_ok, dk)
