"""Random HLA inputs shared by the operator tests."""

import torch


def random_qkv(B, T, H, D, DV, *, kv_heads=None, dtype=torch.float64, seed=0, positive=False,
               scale_qk=False):
    """Seeded q [B,T,H,D], k [B,T,kv,D], v [B,T,kv,DV] (kv = H unless given), drawn in float64.
    `positive` takes |q|, |k| (normalised variants need a positive denominator); `scale_qk`
    divides q and k by sqrt(D)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = H if kv_heads is None else kv_heads
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, kv_heads, D, generator=gen, dtype=torch.float64)
    if scale_qk:
        q, k = q / D ** 0.5, k / D ** 0.5
    v = torch.randn(B, T, kv_heads, DV, generator=gen, dtype=torch.float64)
    if positive:
        q, k = q.abs(), k.abs()
    return q.to(dtype), k.to(dtype), v.to(dtype)

