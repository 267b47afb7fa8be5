"""Triton forms of AHLA (mixers/hla/ahla2): a differentiable chunked op and a decode step,
both on packed states `[B, H, D, Dv(+1)]` (the ones column of the denominator when
normalized); mixers.hla.ahla2 (ahla2, ahla2_step with impl="triton") checks a call, applies
the non-finite rule and unpacks.

  chunked.py  ahla2_triton_packed: two chained causal linear attentions
              (mixers/chain), X = la(q, k, v; P0, g) and o = la(q, k, X; E0, g), as
              one autograd op
  decode.py   the decode step (Alg. 2)
  plan.py     what the kernels support; the decode step's AHLA2Plan, plan_launch

Supported: any T, head dims up to 512 (D and Dv independent, any size: blocks are powers
of two with masked loads), decay (per head), normalize, initial and final states, float16,
bfloat16, float32 and float64 inputs. Not supported: multi-query k and v (ahla2 takes none).
"""

from mixers.hla.ahla2.triton.chunked import ahla2_triton_packed
from mixers.hla.ahla2.triton.decode import step as ahla2_step_packed
from mixers.hla.ahla2.triton.plan import AHLA2Plan, plan_launch, unsupported_reason

__all__ = ["ahla2_triton_packed", "ahla2_step_packed", "AHLA2Plan", "plan_launch",
           "unsupported_reason"]
