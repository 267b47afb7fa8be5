"""The registry entry of a sequence mixer: what it is called and how to build it.

A `Mixer` entry names a sequence mixer and knows how to build it four ways:

- `op(**options)`: the functional op, `op(q, k, v, initial_state=None,
  output_final_state=False) -> (o, final_state)` on `[B, T, H, D]` tensors;
- `layer(d_model, n_heads, **options)`: an `nn.Module` mapping `[B, T, d_model]` to itself;
- `decoder(**options)`: a `Decoder` for single-token streaming steps (decode benchmarks);
- `reference(**options)`: the operator's float64 reference (its `naive.py`), a function
  `(q, k, v) -> o` that every form of the op is checked against.

Each family declares its entries beside its layer (`mixers.builtin` lists them all); the
harness collects them in `hla_bench.registry`, which re-exports this module's names for
plugin authors. Nothing here imports the harness.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol


class MixerUnavailableError(RuntimeError):
    """Raised when a mixer's requirements (CUDA, an optional package) are missing here."""


# `seq_len` is the context length for "decode" (FLOPs of one token step after it);
# "prefill" (the forward that fills the state) counts as "fwd".
FLOP_MODES = ("fwd", "fwdbwd", "decode", "prefill")


class Decoder(Protocol):
    """Streaming decode for one mixer: a state for a context, then one-token steps."""

    def init_state(self, batch: int, heads: int, head_dim: int, value_dim: int,
                   context_len: int, device: Any, dtype: Any) -> Any:
        """A state as after a prefill of `context_len` tokens (random contents are fine)."""

    def step(self, q: Any, k: Any, v: Any, state: Any) -> tuple[Any, Any]:
        """One token: `[B, H, D]` inputs, returns (`[B, H, Dv]` output, new state)."""

    def state_bytes(self, state: Any) -> int:
        """Bytes held by `state` (KV cache for softmax attention).

        A decoder may also define `step_bytes(state)`: the bytes one step must read and
        write at least (the harness takes 2 x state_bytes, a fixed state read and written
        once, where it does not)."""


# A requirement is "cuda" or the import name of an optional package; PACKAGE_NAMES gives
# the pip name shown to users when it is missing.
PACKAGE_NAMES = {
    "fla": "flash-linear-attention",
    "mamba_ssm": "mamba-ssm",
    "flash_attn": "flash-attn",
    "triton": "triton",
}


def requirement_missing(requirement: str) -> str | None:
    """Why `requirement` is not met on this machine, or None when it is."""
    if requirement == "cuda":
        import torch

        return None if torch.cuda.is_available() else "needs a CUDA device"
    if importlib.util.find_spec(requirement) is None:
        return f"{PACKAGE_NAMES.get(requirement, requirement)} not installed"
    return None


