"""A tiny language model around one registered mixer, for the synthetic tasks.

Token embedding (+ learned positions for softmax attention, which has no notion of order
otherwise), `n_layers` pre-norm blocks (mixer, optional MLP), final norm, head tied to the
embedding. With `readout="last"` every position is predicted from the last position's state
(MAD's auto-encoder readout for compression).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from hla_bench import registry
from tasks import IGNORE

READOUTS = ("causal", "last")


class Block(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x)) when enabled."""

    def __init__(self, d_model: int, mixer: nn.Module, mlp: bool):
        super().__init__()
        self.mixer_norm, self.mixer = nn.LayerNorm(d_model), mixer
        self.mlp = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model)) if mlp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(x) if self.mlp is not None else x


def sincos_positions(length: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal position codes `[length, dim]`."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10_000.0) / dim))
    codes = torch.zeros(length, dim)
    codes[:, 0::2] = torch.sin(position * freq)
    codes[:, 1::2] = torch.cos(position * freq[: dim // 2])
    return codes


class LastStateDecoder(nn.Module):
    """Reconstruct every position from the last state: state + position code -> 2-layer MLP
    (MAD's non-expanding auto-encoder decoder)."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.register_buffer("positions", sincos_positions(max_len, d_model), persistent=False)
        self.mlp = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_model), nn.GELU(),
                                 nn.LayerNorm(d_model), nn.Linear(d_model, d_model), nn.GELU())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        last = hidden[:, -1:, :]
        return self.mlp(last + self.positions[: hidden.shape[1]].to(hidden.dtype))


class TinyLM(nn.Module):
    """Embedding, mixer blocks and a tied head; `loss` scores labelled positions only."""

    def __init__(self, vocab_size: int, d_model: int, mixer: str, *, n_layers: int = 2,
                 n_heads: int = 1, mlp: bool = True, mixer_options: dict | None = None,
                 max_len: int = 2048, readout: str = "causal"):
        super().__init__()
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        entry = registry.get(mixer)
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model) if entry.family == "softmax" else None
        self.blocks = nn.ModuleList(
            Block(d_model, entry.layer(d_model, n_heads, **(mixer_options or {})), mlp)
            for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.decoder = LastStateDecoder(d_model, max_len) if readout == "last" else None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def hidden(self, inputs: torch.Tensor) -> torch.Tensor:
        """Final normalised states `[B, T, d_model]` (decoded from the last one for "last")."""
        T = inputs.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len {self.max_len}")
        x = self.embed(inputs)
        if self.positions is not None:
            x = x + self.positions.weight[:T]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.decoder(x) if self.decoder is not None else x

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits `[B, T, vocab]` at every position."""
        return self.hidden(inputs) @ self.embed.weight.T

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
            return hidden[mask] @ self.embed.weight.T, labels[mask]
        rows = labelled_rows(labels, count)
        return hidden[rows] @ self.embed.weight.T, labels[rows]

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor,
             count: int | None = None) -> torch.Tensor:
        logits, targets = self.labelled_logits(inputs, labels, count)
        return F.cross_entropy(logits.float(), targets)


def labelled_rows(labels: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` labelled entries of flat `labels`, in order, computed on the
    labels' device: a running count gives each its slot; unlabelled entries go to a spare
    slot past the end, which is dropped."""
    labelled = labels != IGNORE
    slots = torch.where(labelled, labelled.cumsum(0) - 1, count)
    rows = torch.zeros(count + 1, dtype=torch.long, device=labels.device)
    rows.scatter_(0, slots, torch.arange(labels.numel(), device=labels.device))
    return rows[:count]
