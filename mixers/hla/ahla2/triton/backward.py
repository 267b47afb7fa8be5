"""The ahla2 backward: one program per (value block, batch x head) walks the chunks in
reverse, carrying the gradients dP and dE of the chunk's end states, and reads each chunk's
start states (P0, E0) kept by the forward. With the forward's U = g_in (Q P0) + A V and
A = D * (Q K^T) (D the causal decay weights), per chunk:

    dU = A^T dO + g_out (K dE)          dV = A^T dU + g_out (K dP)
    dA = dO U^T + dU V^T,   dS = D * dA
    dQ = g_in (dO E0^T + dU P0^T) + dS K
    dK = dS^T Q + g_out (V dP^T + U dE^T)
    dE <- g^n dE + Q^T (g_in dO),   dP <- g^n dP + Q^T (g_in dU)

dV's columns belong to one program; dQ and dK sum over value columns, so each program
writes its part to a buffer of its own and the parts are added after. The carried dP and
dE after the first chunk are the start states' gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.hla.tiles import packed_offsets, value_block
from mixers.hla.ahla2.triton.forward import log_decay, precision, token_strides
from mixers.hla.ahla2.triton.grad_chunks import ahla2_grad_chunks_kernel
from mixers.hla.ahla2.triton.grad_scan import ahla2_grad_scan_kernel
from mixers.hla.ahla2.triton.grad_terms import ahla2_grad_terms_kernel
from mixers.hla.ahla2.triton.plan import AHLA2Plan
from mixers.hla.ahla2.triton.terms import chunk_grads, chunk_terms


@triton.jit
def ahla2_backward_kernel(Q, K, V, LOG_G, PS, ES, DO, DP1, DE1, DQ, DK, DVAL, DP0, DE0,
                          B, T, H, D, DV, DVP, NT,
                          stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                          stride_vb, stride_vt, stride_vh,
                          C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                          NT_BOUND: tl.constexpr, NORMALIZE: tl.constexpr,
                          HAS_DECAY: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = PS.dtype.element_ty
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    c_ok = cols < DVP
    dP = tl.load(DP1 + state, mask=state_ok, other=0.0).to(acc)
    dE = tl.load(DE1 + state, mask=state_ok, other=0.0).to(acc)
    for step in range(NT_BOUND):  # chunks past the last load nothing and change nothing
        chunk = NT_BOUND - 1 - step
        q, k, v, A, weights, g_in, g_out, g_n, t, t_ok = chunk_terms(
            Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
            HAS_DECAY, PRECISION, acc)
        out_at = packed_offsets(b, t, h, T, H, DVP, cols)
        dO = tl.load(DO + out_at, mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
        at = (bh * NT + chunk) * D * DVP + dk[:, None] * DVP + cols[None, :]
        P0 = tl.load(PS + at, mask=state_ok & (chunk < NT), other=0.0).to(acc)
        E0 = tl.load(ES + at, mask=state_ok & (chunk < NT), other=0.0).to(acc)
        dQ, dK, dV, dU = chunk_grads(q, k, v, A, weights, g_in, g_out, dO, P0, E0, dP, dE,
                                     PRECISION)
        qk_ok = t_ok[:, None] & d_ok[None, :]
        part = (((pid_v * B + b) * T + t[:, None]) * H + h) * D + dk[None, :]
        tl.store(DQ + part, dQ, mask=qk_ok)
        tl.store(DK + part, dK, mask=qk_ok)
        tl.store(DVAL + ((b * T + t[:, None]) * H + h) * DV + cols[None, :], dV,
                 mask=t_ok[:, None] & (cols < DV)[None, :])
        dE = dE * g_n + tl.dot(tl.trans(q), dO * g_in[:, None], input_precision=PRECISION)
        dP = dP * g_n + tl.dot(tl.trans(q), dU * g_in[:, None], input_precision=PRECISION)
    tl.store(DP0 + state, dP, mask=state_ok)
    tl.store(DE0 + state, dE, mask=state_ok)


def backward(q, k, v, decay, P_starts, E_starts, grad_out, grad_P, grad_E, normalize: bool,
             plan: AHLA2Plan):
    """(dq, dk, dv, dP0, dE0) of ahla2's packed forward: dq, dk, dv in the inputs' dtypes,
    the start states' gradients in the states' dtype. grad_P / grad_E may be None (zeros)."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    dtype = P_starts.dtype
    NT = P_starts.shape[1]
    blocks = triton.cdiv(width, plan.block_v)
    zeros = torch.zeros(B, H, D, width, dtype=dtype, device=q.device)
    grad_P = zeros if grad_P is None else grad_P.to(dtype).contiguous()
    grad_E = zeros if grad_E is None else grad_E.to(dtype).contiguous()
    grad_out = grad_out.to(dtype).contiguous()
    dq_parts = torch.empty(blocks, B, T, H, D, dtype=dtype, device=q.device)
    dk_parts = torch.empty_like(dq_parts)
    dv = torch.empty(B, T, H, Dv, dtype=dtype, device=q.device)
    dP0, dE0 = torch.empty_like(zeros), torch.empty_like(zeros)
    log_g = log_decay(decay, dtype)
    if not plan.walk:
        _staged(q, k, v, log_g if log_g is not None else zeros, decay is not None, P_starts,
                E_starts, grad_out, grad_P, grad_E, dq_parts, dk_parts, dv, dP0, dE0,
                normalize, plan)
        return (dq_parts.sum(0).to(q.dtype), dk_parts.sum(0).to(k.dtype), dv.to(v.dtype),
                dP0, dE0)
    ahla2_backward_kernel[(blocks, B * H)](
        q, k, v, log_g if log_g is not None else zeros, P_starts, E_starts, grad_out, grad_P,
        grad_E, dq_parts, dk_parts, dv, dP0, dE0, B, T, H, D, Dv, width, NT,
        *token_strides(q, k, v),
        C=plan.chunk, BD=plan.block_d, BV=plan.block_v, NT_BOUND=triton.next_power_of_2(NT),
        NORMALIZE=normalize, HAS_DECAY=decay is not None, PRECISION=precision(q.dtype),
        num_warps=plan.warps)
    return (dq_parts.sum(0).to(q.dtype), dk_parts.sum(0).to(k.dtype), dv.to(v.dtype), dP0, dE0)


