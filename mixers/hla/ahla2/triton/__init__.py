"""Triton forms of AHLA (mixers/hla/ahla2): a differentiable chunked op and a decode step,
both on packed states `[B, H, D, Dv(+1)]` (the ones column of the denominator when
normalized); mixers.hla.ahla2 (ahla2, ahla2_step with impl="triton") checks a call, applies
the non-finite rule and unpacks.

  plan.py     what the kernels support; AHLA2Plan, plan_launch, unsupported_reason
  forward.py  the forward: up to key dim 128 three chunk-parallel stages,
                increments.py  each chunk's increments of (P, E) at once
                scan.py        the start states of the chunks in order, over the increments
                output.py      each chunk's outputs at once from its start states
              above it one program per (value block, batch x head) walks the chunks,
              carrying its columns of (P, E); both keep each chunk's start states for the
              backward
  backward.py the backward: the same programs walk the chunks in reverse, carrying the
              gradients of (P, E)
  chunked.py  ahla2_triton_packed, the two as an autograd op
  decode.py   the decode step

Supported: any T, head dims up to 256 (D and Dv independent, any size: blocks are powers
of two with masked loads), decay (per head), normalize, initial and final states, float16,
bfloat16, float32 and float64 inputs. Not supported: multi-query k and v (ahla2 takes none).
"""

from mixers.hla.ahla2.triton.chunked import ahla2_triton_packed
from mixers.hla.ahla2.triton.decode import step as ahla2_step_packed
from mixers.hla.ahla2.triton.plan import AHLA2Plan, plan_launch, unsupported_reason

__all__ = ["ahla2_triton_packed", "ahla2_step_packed", "AHLA2Plan", "plan_launch",
           "unsupported_reason"]
