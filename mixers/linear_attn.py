"""Causal linear attention (Katharopoulos et al. 2020): chunked or parallel PyTorch, or on
CUDA one link of the HLA chain's Triton kernels (mixers/chain) on phi's features.

o_t = phi(q_t)^T S_t with S_t = sum_{i<=t} phi(k_i) v_i^T; normalized, the output is divided
by phi(q_t)^T z_t + eps with z_t = sum_{i<=t} phi(k_i). q and k are not scaled outside the
feature map (like the HLA ops). phi maps the last dim D to F features (F = D except for
"taylor"); S is [F, Dv] and z [F] per head. The chunk form does, per chunk of C tokens, one
masked C x C product and two C x F x Dv products; the carried state S is an exclusive prefix
sum of per-chunk K^T V. The parallel form is the whole sequence as one masked T x T block of
kernel values phi(q_t).phi(k_s), computed from q.k without the features for the identity
and Taylor maps (multiply-adds per token and head: about T (D + Dv), against the chunk
form's C (F + Dv) + 2 F Dv; for Based's F = 273 features of D = 16, far fewer at the recall
tasks' lengths).

"taylor" is Based's map (Arora et al. 2024): the 2nd-order Taylor expansion of exp(q.k/sqrt(D)),
phi(x) = [1, x / D^(1/4), vec(x x^T) / sqrt(2 D)], so that
phi(q).phi(k) = 1 + q.k/sqrt(D) + (q.k)^2/(2 D) and F = 1 + D + D^2. That kernel is at least
1/2 for any q, k, so the normalized form's denominator is at least t/2 without any bound on q, k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mixers.dispatch import opaque
from mixers.common import (FiniteInputs, check_choice, check_chunk_size, check_eps,
                               check_flag, check_qkv, exclusive_cumsum, kernel_read_out,
                               pad_to_multiple, poison, pytorch_form, resolve_impl)

IMPLS = ("auto", "chunk", "parallel", "triton")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def taylor_features(x: torch.Tensor) -> torch.Tensor:
    """`[..., D]` -> `[..., 1 + D + D^2]`: [1, x / D^(1/4), vec(x x^T) / sqrt(2 D)]."""
    D = x.shape[-1]
    second = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2 * D)
    return torch.cat([torch.ones_like(x[..., :1]), x * D ** -0.25, second], dim=-1)


FEATURE_MAPS = {
    "identity": lambda x: x,
    "elu1": lambda x: F.elu(x) + 1,
    "relu": F.relu,
    "taylor": taylor_features,
}

# phi(q).phi(k) as a function of the dot products s = q.k and the width D, for the maps
# whose kernel needs no features (the parallel form's scores)
KERNELS = {
    "identity": lambda s, D: s,
    "taylor": lambda s, D: 1 + s / math.sqrt(D) + s * s / (2 * D),
}


def feature_size(feature_map: str, dim: int) -> int:
    """Width of phi's output for a `dim`-wide input (read off the map itself)."""
    check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
    return FEATURE_MAPS[feature_map](torch.zeros(1, dim)).shape[-1]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def state_shapes(batch: int, heads: int, head_dim: int, value_dim: int, normalize: bool,
                 feature_map: str = "identity") -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the linear-attention state for `head_dim`-wide q and k: S (and z)
    hold phi's features, `feature_size(feature_map, head_dim)` of them."""
    features = feature_size(feature_map, head_dim)
    shapes = {"S": (batch, heads, features, value_dim)}
    if normalize:
        shapes["z"] = (batch, heads, features)
    return shapes


def _initial(initial_state, shapes, device, dtype) -> dict[str, torch.Tensor]:
    if initial_state is None:
        return {key: torch.zeros(shape, device=device, dtype=dtype)
                for key, shape in shapes.items()}
    if set(initial_state) != set(shapes):
        raise ValueError(f"initial_state must have keys {sorted(shapes)}, "
                         f"got {sorted(initial_state)}")
    for key, shape in shapes.items():
        if tuple(initial_state[key].shape) != shape:
            raise ValueError(f"initial_state[{key!r}] must have shape {shape}, "
                             f"got {tuple(initial_state[key].shape)}")
    return {key: value.to(dtype) for key, value in initial_state.items()}


def features_of(phi, q, k, v, dtype):
    """(phi(q), phi(k), v) in the compute dtype `dtype`."""
    return phi(q.to(dtype)), phi(k.to(dtype)), v.to(dtype)


def triton_unsupported(q: torch.Tensor, v: torch.Tensor, features: int) -> str | None:
    """Why the Triton link (mixers/chain) cannot run these inputs, or None."""
    if q.dtype not in TRITON_DTYPES or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {v.dtype} (supported: one of {TRITON_DTYPES} for all)"
    from mixers.chain.plan import MAX_HEAD_DIM, device_reason

    if features > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"feature width {features} or value dim {v.shape[-1]} above {MAX_HEAD_DIM}"
    return device_reason(q)


