"""Third-order HLA (paper §7; docs/discrepancies.md), two operators under distinct names.

variant="causal": the causal restriction of (W W^T W) V, W = L * Q K^T,

    o_t = sum_{u <= t} sum_{i <= u} sum_{j <= u} (q_t . k_i) (q_u . k_i) (q_u . k_j) v_j,

streamed with (S^K, P, F): F_t = F_{t-1} + (S^K_t q_t)(q_t^T P_t), o_t = q_t^T F_t.
Forms "serial", "scan" (a segment operator with d x d moments only, see scan.py), "chunk"
(dense masked chunk products), "parallel" (the whole sequence as one masked block, for
short sequences) and "triton" (three chained causal linear attentions, mixers/chain);
"auto" = "triton" on CUDA where the kernels take the inputs, else "parallel" up to T = 2 D
and "chunk" beyond (mixers.common.pytorch_form).

variant="paper": the paper's Alg. 3 / Alg. 4, which sums the same product over the triples
(i, u, j) in [1..t]^3 whose maximum is attained at least twice: causal, but a different
operator. Forms "serial" (Alg. 3) and "scan" (Alg. 4, segment maps held as d^3 dv tensors,
so only for small heads); "auto" = "scan". No decay (the paper states Alg. 4 for gamma = 1).

Normalized: divided by the same sum with v_j = 1, plus eps. State (float32, float64 for
float64 inputs): causal {"SK", "P", "F"}, paper {"SK", "SQ", "P", "F"} with F the corrected
state of eq. 7.4; normalized adds {"m", "eta"} (the v = 1 columns of P and F).
"""

from __future__ import annotations

import torch

from mixers.dispatch import opaque
from mixers.hla.ahla2.state import (check_token, compute_dtype, pack,
                                    read_out, state_bytes, to_heads_first, unpack)
from mixers.common import (FiniteInputs, check_choice, check_chunk_size, check_eps,
                               check_flag, check_qkv, check_state, kernel_read_out,
                               pytorch_form, resolve_impl)
from mixers.hla.hla3.chunk import hla3_chunk
from mixers.hla.hla3.naive import hla3_naive
from mixers.hla.hla3.parallel import hla3_parallel
from mixers.hla.hla3.scan import hla3_scan
from mixers.hla.hla3.serial import causal_recurrence, hla3_serial, paper_recurrence

__all__ = ["hla3", "hla3_step", "hla3_naive", "hla3_state_bytes", "hla3_flops"]

VARIANTS = ("causal", "paper")
HLA3_IMPLS = ("auto", "serial", "scan", "chunk", "parallel", "triton")
STEP_IMPLS = ("auto", "torch", "triton")


def _keys(variant):
    return ("SK", "P", "F") if variant == "causal" else ("SK", "SQ", "P", "F")


TWINS = {"P": "m", "F": "eta"}


def _state_shapes(variant, B, H, D, Dv, normalize):
    shapes = {key: (B, H, D, D if key.startswith("S") else Dv) for key in _keys(variant)}
    if normalize:
        shapes.update(m=(B, H, D), eta=(B, H, D))
    return shapes


def _carries(state, variant, B, H, D, Dv, normalize, dtype, device, name):
    """Packed carries from a state dict (zeros for None), after checking it (errors call it
    `name`, the caller's argument)."""
    if state is None:
        return tuple(torch.zeros(B, H, D, D if key.startswith("S") else Dv + normalize,
                                 dtype=dtype, device=device) for key in _keys(variant))
    check_state(state, _state_shapes(variant, B, H, D, Dv, normalize), name)
    return tuple(pack(state, key, TWINS.get(key) if normalize else None, dtype, device)
                 for key in _keys(variant))


def _state_dict(carries, variant, normalize):
    state = {}
    for key, x in zip(_keys(variant), carries):
        state.update(unpack(x, key, TWINS.get(key) if normalize else None))
    return state


def _check_variant_impl(variant, impl):
    check_choice("variant", variant, VARIANTS)
    check_choice("impl", impl, HLA3_IMPLS)
    if variant == "paper" and impl in ("chunk", "parallel", "triton"):
        raise ValueError(f"impl={impl!r} is not available for variant='paper' (it has only "
                         "'serial' and 'scan'; 'auto' picks 'scan')")


def _triton_unsupported(q, k, v, step: bool = False) -> str | None:
    """Why the Triton form (the decode step's with `step`) cannot run these inputs, or None
    (imports the kernels lazily)."""
    try:
        from mixers.hla.hla3 import triton as kernels
    except ImportError as error:
        return f"the Triton kernels are not available ({error})"
    if step:
        return kernels.step_unsupported_reason(q, k, v)
    return kernels.unsupported_reason(q, k, v)


