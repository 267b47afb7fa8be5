"""The causal hla3 forward's second stage: the chunks' start states in order, one program
per (value block, batch x head), from each chunk's terms (increments.py):

    F <- F + S (G P + Hm) + J P + Lm,   S <- S + dS,   P <- P + dP   (with the old S, P)

Each program carries the whole d x d S (the first value block writes its start states to a
buffer of their own: the others still read the chunks' dS) and its columns of P and F,
whose start states it writes over dP and Hm in place.

No load depends on the carried states, so the loop is bound by load latency unless loads
are issued ahead of their use. Triton's pipeliner streams G and J, tl.dot operands,
through shared-memory stages on its own; dS, dP, Hm and Lm it leaves in the step that uses
them, so the kernel loads those one chunk ahead by hand, before the chunk's in-place
stores (the next chunk's tiles are at other addresses), and the next chunk's memory
latency overlaps this chunk's work.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_offsets, value_block


@triton.jit
def hla3_scan_kernel(S0, P0, F0, S1, P1, F1, SS, XS, XG, XJ, XP, XH, XL, H, D, DVP, NT,
                     BD: tl.constexpr, BV: tl.constexpr, NT_BOUND: tl.constexpr,
                     PRECISION: tl.constexpr):
    acc: tl.constexpr = XP.dtype.element_ty
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    moment = bh * D * D + dk[:, None] * D + dk[None, :]
    m_ok = d_ok[:, None] & d_ok[None, :]
    S = tl.load(S0 + moment, mask=m_ok, other=0.0).to(acc)
    P = tl.load(P0 + state, mask=state_ok, other=0.0).to(acc)
    F = tl.load(F0 + state, mask=state_ok, other=0.0).to(acc)
    at, at_m = chunk_offsets(bh, NT, 0, D, DVP, dk, cols)
    next_dS = tl.load(XS + at_m, mask=m_ok & (0 < NT), other=0.0)
    next_dP = tl.load(XP + at, mask=state_ok & (0 < NT), other=0.0)
    next_Hm = tl.load(XH + at, mask=state_ok & (0 < NT), other=0.0)
    next_Lm = tl.load(XL + at, mask=state_ok & (0 < NT), other=0.0)
    for chunk in range(NT_BOUND):  # steps past the last chunk load zeros and change nothing
        real = chunk < NT
        at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
        # this chunk's tiles were loaded a step ago; the next chunk's now
        dS, dP, Hm, Lm = next_dS, next_dP, next_Hm, next_Lm
        after = chunk + 1 < NT
        at_next, at_m_next = chunk_offsets(bh, NT, chunk + 1, D, DVP, dk, cols)
        next_dS = tl.load(XS + at_m_next, mask=m_ok & after, other=0.0)
        next_dP = tl.load(XP + at_next, mask=state_ok & after, other=0.0)
        next_Hm = tl.load(XH + at_next, mask=state_ok & after, other=0.0)
        next_Lm = tl.load(XL + at_next, mask=state_ok & after, other=0.0)
        G = tl.load(XG + at_m, mask=m_ok & real, other=0.0)
        J = tl.load(XJ + at_m, mask=m_ok & real, other=0.0)
        tl.store(SS + at_m, S, mask=m_ok & real & (pid_v == 0))
        tl.store(XP + at, P, mask=state_ok & real)  # the chunk's start states, in place
        tl.store(XH + at, F, mask=state_ok & real)
        GPH = tl.dot(G, P, input_precision=PRECISION) + Hm
        F += tl.dot(S, GPH, input_precision=PRECISION)
        F += tl.dot(J, P, input_precision=PRECISION) + Lm
        S += dS
        P += dP
    tl.store(S1 + moment, S, mask=m_ok & (pid_v == 0))
    tl.store(P1 + state, P, mask=state_ok)
    tl.store(F1 + state, F, mask=state_ok)
