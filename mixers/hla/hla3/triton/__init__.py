"""Triton forms of causal third-order HLA (mixers/hla/hla3, variant="causal"): a
differentiable chunked op and a decode step on packed states (S^K `[B, H, D, D]`, P and F
`[B, H, D, Dv(+1)]`, the ones column of the denominator when normalized); mixers.hla.hla3
(hla3, hla3_step with impl="triton") checks a call, applies the non-finite rule and unpacks.

  plan.py     HLA3Plan, plan_launch (what is supported: ahla2's rule)
  forward.py  the forward, d x d moments only, no d^3 maps; up to key dim 64 three
              chunk-parallel stages,
                increments.py  each chunk's terms of (S^K, P, F) at once
                scan.py        the start states of the chunks in order
                output.py      each chunk's outputs at once from its start states
              above it one program per (value block, batch x head) walks the chunks
              carrying S^K and its columns of (P, F); both keep each chunk's start states
              for the backward
  backward.py the backward (key dims up to 64) in three chunk-parallel stages,
                grad_terms.py   each chunk's terms of the start states' gradients
                grad_scan.py    the end-state gradients of the chunks, last to first
                grad_chunks.py  dq, dk, dv of every chunk (grads.py: its equations)
  chunked.py  hla3_triton_packed, the two as an autograd op (above key dim 64 the
              backward recomputes through the PyTorch chunk form)
  decode.py   the decode step

Supported: any T, key head dims up to 128 and value head dims up to 256 (any size, D and
Dv independent), normalize, initial and final states, float16, bfloat16, float32 and
float64 inputs. Not supported: the paper variant (its PyTorch forms remain).
"""

from mixers.hla.hla3.triton.chunked import hla3_triton_packed
from mixers.hla.hla3.triton.decode import step as hla3_step_packed
from mixers.hla.hla3.triton.plan import HLA3Plan, plan_launch, unsupported_reason

__all__ = ["hla3_triton_packed", "hla3_step_packed", "HLA3Plan", "plan_launch",
           "unsupported_reason"]
