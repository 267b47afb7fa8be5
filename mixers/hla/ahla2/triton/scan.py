"""The ahla2 forward's second stage: the states over the chunks, one program per (value
block, batch x head) in chunk order. It reads each chunk's increments (increments.py),
writes the chunk's start states (P, E) over them, in place, and applies

    P <- g^n P + dP,    E <- g^n E + M P + N      (E with the P before the update)

Start states are what the output stage (output.py) and the backward read. Per chunk a
program moves one d x d M and two d x block_v tiles, and multiplies once: the heavy
products stay in the chunk-parallel stages.

No load depends on the carried states, so the loop is bound by load latency unless loads
are issued ahead of their use. Triton's pipeliner streams M, a tl.dot operand, through
shared-memory stages on its own; dP and N it leaves in the step that uses them, so the
kernel loads those one chunk ahead by hand (AHEAD), before the chunk's in-place stores
(the next chunk's tiles are at other addresses), and the next chunk's memory latency
overlaps this chunk's work. At a key block of 128 the registers are full: the two extra
tiles would spill, and the scan loads them in the step that uses them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_offsets, value_block


@triton.jit
def ahla2_scan_kernel(LOG_G, P0, E0, P1, E1, XP, XE, MS, T, H, D, DVP, NT,
                      C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                      NT_BOUND: tl.constexpr, HAS_DECAY: tl.constexpr,
                      PRECISION: tl.constexpr):
    acc: tl.constexpr = XP.dtype.element_ty
    AHEAD: tl.constexpr = BD < 128  # dP and N one chunk ahead (the module docstring)
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    P = tl.load(P0 + state, mask=state_ok, other=0.0).to(acc)
    E = tl.load(E0 + state, mask=state_ok, other=0.0).to(acc)
    log_g = 0.0
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
    m_ok = d_ok[:, None] & d_ok[None, :]
    if AHEAD:
        at, _ = chunk_offsets(bh, NT, 0, D, DVP, dk, cols)
        next_dP = tl.load(XP + at, mask=state_ok & (0 < NT), other=0.0)
        next_N = tl.load(XE + at, mask=state_ok & (0 < NT), other=0.0)
    for chunk in range(NT_BOUND):  # steps past the last chunk load zeros and change nothing
        real = chunk < NT
        at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
        if AHEAD:  # this chunk's tiles were loaded a step ago; the next chunk's now
            dP, N = next_dP, next_N
            at_next, _ = chunk_offsets(bh, NT, chunk + 1, D, DVP, dk, cols)
            next_dP = tl.load(XP + at_next, mask=state_ok & (chunk + 1 < NT), other=0.0)
            next_N = tl.load(XE + at_next, mask=state_ok & (chunk + 1 < NT), other=0.0)
        else:
            dP = tl.load(XP + at, mask=state_ok & real, other=0.0)
            N = tl.load(XE + at, mask=state_ok & real, other=0.0)
        M = tl.load(MS + at_m, mask=m_ok & real, other=0.0)
        tl.store(XP + at, P, mask=state_ok & real)  # the chunk's start states, in place
        tl.store(XE + at, E, mask=state_ok & real)
        if HAS_DECAY:
            g_n = tl.exp(tl.maximum(tl.minimum(T - chunk * C, C), 0).to(acc) * log_g)
            E = E * g_n + tl.dot(M, P, input_precision=PRECISION) + N
            P = P * g_n + dP
        else:
            E += tl.dot(M, P, input_precision=PRECISION) + N
            P += dP
    tl.store(P1 + state, P, mask=state_ok)
    tl.store(E1 + state, E, mask=state_ok)
