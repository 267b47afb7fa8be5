"""Asymmetric second-order HLA, AHLA (paper §6).

    o_t = sum_{j <= i <= t} g^(t - j) (q_t . k_i) (q_i . k_j) v_j
        = [((L_g * Q K^T) (L_g * Q K^T)) V]_t,   L_g[t, s] = g^(t - s) for s <= t

with g = 1 without decay. These are exactly the weights of Alg. 2's decayed recurrence
(P <- g P + k v^T, E <- g E + k (q^T P)): a path j -> i -> t decays once per step from j to
t. Normalized: divided by the same sum with v_j = 1 (den_t = q_t^T n_t), plus eps.

Forms: "serial" (Alg. 2), "scan" (§6.2 associative scan), "chunk" (dense masked chunk
products), "parallel" (the whole sequence as one masked block, for short sequences),
"triton" (two chained causal linear attentions, mixers/chain); "auto" = "triton" on
CUDA where the kernels take the inputs, else "parallel" up to T = 2 D and "chunk" beyond
(mixers.common.pytorch_form). The state is {"P", "E"} (+ {"m", "n"} when normalized), each
`[B, H, D, Dv]` (`[B, H, D]`), float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from mixers.dispatch import opaque
from mixers.hla.ahla2.chunk import ahla2_chunk
from mixers.hla.ahla2.naive import ahla2_naive
from mixers.hla.ahla2.parallel import ahla2_parallel
from mixers.hla.ahla2.scan import ahla2_scan
from mixers.hla.ahla2.serial import ahla2_recurrence, ahla2_serial
from mixers.hla.ahla2.state import (check_token, compute_dtype, pack,
                                    read_out, state_bytes, to_heads_first, unpack)
from mixers.common import (FiniteInputs, check_choice, check_chunk_size, check_decay,
                               check_eps, check_flag, check_qkv, check_state, kernel_read_out,
                               pytorch_form, resolve_impl)

__all__ = ["ahla2", "ahla2_step", "ahla2_naive", "ahla2_state_bytes", "ahla2_flops"]

AHLA2_IMPLS = ("auto", "serial", "scan", "chunk", "parallel", "triton")
STEP_IMPLS = ("auto", "torch", "triton")
FORMS = {"serial": ahla2_serial, "scan": ahla2_scan}


def _triton_unsupported(q, k, v) -> str | None:
    """Why the Triton form cannot run these inputs, or None (imports the kernels lazily)."""
    try:
        from mixers.hla.ahla2 import triton as kernels
    except ImportError as error:
        return f"the Triton kernels are not available ({error})"
    return kernels.unsupported_reason(q, k, v)


def _state_shapes(B, H, D, Dv, normalize):
    shapes = {"P": (B, H, D, Dv), "E": (B, H, D, Dv)}
    if normalize:
        shapes.update(m=(B, H, D), n=(B, H, D))
    return shapes


def _carries(state, B, H, D, Dv, normalize, dtype, device, name):
    """Packed (P, E) carries from a state dict (zeros for None), after checking it (errors
    call it `name`, the caller's argument)."""
    if state is None:
        zeros = torch.zeros(B, H, D, Dv + normalize, dtype=dtype, device=device)
        return zeros, zeros
    check_state(state, _state_shapes(B, H, D, Dv, normalize), name)
    return (pack(state, "P", "m" if normalize else None, dtype, device),
            pack(state, "E", "n" if normalize else None, dtype, device))


def _state_dict(P, E, normalize):
    return {**unpack(P, "P", "m" if normalize else None),
            **unpack(E, "E", "n" if normalize else None)}


def ahla2(q, k, v, *, normalize=False, eps=1e-6, decay=None, impl="auto", chunk_size=64,
          initial_state=None, output_final_state=False):
    """AHLA on `[B, T, H, D]` q, k and `[B, T, H, Dv]` v -> (o `[B, T, H, Dv]`, state or None).

    decay: None, a float or an `[H]` tensor in (0, 1]. No scaling is applied to q or k.
    """
    B, T, H, D, Dv = check_qkv(q, k, v)
    check_flag("normalize", normalize)
    check_flag("output_final_state", output_final_state)
    check_choice("impl", impl, AHLA2_IMPLS)
    check_chunk_size(chunk_size)
    check_eps(eps)
    decay = check_decay(decay, H, q.device)
    dtype = compute_dtype(q.dtype)
    P0, E0 = _carries(initial_state, B, H, D, Dv, normalize, dtype, q.device,
                      "initial_state")
    if T == 0:  # no tokens: no output rows, and the start state is the final one
        final = _state_dict(P0.clone(), E0.clone(), normalize) if output_final_state else None
        return q.new_zeros(B, 0, H, Dv), final
    impl = resolve_impl(impl, pytorch_form(T, D), q, lambda: _triton_unsupported(q, k, v))
    if impl == "triton":  # the kernels keep the non-finite rule (mixers/chain)
        from mixers.hla.ahla2.triton import ahla2_triton_packed
        starts = (P0, E0) if initial_state is not None else (None, None)  # None: zeros
        o, P, E = opaque(ahla2_triton_packed, q, k, v, *starts, decay, normalize, chunk_size,
                         output_final_state)
        o = kernel_read_out(o, normalize, eps, q.dtype)
        return o, (_state_dict(P, E, normalize) if output_final_state else None)
    guard = FiniteInputs(q, k, v)  # the non-finite rule (mixers/common.py)
    q_in, k_in, v_in = guard.inputs
    qh, kh = to_heads_first(q_in, dtype), to_heads_first(k_in, dtype)
    vh = to_heads_first(v_in, dtype, ones_column=normalize)
    if impl == "chunk":
        o, (P, E) = ahla2_chunk(qh, kh, vh, P0, E0, decay, chunk_size)
    elif impl == "parallel":  # zero starts as None: their terms are skipped
        starts = (P0, E0) if initial_state is not None else (None, None)
        o, final = ahla2_parallel(qh, kh, vh, *starts, decay, output_final_state)
        P, E = final if final is not None else (None, None)
    else:
        o, (P, E) = FORMS[impl](qh, kh, vh, P0, E0, decay)
    o = guard.outputs(read_out(o, normalize, eps, q.dtype).transpose(1, 2))
    return o, (guard.state(_state_dict(P, E, normalize)) if output_final_state else None)


def ahla2_step(q_t, k_t, v_t, state=None, *, normalize=False, eps=1e-6, decay=None,
               impl="auto"):
    """One decode step (Alg. 2) on `[B, H, D]` q_t, k_t, `[B, H, Dv]` v_t -> (o_t, new state).
    impl: "torch", "triton" (the fused step), or "auto" (Triton on CUDA)."""
    B, H, D, Dv = check_token(q_t, k_t, v_t)
    check_flag("normalize", normalize)
    check_eps(eps)
    check_choice("impl", impl, STEP_IMPLS)
    decay = check_decay(decay, H, q_t.device)
    dtype = compute_dtype(q_t.dtype)
    P, E = _carries(state, B, H, D, Dv, normalize, dtype, q_t.device, "state")
    if resolve_impl(impl, "torch", q_t, lambda: _triton_unsupported(q_t, k_t, v_t)) == "triton":
        from mixers.hla.ahla2.triton import ahla2_step_packed, plan_launch
        plan = plan_launch(D, Dv + normalize, dtype)
        o, P, E = ahla2_step_packed(q_t, k_t, v_t, P, E, decay, normalize, plan)
        return read_out(o, normalize, eps, q_t.dtype), _state_dict(P, E, normalize)
    v = v_t.to(dtype)
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    o, P, E = ahla2_recurrence(q_t.to(dtype), k_t.to(dtype), v, P, E, decay)
    return read_out(o, normalize, eps, q_t.dtype), _state_dict(P, E, normalize)


def ahla2_state_bytes(state: dict) -> int:
    """Bytes held by an ahla2 state dict."""
    return state_bytes(state)


def ahla2_flops(batch, seq_len, heads, head_dim, value_dim, chunk_size=64, mode="fwd", *,
                normalize=False):
    """Matmul FLOPs (2 per multiply-add) of the chunk form; "fwdbwd" counts backward as 2x
    forward; "decode" is one Alg. 2 step (two outer-product updates, two reads: 8 D Dv)."""
    D, Dv, C = head_dim, value_dim + normalize, chunk_size
    check_choice("mode", mode, ("fwd", "fwdbwd", "decode"))
    if mode == "decode":
        return float(batch * heads * 8 * D * Dv)
    per_chunk = 2 * (C * C * D                # Q K^T
                     + 2 * C * C * Dv         # W V, W X
                     + 2 * C * D * Dv         # Q P0, Q E0
                     + 3 * D * C * Dv         # K^T V, K^T (W V), plus the (K^T Q) P0 step:
                     + D * C * D + D * D * Dv)  # K^T Q, (K^T Q) P0
    chunks = -(-seq_len // C)
    fwd = float(batch * heads * chunks * per_chunk)
    return fwd if mode == "fwd" else 3 * fwd