def _staged(q, k, v, log_g, has_decay, P_starts, E_starts, grad_out, grad_P, grad_E,
            dq_parts, dk_parts, dv, dP0, dE0, normalize, plan):
    """backward() in three chunk-parallel stages (grad_terms.py, grad_scan.py,
    grad_chunks.py), writing into the given gradient buffers."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    NT = P_starts.shape[1]
    blocks = triton.cdiv(width, plan.block_v)
    XS, XR = torch.empty_like(P_starts), torch.empty_like(P_starts)
    MS = torch.empty(B * H, NT, D, D, dtype=P_starts.dtype, device=q.device)
    strides = token_strides(q, k, v)
    common = dict(C=plan.chunk, BD=plan.block_d, BV=plan.block_v, HAS_DECAY=has_decay,
                  PRECISION=precision(q.dtype), num_warps=plan.warps)
    ahla2_grad_terms_kernel[(NT, blocks, B * H)](
        q, k, v, log_g, grad_out, XS, XR, MS, T, H, D, Dv, width, NT, *strides,
        NORMALIZE=normalize, **common)
    ahla2_grad_scan_kernel[(blocks, B * H)](
        log_g, grad_P, grad_E, dP0, dE0, XS, XR, MS, T, H, D, width, NT,
        NT_BOUND=triton.next_power_of_2(NT), **common)
    del MS
    ahla2_grad_chunks_kernel[(NT, blocks, B * H)](
        q, k, v, log_g, P_starts, E_starts, XS, XR, grad_out, dq_parts, dk_parts, dv,
        B, T, H, D, Dv, width, NT, *strides, NORMALIZE=normalize, **common)
