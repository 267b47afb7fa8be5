"""An example third-party mixer: o_t = mean of v_1..v_t (ignores q and k)."""

import torch

from hla_bench.registry import Mixer


def running_mean(q, k, v, initial_state=None, output_final_state=False):
    steps = torch.arange(1, v.shape[1] + 1, device=v.device, dtype=v.dtype)
    return v.cumsum(1) / steps[None, :, None, None], None


def mixers():
    """Entry point: the list of mixers this package adds."""
    return [Mixer(name="example-running-mean", family="example",
                  description="Causal running mean of the values.",
                  build_op=lambda: running_mean)]
