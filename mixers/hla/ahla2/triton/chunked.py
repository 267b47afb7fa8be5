"""ahla2_triton_packed: the forward kernel as a differentiable op.

The backward recomputes the outputs and final states through the PyTorch chunk form
(mixers/hla/ahla2/chunk.py) and differentiates that: exact gradients, at the cost of a
second forward in PyTorch. (A fused backward kernel is not written yet.)
"""

from __future__ import annotations

import torch

from mixers.hla.ahla2.chunk import ahla2_chunk
from mixers.hla.ahla2.state import to_heads_first
from mixers.hla.ahla2.triton.forward import forward as triton_forward
from mixers.hla.ahla2.triton.plan import AHLA2Plan, plan_launch


def plan_call(q, v, normalize: bool, dtype: torch.dtype, chunk_size: int) -> AHLA2Plan:
    """The default plan, at `chunk_size` where that is a power of two in [16, plan's chunk]."""
    plan = plan_launch(q.shape[-1], v.shape[-1] + normalize, dtype)
    if chunk_size in (16, 32, 64, 128) and chunk_size < plan.chunk:
        plan = AHLA2Plan(chunk_size, plan.block_d, plan.block_v, plan.warps)
    return plan


class _AHLA2Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, P0, E0, decay, normalize, chunk_size):
        plan = plan_call(q, v, normalize, q.dtype, chunk_size)
        inputs = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
        out, P1, E1 = triton_forward(*inputs, P0, E0, decay, normalize, plan)
        ctx.save_for_backward(q, k, v, P0, E0, decay)
        ctx.normalize, ctx.chunk = normalize, plan.chunk
        return out, P1, E1

    @staticmethod
    def backward(ctx, grad_out, grad_P, grad_E):
        q, k, v, P0, E0, decay = ctx.saved_tensors
        dtype = P0.dtype
        leaves = [x.detach().requires_grad_(need)
                  for x, need in zip((q, k, v, P0, E0), ctx.needs_input_grad[:5])]
        with torch.enable_grad():
            qh, kh = to_heads_first(leaves[0], dtype), to_heads_first(leaves[1], dtype)
            vh = to_heads_first(leaves[2], dtype, ones_column=ctx.normalize)
            out, (P1, E1) = ahla2_chunk(qh, kh, vh, leaves[3], leaves[4], decay, ctx.chunk)
            pairs = [(out.transpose(1, 2), grad_out), (P1, grad_P), (E1, grad_E)]
            outputs, grads = zip(*[(o, g) for o, g in pairs if g is not None])
            wanted = [x for x in leaves if x.requires_grad]
            found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
                         if wanted else ())
        return (*(next(found) if x.requires_grad else None for x in leaves), None, None, None)


def ahla2_triton_packed(q, k, v, P0, E0, decay, normalize: bool, chunk_size: int = 64):
    """`[B, T, H, D]` q, k, `[B, T, H, Dv]` v (any strides), packed start states
    `[B, H, D, Dv(+1)]` in the compute dtype -> (packed outputs `[B, T, H, Dv(+1)]`, P, E).
    Inputs are taken as given (the caller checks them and applies the non-finite rule)."""
    return _AHLA2Triton.apply(q, k, v, P0, E0, decay, normalize, chunk_size)
