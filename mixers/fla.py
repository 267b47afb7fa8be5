"""Adapters for flash-linear-attention (fla) kernels as mixers: the "fla" family's fixed-gate
entries (fla's own layers, with learned gates, are in mixers/fla_layers.py).

fla's ops take `[B, T, H, D]` inputs (its current layout) and return (o, final_state) with
a `[B, H, K, V]` state, which we keep as {"S": state}. Gates and betas are bound to fixed
values, so every entry is a plain `op(q, k, v)` like the other mixers:
- simple GLA / gated delta rule: a per-head log decay log(1 - 2^-(5..9)) (RetNet's range);
- GLA: the same decay on every key channel of a head;
- delta rules: L2-normalised q and k and a constant beta.
Nothing here catches fla's errors: the sweep runner records them. A key head dim the delta
rules' chunk kernels refuse (over 256) raises NotImplementedError first, which sweeps record
as unsupported.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mixers.entry import Mixer, state_nbytes
from mixers.layer import MixerLayer
from mixers.linear_attn import linear_attn_flops

LAYER_OPTIONS = {"qk_norm": "l2", "short_conv": 4, "output_norm": True}


@functools.lru_cache(maxsize=64)
def head_log_decay(heads: int, device) -> torch.Tensor:
    """Per-head log decay, from log(1 - 1/32) (fast) to log(1 - 1/512) (slow); cached and
    read-only."""
    exponents = torch.linspace(5.0, 9.0, heads, dtype=torch.float64, device="cpu")
    return torch.log1p(-torch.pow(2.0, -exponents)).to(device=device, dtype=torch.float32)


def _simple_gate(q, options):
    B, T, H, _ = q.shape
    return {"g": head_log_decay(H, q.device).expand(B, T, H).contiguous()}


def _channel_gate(q, options):
    B, T, H, D = q.shape
    return {"g": head_log_decay(H, q.device)[:, None].expand(B, T, H, D).contiguous()}


def _beta(q, options):
    B, T, H, _ = q.shape
    return {"beta": q.new_full((B, T, H), options["beta"])}


def _gated_beta(q, options):
    return {**_simple_gate(q, options), **_beta(q, options)}


def _normalize_flag(q, options):
    return {"normalize": options["normalize"]}


@dataclass(frozen=True)
class FlaKernel:
    """One fla operator family: its module, chunk and fused-recurrent function names, the
    extra keyword arguments it needs, and whether q and k are L2-normalised first."""

    module: str
    chunk: str
    recurrent: str
    extras: Callable[[torch.Tensor, dict], dict]
    l2_qk: bool = False
    recurrent_extras: Callable[[torch.Tensor, dict], dict] | None = None
    max_key_dim: int | None = None  # the largest key head dim its chunk kernels take

    def function(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def check_key_dim(self, key_dim: int) -> None:
        """NotImplementedError (recorded as unsupported) for a key head dim the kernels
        refuse, before any work: fla says so only by an assert deep in its chunk forward."""
        if self.max_key_dim is not None and key_dim > self.max_key_dim:
            raise NotImplementedError(
                f"{self.module}'s chunk kernels take key head dims up to {self.max_key_dim}, "
                f"not {key_dim}")

    def run(self, name, extras, q, k, v, state, output_final_state, options):
        if name == self.chunk:
            self.check_key_dim(q.shape[-1])
        if self.l2_qk:  # back to v's dtype: under autocast the norm runs in float32
            q, k = F.normalize(q, dim=-1).to(v.dtype), F.normalize(k, dim=-1).to(v.dtype)
        o, final = self.function(name)(
            q=q, k=k, v=v, **extras(q, options), scale=options["scale"],
            initial_state=None if state is None else state["S"],
            output_final_state=output_final_state)
        return o, ({"S": final} if output_final_state else None)


class FlaDecoder:
    """Decode through the kernel's fused-recurrent form with one token (T = 1)."""

    def __init__(self, kernel: FlaKernel, options: dict):
        self.kernel, self.options = kernel, options

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        return {"S": torch.randn(batch, heads, head_dim, value_dim, device=device,
                                 dtype=torch.float32)}

    def step(self, q, k, v, state):
        extras = self.kernel.recurrent_extras or self.kernel.extras
        o, new = self.kernel.run(self.kernel.recurrent, extras, q.unsqueeze(1),
                                 k.unsqueeze(1), v.unsqueeze(1), state, True, self.options)
        return o.squeeze(1), new

    def state_bytes(self, state):
        return state_nbytes(state)


