"""The causal hla3 backward's second stage: the gradients of the chunks' end states, from
the last chunk to the first, one program per (value block, batch x head). It reads each
chunk's terms (grad_terms.py), writes the gradients of the chunk's end states over them in
place (dF' over XF, dP' over XP, this value block's part of dS' over its Y) and applies

    dP <- dP + XP + M dF,   dS <- dS + Y + dF Z^T,   dF <- dF + XF      (with the old dF)

ending at the gradients of the call's start states (dS in parts, one per value block).

No load depends on the carried gradients, so the loop is bound by load latency unless
loads are issued ahead of their use. Triton's pipeliner streams Z and M, tl.dot operands,
through shared-memory stages on its own; XF, XP and Y it leaves in the step that uses
them, so the kernel loads those one chunk ahead by hand (the chunk before, in this reverse
order), before the chunk's in-place stores (the next chunk's tiles are at other
addresses), and the next chunk's memory latency overlaps this chunk's work.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_offsets, value_block


@triton.jit
def _y_offsets(bh, NT, chunk, BLOCKS, pid_v, D, dk):
    """Offsets of value block pid_v's [D, D] tile of chunk `chunk` in the `[B * H, NT,
    BLOCKS, D, D]` Y terms."""
    return ((bh * NT + chunk) * BLOCKS + pid_v).to(tl.int64) * D * D \
        + dk[:, None] * D + dk[None, :]


@triton.jit
def hla3_grad_scan_kernel(DS1, DP1, DF1, DS0, DP0, DF0, XF, XP, XZ, XY, XM, B, H, D, DVP, NT,
                          BLOCKS, BD: tl.constexpr, BV: tl.constexpr,
                          NT_BOUND: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = XP.dtype.element_ty
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    moment = bh * D * D + dk[:, None] * D + dk[None, :]
    m_ok = d_ok[:, None] & d_ok[None, :]
    dS = tl.load(DS1 + moment, mask=m_ok & (pid_v == 0), other=0.0).to(acc)
    dP = tl.load(DP1 + state, mask=state_ok, other=0.0).to(acc)
    dF = tl.load(DF1 + state, mask=state_ok, other=0.0).to(acc)
    at, _ = chunk_offsets(bh, NT, NT_BOUND - 1, D, DVP, dk, cols)
    next_XF = tl.load(XF + at, mask=state_ok & (NT_BOUND - 1 < NT), other=0.0)
    next_XP = tl.load(XP + at, mask=state_ok & (NT_BOUND - 1 < NT), other=0.0)
    next_Y = tl.load(XY + _y_offsets(bh, NT, NT_BOUND - 1, BLOCKS, pid_v, D, dk),
                     mask=m_ok & (NT_BOUND - 1 < NT), other=0.0)
    for step in range(NT_BOUND):  # chunks past the last load zeros and change nothing
        chunk = NT_BOUND - 1 - step
        real = chunk < NT
        at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
        at_y = _y_offsets(bh, NT, chunk, BLOCKS, pid_v, D, dk)
        # this chunk's tiles were loaded a step ago; the chunk before's now
        XFc, XPc, Y = next_XF, next_XP, next_Y
        before = (chunk > 0) & (chunk - 1 < NT)
        at_next, _ = chunk_offsets(bh, NT, chunk - 1, D, DVP, dk, cols)
        next_XF = tl.load(XF + at_next, mask=state_ok & before, other=0.0)
        next_XP = tl.load(XP + at_next, mask=state_ok & before, other=0.0)
        next_Y = tl.load(XY + _y_offsets(bh, NT, chunk - 1, BLOCKS, pid_v, D, dk),
                         mask=m_ok & before, other=0.0)
        Z = tl.load(XZ + at, mask=state_ok & real, other=0.0)
        M = tl.load(XM + at_m, mask=m_ok & real, other=0.0)
        tl.store(XF + at, dF, mask=state_ok & real)  # the chunk's end-state gradients
        tl.store(XP + at, dP, mask=state_ok & real)
        tl.store(XY + at_y, dS, mask=m_ok & real)
        dP += XPc + tl.dot(M, dF, input_precision=PRECISION)
        dS += Y + tl.dot(dF, tl.trans(Z), input_precision=PRECISION)
        dF += XFc
    tl.store(DS0 + pid_v * B * H * D * D + moment, dS, mask=m_ok)
    tl.store(DP0 + state, dP, mask=state_ok)
    tl.store(DF0 + state, dF, mask=state_ok)
