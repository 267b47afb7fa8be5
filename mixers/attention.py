"""Causal softmax attention: PyTorch SDPA (with a chosen backend), flash-attn, a KV-cache
decoder, and the FLOP formula.

Layout `[B, T, H, D]` like every op here; the default scale is 1/sqrt(D). The state of
softmax attention is its KV cache, a `KVCache` that grows with the context.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mixers import dispatch
from mixers.common import FiniteInputs, check_choice, check_flag, check_qkv

SDPA_BACKENDS = ("auto", "math", "efficient", "flash", "cudnn")
# Backends with no CPU kernel in PyTorch; "flash" has one, "math" runs everywhere.
CUDA_ONLY_BACKENDS = ("efficient", "cudnn")


@dataclass
class KVCache:
    """Keys `[B, H, capacity, D]` and values `[B, H, capacity, Dv]`; the first `length`
    positions are filled. Spare capacity makes a decode step an in-place write instead of a
    copy of the whole cache; it doubles when full."""

    k: torch.Tensor
    v: torch.Tensor
    length: int

    @classmethod
    def from_tensors(cls, k: torch.Tensor, v: torch.Tensor, reserve: int = 0) -> "KVCache":
        """A cache holding `[B, H, L, *]` keys and values, with room for `reserve` more."""
        cache = cls(k.new_empty(*k.shape[:2], k.shape[2] + reserve, k.shape[3]),
                    v.new_empty(*v.shape[:2], v.shape[2] + reserve, v.shape[3]), k.shape[2])
        cache.k[:, :, :cache.length] = k
        cache.v[:, :, :cache.length] = v
        return cache

    def keys(self) -> torch.Tensor:
        return self.k[:, :, :self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, :, :self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """Write `[B, H, n, *]` keys and values after the filled part (in place)."""
        n = k.shape[2]
        if self.length + n > self.k.shape[2]:
            grown = KVCache.from_tensors(self.keys(), self.values(),
                                         reserve=max(self.length, n))
            self.k, self.v = grown.k, grown.v
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of the filled part: what a KV cache of this context costs."""
        return self.length * (self.k.shape[-1] * self.k.element_size()
                              + self.v.shape[-1] * self.v.element_size()) * math.prod(
                                  self.k.shape[:2])


def _backend_context(backend: str):
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([kernels[backend]])


def _chosen_backend(q, k, v, mask, dropout_p, scale) -> str:
    """The SDPA backend PyTorch picks for these inputs under the enabled backends (its own
    dispatch function; "unknown" where this PyTorch lacks it)."""
    from torch.nn.attention import SDPBackend

    try:
        choice = int(torch._fused_sdp_choice(q, k, v, mask, dropout_p, mask is None,
                                             scale=scale))
    except (AttributeError, RuntimeError, TypeError):
        return "unknown"
    names = {int(value): name.lower() for name, value in SDPBackend.__members__.items()}
    return {"flash_attention": "flash", "efficient_attention": "efficient",
            "cudnn_attention": "cudnn"}.get(names.get(choice, ""), names.get(choice, "unknown"))


