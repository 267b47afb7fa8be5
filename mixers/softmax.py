"""The "softmax" family's registry entries: causal softmax attention through PyTorch SDPA
(with a chosen backend) and through flash-attn. The ops and the KV-cache decoder are in
mixers.attention.

Layers use no q/k norm (the op scales by 1/sqrt(D)) and no short convolution by default.
"""

from __future__ import annotations

import functools

from mixers.attention import (CUDA_ONLY_BACKENDS, KVCacheDecoder, check_window,
                              flash_attn_attention, sdpa_attention, softmax_flops)
from mixers.entry import Mixer
from mixers.layer import MixerLayer


def _sdpa_op(backend, scale, window=0, **_):
    return functools.partial(sdpa_attention, backend=backend, scale=scale,
                             window=check_window(window))


def _flash_attn_op(**_):
    return flash_attn_attention


def _sdpa_requires(backend="auto", **_):
    return ("cuda",) if backend in CUDA_ONLY_BACKENDS else ()


def _softmax_layer(build_op, dropout: bool, traceable: bool):
    """Softmax layers: no q/k norm (the op scales by 1/sqrt(D)); `bias` on the projections
    and, where the op takes it, attention `dropout` while training. `traceable`: the op is
    PyTorch's SDPA, which torch.compile traces."""
    def build_layer(d_model, n_heads, **options):
        return MixerLayer(d_model, n_heads, build_op(**options), qk_norm="none",
                          short_conv=options["short_conv"], bias=options["bias"],
                          dropout=options["dropout"] if dropout else 0.0,
                          traceable_op=traceable)

    return build_layer


def _kv_cache_size(d_model, n_heads, seq_len, window=0, **_):
    """Softmax attention's KV cache per layer after seq_len tokens: a key and a value of
    d_model / n_heads per head and token, 2 x seq_len x d_model; a sliding window of W keeps
    min(W, seq_len) tokens, 2 x W x d_model once seq_len >= W."""
    tokens = min(seq_len, window) if window else seq_len
    return 2 * tokens * (d_model // n_heads) * n_heads


SDPA = Mixer(
    name="sdpa", family="softmax",
    description="Causal softmax attention via torch scaled_dot_product_attention "
                "(backend auto|math|efficient|flash|cudnn); window=W > 0: sliding-window "
                "attention over the last W tokens; state = KV cache (of W tokens with a window).",
    build_op=_sdpa_op, build_layer=_softmax_layer(_sdpa_op, dropout=True, traceable=True),
    build_decoder=lambda backend, scale, cache_reserve, window, **_: KVCacheDecoder(
        backend, scale, cache_reserve, window),
    options={"backend": "auto", "scale": None, "cache_reserve": 1024, "short_conv": 0,
             "bias": False, "dropout": 0.0, "window": 0},
    forms=("math", "efficient", "flash", "cudnn"), flops=softmax_flops,
    option_requires=_sdpa_requires, state_size=_kv_cache_size)


FLASH_ATTN = Mixer(
    name="flash-attn", family="softmax",
    description="Causal softmax attention via flash-attn's flash_attn_func (fp16/bf16, CUDA).",
    build_op=_flash_attn_op,
    build_layer=_softmax_layer(_flash_attn_op, dropout=False, traceable=False),
    options={"short_conv": 0, "bias": False}, forms=("flash",), requires=("flash_attn", "cuda"),
    flops=softmax_flops, state_size=_kv_cache_size)


def softmax_mixers() -> list[Mixer]:
    return [SDPA, FLASH_ATTN]
