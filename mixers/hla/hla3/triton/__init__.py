"""Triton forms of causal third-order HLA (mixers/hla/hla3, variant="causal"): a
differentiable chunked op and a decode step on packed states (S^K `[B, H, D, D]`, P and F
`[B, H, D, Dv(+1)]`, the ones column of the denominator when normalized); mixers.hla.hla3
(hla3, hla3_step with impl="triton") checks a call, applies the non-finite rule and unpacks.

  chunked.py  hla3_triton_packed: three chained causal linear attentions
              (mixers/chain), Y = la(q, k, k; S0), R = la(q, k, v; P0),
              o = la(q, Y, R; F0), as one autograd op: d x d moments only, no d^3 maps
  decode.py   the decode step
  plan.py     what the kernels support; the decode step's HLA3Plan, plan_launch

Supported: any T, head dims up to 512 for both forms (any size, D and Dv independent),
normalize, initial and final states, float16, bfloat16, float32 and float64 inputs. Not
supported: the paper variant (its PyTorch forms remain).
"""

from mixers.hla.hla3.triton.chunked import hla3_triton_packed
from mixers.hla.hla3.triton.decode import step as hla3_step_packed
from mixers.hla.hla3.triton.plan import (HLA3Plan, plan_launch, step_unsupported_reason,
                                         unsupported_reason)

__all__ = ["hla3_triton_packed", "hla3_step_packed", "HLA3Plan", "plan_launch",
           "unsupported_reason", "step_unsupported_reason"]
