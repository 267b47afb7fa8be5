"""Decay factors over a whole sequence, for the parallel forms (`parallel.py` of each
operator): tokens t, s = 0..T-1, per-head decay g (no decay: every factor is 1).

    causal(p, shift)[t, s] = g^(p (t - s - shift)) where s <= t - shift, else 0
    from_start(p, offset)[t] = g^(p (t + offset))   how an initial summary has decayed at t
    to_end(p)[s]           = g^(p (T - 1 - s))     how token s counts in the final summary
    total(p)               = g^(p T)               how the initial summary counts in it

Factors that are all ones come back as None, so the undecayed path multiplies by nothing.
"""

from __future__ import annotations

import torch


class SequenceDecay:
    """`log_g`: `[h]` log decays (h heads, or 1 shared), or None for no decay."""

    def __init__(self, log_g: torch.Tensor | None, T: int, dtype: torch.dtype,
                 device: torch.device):
        self.log_g = None if log_g is None else log_g.to(dtype).view(-1, 1, 1)
        self.T, self.dtype = T, dtype
        pos = torch.arange(T, device=device)
        self.lag = pos.view(-1, 1) - pos.view(1, -1)                        # t - s
        self.pos = pos.to(dtype).view(-1, 1)

    def heads(self, h: int) -> "SequenceDecay":
        """The factors of the first h heads (a state shared by all heads decays as head 0)."""
        if self.log_g is None or self.log_g.shape[0] == h:
            return self
        return SequenceDecay(self.log_g[:h].flatten(), self.T, self.dtype, self.lag.device)

    def causal(self, power: int = 1, shift: int = 0) -> torch.Tensor:
        """`[h or 1, T, T]`: g^(power (t - s - shift)) where s <= t - shift, else 0."""
        inside = self.lag >= shift
        if self.log_g is None:
            return inside.to(self.dtype).unsqueeze(0)
        steps = (self.lag - shift).clamp(min=0).to(self.dtype)
        return torch.where(inside, torch.exp(power * self.log_g * steps), 0.0)

    def from_start(self, power: int = 1, offset: int = 1) -> torch.Tensor | None:
        """`[h, T, 1]`: g^(power (t + offset)), or None."""
        if self.log_g is None:
            return None
        return torch.exp(power * self.log_g * (self.pos + offset))

    def to_end(self, power: int = 1) -> torch.Tensor | None:
        """`[h, T, 1]`: g^(power (T - 1 - s)), or None."""
        if self.log_g is None:
            return None
        return torch.exp(power * self.log_g * (self.T - 1 - self.pos))

    def total(self, power: int = 1) -> torch.Tensor | None:
        """`[h, 1, 1]`: g^(power T), or None."""
        if self.log_g is None:
            return None
        return torch.exp(power * self.T * self.log_g)


def scaled(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """x * factor, or x itself when the factor is None (all ones)."""
    return x if factor is None else x * factor
