"""The decode step: one token per call with the state updated in place, the masked form's
kernel here and the paper form's in paper.py (a step is host-bound: one small launch)."""

import torch
import triton
import triton.language as tl

from mixers.hla.hla2.triton.common import (_block, _dim_ok, _mat_offsets, _overwrite_barrier,
                                           _state_tensor, _tile_ok)
from mixers.hla.hla2.triton.paper import _paper_step
from mixers.hla.hla2.triton.plan import triton_unsupported_reason


@triton.jit
def decode_step_kernel(q, k, v, s, a, a_den, g, o, eps, H: tl.constexpr, D: tl.constexpr,
                       DV: tl.constexpr, PD: tl.constexpr, PDV: tl.constexpr,
                       BR: tl.constexpr, HAS_DECAY: tl.constexpr,
                       NORMALIZE: tl.constexpr, SHARED_KV: tl.constexpr):
    """One token for one (batch, head), state updated in place:
    S = g S + k k^T, A = g^2 A + (S q) v^T, o = q^T A (normalize: a = g^2 a + S q,
    o = q^T A / (q^T a + eps)). Row r of A only needs row r of S, so the state is walked
    in blocks of BR rows (few registers, many resident programs: the step is memory bound).
    With SHARED_KV (multi-query) k, v and S have one head per batch and S arrives already
    updated (one writer). Head dims D, DV are held in blocks of PD, PDV (powers of two):
    entries past them load as zero and are not stored. Grid (B*H,)."""
    i_bh = tl.program_id(0)
    i_kv = i_bh
    if SHARED_KV:
        i_kv = i_bh // H
    rd, rv = tl.arange(0, PD), tl.arange(0, PDV)
    rd_ok, rv_ok = _dim_ok(rd, D, PD), _dim_ok(rv, DV, PDV)
    b_q = tl.load(q + i_bh * D + rd, mask=rd_ok, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_kv * D + rd, mask=rd_ok, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_kv * DV + rv, mask=rv_ok, other=0.0).to(tl.float32)
    gamma = 1.0
    if HAS_DECAY:
        gamma = tl.load(g + i_bh % H).to(tl.float32)
    b_num = tl.zeros([PDV], dtype=tl.float32)
    den = eps
    for i_r in tl.static_range(PD // BR):
        rr = i_r * BR + tl.arange(0, BR)
        rr_ok = _dim_ok(rr, D, PD)
        s_ok, a_ok = _tile_ok(rr, rd, D, PD, D, PD), _tile_ok(rr, rv, D, PD, DV, PDV)
        b_qr = tl.load(q + i_bh * D + rr, mask=rr_ok, other=0.0).to(tl.float32)
        b_kr = tl.load(k + i_kv * D + rr, mask=rr_ok, other=0.0).to(tl.float32)
        p_s = s + i_kv.to(tl.int64) * D * D + _mat_offsets(rr, rd, D)
        p_den = a_den + i_bh.to(tl.int64) * D + rr
        p_a = a + i_bh.to(tl.int64) * D * DV + _mat_offsets(rr, rv, DV)
        b_s = tl.load(p_s, mask=s_ok, other=0.0)
        b_a = tl.load(p_a, mask=a_ok, other=0.0)
        if NORMALIZE:
            b_den = tl.load(p_den, mask=rr_ok, other=0.0)
        _overwrite_barrier()
        if not SHARED_KV:
            b_s = gamma * b_s + b_kr[:, None] * b_k[None, :]
            tl.store(p_s, b_s, mask=s_ok)
        b_sq = tl.sum(b_s * b_q[None, :], axis=1)
        if NORMALIZE:
            b_den = gamma * gamma * b_den + b_sq
            tl.store(p_den, b_den, mask=rr_ok)
            den += tl.sum(b_den * b_qr, axis=0)
        b_a = gamma * gamma * b_a + b_sq[:, None] * b_v[None, :]
        tl.store(p_a, b_a, mask=a_ok)
        b_num += tl.sum(b_a * b_qr[:, None], axis=0)
    if NORMALIZE:
        b_num = b_num / den
    tl.store(o + i_bh * DV + rv, b_num.to(o.dtype.element_ty), mask=rv_ok)


def hla2_step_triton(q_t, k_t, v_t, state, *, normalize=False, eps=1e-6, decay=None,
                     decay_form="masked"):
    """One decode token with the fused step kernel: q_t, k_t [B, H, D], v_t [B, H, Dv] ->
    (o_t [B, H, Dv], state). The state's fp32 tensors ("S", "A", and "a" with normalize)
    are updated in place; state=None starts from zeros. decay_form="paper" (state "S", "C",
    "G", and "m", "h" with normalize): see paper._paper_step. Checks that the kernels
    support the inputs (triton_unsupported_reason: ValueError otherwise); shapes, state keys
    and decay values are hla2_step's to validate (it does, then calls _step_unchecked)."""
    reason = triton_unsupported_reason(q_t.unsqueeze(1), k_t.unsqueeze(1), v_t.unsqueeze(1),
                                       masked=True, ridge=0.0, decay_form=decay_form,
                                       decay=decay, step=True)
    if reason is not None:
        raise ValueError(reason)
    return _step_unchecked(q_t, k_t, v_t, state, normalize=normalize, eps=eps, decay=decay,
                           decay_form=decay_form)


def _step_unchecked(q_t, k_t, v_t, state, *, normalize, eps, decay, decay_form):
    """hla2_step_triton for inputs already checked (hla2_step checks them once: a decode
    step is host-bound, and the check is a noticeable part of its host time)."""
    B, H, D = q_t.shape
    DV = v_t.shape[-1]
    if decay is not None and decay_form == "paper":
        return _paper_step(q_t, k_t, v_t, state, normalize=normalize, eps=eps, decay=decay)
    if state is None:
        state = {"S": q_t.new_zeros(B, k_t.shape[1], D, D, dtype=torch.float32),
                 "A": q_t.new_zeros(B, H, D, DV, dtype=torch.float32)}
        if normalize:
            state["a"] = q_t.new_zeros(B, H, D, dtype=torch.float32)
    s, a = _state_tensor(state, "S"), _state_tensor(state, "A")
    a_den = _state_tensor(state, "a") if normalize else a
    g = a if decay is None else decay.float().contiguous()
    shared_kv = k_t.shape[1] == 1 and H > 1
    if shared_kv:  # one S for all heads: update it once here (decay is equal across heads)
        if decay is not None:
            s.mul_(decay[0])
        s.add_(k_t.float().unsqueeze(-1) * k_t.float().unsqueeze(-2))
    o = q_t.new_empty(B, H, DV)
    decode_step_kernel[(B * H,)](
        q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), s, a, a_den, g, o, eps, H=H,
        D=D, DV=DV, PD=_block(D), PDV=_block(DV), BR=16, HAS_DECAY=decay is not None,
        NORMALIZE=normalize,
        SHARED_KV=shared_kv, num_warps=4)
    return o, state
