"""One link of the chain as a differentiable op of its own: causal linear attention on
features (mixers.linear_attn's impl="triton")."""

from __future__ import annotations

import torch

from mixers.chain.launch import backward, forward, last_dim_contiguous
from mixers.chain.plan import plan_chain


class _Link(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, ones, chunk_size, input_dtype, out_dtype, zero_start,
                need_final):
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        plan = plan_chain(q.shape[-1], v.shape[-1] + ones, input_dtype, chunk_size)
        keep = any(ctx.needs_input_grad[:4])
        out, S1, starts = forward(q, k, v, None if zero_start else S0, None, ones, plan,
                                  S0.dtype, keep, out_dtype=S0.dtype if ones else out_dtype,
                                  need_final=need_final)
        if keep:
            ctx.save_for_backward(q, k, v, starts)
        ctx.ones, ctx.plan, ctx.dtype = ones, plan, S0.dtype
        return out, S1

    @staticmethod
    def backward(ctx, grad_out, grad_S1):
        q, k, v, starts = ctx.saved_tensors
        dtype = ctx.dtype
        if grad_out is None:
            grad_out = torch.zeros(*v.shape[:-1], v.shape[-1] + ctx.ones, dtype=dtype,
                                   device=v.device)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk = torch.zeros_like(dq)
        dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
        dS0 = backward(q, k, v, None, ctx.ones, starts, grad_out, grad_S1, dq, dk, dv, ctx.plan,
                       want_dS0=starts is not None)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, None, None, None, None,
                None, None)


def linear_attention_packed(q, k, v, S0, ones: bool, chunk_size: int,
                            input_dtype: torch.dtype, out_dtype: torch.dtype | None = None,
                            zero_start: bool = False, need_final: bool = True):
    """`[B, T, H, F]` features q, k and `[B, T, H, Dv]` v (any float dtype), packed
    start state `[B, H, F, Dv + ones]` -> (packed outputs `[B, T, H, Dv + ones]`, final
    state); `input_dtype` (the dtype the caller's inputs came in) sets tl.dot's precision.
    The outputs come in S0's dtype with a ones column (the caller divides by it), else in
    `out_dtype` (default S0's). `zero_start`: S0 is zeros (its dtype is all the link reads);
    with it, a link of one chunk and not `need_final` keeps no state (final state None)."""
    return _Link.apply(q, k, v, S0, ones, chunk_size, input_dtype, out_dtype or S0.dtype,
                       zero_start, need_final)
