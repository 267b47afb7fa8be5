"""hla3_triton_packed: the causal forward kernel as a differentiable op.

The backward recomputes the outputs and final states through the PyTorch chunk form
(mixers/hla/hla3/chunk.py) and differentiates that: exact gradients, at the cost of a
second forward in PyTorch. (A fused backward kernel is not written yet.)
"""

from __future__ import annotations

import torch

from mixers.hla.ahla2.state import to_heads_first
from mixers.hla.hla3.chunk import hla3_chunk
from mixers.hla.hla3.triton.forward import forward as triton_forward
from mixers.hla.hla3.triton.plan import HLA3Plan, plan_launch


def plan_call(q, v, normalize: bool, dtype: torch.dtype, chunk_size: int) -> HLA3Plan:
    """The default plan, at `chunk_size` where that is a power of two in [16, plan's chunk]."""
    plan = plan_launch(q.shape[-1], v.shape[-1] + normalize, dtype)
    if chunk_size in (16, 32, 64, 128) and chunk_size < plan.chunk:
        plan = HLA3Plan(chunk_size, plan.block_d, plan.block_v, plan.warps)
    return plan


class _HLA3Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, P0, F0, normalize, chunk_size):
        plan = plan_call(q, v, normalize, q.dtype, chunk_size)
        inputs = [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v)]
        results = triton_forward(*inputs, S0, P0, F0, normalize, plan)
        ctx.save_for_backward(q, k, v, S0, P0, F0)
        ctx.normalize, ctx.chunk = normalize, plan.chunk
        return results

    @staticmethod
    def backward(ctx, grad_out, grad_S, grad_P, grad_F):
        saved = ctx.saved_tensors
        dtype = saved[4].dtype
        leaves = [x.detach().requires_grad_(need)
                  for x, need in zip(saved, ctx.needs_input_grad[:6])]
        with torch.enable_grad():
            qh, kh = to_heads_first(leaves[0], dtype), to_heads_first(leaves[1], dtype)
            vh = to_heads_first(leaves[2], dtype, ones_column=ctx.normalize)
            out, finals = hla3_chunk(qh, kh, vh, tuple(leaves[3:]), ctx.chunk)
            pairs = zip((out.transpose(1, 2), *finals), (grad_out, grad_S, grad_P, grad_F))
            outputs, grads = zip(*[(o, g) for o, g in pairs if g is not None])
            wanted = [x for x in leaves if x.requires_grad]
            found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
                         if wanted else ())
        return (*(next(found) if x.requires_grad else None for x in leaves), None, None)


def hla3_triton_packed(q, k, v, S0, P0, F0, normalize: bool, chunk_size: int = 64):
    """`[B, T, H, D]` q, k, `[B, T, H, Dv]` v (any strides), packed start states (S^K
    `[B, H, D, D]`, P and F `[B, H, D, Dv(+1)]`) in the compute dtype -> (packed outputs
    `[B, T, H, Dv(+1)]`, S, P, F). Inputs are taken as given (the caller checks them and
    applies the non-finite rule)."""
    return _HLA3Triton.apply(q, k, v, S0, P0, F0, normalize, chunk_size)
