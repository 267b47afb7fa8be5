"""Second-order symmetric HLA (`hla2`): validation and dispatch to the serial, scan, chunk and
Triton forms, the single-token decode step, and cost helpers.

Forms: naive.py (explicit sums with states, the ground truth), serial.py (recurrence), scan.py
(associative segment scans), chunk.py (dense matmul chunks), parallel.py (the whole sequence
as one masked block, for short sequences), triton/ (fused kernels, else a chain of two
linear attentions).
"""

from __future__ import annotations

import math

import torch

from mixers.dispatch import note, opaque
from mixers.common import (IMPLS, FiniteInputs, check_choice, check_chunk_size,
                               check_decay, check_eps, check_flag, check_qkv, check_state,
                               pytorch_form, resolve_impl)
from mixers.hla.hla2.chunk import hla2_chunk
from mixers.hla.hla2.naive import hla2_naive, hla2_naive_final_state
from mixers.hla.hla2.parallel import hla2_parallel
from mixers.hla.hla2.scan import hla2_scan
from mixers.hla.hla2.serial import hla2_serial, step_packed
from mixers.hla.hla2.state import (DECAY_FORMS, compute_dtype, finish, operator_form, pack,
                                   state_shapes, unpack, with_ones, zero_packed)

__all__ = ["hla2", "hla2_step", "hla2_naive", "hla2_naive_final_state", "hla2_state_bytes",
           "hla2_flops"]

STEP_IMPLS = ("auto", "torch", "triton")
_FORMS = {"serial": hla2_serial, "scan": hla2_scan, "chunk": hla2_chunk,
          "parallel": hla2_parallel}


def _check_scalars(eps, ridge) -> None:
    check_eps(eps)
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not ridge >= 0:
        raise ValueError(f"ridge must be a number >= 0, got {ridge!r}")


def _check_decay(decay, heads: int, kv_heads: int, device) -> torch.Tensor | None:
    """Validated [H] decay; shared k and v (multi-query) need one decay for all heads."""
    g = check_decay(decay, heads, device)
    if g is not None and kv_heads == 1 and heads > 1 and not bool((g == g[0]).all()):
        raise ValueError("decay must be the same for every head when k and v are shared "
                         f"(multi-query: S is stored once), got {g.tolist()}")
    return g


def _check_state(state, shapes: dict, dtype, device, name: str) -> dict | None:
    """The state with exactly the expected keys and shapes, cast to the compute dtype."""
    if state is None:
        return None
    check_state(state, shapes, name, device)
    return {key: state[key].to(dtype) for key in shapes}


def _triton_unsupported(q, k, v, *, masked, ridge, decay_form, decay,
                        step=False) -> str | None:
    """Why the Triton form (the chunked op: the fused kernels, else the chain of two linear
    attentions; or the decode step) cannot run these inputs, or None (imports the kernels
    lazily)."""
    try:
        from mixers.hla.hla2 import triton as kernels
    except ImportError as error:
        return f"the Triton kernels are not available ({error})"
    options = dict(masked=masked, ridge=ridge, decay_form=decay_form, decay=decay)
    fused = kernels.triton_unsupported_reason(q, k, v, step=step, **options)
    if fused is None or step:
        return fused
    chained = kernels.chain_unsupported_reason(q, k, v, **options)
    return None if chained is None else f"{fused}; and through the chain: {chained}"


def _resolve_impl(impl: str, fallback: str, q, k, v, **triton_args) -> str:
    """See mixers.common.resolve_impl. The paper decay form's kernels walk the chunks
    sequentially (one program per head and 32 value columns) and are not tuned, so "auto"
    keeps the PyTorch form there."""
    paper_decay = triton_args["decay"] is not None and triton_args["decay_form"] == "paper"
    return resolve_impl(impl, fallback, q, lambda: _triton_unsupported(q, k, v, **triton_args),
                        "the paper decay form's kernels are not tuned" if paper_decay else None)


