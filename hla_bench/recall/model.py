"""A tiny language model around one sequence-mixer layer, for the synthetic tasks.

Token embedding (+ learned positions when asked: softmax attention has no notion of order
otherwise), embedding dropout, `n_layers` pre-norm blocks, final norm, head. A block is
`x + mixer(norm(x))` followed by its state mixer:

- "mlp": `x + mlp(x)`, a pre-norm 4x GELU MLP;
- "swiglu": `x + swiglu(x)`, a pre-norm SwiGLU MLP (hidden `swiglu_hidden`, default 4x;
  MAD-lab's channel mixer is `mad_swiglu_hidden(d_model)` wide);
- "identity": `x + norm2(x)`: Zoology's block with `torch.nn.Identity` as its state
  mixer, whose output (the normalised residual) is added back to the residual stream;
- "none": nothing.

`norm` is the kind of every norm of the model (blocks, state mixers, final norm, decoder):
"layer" (LayerNorm with bias) or "rms" (RMSNorm, eps 1e-5, as MAD-lab's). `head` "tied"
projects with the embedding matrix; "untied" is a Linear with bias (MAD-lab's head).

The mixer layer comes from a factory (`make_mixer()`, called once per block), so this
module knows no mixer registry. With `readout="last"` every position is predicted from the
last position's state (MAD's auto-encoder readout for compression) through `decoder`:
"default": the final-normed last state plus interleaved sin/cos position codes through a
2-layer MLP, then the head; "mad-lab": MAD-lab's AutoEncoder, where the code is the last
position's residual stream (no norm), plus fairseq-layout sin/cos codes, through the same
MLP, then the final norm and the head.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks import IGNORE

READOUTS = ("causal", "last")
STATE_MIXERS = ("mlp", "swiglu", "identity", "none")
INITS = ("default", "zoology")
NORMS = ("layer", "rms")
HEADS = ("tied", "untied")
DECODERS = ("default", "mad-lab")
RMS_EPS = 1e-5  # MAD-lab's RMSNorm (mad/model/layers/ops/norm/rmsnorm.py)


def mad_swiglu_hidden(d_model: int) -> int:
    """MAD-lab's SwiGLU inner width: int(2 * 4 * d / 3) rounded up to a multiple of 16
    (mad/model/layers/mlp.py); 352 at d_model 128."""
    return 16 * math.ceil(int(2 * 4 * d_model / 3) / 16)


def norm_module(kind: str, d_model: int) -> nn.Module:
    """A LayerNorm ("layer", eps 1e-5, weight and bias) or an RMSNorm ("rms", eps 1e-5,
    weight only)."""
    if kind == "layer":
        return nn.LayerNorm(d_model)
    if kind == "rms":
        return nn.RMSNorm(d_model, eps=RMS_EPS)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class SwiGLU(nn.Module):
    """silu(x W1) * (x W3), then W2; hidden width `hidden`."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def state_mixer_module(kind: str, d_model: int, norm: str = "layer",
                       swiglu_hidden: int | None = None) -> nn.Module | None:
    """The block's state mixer (with its own pre-norm of kind `norm`), or None for "none"."""
    if kind == "mlp":
        return nn.Sequential(norm_module(norm, d_model), nn.Linear(d_model, 4 * d_model),
                             nn.GELU(), nn.Linear(4 * d_model, d_model))
    if kind == "swiglu":
        return nn.Sequential(norm_module(norm, d_model),
                             SwiGLU(d_model, swiglu_hidden or 4 * d_model))
    if kind == "identity":
        return norm_module(norm, d_model)
    return None


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + state_mixer(x)."""

    def __init__(self, d_model: int, mixer: nn.Module, state_mixer: str, norm: str = "layer",
                 swiglu_hidden: int | None = None):
        super().__init__()
        self.mixer_norm, self.mixer = norm_module(norm, d_model), mixer
        self.state_mixer = state_mixer_module(state_mixer, d_model, norm, swiglu_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.state_mixer(x) if self.state_mixer is not None else x


def sincos_positions(length: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal position codes `[length, dim]`, sine and cosine of each frequency
    interleaved (frequencies 10000^(-2i / dim))."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10_000.0) / dim))
    codes = torch.zeros(length, dim)
    codes[:, 0::2] = torch.sin(position * freq)
    codes[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return codes


def fairseq_positions(length: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal position codes `[length, dim]` in fairseq's layout, which MAD-lab's
    decoder uses (`posemb_sincos_1d`): the sines of all `dim // 2` frequencies
    10000^(-i / (dim // 2 - 1)), then their cosines, a zero column for odd `dim`."""
    half = dim // 2
    if half < 2:
        raise ValueError(f"fairseq position codes need dim >= 4, got {dim}")
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10_000.0) / (half - 1)))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * freq[None, :]
    codes = torch.cat([torch.sin(angles), torch.cos(angles)], 1)
    return torch.cat([codes, torch.zeros(length, dim - 2 * half)], 1)


class LastStateDecoder(nn.Module):
    """Reconstruct every position from the last state: state + position code -> 2-layer MLP
    (MAD's non-expanding auto-encoder decoder). `layout` "interleaved" or "fairseq" names
    the position codes (`sincos_positions`, `fairseq_positions`)."""

    def __init__(self, d_model: int, max_len: int, norm: str = "layer",
                 layout: str = "interleaved"):
        super().__init__()
        codes = {"interleaved": sincos_positions, "fairseq": fairseq_positions}[layout]
        self.register_buffer("positions", codes(max_len, d_model), persistent=False)
        self.mlp = nn.Sequential(norm_module(norm, d_model), nn.Linear(d_model, d_model),
                                 nn.GELU(), norm_module(norm, d_model),
                                 nn.Linear(d_model, d_model), nn.GELU())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        last = hidden[:, -1:, :]
        return self.mlp(last + self.positions[: hidden.shape[1]].to(hidden.dtype))


