"""ahla2's Triton kernels (under the interpreter on the CPU): forward, final state,
gradients, continuation and the decode step against the float64 explicit sum and the
recurrence, at head dims that are not powers of two and partial last chunks."""

import pytest
import torch

from hla_inputs import random_qkv
from mixers.hla.ahla2 import ahla2, ahla2_naive, ahla2_step
from mixers.hla.ahla2.triton import plan_launch, unsupported_reason
from mixers.reference import relative_error

H = 2
DECAYS = {"none": None, "float": 0.9, "per_head": torch.tensor([0.6, 0.97], dtype=torch.float64)}
# (T, D, Dv): a partial last chunk, head dims that are not powers of two, Dv != D
SHAPES = [(37, 16, 16), (41, 24, 40), (23, 48, 16)]


def inputs(T, D, Dv, dtype=torch.float64, positive=False, seed=0, B=2):
    return random_qkv(B, T, H, D, Dv, dtype=dtype, seed=seed, positive=positive, scale_qk=True)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T%d-D%d-Dv%d" % s)
@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
@pytest.mark.parametrize("normalize", [False, True])
def test_forward_and_final_state_match_the_explicit_sum(shape, decay, normalize):
    q, k, v = inputs(*shape, positive=normalize)
    ref = ahla2_naive(q, k, v, normalize=normalize, decay=decay)
    o, state = ahla2(q, k, v, impl="triton", normalize=normalize, decay=decay, chunk_size=16,
                     output_final_state=True)
    _, ref_state = ahla2(q, k, v, impl="serial", normalize=normalize, decay=decay,
                         output_final_state=True)
    assert o.dtype == torch.float64 and relative_error(o, ref) < 1e-10
    assert state.keys() == ref_state.keys()
    for key in state:
        assert relative_error(state[key], ref_state[key]) < 1e-10, key


@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_two_calls_chained_by_the_state_equal_one(decay):
    q, k, v = inputs(40, 24, 20, positive=True)
    whole, whole_state = ahla2(q, k, v, impl="triton", normalize=True, decay=decay,
                               output_final_state=True)
    first, state = ahla2(q[:, :17], k[:, :17], v[:, :17], impl="triton", normalize=True,
                         decay=decay, output_final_state=True)
    second, end = ahla2(q[:, 17:], k[:, 17:], v[:, 17:], impl="triton", normalize=True,
                        decay=decay, initial_state=state, output_final_state=True)
    assert relative_error(torch.cat([first, second], 1), whole) < 1e-10
    for key in end:
        assert relative_error(end[key], whole_state[key]) < 1e-10, key


@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
@pytest.mark.parametrize("normalize", [False, True])
def test_gradients_match_the_chunk_form(decay, normalize):
    q, k, v = inputs(29, 20, 24, positive=normalize)
    _, start = ahla2(*inputs(5, 20, 24, positive=normalize, seed=1), normalize=normalize,
                     output_final_state=True)
    grads = {}
    for impl in ("triton", "chunk"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        initial = {key: x.clone().requires_grad_() for key, x in start.items()}
        o, end = ahla2(*leaves, impl=impl, normalize=normalize, decay=decay,
                       initial_state=initial, output_final_state=True)
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2),
                              dtype=o.dtype)
        ((o * weights).sum() + sum(x.sum() for x in end.values())).backward()
        grads[impl] = [x.grad for x in leaves] + [initial[key].grad for key in sorted(initial)]
    for got, want in zip(grads["triton"], grads["chunk"]):
        assert relative_error(got, want) < 1e-10


@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
@pytest.mark.parametrize("normalize", [False, True])
def test_decode_steps_continue_the_forward(decay, normalize):
    q, k, v = inputs(12, 24, 40, positive=normalize)
    o, _ = ahla2(q, k, v, impl="chunk", normalize=normalize, decay=decay)
    _, state = ahla2(q[:, :8], k[:, :8], v[:, :8], impl="triton", normalize=normalize,
                     decay=decay, output_final_state=True)
    for t in range(8, 12):
        before = {key: x.clone() for key, x in state.items()}
        out, state = ahla2_step(q[:, t], k[:, t], v[:, t], state, impl="triton",
                                normalize=normalize, decay=decay)
        assert relative_error(out, o[:, t]) < 1e-10
        _, torch_state = ahla2_step(q[:, t], k[:, t], v[:, t], before, impl="torch",
                                    normalize=normalize, decay=decay)
        for key in state:
            assert relative_error(state[key], torch_state[key]) < 1e-10, key
            assert torch.equal(before[key], before[key])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_precision_against_float64_on_the_same_rounded_inputs(dtype, tolerance):
    q, k, v = inputs(70, 32, 48, dtype=dtype, positive=True)
    o = ahla2(q, k, v, impl="triton", normalize=True, decay=0.97)[0]
    ref = ahla2_naive(q.double(), k.double(), v.double(), normalize=True, decay=0.97)
    assert o.dtype == dtype and relative_error(o.double(), ref) < tolerance


def test_non_finite_inputs_change_only_later_outputs():
    q, k, v = inputs(30, 16, 16)
    k[0, 20, 1, 3] = float("nan")
    o = ahla2(q, k, v, impl="triton")[0]
    clean = ahla2(q, k.nan_to_num(), v, impl="chunk")[0]
    assert torch.equal(o[0, :20].isnan(), torch.zeros_like(o[0, :20], dtype=torch.bool))
    assert relative_error(o[0, :20], clean[0, :20]) < 1e-12
    assert o[0, 20:, 1].isnan().all() and not o[1].isnan().any() and not o[0, :, 0].isnan().any()


def test_plans_and_refusals():
    assert plan_launch(24, 41, torch.bfloat16).block_d == 32
    assert plan_launch(24, 41, torch.bfloat16).block_v == 64
    assert plan_launch(256, 256, torch.bfloat16).block_v == 16
    q, k, v = inputs(4, 300, 8)
    assert "above 256" in unsupported_reason(q, k, v)
    with pytest.raises(ValueError, match="impl='triton' cannot run these inputs: head dims"):
        ahla2(q, k, v, impl="triton")
    assert ahla2(*inputs(8, 16, 16), impl="auto")[0].shape == (2, 8, H, 16)  # CPU: the chunk form
