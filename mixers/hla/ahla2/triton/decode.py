"""The ahla2 decode step (Alg. 2): per token, P <- g P + k v^T, E <- g E + k (q^T P),
o = q^T E, one program per (value block, batch x head) over packed `[B, H, D, Dv(+1)]`
states (the ones column of the denominator when normalized). New states are written to
buffers of their own: the caller's state is never changed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.tiles import value_block
from mixers.hla.ahla2.triton.plan import AHLA2Plan


@triton.jit
def ahla2_step_kernel(Q, K, V, G, P0, E0, O, P1, E1, H, D, DV, DVP,
                      stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                      BD: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr,
                      HAS_DECAY: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    q = tl.load(Q + b * stride_qb + h * stride_qh + dk, mask=d_ok, other=0.0).to(acc)
    k = tl.load(K + b * stride_kb + h * stride_kh + dk, mask=d_ok, other=0.0).to(acc)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols, mask=cols < DV, other=0.0).to(acc)
    if NORMALIZE:
        v = tl.where(cols == DV, 1.0, v).to(acc)
    P = tl.load(P0 + state, mask=state_ok, other=0.0).to(acc)
    E = tl.load(E0 + state, mask=state_ok, other=0.0).to(acc)
    if HAS_DECAY:
        g = tl.load(G + h).to(acc)
        P = P * g
        E = E * g
    P += k[:, None] * v[None, :]
    qP = tl.sum(q[:, None] * P, 0)
    E += k[:, None] * qP[None, :]
    out = tl.sum(q[:, None] * E, 0)
    tl.store(O + bh * DVP + cols, out, mask=cols < DVP)
    tl.store(P1 + state, P, mask=state_ok)
    tl.store(E1 + state, E, mask=state_ok)


def step(q, k, v, P0, E0, decay, normalize: bool, plan: AHLA2Plan):
    """One token: `[B, H, *]` q, k, v and packed states -> (packed output `[B, H, Dv(+1)]`,
    new P, new E)."""
    B, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    P0, E0 = P0.contiguous(), E0.contiguous()
    out = torch.empty(B, H, width, dtype=P0.dtype, device=q.device)
    P1, E1 = torch.empty_like(P0), torch.empty_like(E0)
    grid = (triton.cdiv(width, plan.block_v), B * H)
    ahla2_step_kernel[grid](
        q, k, v, decay.contiguous() if decay is not None else P0, P0, E0, out, P1, E1, H, D, Dv,
        width,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BD=plan.block_d, BV=plan.block_v, NORMALIZE=normalize, HAS_DECAY=decay is not None,
        num_warps=plan.warps)
    return out, P1, E1
