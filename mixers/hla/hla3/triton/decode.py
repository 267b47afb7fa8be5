"""The causal hla3 decode step: S^K <- S^K + k k^T, P <- P + k v^T, F <- F + (S^K q)(q^T P),
o = q^T F, one program per (value block, batch x head) over packed states (the first
program writes S^K back). New states go to buffers of their own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.hla.tiles import value_block
from mixers.hla.hla3.triton.plan import HLA3Plan


@triton.jit
def hla3_step_kernel(Q, K, V, S0, P0, F0, O, S1, P1, F1, H, D, DV, DVP,
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                     BD: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    moment = bh * D * D + dk[:, None] * D + dk[None, :]
    moment_ok = d_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + dk, mask=d_ok, other=0.0).to(acc)
    k = tl.load(K + b * stride_kb + h * stride_kh + dk, mask=d_ok, other=0.0).to(acc)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols, mask=cols < DV, other=0.0).to(acc)
    if NORMALIZE:
        v = tl.where(cols == DV, 1.0, v).to(acc)
    S = tl.load(S0 + moment, mask=moment_ok, other=0.0).to(acc) + k[:, None] * k[None, :]
    P = tl.load(P0 + state, mask=state_ok, other=0.0).to(acc) + k[:, None] * v[None, :]
    Sq = tl.sum(S * q[None, :], 1)
    qP = tl.sum(q[:, None] * P, 0)
    F = tl.load(F0 + state, mask=state_ok, other=0.0).to(acc) + Sq[:, None] * qP[None, :]
    out = tl.sum(q[:, None] * F, 0)
    tl.store(O + bh * DVP + cols, out, mask=cols < DVP)
    tl.store(S1 + moment, S, mask=moment_ok & (pid_v == 0))
    tl.store(P1 + state, P, mask=state_ok)
    tl.store(F1 + state, F, mask=state_ok)


def step(q, k, v, S0, P0, F0, normalize: bool, plan: HLA3Plan):
    """One token: `[B, H, *]` q, k, v and packed states -> (packed output `[B, H, Dv(+1)]`,
    new S, P, F)."""
    B, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    S0, P0, F0 = S0.contiguous(), P0.contiguous(), F0.contiguous()
    out = torch.empty(B, H, width, dtype=P0.dtype, device=q.device)
    S1, P1, F1 = torch.empty_like(S0), torch.empty_like(P0), torch.empty_like(F0)
    grid = (triton.cdiv(width, plan.block_v), B * H)
    hla3_step_kernel[grid](
        q, k, v, S0, P0, F0, out, S1, P1, F1, H, D, Dv, width,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BD=plan.block_d, BV=plan.block_v, NORMALIZE=normalize, num_warps=plan.warps)
    return out, S1, P1, F1
