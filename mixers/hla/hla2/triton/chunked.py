"""The chunked op hla2_triton: checks a call, plans its launches (plan.py) and runs them,
the masked form's stages (increments, state scan, output, and the backward through
_HLA2Masked) or the paper form's walks (paper.py)."""

from __future__ import annotations

import torch

from mixers.common import normalize_grads
from mixers.hla.hla2.triton.backward import _final_grads, _masked_backward
from mixers.hla.hla2.triton.common import _cdiv, _shape_args
from mixers.hla.hla2.triton.increments import _chunk_increments
from mixers.hla.hla2.triton.output import _chunk_output
from mixers.hla.hla2.triton.paper import _hla2_paper
from mixers.hla.hla2.triton.plan import (call_form, needs_backward, plan_launch,
                                         plan_unfit_reason, triton_unsupported_reason)
from mixers.hla.hla2.triton.scans import _scan_states


def _forward(q, k, v, log2g, init, plan, want_final, normalize, eps):
    """(o, den, final, chunk states): chunk states = (S, X, A, Xn, An), each chunk's start
    states S, A (An: the denominator column of A) and its X (Xn). Unless the plan gives the
    states buffers of their own (states_out_of_place), they overwrite the increments, which
    takes no extra memory."""
    B, T, H, D = q.shape
    NT = _cdiv(T, plan.chunk)
    shape = _shape_args(q, v, log2g, normalize, plan)
    lg = q if log2g is None else log2g
    ds, x, da, xn, an = _chunk_increments(q, k, v, lg, T, NT, shape, plan)
    final = None
    if want_final:
        final = (q.new_empty(B, H, D, D, dtype=torch.float32),
                 q.new_empty(B, H, D, v.shape[-1], dtype=torch.float32),
                 q.new_empty(B, H, D, dtype=torch.float32) if normalize else q)
    states = None
    if plan.states_out_of_place:
        states = (torch.empty_like(ds), torch.empty_like(da),
                  torch.empty_like(an) if normalize else an)
    _scan_states((ds, x, da, xn, an), lg, init, final, T, shape, plan, states)
    if states is not None:
        ds, da, an = states
    o, den = _chunk_output(q, k, v, lg, (ds, da, an), eps, T, NT, shape, plan)
    return o, den, final, (ds, x, da, xn, an)


def _masked_forward(q, k, v, s0, a0, an0, log2g, plan, want_final, normalize, eps):
    """((o, S1, A1, a1), den, chunk states) of _HLA2Masked's forward; None for the final
    states not asked for (a1 without normalize)."""
    init = None if s0 is None else (s0, a0, an0 if normalize else q)
    o, den, final, states = _forward(q, k, v, log2g, init, plan, want_final, normalize, eps)
    s1, a1, an1 = (None, None, None) if final is None else final
    return (o, s1, a1, an1 if normalize else None), den, states


class _HLA2Masked(torch.autograd.Function):
    """(q, k, v, S0, A0, a0) -> (o, S1, A1, a1) for masked hla2 with optional per-head decay
    (given as log2 g, not differentiated); a0, a1: the denominator state with normalize,
    whose output o = numerator / (denominator + eps) comes from the same launches."""

    @staticmethod
    def forward(ctx, q, k, v, s0, a0, an0, log2g, plan, want_final, normalize, eps):
        outputs, den, states = _masked_forward(q, k, v, s0, a0, an0, log2g, plan, want_final,
                                               normalize, eps)
        saved = (outputs[0], den) if normalize else ()
        ctx.save_for_backward(q, k, v, log2g, *states, *saved)
        ctx.plan, ctx.normalize, ctx.eps = plan, normalize, eps
        return outputs

    @staticmethod
    def backward(ctx, do, gs1, ga1, gan1):
        q, k, v, log2g, *states = ctx.saved_tensors
        states, saved = states[:5], states[5:]
        D, DV = q.shape[-1], v.shape[-1]
        dden = None
        if ctx.normalize:  # o = n / (den + eps): dn = do / (den + eps), dden = -(do . o) / ..
            o, den = saved
            dn, dden = normalize_grads(do, o, den, ctx.eps)
            do, dden = dn.to(q.dtype), dden.contiguous()
        want_init_grad = any(ctx.needs_input_grad[3:6])
        final_grads = _final_grads(q, D, DV, ctx.normalize, (gs1, ga1, gan1))
        dq, dk, dv, init_grads = _masked_backward(q, k, v, log2g, states, do.contiguous(), dden,
                                                  final_grads, ctx.plan, want_init_grad)
        gs0, ga0, gan0 = (None, None, None) if init_grads is None else init_grads
        gan0 = gan0 if ctx.normalize and init_grads is not None else None
        return dq, dk, dv, gs0, ga0, gan0, None, None, None, None, None


