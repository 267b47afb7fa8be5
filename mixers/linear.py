"""The "linear" family's registry entries: linear attention and Based, their layers, decoder
and float64 reference. The operator is mixers.linear_attn.

Layers: linear attention uses q/k L2 normalisation, a short causal convolution of size 4 and
an output norm; Based keeps the convolution but leaves q, k as projected (its Taylor map
scales inside) and has no output norm.
"""

from __future__ import annotations

import functools

import torch

from mixers.entry import Mixer, state_nbytes
from mixers.layer import MixerLayer
from mixers.linear_attn import (linear_attn, linear_attn_flops, linear_attn_naive,
                                linear_attn_step, state_shapes)


class LinearAttnDecoder:
    """Linear attention decode: state {"S"} (+ {"z"}), one outer-product update a token.

    feature_dim > 0 fixes the width of q and k (the layer projects them to it), so the state
    holds phi of that width whatever head_dim `init_state` is given, and `step` refuses q, k
    of another width; 0 takes q and k at head_dim.
    """

    def __init__(self, feature_map, normalize, eps, feature_dim=0):
        self.options = {"feature_map": feature_map, "normalize": normalize, "eps": eps}
        self.feature_dim = feature_dim

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        shapes = state_shapes(batch, heads, self.feature_dim or head_dim, value_dim,
                              self.options["normalize"], self.options["feature_map"])
        state = {"S": torch.randn(shapes["S"], device=device, dtype=dtype)}
        if "z" in shapes:
            # A positive key sum, as after a prefill with a positive feature map.
            state["z"] = torch.rand(shapes["z"], device=device, dtype=dtype) + 1
        return state

    def step(self, q, k, v, state):
        check_key_width(q, self.feature_dim)
        o, state = linear_attn_step(q, k, v, state, **self.options)
        return o.to(v.dtype), state

    def state_bytes(self, state):
        return state_nbytes(state)


def check_key_width(q, feature_dim) -> None:
    """With feature_dim > 0, q and k must be feature_dim wide (the op's state and features
    follow that width)."""
    if feature_dim and q.shape[-1] != feature_dim:
        raise ValueError(f"q and k must have width feature_dim={feature_dim}, got "
                         f"{q.shape[-1]} (benchmark at head_dim={feature_dim}, or set "
                         f"feature_dim=0 to map q and k at the head dim)")


def _linear_op(feature_map, normalize, eps, chunk_size, feature_dim=0, impl="auto", **_):
    op = functools.partial(linear_attn, feature_map=feature_map, normalize=normalize,
                           eps=eps, impl=impl, chunk_size=chunk_size)
    if not feature_dim:
        return op

    def op_at_feature_dim(q, k, v, **kwargs):
        check_key_width(q, feature_dim)
        return op(q, k, v, **kwargs)

    return op_at_feature_dim


def _linear_layer(d_model, n_heads, **options):
    """MixerLayer around linear attention; feature_dim > 0 projects q and k to that width
    per head (MixerLayer's key_dim), v and the output keep the head dim."""
    return MixerLayer(d_model, n_heads, _linear_op(**options), qk_norm=options["qk_norm"],
                      short_conv=options["short_conv"], output_norm=options["output_norm"],
                      key_dim=options["feature_dim"] or None, traceable_op=True)


def _linear_decoder(feature_map, normalize, eps, feature_dim, **_):
    return LinearAttnDecoder(feature_map, normalize, eps, feature_dim)


def _linear_reference(feature_map, normalize, eps, **_):
    """The token-by-token recurrence of linear_attn_naive on float64 inputs."""
    def reference(q, k, v):
        return linear_attn_naive(q.double(), k.double(), v.double(), feature_map=feature_map,
                                 normalize=normalize, eps=eps)[0]

    return reference


def _linear_state_size(d_model, n_heads, seq_len, feature_map, feature_dim, normalize, **_):
    """Linear attention's state per layer: S, F x dv per head, and z, F per head when
    normalized; F is phi's width of the key_dim-wide q, k (identity: d_k; Based's Taylor map
    of f = feature_dim channels: 1 + f + f^2), dv = d_model / n_heads."""
    from mixers.linear_attn import feature_size

    features = feature_size(feature_map, feature_dim or d_model // n_heads)
    return n_heads * features * (d_model // n_heads + (1 if normalize else 0))


def _triton_requires(impl="auto", **_):
    return ("triton", "cuda") if impl == "triton" else ()


LINEAR_ATTN = Mixer(
    name="linear-attn", family="linear",
    description="Causal linear attention: chunked or parallel PyTorch or the HLA chain's "
                "Triton link (impl chunk|parallel|triton|auto; feature_map identity|elu1|relu|taylor, optional "
                "normalisation; feature_dim > 0 projects q, k to that width per head).",
    build_op=_linear_op, build_layer=_linear_layer, build_decoder=_linear_decoder,
    options={"feature_map": "identity", "feature_dim": 0, "normalize": False, "eps": 1e-6,
             "impl": "auto", "chunk_size": 64, "qk_norm": "l2", "short_conv": 4,
             "output_norm": True},
    forms=("chunk", "parallel", "triton"), flops=linear_attn_flops,
    option_requires=_triton_requires, build_reference=_linear_reference,
    state_size=_linear_state_size)


# Based (Arora et al. 2024) as Zoology and the Based repository build it: q, k projected to
# 16 features per head with no norm or scaling before the Taylor map, normalised output
# (eps 1e-12, their default: the Taylor kernel is >= 1/2, so the denominator is >= t/2 and
# eps never matters) and no output norm (the normalised output is a convex combination of
# the values). The short convolution stands in for the BaseConv layer Based pairs with it.
BASED = Mixer(
    name="based", family="linear",
    description="Based: linear attention with the 2nd-order Taylor map of exp on q, k "
                "projected to feature_dim (16) per head; normalised; short convolution.",
    build_op=_linear_op, build_layer=_linear_layer, build_decoder=_linear_decoder,
    options={"feature_map": "taylor", "feature_dim": 16, "normalize": True, "eps": 1e-12,
             "impl": "auto", "chunk_size": 64, "qk_norm": "none", "short_conv": 4,
             "output_norm": False},
    forms=("chunk", "parallel", "triton"), flops=linear_attn_flops,
    option_requires=_triton_requires, build_reference=_linear_reference,
    state_size=_linear_state_size)


def linear_mixers() -> list[Mixer]:
    return [LINEAR_ATTN, BASED]
