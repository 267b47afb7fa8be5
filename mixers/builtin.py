"""The built-in mixers: `builtin_mixers()` lists every family's registry entries.

Families, each declared beside its layer: "hla" (mixers.hla operators; mixers/hla/layers.py),
"softmax" (SDPA, flash-attn; mixers/softmax.py), "linear" (our chunked linear attention and
Based; mixers/linear.py), "ssm" (Mamba-2 SSD; mixers/mamba2/layer.py), "fla"
(flash-linear-attention kernels with fixed gates, mixers/fla.py; fla's own layers with
learned gates, mixers/fla_layers.py).
Layers: HLA, linear-attn and the fixed-gate fla entries use q/k L2 normalisation and a
short causal convolution of size 4 (fla's layer default); based keeps the convolution but
leaves q, k as projected (its Taylor map scales inside); softmax layers use neither (the op
scales by 1/sqrt(D)); fla's own layers do as fla does.
"""

from __future__ import annotations

from mixers.entry import Mixer
from mixers.fla import fla_mixers
from mixers.fla_layers import fla_layer_mixers
from mixers.hla.layers import hla_mixers
from mixers.linear import linear_mixers
from mixers.mamba2.layer import mamba2_mixers
from mixers.softmax import softmax_mixers


def builtin_mixers() -> list[Mixer]:
    """Every built-in entry, family by family."""
    return [*hla_mixers(), *softmax_mixers(), *linear_mixers(), *mamba2_mixers(),
            *fla_mixers(), *fla_layer_mixers()]
