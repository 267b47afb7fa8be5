"""Fused kernels for stacked training (recall/stacked.py): N models' elementwise work done in
one pass each, exact against the unstacked computation (a stacked layer's own fused
convolution and q/k normalisation is mixers.short_conv).

  norm.py           stacked_norm: LayerNorm or RMSNorm with per-model weights `[N, d]` over
                    activations `[N, M, d]`, optionally fused with the residual add; the
                    backward produces the per-model weight and bias gradients in the same
                    kernel as the input gradient (per-program partials, summed once)
  cross_entropy.py  labelled_cross_entropy: the head (hidden @ W^T + b) and the mean
                    cross-entropy over each model's labelled rows, chunk by chunk, never
                    holding every row's logits; the gradients come out of the forward
  adamw.py          adamw_step_: FlatAdamW's update of `[N, P]` rows in one pass
  embedding.py      stacked_embedding: N models' embedding lookups whose weight gradient
                    sums each vocabulary row's gradients over the sorted ids, every row
                    written once, no atomics (embedding_row_sums, a custom op that
                    torch.compile keeps whole)

Each runs Triton kernels on CUDA and a PyTorch path on the CPU and for float64 (`impl`
"auto"), and either on request (`impl="triton"` runs the kernels on the CPU under
TRITON_INTERPRET=1).
"""

from hla_bench.recall.kernels.adamw import adamw_step_
from hla_bench.recall.kernels.cross_entropy import labelled_cross_entropy
from hla_bench.recall.kernels.embedding import embedding_row_sums, stacked_embedding
from hla_bench.recall.kernels.norm import stacked_norm

__all__ = ["adamw_step_", "embedding_row_sums", "labelled_cross_entropy", "stacked_embedding",
           "stacked_norm"]