def check_window(window) -> int:
    """A sliding window's width: 0 (none: full causal attention) or a positive int."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be 0 (full causal attention) or a positive int, got "
                         f"{window!r}")
    return window


def window_mask(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """`[queries, keys]` True where query i (the last `queries` of `keys` positions) may
    attend to key j: j <= i, and with `window` > 0 also i - j < window (its last `window`
    tokens, itself included)."""
    past = keys - queries
    rows = torch.arange(queries, device=device)[:, None] + past
    cols = torch.arange(keys, device=device)[None, :]
    allowed = cols <= rows
    if window:
        allowed &= rows - cols < window
    return allowed


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   backend: str = "auto", scale: float | None = None,
                   initial_state: KVCache | None = None, output_final_state: bool = False,
                   cache_reserve: int = 0, dropout_p: float = 0.0, window: int = 0):
    """Causal attention through `F.scaled_dot_product_attention`; returns (o, KVCache | None).

    `window` > 0 is sliding-window attention: each token attends to its last `window` tokens
    (itself included), so its state is a KV cache of `window` tokens. The returned cache
    then holds the last `window` tokens only.

    With `initial_state` (a KV cache) the new tokens also attend to the cached ones. The
    returned cache has room for `cache_reserve` more tokens. `dropout_p` drops attention
    weights (training only: the layer passes it while training).
    Non-finite inputs follow the rule of mixers/common.py: PyTorch's kernels alone would
    let a masked-out later value enter P V as 0 * NaN and spread NaN into earlier gradients,
    so the new tokens' q, k, v go in with non-finite entries read as 0 and the outputs from
    a (batch row, head)'s first non-finite token on are NaN. The returned cache holds the
    inputs as given, so later steps see them.
    """
    check_qkv(q, k, v)
    check_flag("output_final_state", output_final_state)
    check_choice("backend", backend, SDPA_BACKENDS)
    window = check_window(window)
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p!r}")
    guard = FiniteInputs(q, k, v)
    raw_k, raw_v = k.transpose(1, 2), v.transpose(1, 2)
    q, k, v = (x.transpose(1, 2) for x in guard.inputs)                 # [B, H, T, *]
    keys, values, mask = k, v, None
    if initial_state is not None:
        past = initial_state.length
        keys = torch.cat([initial_state.keys(), k], 2)
        values = torch.cat([initial_state.values(), v], 2)
        raw_k = torch.cat([initial_state.keys(), raw_k], 2)
        raw_v = torch.cat([initial_state.values(), raw_v], 2)
        T = q.shape[2]
        mask = window_mask(T, past + T, window, q.device)
    elif window and window < q.shape[2]:
        mask = window_mask(q.shape[2], q.shape[2], window, q.device)
    with _backend_context(backend):
        if dispatch.listening():
            dispatch.note(sdpa_backend=backend if backend != "auto" else
                          _chosen_backend(q, keys, values, mask, dropout_p, scale))
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p,
                                           is_causal=mask is None, scale=scale)
    if window:  # the cache of a window: its last `window` tokens
        raw_k, raw_v = raw_k[:, :, -window:], raw_v[:, :, -window:]
    cache = KVCache.from_tensors(raw_k, raw_v, cache_reserve) if output_final_state else None
    return guard.outputs(o.transpose(1, 2)), cache


def flash_attn_attention(q, k, v, *, initial_state=None, output_final_state=False):
    """Causal attention through flash-attn's `flash_attn_func` (CUDA, fp16/bf16)."""
    if initial_state is not None or output_final_state:
        raise ValueError("flash-attn op keeps no state; use the sdpa mixer for a KV cache")
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, causal=True), None


class KVCacheDecoder:
    """Decode with a KV cache: each step appends one token and attends over the cache (with
    `window` > 0 over its last `window` tokens, and the cache keeps no more)."""

    def __init__(self, backend: str = "auto", scale: float | None = None,
                 cache_reserve: int = 1024, window: int = 0):
        self.backend, self.scale, self.cache_reserve = backend, scale, cache_reserve
        self.window = check_window(window)

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        length = min(context_len, self.window) if self.window else context_len
        k = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
        v = torch.randn(batch, heads, length, value_dim, device=device, dtype=dtype)
        return KVCache.from_tensors(k, v, self.cache_reserve)

    def step(self, q, k, v, state: KVCache):
        if self.window and state.length >= self.window:  # the oldest token leaves the window
            kept = KVCache.from_tensors(state.keys()[:, :, 1 - self.window:],
                                        state.values()[:, :, 1 - self.window:],
                                        max(1, self.cache_reserve))
            state.k, state.v, state.length = kept.k, kept.v, kept.length
        state.append(k.unsqueeze(2), v.unsqueeze(2))
        with _backend_context(self.backend):
            o = F.scaled_dot_product_attention(q.unsqueeze(2), state.keys(), state.values(),
                                               scale=self.scale)
        return o.squeeze(2), state

    def state_bytes(self, state: KVCache) -> int:
        return state.nbytes

    def step_bytes(self, state: KVCache) -> int:
        """A step reads the whole cache and appends one token's keys and values."""
        per_token = state.nbytes // max(1, state.length)
        return state.nbytes + per_token


def softmax_flops(batch, seq_len, heads, head_dim, value_dim, mode, **_):
    """Causal attention: QK^T and PV over half the T x T square; backward is 2.5x forward.
    Decode at context L: one query against L keys and values."""
    if mode == "decode":
        return float(2 * batch * heads * seq_len * (head_dim + value_dim))
    fwd = 2.0 * batch * heads * seq_len * seq_len * (head_dim + value_dim) / 2
    return fwd if mode == "fwd" else 3.5 * fwd
