"""Registers the built-in mixers (imported by `hla_bench.registry` on first use).

Families: "hla" (mixers.hla operators), "softmax" (SDPA, flash-attn), "linear" (our chunked
linear attention), "ssm" (Mamba-2 SSD), "fla" (flash-linear-attention kernels).
Layers: HLA, linear and fla entries use q/k L2 normalisation and a short causal convolution
of size 4 (fla's layer default); softmax layers use neither (the op scales by 1/sqrt(D)).
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
from mixers.linear_attn import linear_attn, linear_attn_flops, linear_attn_step
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
    """Linear attention decode: state {"S"} (+ {"z"}), one outer-product update a token."""

    def __init__(self, feature_map, normalize, eps):
        self.options = {"feature_map": feature_map, "normalize": normalize, "eps": eps}

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        state = {"S": torch.randn(batch, heads, head_dim, value_dim, device=device, dtype=dtype)}
        if self.options["normalize"]:
            # A positive key sum, as after a prefill with a positive feature map.
            state["z"] = torch.rand(batch, heads, head_dim, device=device, dtype=dtype) + 1
        return state

    def step(self, q, k, v, state):
        o, state = linear_attn_step(q, k, v, state, **self.options)
        return o.to(v.dtype), state

    def state_bytes(self, state):
        return state_nbytes(state)


def _linear_op(feature_map, normalize, eps, chunk_size, **_):
    return functools.partial(linear_attn, feature_map=feature_map, normalize=normalize,
                             eps=eps, chunk_size=chunk_size)


LINEAR_ATTN = Mixer(
    name="linear-attn", family="linear",
    description="Causal linear attention, chunked PyTorch (feature_map identity|elu1|relu, "
                "optional normalisation).",
    build_op=_linear_op,
    build_layer=lambda d_model, n_heads, **o: MixerLayer(
        d_model, n_heads, _linear_op(**o), qk_norm=o["qk_norm"], short_conv=o["short_conv"],
        output_norm=o["output_norm"]),
    build_decoder=lambda feature_map, normalize, eps, **_: LinearAttnDecoder(
        feature_map, normalize, eps),
    options={"feature_map": "identity", "normalize": False, "eps": 1e-6, "chunk_size": 64,
             "qk_norm": "l2", "short_conv": 4, "output_norm": True},
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


for _mixer in [*hla_mixers(), SDPA, FLASH_ATTN, LINEAR_ATTN, MAMBA2_SSD, *fla_mixers()]:
    register(_mixer)