@dataclass(frozen=True)
class Mixer:
    """One sequence mixer.

    `options` maps every accepted option to its default. The builders receive the merged
    options as keyword arguments: `build_op(**options)`, `build_layer(d_model, n_heads,
    **options)`, `build_decoder(**options)`, `build_reference(**options)` (each takes
    `**options` and uses what it needs).
    `flops(batch, seq_len, heads, head_dim, value_dim, mode, **options)` gives model FLOPs
    for a mode (`fwd`, `fwdbwd`, `decode`) or None when no formula is known. `forms` lists
    the implementations behind the op (e.g. "chunk", "triton"), for display.
    `build_reference` returns the float64 reference `(q, k, v) -> o` of the op with those
    options: an explicit form that runs on the CPU, whatever the op itself requires.
    `layer_state_dims(d_model, n_heads, **options)` gives the (heads, head dim, value dim)
    of the decoder state one layer holds, where the layer's op does not run on n_heads
    heads of d_model / n_heads (None: it does).
    `state_size(d_model, n_heads, seq_len, **options)` counts the elements of the recurrent
    state one layer of `build_layer(d_model, n_heads, **options)` holds per sequence after
    `seq_len` tokens (softmax attention: its KV cache; a fixed-state mixer: its state,
    whatever the length); the layer's short convolution buffer is not counted. None (the
    field, or its value): no count known.
    """

    name: str
    family: str
    description: str
    build_op: Callable[..., Callable]
    build_layer: Callable[..., Any] | None = None
    build_decoder: Callable[..., Decoder] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    forms: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    flops: Callable[..., float | None] | None = None
    option_requires: Callable[..., tuple[str, ...]] | None = None
    build_reference: Callable[..., Callable] | None = None
    layer_state_dims: Callable[..., tuple[int, int, int]] | None = None
    state_size: Callable[..., int | None] | None = None

    def unavailable_reason(self, options: Mapping[str, Any] | None = None) -> str | None:
        """Why this mixer (with `options`, when given) cannot run here, or None when it can.

        `option_requires(**resolved_options)` names extra requirements of some options, e.g.
        an SDPA backend that exists only on CUDA.
        """
        requires = list(self.requires)
        if self.option_requires is not None:
            requires += self.option_requires(**self.resolve_options(options))
        reasons = [r for r in (requirement_missing(req) for req in dict.fromkeys(requires)) if r]
        return "; ".join(reasons) or None

    @property
    def available(self) -> bool:
        return self.unavailable_reason() is None

    def resolve_options(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults overridden by `options`; unknown option names raise ValueError."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            accepted = ", ".join(sorted(self.options)) or "none"
            raise ValueError(f"mixer {self.name!r} has no option {', '.join(map(repr, unknown))}"
                             f" (accepted: {accepted})")
        for key, value in options.items():  # no option of any mixer means NaN or inf
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"mixer {self.name!r}: option {key} must be finite, got "
                                 f"{value}")
        return {**self.options, **options}

    def _checked_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Resolved options, after checking that the mixer can run here with them."""
        resolved = self.resolve_options(options)
        reason = self.unavailable_reason(resolved)
        if reason:
            raise MixerUnavailableError(f"mixer {self.name!r} is unavailable: {reason}")
        return resolved

    def op(self, **options: Any) -> Callable:
        return self.build_op(**self._checked_options(options))

    def state_dims(self, d_model: int, n_heads: int, **options: Any) -> tuple[int, int, int]:
        """(heads, head dim, value dim) of the decoder state of one layer of this mixer."""
        if self.layer_state_dims is not None:
            return self.layer_state_dims(d_model, n_heads, **self.resolve_options(options))
        return n_heads, d_model // n_heads, d_model // n_heads

    def state_bytes(self, d_model: int, n_heads: int, seq_len: int, *,
                    element_bytes: int = 4, **options: Any) -> int | None:
        """Bytes of the recurrent state of one layer per sequence after `seq_len` tokens
        (`state_size` elements of `element_bytes` each, float32 by default), or None where
        the entry has no count. Options as `layer` takes them (defaults filled in)."""
        if self.state_size is None:
            return None
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        elements = self.state_size(d_model, n_heads, seq_len, **self.resolve_options(options))
        return None if elements is None else int(elements) * element_bytes

    def layer(self, d_model: int, n_heads: int, **options: Any) -> Any:
        if self.build_layer is None:
            raise ValueError(f"mixer {self.name!r} has no layer form")
        return self.build_layer(d_model, n_heads, **self._checked_options(options))

    def decoder(self, **options: Any) -> Decoder:
        if self.build_decoder is None:
            raise ValueError(f"mixer {self.name!r} has no decode form")
        return self.build_decoder(**self._checked_options(options))

    def reference(self, **options: Any) -> Callable:
        """The float64 reference `(q, k, v) -> o` with `options` (defaults filled in). The
        requirements of the op are not checked: the reference runs anywhere."""
        if self.build_reference is None:
            raise ValueError(f"mixer {self.name!r} has no float64 reference")
        return self.build_reference(**self.resolve_options(options))

    def model_flops(self, batch: int, seq_len: int, heads: int, head_dim: int,
                    value_dim: int, mode: str = "fwd", **options: Any) -> float | None:
        """FLOPs for `mode` with `options` (defaults filled in), or None without a formula."""
        if mode not in FLOP_MODES:
            raise ValueError(f"mode must be one of {FLOP_MODES}, got {mode!r}")
        if self.flops is None:
            return None
        mode = "fwd" if mode == "prefill" else mode
        return self.flops(batch, seq_len, heads, head_dim, value_dim, mode,
                          **self.resolve_options(options))


def state_nbytes(state: Any) -> int:
    """Bytes of every tensor in `state` (a tensor, or a dict / list / tuple of them)."""
    if isinstance(state, Mapping):
        return sum(state_nbytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(value) for value in state)
    nbytes = getattr(state, "nbytes", None)
    return int(nbytes) if nbytes is not None else 0