def linear_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                feature_map: str = "identity", normalize: bool = False, eps: float = 1e-6,
                impl: str = "auto", chunk_size: int = 64, initial_state: dict | None = None,
                output_final_state: bool = False):
    """Causal linear attention on `[B, T, H, D]` inputs; returns (o, state | None).
    impl: "chunk" or "parallel" (PyTorch), "triton" (the chain's link, mixers/chain, on
    the features) or "auto" (Triton on CUDA where it takes the inputs, else "parallel" up to
    T = 2 F, F phi's width, and "chunk" beyond: mixers.common.pytorch_form)."""
    B, T, H, D, Dv = check_qkv(q, k, v)
    check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
    check_choice("impl", impl, IMPLS)
    check_flag("normalize", normalize)
    check_flag("output_final_state", output_final_state)
    check_eps(eps)
    check_chunk_size(chunk_size)
    dtype = _compute_dtype(q)
    state = _initial(initial_state, state_shapes(B, H, D, Dv, normalize, feature_map),
                     q.device, dtype)
    if T == 0:  # no tokens: no output rows, and the start state is the final one
        final = {key: x.clone() for key, x in state.items()} if output_final_state else None
        return v.new_zeros(B, 0, H, Dv), final
    phi = FEATURE_MAPS[feature_map]
    out_dtype, features = v.dtype, state["S"].shape[-2]
    impl = resolve_impl(impl, pytorch_form(T, features), q,
                        lambda: triton_unsupported(q, v, features))
    if impl == "triton":
        # The kernels read 16-bit inputs as they are (tl.dot's tf32 holds them exactly), so
        # the identity map costs no copy; another map runs in the compute dtype first.
        inputs = (q, k, v) if feature_map == "identity" else features_of(phi, q, k, v, dtype)
        return _triton(inputs, state, normalize, eps, chunk_size, q.dtype, out_dtype,
                       output_final_state, zero_start=initial_state is None)
    if impl == "parallel":
        return _parallel(q, k, v, state, feature_map, normalize, eps, dtype, out_dtype,
                         output_final_state, zero_start=initial_state is None)
    # The non-finite rule (mixers/common.py) on the features. The feature map runs in the
    # compute dtype and before the zero padding, so padded tokens add nothing (taylor maps a
    # zero key to [1, 0, 0], which would enter z).
    guard = FiniteInputs(*features_of(phi, q, k, v, dtype))
    q, k, v = (pad_to_multiple(x, chunk_size) for x in guard.inputs)
    N, C = q.shape[1] // chunk_size, chunk_size
    q, k, v = (x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))  # [B,H,N,C,*]

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)).masked_fill(~causal, 0)
    chunk_kv = k.transpose(-1, -2) @ v                                  # [B, H, N, F, Dv]
    S_before = state["S"].unsqueeze(2) + exclusive_cumsum(chunk_kv, 2)
    o = q @ S_before + scores @ v
    final = {"S": state["S"] + chunk_kv.sum(2)}
    if normalize:
        chunk_k = k.sum(3)                                              # [B, H, N, F]
        z_before = state["z"].unsqueeze(2) + exclusive_cumsum(chunk_k, 2)
        den = (q @ z_before.unsqueeze(-1)).squeeze(-1) + scores.sum(-1)
        o = o / (den.unsqueeze(-1) + eps)
        final["z"] = state["z"] + chunk_k.sum(2)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, Dv)[:, :T]
    return guard.outputs(o.to(out_dtype)), (guard.state(final) if output_final_state else None)


def _triton(inputs, state, normalize, eps, chunk_size, input_dtype, out_dtype,
            output_final_state, zero_start):
    """linear_attn through the chain's link: the features and values (as given: 16-bit
    inputs of the identity map, else the compute dtype) with a column of ones for the
    denominator when normalized; z is the state's ones column. The kernels keep the
    non-finite rule (mixers/chain); the state never reads q, so a final state asked for
    is set to NaN here for a (batch, head) with a non-finite query, as the rule asks.
    `zero_start`: the state is zeros, which the link then takes as None (a link of one
    chunk without a final state keeps no state)."""
    from mixers.chain.link import linear_attention_packed

    S0 = state["S"]
    if normalize:
        S0 = torch.cat([S0, state["z"].unsqueeze(-1)], dim=-1)
    out, S1 = opaque(linear_attention_packed, *inputs, S0, normalize, chunk_size, input_dtype,
                     out_dtype, zero_start=zero_start, need_final=output_final_state)
    o = kernel_read_out(out, normalize, eps, out_dtype)
    if not output_final_state:
        return o, None
    Dv = state["S"].shape[-1]
    final = {"S": S1[..., :Dv], "z": S1[..., Dv]} if normalize else {"S": S1}
    bad = ~torch.isfinite(inputs[0].sum(-1, dtype=S1.dtype)).all(1)    # [B, H]
    return o, {key: poison(x, bad) for key, x in final.items()}


