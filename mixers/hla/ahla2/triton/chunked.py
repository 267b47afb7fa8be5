"""ahla2_triton_packed: AHLA as a chain of two causal linear attentions (mixers/chain)
over the same queries, keys and decay,

    X = la(q, k, v; P0, g),   o = la(q, k, X; E0, g),

as one differentiable op. The forward keeps X (`[B, T, H, Dv(+1)]`) and both links' chunk
start states (`[B * H, NT, D, Dv(+1)]` each, in the compute dtype) when a gradient will be
asked for; the backward runs the links in reverse, adding dq and dk of both into one
buffer each. X is computed, so the second link's backward adds no NaN to dX's rows (its
non-finite rows read as 0 there; the first link's backward poisons v's own rows)."""

from __future__ import annotations

import torch

from mixers import chain
from mixers.chain.launch import last_dim_contiguous, log_decay
from mixers.hla.ahla2.state import compute_dtype


class _AHLA2Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, P0, E0, decay, normalize, chunk_size, need_final):
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dtype = compute_dtype(q.dtype)
        plan = chain.plan_chain(q.shape[-1], v.shape[-1] + normalize, q.dtype, chunk_size)
        log_g = log_decay(decay, dtype)
        keep = any(ctx.needs_input_grad[:5])
        X, P1, P_starts = chain.forward(q, k, v, P0, log_g, normalize, plan, dtype, keep,
                                        need_final=need_final)
        out, E1, E_starts = chain.forward(q, k, X, E0, log_g, False, plan, dtype, keep,
                                          out_dtype=dtype if normalize else q.dtype,
                                          need_final=need_final)
        if keep:
            ctx.save_for_backward(q, k, v, X, P_starts, E_starts)
        ctx.log_g, ctx.normalize, ctx.plan = log_g, normalize, plan
        ctx.starts = (P0 is not None, E0 is not None)
        return out, P1, E1

    @staticmethod
    def backward(ctx, grad_out, grad_P, grad_E):
        q, k, v, X, P_starts, E_starts = ctx.saved_tensors
        dtype = X.dtype
        if grad_out is None:
            grad_out = torch.zeros_like(X)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk, dX = torch.zeros_like(dq), torch.zeros_like(X)
        dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
        has_P0, has_E0 = ctx.starts
        dE0 = chain.backward(q, k, X, ctx.log_g, False, E_starts, grad_out, grad_E, dq, dk, dX,
                             ctx.plan, want_dS0=has_E0, poison=(True, True, False))
        dP0 = chain.backward(q, k, v, ctx.log_g, ctx.normalize, P_starts, dX, grad_P, dq, dk,
                             dv, ctx.plan, want_dS0=has_P0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dP0, dE0, None, None, None, None


def ahla2_triton_packed(q, k, v, P0, E0, decay, normalize: bool, chunk_size: int = 64,
                        need_final: bool = True):
    """`[B, T, H, D]` q, k, `[B, T, H, Dv]` v (any strides), packed start states
    `[B, H, D, Dv(+1)]` in the compute dtype, or None for zeros -> (packed outputs
    `[B, T, H, Dv(+1)]`, in the compute dtype when normalized and in q's dtype when not, P,
    E; P and E None when not `need_final` and T fits one chunk: no state is computed then).
    Inputs are taken as given (the caller checks them); the kernels keep the non-finite rule
    (mixers/chain): read the outputs out with mixers.common.kernel_read_out."""
    return _AHLA2Chain.apply(q, k, v, P0, E0, decay, normalize, chunk_size, need_final)
