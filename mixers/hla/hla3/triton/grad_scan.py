"""The causal hla3 backward's second stage: the gradients of the chunks' end states, from
the last chunk to the first, one program per (value block, batch x head). It reads each
chunk's terms (grad_terms.py), writes the gradients of the chunk's end states over them in
place (dF' over XF, dP' over XP, this value block's part of dS' over its Y) and applies

    dP <- dP + XP + M dF,   dS <- dS + Y + dF Z^T,   dF <- dF + XF      (with the old dF)

ending at the gradients of the call's start states (dS in parts, one per value block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mixers.hla.tiles import chunk_offsets, value_block


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
    for step in range(NT_BOUND):  # chunks past the last load zeros and change nothing
        chunk = NT_BOUND - 1 - step
        real = chunk < NT
        at, at_m = chunk_offsets(bh, NT, chunk, D, DVP, dk, cols)
        at_y = ((bh * NT + chunk) * BLOCKS + pid_v).to(tl.int64) * D * D \
            + dk[:, None] * D + dk[None, :]
        XFc = tl.load(XF + at, mask=state_ok & real, other=0.0)
        XPc = tl.load(XP + at, mask=state_ok & real, other=0.0)
        Z = tl.load(XZ + at, mask=state_ok & real, other=0.0)
        Y = tl.load(XY + at_y, mask=m_ok & real, other=0.0)
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