def hla3(q, k, v, *, variant="causal", normalize=False, eps=1e-6, impl="auto", chunk_size=64,
         initial_state=None, output_final_state=False):
    """Third-order HLA on `[B, T, H, D]` q, k and `[B, T, H, Dv]` v -> (o, state or None).

    No scaling is applied to q or k.
    """
    B, T, H, D, Dv = check_qkv(q, k, v)
    check_flag("normalize", normalize)
    check_flag("output_final_state", output_final_state)
    _check_variant_impl(variant, impl)
    check_chunk_size(chunk_size)
    check_eps(eps)
    dtype = compute_dtype(q.dtype)
    carries = _carries(initial_state, variant, B, H, D, Dv, normalize, dtype, q.device,
                       "initial_state")
    if T == 0:  # no tokens: no output rows, and the start state is the final one
        final = None
        if output_final_state:
            final = _state_dict(tuple(x.clone() for x in carries), variant, normalize)
        return q.new_zeros(B, 0, H, Dv), final
    if variant == "causal":
        impl = resolve_impl(impl, pytorch_form(T, D), q, lambda: _triton_unsupported(q, k, v))
    else:
        impl = resolve_impl("scan" if impl == "auto" else impl, "scan", q, lambda: None)
    if impl == "triton":  # the kernels keep the non-finite rule (mixers/chain)
        from mixers.hla.hla3.triton import hla3_triton_packed
        starts = carries if initial_state is not None else (None,) * len(carries)  # zeros
        o, *carries = opaque(hla3_triton_packed, q, k, v, *starts, normalize, chunk_size,
                             output_final_state)
        o = kernel_read_out(o, normalize, eps, q.dtype)
        return o, (_state_dict(carries, variant, normalize) if output_final_state else None)
    guard = FiniteInputs(q, k, v)  # the non-finite rule (mixers/common.py)
    q_in, k_in, v_in = guard.inputs
    qh, kh = to_heads_first(q_in, dtype), to_heads_first(k_in, dtype)
    vh = to_heads_first(v_in, dtype, ones_column=normalize)
    if impl == "chunk":
        o, carries = hla3_chunk(qh, kh, vh, carries, chunk_size)
    elif impl == "parallel":  # zero starts as None: their terms are skipped
        starts = carries if initial_state is not None else (None,) * len(carries)
        o, carries = hla3_parallel(qh, kh, vh, *starts, output_final_state)
    else:
        form = hla3_serial if impl == "serial" else hla3_scan
        o, carries = form(qh, kh, vh, carries, variant)
    o = guard.outputs(read_out(o, normalize, eps, q.dtype).transpose(1, 2))
    final = guard.state(_state_dict(carries, variant, normalize)) if output_final_state else None
    return o, final


def hla3_step(q_t, k_t, v_t, state=None, *, variant="causal", normalize=False, eps=1e-6,
              impl="auto"):
    """One decode step on `[B, H, D]` q_t, k_t, `[B, H, Dv]` v_t -> (o_t, new state).
    impl: "torch", "triton" (the fused causal step), or "auto" (Triton on CUDA, causal)."""
    B, H, D, Dv = check_token(q_t, k_t, v_t)
    check_flag("normalize", normalize)
    check_choice("variant", variant, VARIANTS)
    check_choice("impl", impl, STEP_IMPLS)
    check_eps(eps)
    if variant == "paper" and impl == "triton":
        raise ValueError("impl='triton' is not available for variant='paper'")
    dtype = compute_dtype(q_t.dtype)
    carries = _carries(state, variant, B, H, D, Dv, normalize, dtype, q_t.device, "state")
    if variant == "causal" and resolve_impl(
            impl, "torch", q_t, lambda: _triton_unsupported(q_t, k_t, v_t, step=True)) == "triton":
        from mixers.hla.hla3.triton import hla3_step_packed, plan_launch
        plan = plan_launch(D, Dv + normalize, dtype)
        o, *carries = hla3_step_packed(q_t, k_t, v_t, *carries, normalize, plan)
        return read_out(o, normalize, eps, q_t.dtype), _state_dict(carries, variant, normalize)
    q, k, v = q_t.to(dtype), k_t.to(dtype), v_t.to(dtype)
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    if variant == "causal":
        o, *carries = causal_recurrence(q, k, v, *carries)
    else:
        SK, SQ, P, F = carries
        o, SK, SQ, P, G = paper_recurrence(q, k, v, SK, SQ, P, SK @ SQ @ P - F)
        carries = (SK, SQ, P, SK @ SQ @ P - G)
    return read_out(o, normalize, eps, q_t.dtype), _state_dict(carries, variant, normalize)


def hla3_state_bytes(state: dict) -> int:
    """Bytes held by an hla3 state dict."""
    return state_bytes(state)


def hla3_flops(batch, seq_len, heads, head_dim, value_dim, chunk_size=64, mode="fwd", *,
               normalize=False):
    """Matmul FLOPs (2 per multiply-add) of the causal chunk form; "fwdbwd" counts backward
    as 2x forward; "decode" is one causal serial step (4 D^2 + 8 D Dv)."""
    D, Dv, C = head_dim, value_dim + normalize, chunk_size
    check_choice("mode", mode, ("fwd", "fwdbwd", "decode"))
    if mode == "decode":
        return float(batch * heads * (4 * D * D + 8 * D * Dv))
    per_chunk = 2 * (2 * C * C * D + C * D * D   # Q K^T, (Q S0) Q^T, Q S0
                     + C * C * C                 # A (L * A)^T
                     + 3 * C * C * Dv            # (L * A) V, Bm r, (L * A)^T r
                     + 5 * C * D * Dv            # Q P0, Q F0, K^T V, Q^T r, K^T (...)
                     + D * D * C + D * D * Dv)   # K^T K, S0 (Q^T r)
    chunks = -(-seq_len // C)
    fwd = float(batch * heads * chunks * per_chunk)
    return fwd if mode == "fwd" else 3 * fwd
