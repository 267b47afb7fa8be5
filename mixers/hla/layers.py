"""The "hla" family's registry entries: ops with options bound, layers, decoders and the
float64 references.

Each entry's op is the `mixers.hla` operator with its options bound; the layer is a
`MixerLayer` around that op (q and k L2-normalised by default so second and third order
products stay bounded, plus a short causal convolution of size 4 as in fla's linear-attention
layers); the decoder streams with the operator's `*_step`; the reference is the operator's
`*_naive` (its naive.py: explicit sums in float64). Options are passed to each operator
function only where its signature accepts them, so the entries follow the operators as they
grow options.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math

import torch

from mixers.entry import Mixer, state_nbytes
from mixers.layer import MixerLayer

LAYER_OPTIONS = {"qk_norm": "l2", "short_conv": 4, "output_norm": True}


def _accepted(fn, options: dict) -> dict:
    """The subset of `options` that `fn` takes as keyword arguments."""
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(options)
    return {name: value for name, value in options.items() if name in parameters}


def _operator(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _op_options(options: dict) -> dict:
    return {name: value for name, value in options.items() if name not in LAYER_OPTIONS}


def _step_options(options: dict) -> dict:
    """Op options for a `*_step`: a step has no serial/scan/chunk/parallel forms, so those run
    its PyTorch step ("torch"); "auto" and "triton" keep their meaning."""
    options = _op_options(options)
    if options.get("impl") in ("serial", "scan", "chunk", "parallel"):
        options["impl"] = "torch"
    return options


class HLADecoder:
    """Streaming decode through an HLA `*_step`; the state has a fixed size for any context."""

    def __init__(self, step_fn, options: dict, state_bytes_fn=None):
        self.step_fn = step_fn
        self.options = _accepted(step_fn, options)
        self.state_bytes_fn = state_bytes_fn or state_nbytes

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        """Random tensors with the keys and shapes the step keeps (context_len is irrelevant:
        the state does not grow)."""
        token = [torch.randn(batch, heads, dim, device=device, dtype=dtype)
                 for dim in (head_dim, head_dim, value_dim)]
        _, state = self.step_fn(*token, None, **self.options)
        return {key: torch.randn_like(value) for key, value in state.items()}

    def step(self, q, k, v, state):
        return self.step_fn(q, k, v, state, **self.options)

    def state_bytes(self, state):
        return int(self.state_bytes_fn(state))


def _flops_fn(module: str, name: str):
    """FLOPs from the operator module's `*_flops` (None while it has none)."""

    def flops(batch, seq_len, heads, head_dim, value_dim, mode, **options):
        fn = getattr(importlib.import_module(module), name, None)
        if fn is None:
            return None
        return fn(batch, seq_len, heads, head_dim, value_dim,
                  **_accepted(fn, {"mode": mode, **_op_options(options)}))

    return flops


def _elements(shapes: dict) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def _hla2_state_size(masked: bool):
    """hla2's state per layer (spec §1): S d x d and its value-side summaries d x dv per
    head (masked: A, + C with ridge; the paper's decay: C, G; unmasked: C), each with a [d]
    twin under normalize; d = dv = d_model / n_heads."""
    def count(d_model, n_heads, seq_len, normalize, ridge, decay, decay_form, **_):
        from mixers.hla.hla2.state import operator_form, state_shapes

        d = d_model // n_heads
        form = operator_form(masked, decay, decay_form)
        return _elements(state_shapes(form, normalize, ridge, 1, n_heads, n_heads, d, d))

    return count


def _ahla2_state_size(d_model, n_heads, seq_len, normalize, **_):
    """AHLA's state per layer (spec §2): P and E, d x dv per head (+ two [d] under
    normalize)."""
    from mixers.hla.ahla2 import _state_shapes

    d = d_model // n_heads
    return _elements(_state_shapes(1, n_heads, d, d, normalize))