def hla2_triton(q, k, v, *, normalize=False, eps=1e-6, decay=None, decay_form="masked",
                chunk_size=64, initial_state=None, output_final_state=False, plan=None):
    """Masked hla2 with the Triton kernels: (o [B, T, H, Dv], final state dict or None).

    Checks that the kernels support the inputs (triton_unsupported_reason) and that `plan`,
    when given, fits the call (plan_unfit_reason): ValueError otherwise. Shapes, state keys
    and decay values are `mixers.hla.hla2`'s to validate (hla2(impl="triton") does, then
    runs the op unchecked). plan: a LaunchPlan for this call, plan_call(q, k, v, ...) or
    plan_launch(...) with fields changed by dataclasses.replace; None computes the default.
    chunk_size enters the default plan only.
    """
    reason = triton_unsupported_reason(q, k, v, masked=True, ridge=0.0,
                                       decay_form=decay_form, decay=decay)
    if reason is None and plan is not None:
        B, T, H, D = q.shape
        reason = plan_unfit_reason(plan, (B, T, H, D, v.shape[-1]), q.dtype,
                                   needs_backward(q, k, v, initial_state),
                                   call_form(decay, decay_form), normalize)
    if reason is not None:
        raise ValueError(reason)
    return _hla2_triton_unchecked(q, k, v, normalize=normalize, eps=eps, decay=decay,
                                  decay_form=decay_form, chunk_size=chunk_size,
                                  initial_state=initial_state,
                                  output_final_state=output_final_state, plan=plan)


def _hla2_triton_unchecked(q, k, v, *, normalize, eps, decay, decay_form, chunk_size,
                           initial_state, output_final_state, plan=None):
    """hla2_triton for inputs (and a plan) already checked (mixers.hla.hla2 checks them
    once: until the first kernel starts the GPU waits for this host path)."""
    B, T, H, D = q.shape
    form = call_form(decay, decay_form)
    backward = needs_backward(q, k, v, initial_state)
    if plan is None:
        plan = plan_launch((B, T, H, D, v.shape[-1]), q.dtype, q.device, backward,
                           chunk_size=chunk_size, normalize=normalize, form=form)
    shared_kv = k.shape[2] == 1 and H > 1
    if shared_kv:  # multi-query: every head runs on the shared k, v (and shared S)
        k, v = k.expand(B, T, H, D), v.expand(B, T, H, v.shape[-1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if form == "paper":
        o, final = _hla2_paper(q, k, v, normalize=normalize, eps=eps, decay=decay,
                               initial_state=initial_state,
                               output_final_state=output_final_state, plan=plan)
        if final is not None and shared_kv:
            final["S"] = final["S"][:, :1].contiguous()
        return o, final
    s0 = a0 = an0 = None
    if initial_state is not None:
        s0 = initial_state["S"].float().expand(B, H, D, D).contiguous()
        a0 = initial_state["A"].float().contiguous()
        if normalize:
            an0 = initial_state["a"].float().contiguous()
    log2g = None if decay is None else torch.log2(decay.float()).contiguous()
    args = (q, k, v, s0, a0, an0, log2g, plan, output_final_state, normalize, float(eps))
    if backward:
        o, s1, a1, an1 = _HLA2Masked.apply(*args)
    else:  # inference: no autograd node, and the chunk states are not kept
        o, s1, a1, an1 = _masked_forward(*args)[0]
    final = None
    if output_final_state:
        final = {"S": s1[:, :1].contiguous() if shared_kv else s1, "A": a1}
        if normalize:
            final["a"] = an1
    return o, final
