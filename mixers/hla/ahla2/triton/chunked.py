"""ahla2_triton_packed: the forward and backward kernels as one differentiable op. The
forward keeps every chunk's start states when a gradient will be asked for (two
`[B * H, NT, D, Dv(+1)]` buffers in the compute dtype); the backward reads them."""

from __future__ import annotations

import torch

from mixers.hla.ahla2.triton.backward import backward as triton_backward
from mixers.hla.ahla2.triton.forward import forward as triton_forward
from mixers.hla.ahla2.triton.plan import at_requested_chunk, plan_launch


class _AHLA2Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, P0, E0, decay, normalize, chunk_size):
        plan = at_requested_chunk(plan_launch(q.shape[-1], v.shape[-1] + normalize, q.dtype),
                                  chunk_size)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        keep = any(ctx.needs_input_grad[:5])
        out, P1, E1, P_starts, E_starts = triton_forward(q, k, v, P0, E0, decay, normalize,
                                                         plan, keep_states=keep)
        if keep:
            ctx.save_for_backward(q, k, v, decay, P_starts, E_starts)
        ctx.normalize, ctx.plan = normalize, plan
        return out, P1, E1

    @staticmethod
    def backward(ctx, grad_out, grad_P, grad_E):
        q, k, v, decay, P_starts, E_starts = ctx.saved_tensors
        dq, dk, dv, dP0, dE0 = triton_backward(q, k, v, decay, P_starts, E_starts, grad_out,
                                               grad_P, grad_E, ctx.normalize, ctx.plan)
        return dq, dk, dv, dP0, dE0, None, None, None


def ahla2_triton_packed(q, k, v, P0, E0, decay, normalize: bool, chunk_size: int = 64):
    """`[B, T, H, D]` q, k, `[B, T, H, Dv]` v (any strides), packed start states
    `[B, H, D, Dv(+1)]` in the compute dtype -> (packed outputs `[B, T, H, Dv(+1)]`, P, E).
    Inputs are taken as given (the caller checks them and applies the non-finite rule)."""
    return _AHLA2Triton.apply(q, k, v, P0, E0, decay, normalize, chunk_size)