def _prepare(q, k, v, state, state_name, *, masked, normalize, eps, ridge, decay, decay_form):
    """Validate the options; return (form, decay [H] | None, checked state | None, decay for
    the torch forms: [1] under multi-query)."""
    B, _, H, D, Dv = check_qkv(q, k, v, shared_kv_ok=True)
    check_flag("masked", masked)
    check_flag("normalize", normalize)
    check_choice("decay_form", decay_form, DECAY_FORMS)
    _check_scalars(eps, ridge)
    kv_heads, dtype = k.shape[2], compute_dtype(q.dtype)
    g = _check_decay(decay, H, kv_heads, q.device)
    form = operator_form(masked, g, decay_form)
    shapes = state_shapes(form, normalize, ridge, B, H, kv_heads, D, Dv)
    state = _check_state(state, shapes, dtype, q.device, state_name)
    g = None if g is None else g.to(dtype)
    # multi-query decay is uniform (checked), and one value keeps the shared S at one head
    g_torch = g[:1] if g is not None and kv_heads == 1 else g
    return form, g, state, g_torch


def _start_packed(state, form, q, k, v, *, normalize, ridge) -> dict:
    """The torch forms' packed start state: the checked state, or zeros. Built only where a
    torch form runs (the Triton path takes the state as it is, and zeros would cost launches)."""
    if state is not None:
        return pack(state, form, normalize, ridge)
    B, _, H, D = q.shape
    return zero_packed(form, normalize, ridge, B, H, k.shape[2], D, v.shape[-1],
                       compute_dtype(q.dtype), q.device)


def hla2(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None,
         decay_form="masked", impl="auto", chunk_size=64, initial_state=None,
         output_final_state=False):
    """Second-order HLA over [B, T, H, D] q, k and [B, T, H, Dv] v -> (o, final_state | None).

    k, v may have one head shared by all query heads (multi-query). See state.py for the state
    keys each option set carries, and naive.py for the exact sums every impl computes.
    """
    check_flag("output_final_state", output_final_state)
    check_choice("impl", impl, IMPLS)
    check_chunk_size(chunk_size)
    form, g, state, g_torch = _prepare(
        q, k, v, initial_state, "initial_state", masked=masked, normalize=normalize, eps=eps,
        ridge=ridge, decay=decay, decay_form=decay_form)
    impl = _resolve_impl(impl, pytorch_form(q.shape[1], q.shape[-1]), q, k, v, masked=masked,
                         ridge=ridge, decay_form=decay_form, decay=g)
    if impl == "triton" and q.shape[1] > 0:  # checked by _resolve_impl
        from mixers.hla.hla2.triton import (_hla2_triton_unchecked, hla2_chain_unchecked,
                                            triton_unsupported_reason)
        fused = triton_unsupported_reason(q, k, v, masked=masked, ridge=ridge,
                                          decay_form=decay_form, decay=g) is None
        note(triton_path="fused kernels" if fused else "chain of two linear attentions")
        return opaque(_hla2_triton_unchecked if fused else hla2_chain_unchecked, q, k, v,
                      normalize=normalize, eps=eps, decay=g, chunk_size=chunk_size,
                      initial_state=state, output_final_state=output_final_state,
                      **({"decay_form": decay_form} if fused else {}))
    packed = _start_packed(state, form, q, k, v, normalize=normalize, ridge=ridge)
    if q.shape[1] == 0:  # no tokens: no output rows, and the start state is the final one
        final = None
        if output_final_state:  # copies: the caller may update its initial state in place
            final = unpack({key: x.clone() for key, x in packed.items()}, form, normalize, ridge)
        return q.new_zeros(*q.shape[:3], v.shape[-1]), final

    guard = FiniteInputs(q, k, v)  # the non-finite rule (mixers/common.py)
    kwargs = dict(form=form, normalize=normalize, eps=eps, ridge=ridge, g=g_torch, packed=packed)
    if impl != "serial":
        kwargs.update(output_final_state=output_final_state)
    if impl in ("scan", "chunk"):
        kwargs.update(chunk_size=chunk_size)
    if impl == "parallel":  # a zero start's terms are skipped
        kwargs.update(zero_start=state is None)
    o, packed = _FORMS[impl](*guard.inputs, **kwargs)
    final = unpack(packed, form, normalize, ridge) if output_final_state else None
    return guard.outputs(o.to(q.dtype)), guard.state(final)


