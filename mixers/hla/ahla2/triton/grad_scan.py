"""The ahla2 backward's second stage: the gradients of the chunks' end states, from the
last chunk to the first, one program per (value block, batch x head). It reads each chunk's
terms (grad_terms.py), writes the gradients of the chunk's end states (dP', dE') over
them, in place, and applies

    dP <- g^n dP + M^T dE + R,    dE <- g^n dE + S      (dP with the dE before the update)

ending at the gradients of the call's start states.

No load depends on the carried gradients, so the loop is bound by load latency unless
loads are issued ahead of their use. Triton's pipeliner streams M, a tl.dot operand,
through shared-memory stages on its own; S and R it leaves in the step that uses them, so
the kernel loads those one chunk ahead by hand (AHEAD: the chunk before, in this reverse
order), before the chunk's in-place stores (the next chunk's tiles are at other
addresses), and the next chunk's memory latency overlaps this chunk's work. At a key
block of 128 the registers are full: the two extra tiles would spill, and the scan loads
them in the step that uses them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_offsets, value_block


@triton.jit
def ahla2_grad_scan_kernel(LOG_G, DP1, DE1, DP0, DE0, XS, XR, MS, T, H, D, DVP, NT,
                           C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                           NT_BOUND: tl.constexpr, HAS_DECAY: tl.constexpr,
                           PRECISION: tl.constexpr):
    acc: tl.constexpr = XS.dtype.element_ty
    AHEAD: tl.constexpr = BD < 128  # S and R one chunk ahead (the module docstring)
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    dP = tl.load(DP1 + state, mask=state_ok, other=0.0).to(acc)
    dE = tl.load(DE1 + state, mask=state_ok, other=0.0).to(acc)
    log_g = 0.0
    if HAS_DECAY:
        log_g = tl.load(LOG_G + h).to(acc)
    m_ok = d_ok[:, None] & d_ok[None, :]
    if AHEAD:
        at, _ = chunk_offsets(bh, NT, NT_BOUND - 1, D, DVP, dk, cols)
        next_S = tl.load(XS + at, mask=state_ok & (NT_BOUND - 1 < NT), other=0.0)
        next_R = tl.load(XR + at, mask=state_ok & (NT_BOUND - 1 < NT), other=0.0)
    for step in range(NT_BOUND):  # chunks past the last load zeros and change nothing
        chunk = NT_BOUND - 1 - step
        real = chunk < NT
        at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
        if AHEAD:  # this chunk's tiles were loaded a step ago; the chunk before's now
            S, R = next_S, next_R
            before = (chunk > 0) & (chunk - 1 < NT)
            at_next, _ = chunk_offsets(bh, NT, chunk - 1, D, DVP, dk, cols)
            next_S = tl.load(XS + at_next, mask=state_ok & before, other=0.0)
            next_R = tl.load(XR + at_next, mask=state_ok & before, other=0.0)
        else:
            S = tl.load(XS + at, mask=state_ok & real, other=0.0)
            R = tl.load(XR + at, mask=state_ok & real, other=0.0)
        M = tl.load(MS + at_m, mask=m_ok & real, other=0.0)
        tl.store(XS + at, dP, mask=state_ok & real)  # the chunk's end-state gradients
        tl.store(XR + at, dE, mask=state_ok & real)
        if HAS_DECAY:
            g_n = tl.exp(tl.maximum(tl.minimum(T - chunk * C, C), 0).to(acc) * log_g)
            dP = dP * g_n + tl.dot(tl.trans(M), dE, input_precision=PRECISION) + R
            dE = dE * g_n + S
        else:
            dP += tl.dot(tl.trans(M), dE, input_precision=PRECISION) + R
            dE += S
    tl.store(DP0 + state, dP, mask=state_ok)
    tl.store(DE0 + state, dE, mask=state_ok)
