"""The causal hla3 backward (key dims up to 64; above, chunked.py recomputes through the
PyTorch chunk form) in three chunk-parallel stages: each chunk's terms of the start states'
gradients (grad_terms.py), a reverse scan leaving each chunk's end-state gradients in place
(grad_scan.py), and dq, dk, dv of every chunk (grad_chunks.py, by the equations of
grads.py). dQ, dK and dS sum over value columns: each value block writes its own part (the
final state's dS enters in the first block's) and the parts are added after.
"""

from __future__ import annotations

import torch
import triton

from mixers.hla.ahla2.triton.forward import precision, token_strides
from mixers.hla.hla3.triton.grad_chunks import hla3_grad_chunks_kernel
from mixers.hla.hla3.triton.grad_scan import hla3_grad_scan_kernel
from mixers.hla.hla3.triton.grad_terms import hla3_grad_terms_kernel
from mixers.hla.hla3.triton.plan import HLA3Plan


def backward(q, k, v, starts, grads, normalize: bool, plan: HLA3Plan):
    """(dq, dk, dv, dS0, dP0, dF0) of the packed causal hla3 forward. `starts`: the chunks'
    start states (S, P, F) kept by the forward; `grads`: the gradients of the packed output
    and of the final S, P, F (None: zeros)."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    S_starts, P_starts, F_starts = starts
    dtype, NT = P_starts.dtype, P_starts.shape[1]
    blocks = triton.cdiv(width, plan.block_v)
    shapes = ((B, H, D, D), (B, H, D, width), (B, H, D, width))
    grad_out, *finals = grads
    grad_out = grad_out.to(dtype).contiguous()
    finals = [torch.zeros(shape, dtype=dtype, device=q.device) if g is None
              else g.to(dtype).contiguous() for g, shape in zip(finals, shapes)]
    dq_parts = torch.empty(blocks, B, T, H, D, dtype=dtype, device=q.device)
    dk_parts = torch.empty_like(dq_parts)
    dv = torch.empty(B, T, H, Dv, dtype=dtype, device=q.device)
    dS_parts = torch.empty(blocks, B, H, D, D, dtype=dtype, device=q.device)
    dP0, dF0 = torch.empty_like(finals[1]), torch.empty_like(finals[2])
    # the chunks' terms, then (in place) the gradients of their end states
    XF, XP, XZ = (torch.empty_like(P_starts) for _ in range(3))
    XY = torch.empty(B * H, NT, blocks, D, D, dtype=dtype, device=q.device)
    XM = torch.empty_like(S_starts)
    strides = token_strides(q, k, v)
    common = dict(BD=plan.block_d, BV=plan.block_v, PRECISION=precision(q.dtype),
                  num_warps=plan.warps)
    hla3_grad_terms_kernel[(NT, blocks, B * H)](
        q, k, v, S_starts, P_starts, grad_out, XF, XP, XZ, XY, XM, T, H, D, Dv, width, NT,
        blocks, *strides, C=plan.chunk, NORMALIZE=normalize, **common)
    hla3_grad_scan_kernel[(blocks, B * H)](
        *finals, dS_parts, dP0, dF0, XF, XP, XZ, XY, XM, B, H, D, width, NT, blocks,
        NT_BOUND=triton.next_power_of_2(NT), **common)
    del XZ, XM
    hla3_grad_chunks_kernel[(NT, blocks, B * H)](
        q, k, v, S_starts, P_starts, F_starts, XY, XP, XF, grad_out, dq_parts, dk_parts, dv,
        B, T, H, D, Dv, width, NT, blocks, *strides, C=plan.chunk, NORMALIZE=normalize,
        **common)
    return (dq_parts.sum(0).to(q.dtype), dk_parts.sum(0).to(k.dtype), dv.to(v.dtype),
            dS_parts.sum(0), dP0, dF0)
