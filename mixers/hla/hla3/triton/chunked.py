"""hla3_triton_packed: the causal forward and backward kernels as one differentiable op.
The forward keeps every chunk's start states when a gradient will be asked for
(`[B * H, NT, D, D]` for S^K, `[B * H, NT, D, Dv(+1)]` for P and F, in the compute dtype);
the backward kernel reads them. Above key dim 64 (FUSED_BACKWARD_MAX_KEY_DIM) a backward
program would need more than an SM's 227 KiB of shared memory on sm_90a (it holds S0 and
dS, d x d, with the chunk's products), so there the backward recomputes the forward through
the PyTorch chunk form and differentiates it (exact, at the cost of a second forward)."""

from __future__ import annotations

import torch

from mixers.hla.ahla2.state import to_heads_first
from mixers.hla.ahla2.triton.plan import at_requested_chunk
from mixers.hla.hla3.chunk import hla3_chunk
from mixers.hla.hla3.triton.backward import backward as triton_backward
from mixers.hla.hla3.triton.forward import forward as triton_forward
from mixers.hla.hla3.triton.plan import plan_launch


FUSED_BACKWARD_MAX_KEY_DIM = 64


class _HLA3Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, P0, F0, normalize, chunk_size):
        plan = at_requested_chunk(plan_launch(q.shape[-1], v.shape[-1] + normalize, q.dtype),
                                  chunk_size)
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        ctx.fused = q.shape[-1] <= FUSED_BACKWARD_MAX_KEY_DIM
        keep = any(ctx.needs_input_grad[:6]) and ctx.fused
        out, S1, P1, F1, *starts = triton_forward(q, k, v, S0, P0, F0, normalize, plan,
                                                  keep_states=keep)
        if keep:
            ctx.save_for_backward(q, k, v, *starts)
        elif any(ctx.needs_input_grad[:6]):
            ctx.save_for_backward(q, k, v, S0, P0, F0)
        ctx.normalize, ctx.plan = normalize, plan
        return out, S1, P1, F1

    @staticmethod
    def backward(ctx, grad_out, grad_S, grad_P, grad_F):
        grads = (grad_out, grad_S, grad_P, grad_F)
        if ctx.fused:
            q, k, v, *starts = ctx.saved_tensors
            return (*triton_backward(q, k, v, starts, grads, ctx.normalize, ctx.plan),
                    None, None)
        return (*_recomputed_backward(ctx, grads), None, None)


def _recomputed_backward(ctx, grads) -> tuple:
    """Gradients of the saved inputs through the PyTorch chunk form of the same forward."""
    saved = ctx.saved_tensors
    dtype = saved[4].dtype
    leaves = [x.detach().requires_grad_(need) for x, need in zip(saved, ctx.needs_input_grad)]
    with torch.enable_grad():
        qh, kh = to_heads_first(leaves[0], dtype), to_heads_first(leaves[1], dtype)
        vh = to_heads_first(leaves[2], dtype, ones_column=ctx.normalize)
        out, finals = hla3_chunk(qh, kh, vh, tuple(leaves[3:]), ctx.plan.chunk)
        pairs = [(o, g) for o, g in zip((out.transpose(1, 2), *finals), grads) if g is not None]
        wanted = [x for x in leaves if x.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                         allow_unused=True))
    return tuple(next(found) if x.requires_grad else None for x in leaves)


def hla3_triton_packed(q, k, v, S0, P0, F0, normalize: bool, chunk_size: int = 64):
    """`[B, T, H, D]` q, k, `[B, T, H, Dv]` v (any strides), packed start states (S^K
    `[B, H, D, D]`, P and F `[B, H, D, Dv(+1)]`) in the compute dtype -> (packed outputs
    `[B, T, H, Dv(+1)]`, S, P, F). Inputs are taken as given (the caller checks them and
    applies the non-finite rule)."""
    return _HLA3Triton.apply(q, k, v, S0, P0, F0, normalize, chunk_size)