def _fla_state_size(d_model, n_heads, seq_len, **_):
    """fla's recurrent state per layer: S, d_k x d_v per head (d_k = d_v = d_model /
    n_heads)."""
    head = d_model // n_heads
    return n_heads * head * head


def fla_entry(name: str, kernel: FlaKernel, description: str, options: dict,
              flops=None) -> Mixer:
    def build_op(**opts):
        def op(q, k, v, initial_state=None, output_final_state=False):
            return kernel.run(kernel.chunk, kernel.extras, q, k, v, initial_state,
                              output_final_state, opts)

        return op

    def build_layer(d_model, n_heads, **opts):
        kernel.check_key_dim(d_model // n_heads)
        return MixerLayer(d_model, n_heads, build_op(**opts), qk_norm=opts["qk_norm"],
                          short_conv=opts["short_conv"], output_norm=opts["output_norm"])

    def build_decoder(**opts):
        if opts.get("normalize"):
            raise ValueError("fla's normalize divides by the key sum of the current call "
                             "only, so it cannot stream; use linear-attn with normalize=True")
        return FlaDecoder(kernel, opts)

    return Mixer(name=name, family="fla", description=description, build_op=build_op,
                 build_layer=build_layer, build_decoder=build_decoder,
                 options={"scale": None, **options, **LAYER_OPTIONS}, forms=("chunk", "triton"),
                 requires=("fla", "cuda"), flops=flops, state_size=_fla_state_size)


def fla_mixers() -> list[Mixer]:
    return [
        fla_entry("fla-linear-attn",
                  FlaKernel("fla.ops.linear_attn", "chunk_linear_attn",
                            "fused_recurrent_linear_attn", _normalize_flag),
                  "fla chunked linear attention (Triton).", {"normalize": False},
                  flops=linear_attn_flops),
        fla_entry("fla-simple-gla",
                  FlaKernel("fla.ops.simple_gla", "chunk_simple_gla",
                            "fused_recurrent_simple_gla", _simple_gate),
                  "fla simple GLA, fixed-gate: linear attention with a fixed per-head decay.", {},
                  flops=linear_attn_flops),
        fla_entry("fla-gla",
                  FlaKernel("fla.ops.gla", "chunk_gla", "fused_recurrent_gla", _channel_gate,
                            recurrent_extras=lambda q, o: {"gk": _channel_gate(q, o)["g"]}),
                  "fla GLA kernel, fixed-gate: a fixed per-head decay on every key channel "
                  "(learned gates: fla-gla-learned).", {},
                  flops=linear_attn_flops),
        fla_entry("fla-delta-rule",
                  FlaKernel("fla.ops.delta_rule", "chunk_delta_rule",
                            "fused_recurrent_delta_rule", _beta, l2_qk=True, max_key_dim=256),
                  "fla DeltaNet kernel, fixed-gate: delta rule, L2-normalised q/k, fixed beta "
                  "(learned beta: fla-deltanet-learned).",
                  {"beta": 1.0}),
        fla_entry("fla-gated-delta-rule",
                  FlaKernel("fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                            "fused_recurrent_gated_delta_rule", _gated_beta, l2_qk=True,
                            max_key_dim=256),
                  "fla Gated DeltaNet kernel, fixed-gate: fixed per-head decay and beta "
                  "(learned: fla-gated-deltanet).",
                  {"beta": 1.0}),
    ]