def _parallel(q, k, v, state, feature_map, normalize, eps, dtype, out_dtype,
              output_final_state, zero_start):
    """The parallel form: A = L * (phi(Q) phi(K)^T) over the whole sequence (L the causal
    mask), o = A V + phi(Q) S0, divided by A 1 + phi(Q) z0 + eps when normalized; the final
    state S0 + phi(K)^T V (z0 + phi(K)^T 1). The non-finite rule holds on the inputs of the
    scores: the raw q, k for a map in KERNELS (a non-finite entry gives non-finite
    features there), else the features."""
    phi = FEATURE_MAPS[feature_map]
    direct = feature_map in KERNELS
    guard = FiniteInputs(*((q.to(dtype), k.to(dtype), v.to(dtype)) if direct
                           else features_of(phi, q, k, v, dtype)))
    q, k, v = (x.transpose(1, 2) for x in guard.inputs)                 # [B, H, T, .]
    T, D = q.shape[2], q.shape[3]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = KERNELS[feature_map](q @ k.mT, D) if direct else q @ k.mT
    A = scores.masked_fill(~causal, 0)
    o = A @ v
    features = phi if direct else (lambda x: x)    # only for the state terms
    if not zero_start:
        fq = features(q)
        o = o + fq @ state["S"]
    if normalize:
        den = A.sum(-1, keepdim=True)
        if not zero_start:
            den = den + fq @ state["z"].unsqueeze(-1)
        o = o / (den + eps)
    o = guard.outputs(o.transpose(1, 2).to(out_dtype))
    if not output_final_state:
        return o, None
    fk = features(k)
    final = {"S": state["S"] + fk.mT @ v}
    if normalize:
        final["z"] = state["z"] + fk.sum(2)
    return o, guard.state(final)


def linear_attn_naive(q, k, v, *, feature_map="identity", normalize=False, eps=1e-6,
                      initial_state=None):
    """Token-by-token reference (float64 when given float64): returns (o, final state)."""
    B, T, H, D, Dv = check_qkv(q, k, v)
    check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
    check_flag("normalize", normalize)
    check_eps(eps)
    state = _initial(initial_state, state_shapes(B, H, D, Dv, normalize, feature_map),
                     q.device, q.dtype)
    outputs = [q.new_zeros(B, 0, H, Dv)]  # the empty sequence's output (T = 0)
    for t in range(T):
        o_t, state = linear_attn_step(q[:, t], k[:, t], v[:, t], state,
                                      feature_map=feature_map, normalize=normalize, eps=eps)
        outputs.append(o_t.unsqueeze(1))
    return torch.cat(outputs, 1), state


def linear_attn_step(q_t, k_t, v_t, state, *, feature_map="identity", normalize=False,
                     eps=1e-6):
    """One token, `[B, H, D]` inputs: returns (`[B, H, Dv]` output, new state); the state's
    S is `[B, H, F, Dv]` (z `[B, H, F]`) with F phi's output width."""
    check_choice("feature_map", feature_map, tuple(FEATURE_MAPS))
    phi = FEATURE_MAPS[feature_map]
    dtype = state["S"].dtype
    q_t, k_t, v_t = phi(q_t.to(dtype)), phi(k_t.to(dtype)), v_t.to(dtype)
    new = {"S": state["S"] + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)}
    o_t = (q_t.unsqueeze(-2) @ new["S"]).squeeze(-2)
    if normalize:
        new["z"] = state["z"] + k_t
        o_t = o_t / ((q_t * new["z"]).sum(-1, keepdim=True) + eps)
    return o_t, new


def linear_attn_flops(batch, seq_len, heads, head_dim, value_dim, mode, *, chunk_size=64,
                      normalize=False, feature_map="identity", feature_dim=0, **_):
    """Chunk-form FLOPs with D the feature width after the map (phi of `feature_dim`, or of
    `head_dim` when it is 0): per token 2C(D+Dv) for the masked chunk products, 4 D Dv for
    the state read and update (plus 2C + 4D when normalized); backward counted as 2x forward.
    The map itself is not counted."""
    D = feature_size(feature_map, feature_dim or head_dim)
    Dv, C = value_dim, chunk_size
    if mode == "decode":
        per_token = 4 * D * Dv + (4 * D if normalize else 0)
        return float(batch * heads * per_token)
    per_token = 2 * C * (D + Dv) + 4 * D * Dv + ((2 * C + 4 * D) if normalize else 0)
    fwd = float(batch * heads * seq_len * per_token)
    return fwd if mode == "fwd" else 3 * fwd
