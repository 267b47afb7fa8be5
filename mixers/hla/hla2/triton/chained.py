"""Masked hla2 as a chain of two causal linear attentions (mixers/chain), for inputs the
fused kernels of this package do not take (head dims above 256, fp16 and fp32 above 128,
float64) and the chain does (head dims up to 512, any float dtype):

    Y = la(q, k, k; S0, g),   o = la(q, Y, v; A0, g^2)

The inner sum of the masked operator is sum_{i<=j} w(q_t,k_i) w(q_j,k_i) = q_t^T S_j q_j,
so o_t = q_t^T A_t with A_t = g^2 A_{t-1} + (S_t q_t) v_t^T and S_t = g S_{t-1} + k_t k_t^T:
the spec's equivalent state (A, section 1), with the masked decay form's weights
g^((t-i)+(t-j)) = g^(j-i) g^(2(t-j)). The first link's rows are y_j = S_j q_j (the chain's
key-moments link, launch.key_moments_forward, as hla3 begins); the second link's state is A, with the denominator's column a when normalized. No ridge, no
paper decay form, no multi-query (the fused kernels or the chunk form run those)."""

from __future__ import annotations

import torch

from mixers import chain
from mixers.chain.launch import (key_moments_backward, key_moments_forward,
                                     last_dim_contiguous, log_decay)
from mixers.chain.plan import MAX_HEAD_DIM, device_reason
from mixers.common import kernel_read_out
from mixers.hla.hla2.state import compute_dtype, pack, unpack


def chain_unsupported_reason(q, k, v, *, masked, ridge, decay_form, decay) -> str | None:
    """None when the chain runs these inputs and options, else why not."""
    if not masked:
        return "the chain implements masked hla2 only"
    if ridge != 0:
        return "the chain does not implement ridge != 0"
    if decay is not None and decay_form == "paper":
        return "the chain implements the masked decay form only"
    reason = device_reason(q)
    if reason is not None:
        return reason
    if not q.dtype.is_floating_point:
        return f"the chain takes floating-point inputs, got {q.dtype}"
    if k.shape[2] != q.shape[2]:
        return "the chain takes k and v with as many heads as q (no multi-query)"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return (f"the chain takes head dims up to {MAX_HEAD_DIM}, got D={q.shape[-1]}, "
                f"Dv={v.shape[-1]}")
    return None


class _HLA2Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, A0, decay, normalize, chunk_size, need_final):
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        dtype = compute_dtype(q.dtype)
        D, width = q.shape[-1], v.shape[-1] + normalize
        keys_plan = chain.plan_chain(D, D, q.dtype, chunk_size)
        values_plan = chain.plan_chain(D, width, q.dtype, chunk_size)
        log_g = log_decay(decay, dtype)
        log_g2 = 2 * log_g if log_g is not None else None
        keep = any(ctx.needs_input_grad[:5])
        Y, S1, S_starts = key_moments_forward(q, k, S0, log_g, keys_plan, dtype, keep,
                                              need_final)
        out, A1, A_starts = chain.forward(q, Y, v, A0, log_g2, normalize, values_plan, dtype,
                                          keep, out_dtype=dtype if normalize else q.dtype,
                                          need_final=need_final)
        if keep:
            ctx.save_for_backward(q, k, v, Y, S_starts, A_starts)
        ctx.logs, ctx.normalize, ctx.plans = (log_g, log_g2), normalize, (keys_plan, values_plan)
        ctx.starts = (S0 is not None, A0 is not None)
        return out, S1, A1

    @staticmethod
    def backward(ctx, grad_out, grad_S, grad_A):
        q, k, v, Y, S_starts, A_starts = ctx.saved_tensors
        (log_g, log_g2), (keys_plan, values_plan) = ctx.logs, ctx.plans
        dtype = Y.dtype
        if grad_out is None:
            grad_out = torch.zeros(*v.shape[:-1], v.shape[-1] + ctx.normalize, dtype=dtype,
                                   device=v.device)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dk, dY = torch.zeros_like(dq), torch.zeros_like(Y)
        dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
        has_S0, has_A0 = ctx.starts
        dA0 = chain.backward(q, Y, v, log_g2, ctx.normalize, A_starts, grad_out, grad_A, dq, dY,
                             dv, values_plan, want_dS0=has_A0, poison=(True, False, True))
        dS0 = key_moments_backward(q, k, log_g, S_starts, dY, grad_S, dq, dk, keys_plan,
                                   want_dS0=has_S0)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dS0, dA0, None, None, None, None


def hla2_chain_unchecked(q, k, v, *, normalize, eps, decay, chunk_size, initial_state,
                         output_final_state):
    """hla2 (masked form) through the chain on inputs the caller checked (mixers.hla.hla2:
    chain_unsupported_reason is None; initial_state checked and in the compute dtype, or
    None) -> (o in q's dtype, final state {"S", "A"(, "a")} or None)."""
    S0 = A0 = None  # zeros
    if initial_state is not None:
        packed = pack(initial_state, "masked", normalize, 0.0)
        S0, A0 = packed["S"], packed["A"]
    out, S1, A1 = _HLA2Chain.apply(q, k, v, S0, A0, decay, normalize, chunk_size,
                                   output_final_state)
    o = kernel_read_out(out, normalize, eps, q.dtype)
    final = unpack({"S": S1, "A": A1}, "masked", normalize, 0.0) if output_final_state else None
    return o, final
