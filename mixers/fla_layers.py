"""fla's own layers, with their learned gates, as mixer layers: the "fla" family's layer entries.

`mixers.fla` binds fla's kernels to fixed gates and betas, so that each is a plain op; the
entries here run fla's layers (`fla.layers`) whole, as their papers and Zoology's configs
do, each with the gates it learns from its input:

- `fla-gla-learned`: `GatedLinearAttention`, a low-rank data-dependent log gate on every key
  channel (logsigmoid / `gate_logit_normalizer`) and a swish output gate;
- `fla-deltanet-learned`: `DeltaNet`, the delta rule with a learned beta (sigmoid of a
  projection per head), L2-normalised q and k inside the kernel;
- `fla-gated-deltanet`: `GatedDeltaNet`, the delta rule with a learned beta and a learned
  Mamba-2-style decay per head (A_log, dt_bias).

Options are fla's keyword arguments under fla's names, passed through; `num_heads` is the
model's n_heads (a recall config sets it per mixer with `mixer_model`) and `hidden_size` its
d_model. The defaults are those of Zoology's configs for these layers where they set one
(zoology/experiments/models_repo.py: GLA without a short convolution; DeltaNet and Gated
DeltaNet with one of size 4 and no output gate; Gated DeltaNet's head dim d_model / heads
with values twice as wide), else fla's own. Bad option values raise ValueError before fla
is imported, so they fail alike with or without fla.

The layer (`FlaLayer`) maps `[B, T, d_model]` to itself through the fla module it holds
(`.layer`) and exposes the module's output projection as `out_proj` (the recall model scales
its initialisation). fla's layer keeps its weights in submodules of its own and feeds some
straight to its kernels (GatedDeltaNet's A_log and dt_bias), so N copies with different
weights cannot share one call: it has no `forward_stacked`, and the stacked trainer
(`hla_bench.recall.stacked.stack_unsupported_reason`) trains each run alone. fla's kernels run on CUDA
tensors only (they do not run in Triton's interpreter): other inputs raise
NotImplementedError, which the harness records as unsupported and the FLOP count skips.

Where fla refuses a layer's backward (Gated DeltaNet's gated chunk backward on Hopper with
Triton from 3.4 to before 3.7.1 and no TileLang backend), the first forward that records
gradients raises NotImplementedError with fla's own message, found by one backward of a
one-sequence copy of the input (`refused_backward`), so a recall run is recorded as
unsupported with fla's reason before any step.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from mixers.dispatch import note, opaque
from mixers.entry import Mixer

# The largest key head dim the delta rules' chunk kernels take (as mixers.fla's entries).
DELTA_MAX_KEY_DIM = 256


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _width(d_model: int, expand: float, name: str, n_heads: int) -> int:
    """d_model * expand as fla computes it, checked to be a whole width that n_heads divide
    (fla asserts both)."""
    width = d_model * expand
    if not math.isclose(width, round(width)) or round(width) < 1:
        raise ValueError(f"d_model {d_model} x {name} {expand} is not a whole width")
    if round(width) % n_heads:
        raise ValueError(f"d_model {d_model} x {name} {expand} = {round(width)} is not "
                         f"divisible by {n_heads} heads")
    return round(width)


def _heads(d_model: int, n_heads: int) -> None:
    _positive_int("d_model", d_model)
    _positive_int("n_heads", n_heads)


def _conv(options: dict) -> None:
    _flag("use_short_conv", options["use_short_conv"])
    _flag("conv_bias", options["conv_bias"])
    _positive_int("conv_size", options["conv_size"])


# --- each layer: its checks, fla's keyword arguments and its state --------------------------

def _expanded_dims(d_model, n_heads, options):
    """(heads, key head dim, value head dim) of the state of GatedLinearAttention and
    DeltaNet: key and value widths d_model x expand_k and x expand_v, split over the heads."""
    _heads(d_model, n_heads)
    key = _width(d_model, _positive_number("expand_k", options["expand_k"]), "expand_k", n_heads)
    value = _width(d_model, _positive_number("expand_v", options["expand_v"]), "expand_v",
                   n_heads)
    return n_heads, key // n_heads, value // n_heads


def _gla_kwargs(d_model, n_heads, options):
    _expanded_dims(d_model, n_heads, options)
    _conv(options)
    _flag("use_output_gate", options["use_output_gate"])
    _choice("mode", options["mode"], ("chunk", "fused_recurrent"))
    _positive_int("gate_low_rank_dim", options["gate_low_rank_dim"])
    _positive_number("gate_logit_normalizer", options["gate_logit_normalizer"])
    if options["clamp_min"] is not None and (isinstance(options["clamp_min"], bool) or not
                                             isinstance(options["clamp_min"], (int, float))):
        raise ValueError(f"clamp_min must be a number or null, got {options['clamp_min']!r}")
    return {"hidden_size": d_model, "num_heads": n_heads, **options}


def _delta_kwargs(d_model, n_heads, options):
    _expanded_dims(d_model, n_heads, options)
    _conv(options)
    for name in ("use_beta", "use_gate", "allow_neg_eigval"):
        _flag(name, options[name])
    _choice("mode", options["mode"], ("chunk", "fused_recurrent"))
    _choice("qk_activation", options["qk_activation"], ("silu", "relu", "elu", "identity"))
    _choice("qk_norm", options["qk_norm"], ("l2", "sum"))
    return {"hidden_size": d_model, "num_heads": n_heads, **options}


def _gated_delta_dims(d_model, n_heads, options):
    """(value heads, key head dim, value head dim) of GatedDeltaNet's state: with
    num_v_heads above num_heads (grouped values) each value head keeps its own state."""
    _heads(d_model, n_heads)
    head_dim = options["head_dim"]
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        head_dim = d_model // n_heads
    _positive_int("head_dim", head_dim)
    expand_v = _positive_number("expand_v", options["expand_v"])
    value_dim = head_dim * expand_v
    if not math.isclose(value_dim, round(value_dim)) or round(value_dim) < 1:
        raise ValueError(f"head_dim {head_dim} x expand_v {expand_v} is not a whole width")
    value_heads = n_heads if options["num_v_heads"] is None else _positive_int(
        "num_v_heads", options["num_v_heads"])
    if value_heads < n_heads or value_heads % n_heads:
        raise ValueError(f"num_v_heads ({value_heads}) must be a multiple of n_heads "
                         f"({n_heads})")
    return value_heads, head_dim, round(value_dim)


def _gated_delta_kwargs(d_model, n_heads, options):
    _, head_dim, _ = _gated_delta_dims(d_model, n_heads, options)
    _conv(options)
    for name in ("use_gate", "allow_neg_eigval"):
        _flag(name, options[name])
    _choice("mode", options["mode"], ("chunk", "fused_recurrent"))
    return {"hidden_size": d_model, "num_heads": n_heads, **options, "head_dim": head_dim}


@dataclass(frozen=True)
class FlaLayerKind:
    """One fla layer class: its name in `fla.layers`, the checks and keyword arguments of a
    build, its state's (heads, key head dim, value head dim), and whether fla may refuse its
    backward here (`refused_backward` then runs before the first step)."""

    cls: str
    kwargs: Callable[[int, int, dict], dict]
    dims: Callable[[int, int, dict], tuple[int, int, int]]
    max_key_dim: int | None = None
    may_refuse_backward: bool = False

    def build(self, d_model: int, n_heads: int, options: dict) -> "FlaLayer":
        kwargs = self.kwargs(d_model, n_heads, options)     # ValueError before the import
        _, key_dim, _ = self.dims(d_model, n_heads, options)
        if self.max_key_dim is not None and key_dim > self.max_key_dim:
            raise NotImplementedError(f"fla's {self.cls} kernels take key head dims up to "
                                      f"{self.max_key_dim}, not {key_dim}")
        layer_class = getattr(importlib.import_module("fla.layers"), self.cls)
        return FlaLayer(layer_class(**kwargs), self.cls,
                        probe_backward=self.may_refuse_backward)

    def state_size(self, d_model: int, n_heads: int, seq_len: int, **options) -> int:
        """The recurrent state per layer and sequence: a key x value matrix per (value)
        head, whatever the length (the short convolution's buffer is not counted)."""
        heads, key_dim, value_dim = self.dims(d_model, n_heads, options)
        return heads * key_dim * value_dim


# --- the layer ------------------------------------------------------------------------------

_REFUSALS: dict[tuple, str | None] = {}
# Errors of the probe that are no refusal: out of memory, a CUDA fault (the harness has its
# own handling of each)
_NOT_REFUSALS = tuple(error for error in (torch.cuda.OutOfMemoryError,
                                          getattr(torch, "AcceleratorError", None)) if error)


def _may_refuse_here() -> bool:
    """Whether fla's flags name the case where it refuses a gated chunk backward: a Hopper
    GPU with Triton from 3.4 to before 3.7.1 (fla.ops.common.chunk_o)."""
    flags = importlib.import_module("fla.utils")
    return bool(getattr(flags, "IS_NVIDIA_HOPPER", False)
                and getattr(flags, "TRITON_ABOVE_3_4_0", False)
                and not getattr(flags, "TRITON_ABOVE_3_7_1", True))


def refused_backward(layer: nn.Module, x: torch.Tensor) -> str | None:
    """fla's message where it refuses `layer`'s backward for inputs like `x`, else None.

    Only where fla's flags name the refused case: then one forward and backward of the first
    sequence of x (gradients for that copy alone: the weights' .grad stay as they are) shows
    whether fla refuses it or a backend it has takes it; the outcome is kept per class,
    device and dtype. Never while a CUDA graph is being captured (the first eager step has
    probed by then)."""
    if not _may_refuse_here() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    key = (type(layer).__name__, x.device, dtype)
    if key not in _REFUSALS:
        probe = x[:1].detach().requires_grad_(True)
        try:
            torch.autograd.grad(layer(probe)[0].float().sum(), probe)
            _REFUSALS[key] = None
        except _NOT_REFUSALS:
            raise
        except RuntimeError as error:
            if "CUDA error" in str(error):
                raise
            _REFUSALS[key] = str(error).strip() or type(error).__name__
    return _REFUSALS[key]


def kernels_run_on(x: torch.Tensor) -> bool:
    """Whether fla's Triton kernels take `x` (a CUDA tensor)."""
    return x.device.type == "cuda"


def _run(module: "FlaLayer", x: torch.Tensor) -> torch.Tensor:
    if not kernels_run_on(x):
        raise NotImplementedError(f"fla's {module.name} runs its Triton kernels on CUDA "
                                  f"tensors only, not {x.device.type}")
    note(layer=f"fla.layers.{module.name}")
    if module.probe_backward and torch.is_grad_enabled():
        reason = refused_backward(module.layer, x)
        if reason is not None:
            raise NotImplementedError(f"fla refuses {module.name}'s backward here: {reason}")
    return module.layer(x)[0]


class FlaLayer(nn.Module):
    """An fla layer (`layer`, class `name` of fla.layers) as a mixer layer: `[B, T,
    d_model]` -> `[B, T, d_model]`, fla's (output, attentions, cache) reduced to the output.
    The call is kept out of torch.compile's trace (`opaque`'s reason) and runs eagerly."""

    def __init__(self, layer: nn.Module, name: str, *, probe_backward: bool = False):
        super().__init__()
        self.layer, self.name, self.probe_backward = layer, name, bool(probe_backward)

    @property
    def out_proj(self) -> nn.Linear:
        """fla's output projection, where the recall model's init looks for it."""
        return self.layer.o_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opaque(_run, self, x)


# --- the registry entries -------------------------------------------------------------------

CONV_OPTIONS = {"conv_size": 4, "conv_bias": False}

KINDS = {
    "fla-gla-learned": (
        FlaLayerKind("GatedLinearAttention", _gla_kwargs, _expanded_dims),
        "fla's GatedLinearAttention layer: learned data-dependent per-channel gates "
        "(low-rank), swish output gate; Zoology's settings (no short convolution).",
        {"expand_k": 0.5, "expand_v": 1.0, "use_short_conv": False, **CONV_OPTIONS,
         "use_output_gate": True, "gate_low_rank_dim": 16, "gate_logit_normalizer": 16,
         "clamp_min": None, "mode": "chunk"}),
    "fla-deltanet-learned": (
        FlaLayerKind("DeltaNet", _delta_kwargs, _expanded_dims, max_key_dim=DELTA_MAX_KEY_DIM),
        "fla's DeltaNet layer: delta rule with a learned beta per head and token, L2 q/k; "
        "Zoology's settings (short convolution 4, no output gate).",
        {"expand_k": 1.0, "expand_v": 1.0, "use_beta": True, "use_gate": False,
         "use_short_conv": True, **CONV_OPTIONS, "allow_neg_eigval": False,
         "qk_activation": "silu", "qk_norm": "l2", "mode": "chunk"}),
    "fla-gated-deltanet": (
        FlaLayerKind("GatedDeltaNet", _gated_delta_kwargs, _gated_delta_dims,
                     max_key_dim=DELTA_MAX_KEY_DIM, may_refuse_backward=True),
        "fla's GatedDeltaNet layer: delta rule with a learned beta and a learned per-head "
        "decay; Zoology's settings (head dim d_model / heads, values 2x, short "
        "convolution 4, no output gate).",
        {"head_dim": None, "expand_v": 2.0, "num_v_heads": None, "use_gate": False,
         "use_short_conv": True, **CONV_OPTIONS, "allow_neg_eigval": False,
         "mode": "chunk"}),
}


def _no_op(name: str):
    def build_op(**_):
        raise NotImplementedError(f"{name} is a layer only: fla's layer computes its gates "
                                  "from the layer input, so there is no op on q, k, v")
    return build_op


def fla_layer_entry(name: str) -> Mixer:
    kind, description, options = KINDS[name]

    def build_layer(d_model, n_heads, **opts):
        return kind.build(d_model, n_heads, opts)

    return Mixer(name=name, family="fla", description=description, build_op=_no_op(name),
                 build_layer=build_layer, options=options, forms=("layer",),
                 requires=("fla", "cuda"), state_size=kind.state_size)


def fla_layer_mixers() -> list[Mixer]:
    return [fla_layer_entry(name) for name in KINDS]
