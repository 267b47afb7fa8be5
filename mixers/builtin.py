"""Registers the built-in mixers (imported by `hla_bench.registry` on first use).

Families: "hla" (mixers.hla operators), "softmax" (SDPA, flash-attn), "linear" (our chunked
linear attention), "ssm" (Mamba-2 SSD), "fla" (flash-linear-attention kernels).
Layers: HLA, linear-attn and fla entries use q/k L2 normalisation and a short causal
convolution of size 4 (fla's layer default); based keeps the convolution but leaves q, k as
projected (its Taylor map scales inside); softmax layers use neither (the op scales by
1/sqrt(D)).
"""

from __future__ import annotations

import functools

import torch

from hla_bench.registry import Mixer, register, state_nbytes
from mixers.attention import (CUDA_ONLY_BACKENDS, KVCacheDecoder, flash_attn_attention,
                              sdpa_attention, softmax_flops)
from mixers.fla import fla_mixers
from mixers.hla.layers import hla_mixers
from mixers.layer import MixerLayer
from mixers.linear_attn import linear_attn, linear_attn_flops, linear_attn_step, state_shapes
from mixers.mamba2 import SSDDecoder, mamba2_ssd, ssd_flops, ssd_parameters
from mixers.mamba2.layer import Mamba2Block


def _sdpa_op(backend, scale, **_):
    return functools.partial(sdpa_attention, backend=backend, scale=scale)


def _flash_attn_op(**_):
    return flash_attn_attention


def _sdpa_requires(backend="auto", **_):
    return ("cuda",) if backend in CUDA_ONLY_BACKENDS else ()


def _softmax_layer(build_op, dropout: bool):
    """Softmax layers: no q/k norm (the op scales by 1/sqrt(D)); `bias` on the projections
    and, where the op takes it, attention `dropout` while training."""
    def build_layer(d_model, n_heads, **options):
        return MixerLayer(d_model, n_heads, build_op(**options), qk_norm="none",
                          short_conv=options["short_conv"], bias=options["bias"],
                          dropout=options["dropout"] if dropout else 0.0)

    return build_layer


SDPA = Mixer(
    name="sdpa", family="softmax",
    description="Causal softmax attention via torch scaled_dot_product_attention "
                "(backend auto|math|efficient|flash|cudnn); state = KV cache.",
    build_op=_sdpa_op, build_layer=_softmax_layer(_sdpa_op, dropout=True),
    build_decoder=lambda backend, scale, cache_reserve, **_: KVCacheDecoder(
        backend, scale, cache_reserve),
    options={"backend": "auto", "scale": None, "cache_reserve": 1024, "short_conv": 0,
             "bias": False, "dropout": 0.0},
    forms=("math", "efficient", "flash", "cudnn"), flops=softmax_flops,
    option_requires=_sdpa_requires)


FLASH_ATTN = Mixer(
    name="flash-attn", family="softmax",
    description="Causal softmax attention via flash-attn's flash_attn_func (fp16/bf16, CUDA).",
    build_op=_flash_attn_op, build_layer=_softmax_layer(_flash_attn_op, dropout=False),
    options={"short_conv": 0, "bias": False}, forms=("flash",), requires=("flash_attn", "cuda"),
    flops=softmax_flops)


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


def _linear_op(feature_map, normalize, eps, chunk_size, feature_dim=0, **_):
    op = functools.partial(linear_attn, feature_map=feature_map, normalize=normalize,
                           eps=eps, chunk_size=chunk_size)
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
                      key_dim=options["feature_dim"] or None)


def _linear_decoder(feature_map, normalize, eps, feature_dim, **_):
    return LinearAttnDecoder(feature_map, normalize, eps, feature_dim)


LINEAR_ATTN = Mixer(
    name="linear-attn", family="linear",
    description="Causal linear attention, chunked PyTorch (feature_map identity|elu1|relu|"
                "taylor, optional normalisation; feature_dim > 0 projects q, k to that width "
                "per head).",
    build_op=_linear_op, build_layer=_linear_layer, build_decoder=_linear_decoder,
    options={"feature_map": "identity", "feature_dim": 0, "normalize": False, "eps": 1e-6,
             "chunk_size": 64, "qk_norm": "l2", "short_conv": 4, "output_norm": True},
    forms=("chunk",), flops=linear_attn_flops)


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
             "chunk_size": 64, "qk_norm": "none", "short_conv": 4, "output_norm": False},
    forms=("chunk",), flops=linear_attn_flops)


def _ssd_op(impl, chunk_size, d_skip, seed, **_):
    def op(q, k, v, initial_state=None, output_final_state=False):
        dt, A = ssd_parameters(v.shape[2], seed, v.device)
        D = dt.new_ones(dt.shape) if d_skip else None
        return mamba2_ssd(q, k, v, dt=dt, A=A, D=D, impl=impl, chunk_size=chunk_size,
                          initial_state=initial_state, output_final_state=output_final_state)

    return op


def _ssd_requires(impl="auto", **_):
    return ("mamba_ssm", "cuda") if impl == "triton" else ()


MAMBA2_SSD = Mixer(
    name="mamba2-ssd", family="ssm",
    description="Mamba-2 SSD scan (C=q, B=k, x=v, seeded per-head dt and A); mamba_ssm's "
                "Triton kernel on CUDA when installed, else chunked PyTorch. Layer: a compact "
                "Mamba-2 block.",
    build_op=_ssd_op,
    build_layer=lambda d_model, n_heads, impl, chunk_size, d_state, expand, short_conv, **_:
        Mamba2Block(d_model, n_heads, d_state=d_state, expand=expand, short_conv=short_conv,
                    chunk_size=chunk_size, impl=impl),
    build_decoder=lambda seed, d_skip, **_: SSDDecoder(seed, d_skip),
    options={"impl": "auto", "chunk_size": 64, "d_skip": False, "seed": 0,
             "d_state": 64, "expand": 2, "short_conv": 4},
    forms=("naive", "chunk", "triton"), flops=ssd_flops, option_requires=_ssd_requires)


for _mixer in [*hla_mixers(), SDPA, FLASH_ATTN, LINEAR_ATTN, BASED, MAMBA2_SSD, *fla_mixers()]:
    register(_mixer)
