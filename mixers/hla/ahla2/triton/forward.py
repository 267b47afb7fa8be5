"""The ahla2 forward: one program per (value block, batch x head) walks the chunks in order,
carrying its columns of P and E (spec §2; the chunk equations of mixers/hla/ahla2/chunk.py):

    A = D * (Q K^T)                      C x C, D[s, i] = g^(s - i) for i <= s, else 0
    U = g_in * (Q P0) + A V              rows q_s^T P_s
    O = g_in * (Q E0) + A U
    P' = g^n P0 + K^T (g_out * V),  E' = g^n E0 + K^T (g_out * U)

g_in[s] = g^(s + 1), g_out[i] = g^(n - 1 - i), n the chunk's real tokens. Every value
column's (P, E) and outputs depend on that column alone, so the packed width (value dim,
plus the ones column of the denominator when normalized) is split over programs. Inputs are
read in place from `[B, T, H, D]` tensors (last dim contiguous); rows past T and columns
past D or Dv are masked loads of zero. The chunk loop's bound is a compile-time power of two
(one compile per bucket of T; the Triton interpreter cannot loop to a runtime bound): steps
past the last chunk change nothing. Arithmetic and states in the output's dtype
(float32, float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.hla.tiles import packed_offsets, value_block
from mixers.hla.ahla2.triton.increments import ahla2_increments_kernel
from mixers.hla.ahla2.triton.output import ahla2_output_kernel
from mixers.hla.ahla2.triton.plan import AHLA2Plan
from mixers.hla.ahla2.triton.scan import ahla2_scan_kernel
from mixers.hla.ahla2.triton.terms import chunk_terms


@triton.jit
def ahla2_forward_kernel(Q, K, V, LOG_G, P0, E0, O, P1, E1, PS, ES, T, H, D, DV, DVP, NT,
                         stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh,
                         C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                         NT_BOUND: tl.constexpr, NORMALIZE: tl.constexpr,
                         HAS_DECAY: tl.constexpr, STORE_STATES: tl.constexpr,
                         PRECISION: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    P = tl.load(P0 + state, mask=state_ok, other=0.0).to(acc)
    E = tl.load(E0 + state, mask=state_ok, other=0.0).to(acc)
    for chunk in range(NT_BOUND):  # steps past the last chunk load nothing and change nothing
        if STORE_STATES:  # each chunk's start states, for the backward
            at = (bh * NT + chunk) * D * DVP + dk[:, None] * DVP + cols[None, :]
            tl.store(PS + at, P, mask=state_ok & (chunk < NT))
            tl.store(ES + at, E, mask=state_ok & (chunk < NT))
        q, k, v, A, weights, g_in, g_out, g_n, t, t_ok = chunk_terms(
            Q, K, V, LOG_G, chunk, b, h, T, D, DV, dk, cols, stride_qb, stride_qt, stride_qh,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, C, NORMALIZE,
            HAS_DECAY, PRECISION, acc)
        qg = q * g_in[:, None]
        U = tl.dot(qg, P, input_precision=PRECISION) + tl.dot(A, v, input_precision=PRECISION)
        out = tl.dot(qg, E, input_precision=PRECISION) + tl.dot(A, U, input_precision=PRECISION)
        ks = tl.trans(k * g_out[:, None])
        P = P * g_n + tl.dot(ks, v, input_precision=PRECISION)
        E = E * g_n + tl.dot(ks, U, input_precision=PRECISION)
        tl.store(O + packed_offsets(b, t, h, T, H, DVP, cols), out.to(acc),
                 mask=t_ok[:, None] & (cols < DVP)[None, :])
    tl.store(P1 + state, P, mask=state_ok)
    tl.store(E1 + state, E, mask=state_ok)


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact for float32 and float64 inputs, tf32 for 16-bit ones
    (their products are no finer than tf32's mantissa)."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def token_strides(q, k, v) -> tuple[int, ...]:
    """The batch, token and head strides of q, k and v, in the order the kernels take them."""
    return tuple(x.stride(i) for x in (q, k, v) for i in range(3))


def log_decay(decay, dtype):
    """log g per head, contiguous (a float decay arrives as an expanded tensor)."""
    return torch.log(decay.to(dtype)).contiguous() if decay is not None else None


def forward(q, k, v, P0, E0, decay, normalize: bool, plan: AHLA2Plan, keep_states: bool = False):
    """Packed outputs `[B, T, H, Dv(+1)]` and final (P, E) `[B, H, D, Dv(+1)]`, in P0's dtype,
    from `[B, T, H, *]` q, k, v (last dim contiguous) and packed start states; with
    `keep_states` also every chunk's start states `[B * H, NT, D, Dv(+1)]` (else None).
    plan.walk: the one-kernel walk over the chunks (below), else the three chunk-parallel
    stages (increments.py, scan.py, output.py)."""
    if not plan.walk:
        return _staged(q, k, v, P0, E0, decay, normalize, plan, keep_states)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    NT = triton.cdiv(T, plan.chunk)
    out = torch.empty(B, T, H, width, dtype=P0.dtype, device=q.device)
    P1, E1 = torch.empty_like(P0), torch.empty_like(E0)
    starts = [torch.empty(B * H, NT, D, width, dtype=P0.dtype, device=q.device)
              for _ in range(2)] if keep_states else [None, None]
    log_g = log_decay(decay, P0.dtype)
    grid = (triton.cdiv(width, plan.block_v), B * H)
    ahla2_forward_kernel[grid](
        q, k, v, log_g if log_g is not None else P0, P0.contiguous(), E0.contiguous(), out, P1,
        E1, starts[0] if keep_states else P1, starts[1] if keep_states else E1, T, H, D, Dv,
        width, NT, *token_strides(q, k, v),
        C=plan.chunk, BD=plan.block_d, BV=plan.block_v,
        NT_BOUND=triton.next_power_of_2(NT), NORMALIZE=normalize, HAS_DECAY=decay is not None,
        STORE_STATES=keep_states, PRECISION=precision(q.dtype), num_warps=plan.warps)
    return out, P1, E1, starts[0], starts[1]


def _staged(q, k, v, P0, E0, decay, normalize, plan, keep_states):
    """forward() in three chunk-parallel stages: the increments of every chunk, the scan
    that turns them into the chunks' start states in place, the outputs of every chunk.
    The start states are kept for the backward at no extra cost."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    NT = triton.cdiv(T, plan.chunk)
    dtype = P0.dtype
    XP, XE = (torch.empty(B * H, NT, D, width, dtype=dtype, device=q.device) for _ in range(2))
    MS = torch.empty(B * H, NT, D, D, dtype=dtype, device=q.device)
    out = torch.empty(B, T, H, width, dtype=dtype, device=q.device)
    P1, E1 = torch.empty_like(P0), torch.empty_like(E0)
    log_g = log_decay(decay, dtype)
    log_g = log_g if log_g is not None else P0
    strides = token_strides(q, k, v)
    blocks = triton.cdiv(width, plan.block_v)
    common = dict(C=plan.chunk, BD=plan.block_d, BV=plan.block_v, HAS_DECAY=decay is not None,
                  PRECISION=precision(q.dtype), num_warps=plan.warps)
    ahla2_increments_kernel[(NT, blocks, B * H)](
        q, k, v, log_g, XP, XE, MS, T, H, D, Dv, width, NT, *strides, NORMALIZE=normalize,
        **common)
    ahla2_scan_kernel[(blocks, B * H)](
        log_g, P0.contiguous(), E0.contiguous(), P1, E1, XP, XE, MS, T, H, D, width, NT,
        NT_BOUND=triton.next_power_of_2(NT), **common)
    del MS
    ahla2_output_kernel[(NT, blocks, B * H)](
        q, k, v, log_g, XP, XE, out, T, H, D, Dv, width, NT, *strides, NORMALIZE=normalize,
        **common)
    if not keep_states:
        return out, P1, E1, None, None
    return out, P1, E1, XP, XE