def output_projection(mixer: nn.Module) -> nn.Linear | None:
    """The mixer layer's projection back into the residual stream (`out` or `out_proj`)."""
    for name in ("out", "out_proj"):
        module = getattr(mixer, name, None)
        if isinstance(module, nn.Linear):
            return module
    return None


class TinyLM(nn.Module):
    """Embedding, mixer blocks and a head; `loss` scores labelled positions only.

    init "default": every Linear and Embedding weight ~ N(0, 0.02), biases 0. "zoology":
    the same, and each mixer's output projection ~ N(0, 0.02 / sqrt(2 n_layers)) (GPT-2's
    residual scaling, as Zoology initialises its models). Norm weights start at 1 (and
    LayerNorm biases at 0) either way.
    """

    def __init__(self, vocab_size: int, d_model: int, make_mixer: Callable[[], nn.Module], *,
                 n_layers: int = 2, state_mixer: str = "mlp", positions: bool = False,
                 embed_dropout: float = 0.0, max_len: int = 2048, readout: str = "causal",
                 init: str = "default", norm: str = "layer", head: str = "tied",
                 swiglu_hidden: int | None = None, decoder: str = "default"):
        super().__init__()
        for name, value, choices in (("readout", readout, READOUTS),
                                     ("state_mixer", state_mixer, STATE_MIXERS),
                                     ("init", init, INITS), ("norm", norm, NORMS),
                                     ("head", head, HEADS), ("decoder", decoder, DECODERS)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers must be an int >= 1, got {n_layers!r}")
        if not 0 <= embed_dropout < 1:
            raise ValueError(f"embed_dropout must lie in [0, 1), got {embed_dropout!r}")
        if swiglu_hidden is not None and (isinstance(swiglu_hidden, bool) or
                                          not isinstance(swiglu_hidden, int) or swiglu_hidden < 1):
            raise ValueError(f"swiglu_hidden must be an int >= 1 or None, got {swiglu_hidden!r}")
        self.max_len, self.embed_dropout, self.state_mixer = max_len, float(embed_dropout), state_mixer
        self.decoder_kind = decoder
        self.embed = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model) if positions else None
        self.blocks = nn.ModuleList(Block(d_model, make_mixer(), state_mixer, norm, swiglu_hidden)
                                    for _ in range(n_layers))
        self.norm = norm_module(norm, d_model)
        self.decoder = (LastStateDecoder(d_model, max_len, norm,
                                         "fairseq" if decoder == "mad-lab" else "interleaved")
                        if readout == "last" else None)
        self.head = nn.Linear(d_model, vocab_size) if head == "untied" else None
        self.apply(self._init_weights)
        if init == "zoology":
            for block in self.blocks:
                projection = output_projection(block.mixer)
                if projection is not None:
                    nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """The states the head reads, `[B, T, d_model]`: the final-normed block output, or
        for readout "last" every position decoded from the last one (decoder "default":
        norm, then decode; "mad-lab": decode the raw residual stream, then norm)."""
        T = inputs.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len {self.max_len}")
        x = self.embed(inputs)
        if self.positions is not None:
            x = x + self.positions.weight[:T]
        x = F.dropout(x, self.embed_dropout, self.training)
        for block in self.blocks:
            x = block(x)
        if self.decoder is None:
            return self.norm(x)
        if self.decoder_kind == "default":
            return self.decoder(self.norm(x))
        return self.norm(self.decoder(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head: `hidden @ embed.T` (tied) or the untied Linear with bias."""
        return self.head(hidden) if self.head is not None else hidden @ self.embed.weight.T

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits `[B, T, vocab]` at every position."""
        return self.logits(self.hidden(inputs))

    def labelled_logits(self, inputs: torch.Tensor, labels: torch.Tensor,
                        count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[N, vocab]` and targets `[N]` at the N labelled positions only: the head
        (the largest matmul for a big vocabulary) runs where the loss looks.

        Given `count` (= N, known on the host), the positions are gathered without a boolean
        index, which would wait for the GPU every step; same rows, same order."""
        hidden = self.hidden(inputs).flatten(0, 1)
        labels = labels.flatten()
        if count is None:
            mask = labels != IGNORE
            return self.logits(hidden[mask]), labels[mask]
        rows = labelled_rows(labels, count)
        return self.logits(hidden[rows]), labels[rows]

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor,
             count: int | None = None) -> torch.Tensor:
        logits, targets = self.labelled_logits(inputs, labels, count)
        return F.cross_entropy(at_least_float32(logits), targets)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or kept in float64: the loss never runs in a 16-bit dtype."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def labelled_rows(labels: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` labelled entries of flat `labels`, in order, computed on the
    labels' device: a running count gives each its slot; unlabelled entries go to a spare
    slot past the end, which is dropped."""
    labelled = labels != IGNORE
    slots = torch.where(labelled, labelled.cumsum(0) - 1, count)
    rows = torch.zeros(count + 1, dtype=torch.long, device=labels.device)
    rows.scatter_(0, slots, torch.arange(labels.numel(), device=labels.device))
    return rows[:count]