def hla2_step(q_t, k_t, v_t, state=None, *, masked=True, normalize=False, eps=1e-6, ridge=0.0,
              decay=None, decay_form="masked", impl="auto"):
    """One decode step: [B, H, D] q_t, k_t and [B, H, Dv] v_t (k, v may have 1 head) ->
    (o_t [B, H, Dv] in q_t's dtype, new_state). state=None starts from zeros."""
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [B, H, D], got {got}")
    check_choice("impl", impl, STEP_IMPLS)
    q, k, v = q_t.unsqueeze(1), k_t.unsqueeze(1), v_t.unsqueeze(1)
    form, g, state, g_torch = _prepare(
        q, k, v, state, "state", masked=masked, normalize=normalize, eps=eps, ridge=ridge,
        decay=decay, decay_form=decay_form)
    impl = _resolve_impl(impl, "torch", q, k, v, masked=masked, ridge=ridge,
                         decay_form=decay_form, decay=g, step=True)
    if impl == "triton":  # checked by _resolve_impl
        from mixers.hla.hla2.triton import _step_unchecked
        return _step_unchecked(q_t, k_t, v_t, state, normalize=normalize, eps=eps, decay=g,
                               decay_form=decay_form)
    packed = _start_packed(state, form, q, k, v, normalize=normalize, ridge=ridge)

    dtype = packed["S"].dtype
    v_in = with_ones(v_t.to(dtype)) if normalize else v_t.to(dtype)
    out, packed = step_packed(packed, q_t.to(dtype), k_t.to(dtype), v_in, form=form, ridge=ridge,
                              g=g_torch)
    return finish(out, normalize, eps).to(q_t.dtype), unpack(packed, form, normalize, ridge)


def hla2_state_bytes(state: dict) -> int:
    """Bytes held by a state dict."""
    return sum(x.numel() * x.element_size() for x in state.values())


def hla2_flops(batch, seq_len, heads, head_dim, value_dim, chunk_size=64, mode="fwd") -> float:
    """FLOPs (2 per multiply-add) of the masked, undecayed chunk form's matmuls.

    Per chunk of c tokens and head (d = head_dim, e = value_dim): intra-chunk P = Q K^T (c^2 d),
    (P*L) Wd^T (c^3), its product with V (c^2 e); state terms K^T K (c d^2), Wd^T V and K^T of
    it (c^2 e + c d e), Q^T V (c d e), S0 (Q^T V) (d^2 e); carried read-out Q A0 (c d e),
    Q S0 (c d^2), (Q S0) Q^T (c^2 d) and its product with V (c^2 e). mode "fwdbwd" counts the
    backward as twice the forward (3x); "decode" is one token step at any context
    (k k^T, S q: d^2 each; (S q) v^T, q^T A: d e each).
    """
    check_choice("mode", mode, ("fwd", "fwdbwd", "decode"))
    c, d, e = chunk_size, head_dim, value_dim
    if mode == "decode":
        return 2.0 * batch * heads * (2 * d * d + 2 * d * e)
    per_chunk = 2 * c * c * d + c ** 3 + 3 * c * c * e + 2 * c * d * d + 3 * c * d * e + d * d * e
    fwd = 2.0 * batch * heads * math.ceil(seq_len / c) * per_chunk
    return 3 * fwd if mode == "fwdbwd" else fwd
