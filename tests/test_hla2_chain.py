"""Masked hla2 through the chain of two causal linear attentions (mixers/hla/hla2/triton/
chained.py), the Triton path for inputs the fused kernels do not take, under the
interpreter: float64 against the explicit sums of its definition (outputs and final state),
gradients against the float64 chunk form, and which path impl="triton" takes."""

import pytest
import torch

from grids import parametrize
from mixers.dispatch import noting
from mixers.hla.hla2 import hla2, hla2_naive, hla2_naive_final_state
from mixers.errors import relative_error

B, H = 2, 2
DECAY = torch.tensor([0.6, 0.97], dtype=torch.float64)


def inputs(T, D, Dv, positive, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (0.3 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
               for d in (D, D, Dv))
    if positive:
        q, k = q.abs(), k.abs()
    return [x.to(dtype) for x in (q, k, v)]


# T = 37 at chunks of 16: 3 chunks, walked; T = 70: 5 chunks, increments + scan; T = 13:
# one chunk, without a start state and (test below) a final state, no state at all (two key
# blocks: tests/test_chain.py and the hla3 and ahla2 tests, whose links these are)
@parametrize("T, D, decay, normalize, start", [
    (37, 24, False, False, False), (70, 40, True, True, True), (13, 24, True, True, False),
    (13, 24, False, False, True)], fast=[2, 3])
def test_the_chain_equals_the_explicit_sums(T, D, decay, normalize, start):
    q, k, v = inputs(T, D, 20, positive=normalize)
    g = DECAY if decay else None
    state = None
    if start:
        _, state = hla2(*inputs(5, D, 20, normalize, seed=1), impl="chunk", decay=g,
                        normalize=normalize, output_final_state=True)
    with noting() as notes:
        o, final = hla2(q, k, v, impl="triton", chunk_size=16, decay=g, normalize=normalize,
                        initial_state=state, output_final_state=True)
    assert notes["triton_path"] == "chain of two linear attentions"
    options = dict(decay=g, normalize=normalize, initial_state=state)
    assert relative_error(o, hla2_naive(q, k, v, **options)) < 1e-12
    want = hla2_naive_final_state(q, k, v, **options)
    assert final.keys() == want.keys()
    for key in want:
        assert relative_error(final[key], want[key]) < 1e-12, key
    o_only, none = hla2(q, k, v, impl="triton", chunk_size=16, decay=g, normalize=normalize,
                        initial_state=state)
    assert none is None and torch.equal(o_only, o)


@pytest.mark.slow
@pytest.mark.parametrize("T, states", [(41, True), (13, False)], ids=["states", "one-chunk"])
def test_the_chain_gradients_equal_the_chunk_form(T, states):
    """With a start state and the final state's gradient, and (one chunk) with neither."""
    q, k, v = inputs(T, 24, 20, positive=True)
    _, start = hla2(*inputs(5, 24, 20, True, seed=1), impl="chunk", decay=DECAY,
                    normalize=True, output_final_state=True)
    grads = {}
    for impl in ("triton", "chunk"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        initial = {key: x.clone().requires_grad_() for key, x in start.items()}
        o, end = hla2(*leaves, impl=impl, chunk_size=16, decay=DECAY, normalize=True,
                      initial_state=initial if states else None, output_final_state=states)
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2),
                              dtype=o.dtype)
        loss = (o * weights).sum()
        if states:
            loss = loss + sum((x * x).sum() for x in end.values())
        loss.backward()
        grads[impl] = [x.grad for x in leaves]
        if states:
            grads[impl] += [initial[key].grad for key in sorted(start)]
    for got, want in zip(grads["triton"], grads["chunk"]):
        assert relative_error(got, want) < 1e-12


@pytest.mark.slow
def test_impl_triton_takes_the_fused_kernels_where_they_run_and_the_chain_elsewhere():
    q, k, v = inputs(20, 24, 16, positive=False, dtype=torch.float32)
    with noting() as notes:
        hla2(q, k, v, impl="triton")
    assert notes["triton_path"] == "fused kernels"
    q136, k136 = inputs(20, 136, 16, positive=False, dtype=torch.float32)[:2]  # fp32 above 128
    with noting() as notes:
        o, _ = hla2(q136, k136, v, impl="triton")
    assert notes["triton_path"] == "chain of two linear attentions"
    assert relative_error(o.double(), hla2_naive(q136.double(), k136.double(),
                                                 v.double())) < 1e-5
    shared = [x[:, :, :1].double() for x in (k136, v)]  # multi-query: neither takes it
    with pytest.raises(ValueError, match="got torch.float64.*through the chain.*multi-query"):
        hla2(q136.double(), *shared, impl="triton")