def _hla3_state_size(d_model, n_heads, seq_len, variant, normalize, **_):
    """Third order's state per layer (spec §3): causal S^K d x d, P and F d x dv per head;
    the paper's Alg. 3 adds S^Q d x d (+ two [d] under normalize)."""
    from mixers.hla.hla3 import _state_shapes

    d = d_model // n_heads
    return _elements(_state_shapes(variant, 1, n_heads, d, d, normalize))


def _triton_requires(impl="auto", **_):
    return ("triton", "cuda") if impl == "triton" else ()


def hla_entry(name: str, module: str, op_name: str, description: str, options: dict,
              forms: tuple[str, ...], bound: dict | None = None, state_size=None) -> Mixer:
    """A registry entry for the operator `module.op_name` (its step is `op_name + "_step"`,
    its reference `op_name + "_naive"`)."""
    bound = bound or {}

    def build_op(**opts):
        op = _operator(module, op_name)
        return functools.partial(op, **_accepted(op, {**bound, **_op_options(opts)}))

    def build_layer(d_model, n_heads, **opts):
        # traceable: the dispatchers keep their Triton kernels out of a torch.compile trace
        return MixerLayer(d_model, n_heads, build_op(**opts), qk_norm=opts["qk_norm"],
                          short_conv=opts["short_conv"], output_norm=opts["output_norm"],
                          traceable_op=True)

    def build_decoder(**opts):
        step = _operator(module, op_name + "_step")
        state_bytes = getattr(importlib.import_module(module), op_name + "_state_bytes", None)
        return HLADecoder(step, {**bound, **_step_options(opts)}, state_bytes)

    def build_reference(**opts):
        naive = _operator(module, op_name + "_naive")
        return functools.partial(naive, **_accepted(naive, {**bound, **_op_options(opts)}))

    return Mixer(name=name, family="hla", description=description, build_op=build_op,
                 build_layer=build_layer, build_decoder=build_decoder,
                 options={**options, **LAYER_OPTIONS}, forms=forms,
                 flops=_flops_fn(module, op_name + "_flops"), option_requires=_triton_requires,
                 build_reference=build_reference, state_size=state_size)


def hla_mixers() -> list[Mixer]:
    hla2_options = {"normalize": False, "eps": 1e-6, "ridge": 0.0, "decay": None,
                    "decay_form": "masked", "impl": "auto", "chunk_size": 64}
    return [
        hla_entry("hla2", "mixers.hla.hla2", "hla2",
                  "Second-order HLA, masked (strictly causal) form; optional decay, "
                  "normalisation and ridge.", hla2_options,
                  ("serial", "scan", "chunk", "parallel", "triton"), bound={"masked": True},
                  state_size=_hla2_state_size(True)),
        hla_entry("hla2-unmasked", "mixers.hla.hla2", "hla2",
                  "Second-order HLA without the causal mask inside: o_t = q_t^T S_t C_t.",
                  hla2_options, ("serial", "scan", "chunk", "parallel", "triton"),
                  bound={"masked": False}, state_size=_hla2_state_size(False)),
        hla_entry("ahla2", "mixers.hla.ahla2", "ahla2",
                  "Asymmetric second-order HLA (AHLA): ((L*QK^T)(L*QK^T)*L) V.",
                  {"normalize": False, "eps": 1e-6, "decay": None, "impl": "auto",
                   "chunk_size": 64}, ("serial", "scan", "chunk", "parallel", "triton"),
                  state_size=_ahla2_state_size),
        hla_entry("hla3", "mixers.hla.hla3", "hla3",
                  "Third-order HLA: variant 'causal' (causal restriction of the tensor form) "
                  "or 'paper' (the paper's Alg. 3).",
                  {"variant": "causal", "normalize": False, "eps": 1e-6, "impl": "auto",
                   "chunk_size": 64}, ("serial", "scan", "chunk", "parallel", "triton"),
                  state_size=_hla3_state_size),
    ]
