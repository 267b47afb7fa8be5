"""hla3_triton_packed: causal third-order HLA as a chain of three causal linear attentions
(mixers/chain) over the same queries,

    Y = la(q, k, k; S0),   R = la(q, k, v; P0),   o = la(q, Y, R; F0),

(y_u = S^K_u q_u, r_u = q_u^T P_u, F_t = sum_{u<=t} y_u r_u^T), as one differentiable op.
The first link is the chain's key-moments link (launch.key_moments_forward: S^K in and out
transposed).
The forward keeps Y, R and the three links' chunk start states when a gradient will be
asked for; the backward runs the links in reverse: the last link's key gradient is dY, its
value gradient dR, and the first link adds its value gradient into dk. Y and R are
computed, so the last link's backward adds no NaN to their gradients' rows."""

from __future__ import annotations

import torch

from mixers import chain
from mixers.hla.ahla2.state import compute_dtype
from mixers.chain.launch import (key_moments_backward, key_moments_forward,
                                     last_dim_contiguous)


class _HLA3Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, P0, F0, normalize, chunk_size, need_final):
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dtype = compute_dtype(q.dtype)
        D, width = q.shape[-1], v.shape[-1] + normalize
        keys_plan = chain.plan_chain(D, D, q.dtype, chunk_size)
        values_plan = chain.plan_chain(D, width, q.dtype, chunk_size)
        keep = any(ctx.needs_input_grad[:6])
        Y, S1, S_starts = key_moments_forward(q, k, S0, None, keys_plan, dtype, keep,
                                              need_final)
        R, P1, P_starts = chain.forward(q, k, v, P0, None, normalize, values_plan, dtype, keep,
                                        need_final=need_final)
        out, F1, F_starts = chain.forward(q, Y, R, F0, None, False, values_plan, dtype, keep,
                                          out_dtype=dtype if normalize else q.dtype,
                                          need_final=need_final)
        if keep:
            ctx.save_for_backward(q, k, v, Y, R, S_starts, P_starts, F_starts)
        ctx.normalize, ctx.plans = normalize, (keys_plan, values_plan)
        ctx.starts = tuple(x is not None for x in (S0, P0, F0))
        return out, S1, P1, F1

    @staticmethod
    def backward(ctx, grad_out, grad_S, grad_P, grad_F):
        q, k, v, Y, R, S_starts, P_starts, F_starts = ctx.saved_tensors
        keys_plan, values_plan = ctx.plans
        if grad_out is None:
            grad_out = torch.zeros_like(R)
        dq = torch.zeros(q.shape, dtype=R.dtype, device=q.device)
        dk, dY, dR = torch.zeros_like(dq), torch.zeros_like(dq), torch.zeros_like(R)
        dv = torch.zeros(v.shape, dtype=R.dtype, device=v.device)
        has_S0, has_P0, has_F0 = ctx.starts
        dF0 = chain.backward(q, Y, R, None, False, F_starts, grad_out, grad_F, dq, dY, dR,
                             values_plan, want_dS0=has_F0, poison=(True, False, False))
        dP0 = chain.backward(q, k, v, None, ctx.normalize, P_starts, dR, grad_P, dq, dk, dv,
                             values_plan, want_dS0=has_P0)
        dS0 = key_moments_backward(q, k, None, S_starts, dY, grad_S, dq, dk, keys_plan,
                                   want_dS0=has_S0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, dP0, dF0, None, None, None


def hla3_triton_packed(q, k, v, S0, P0, F0, normalize: bool, chunk_size: int = 64,
                       need_final: bool = True):
    """`[B, T, H, D]` q, k, `[B, T, H, Dv]` v (any strides), packed start states (S^K
    `[B, H, D, D]`, P and F `[B, H, D, Dv(+1)]`) in the compute dtype, or None for zeros ->
    (packed outputs `[B, T, H, Dv(+1)]`, in the compute dtype when normalized and in q's
    dtype when not, S, P, F; the states None when not `need_final` and T fits one chunk:
    no state is computed then). Inputs are taken as given (the caller checks them); the
    kernels keep the non-finite rule (mixers/chain): read the outputs out with
    mixers.common.kernel_read_out."""
    return _HLA3Chain.apply(q, k, v, S0, P0, F0, normalize, chunk_size, need_final)
