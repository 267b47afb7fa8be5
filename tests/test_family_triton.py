"""The Triton kernels of ahla2 and causal hla3 (under the interpreter on the CPU): forward,
final state, gradients, continuation and the decode step against the float64 explicit sums
and the PyTorch forms, at head dims that are not powers of two and partial last chunks."""

import dataclasses

import pytest
import torch

from grids import parametrize
from hla_inputs import random_qkv
from mixers.hla.ahla2 import ahla2, ahla2_naive, ahla2_step
from mixers.hla.ahla2.triton import plan_launch, unsupported_reason
from mixers.hla.hla3.triton import HLA3Plan
from mixers.hla.hla3.triton import plan_launch as hla3_plan_launch
from mixers.hla.hla3 import hla3, hla3_naive, hla3_step
from mixers.errors import relative_error

H = 2
PER_HEAD = torch.tensor([0.6, 0.97], dtype=torch.float64)
# (op, naive, step, options): ahla2 with and without decay, causal hla3 (no decay)
OPS = {
    "ahla2": (ahla2, ahla2_naive, ahla2_step, {}),
    "ahla2-decay": (ahla2, ahla2_naive, ahla2_step, {"decay": 0.9}),
    "ahla2-decay-per-head": (ahla2, ahla2_naive, ahla2_step, {"decay": PER_HEAD}),
    "hla3": (hla3, hla3_naive, hla3_step, {"variant": "causal"}),
}
# (T, D, Dv): a partial last chunk, head dims that are not powers of two, Dv != D
SHAPES = [(37, 16, 16), (41, 24, 40), (23, 48, 16)]


def inputs(T, D, Dv, dtype=torch.float64, positive=False, seed=0, B=2):
    return random_qkv(B, T, H, D, Dv, dtype=dtype, seed=seed, positive=positive, scale_qk=True)


FORWARD_CASES = [(normalize, name, shape) for shape in SHAPES for name in OPS
                 for normalize in (False, True)]
# the fast suite: each op once, at the shapes of the other tests' cases
FORWARD_FAST = {(False, "ahla2", SHAPES[0]), (True, "ahla2-decay-per-head", SHAPES[2]),
                (True, "hla3", SHAPES[0])}


@parametrize("normalize, name, shape", FORWARD_CASES,
             ids=["%s-%s-T%d-D%d-Dv%d" % (normalize, name, *shape)
                  for normalize, name, shape in FORWARD_CASES],
             fast=lambda case: case in FORWARD_FAST)
def test_forward_and_final_state_match_the_explicit_sum(shape, name, normalize):
    op, naive, _, options = OPS[name]
    q, k, v = inputs(*shape, positive=normalize)
    ref = naive(q, k, v, normalize=normalize, **options)
    o, state = op(q, k, v, impl="triton", normalize=normalize, chunk_size=16,
                  output_final_state=True, **options)
    _, ref_state = op(q, k, v, impl="serial", normalize=normalize, output_final_state=True,
                      **options)
    assert o.dtype == torch.float64 and relative_error(o, ref) < 1e-10
    assert state.keys() == ref_state.keys()
    for key in state:
        assert relative_error(state[key], ref_state[key]) < 1e-10, key


@parametrize("name", OPS, fast=[1])
def test_two_calls_chained_by_the_state_equal_one(name):
    op, _, _, options = OPS[name]
    q, k, v = inputs(40, 24, 20, positive=True)
    kwargs = dict(impl="triton", normalize=True, output_final_state=True, **options)
    whole, whole_state = op(q, k, v, **kwargs)
    first, state = op(q[:, :17], k[:, :17], v[:, :17], **kwargs)
    second, end = op(q[:, 17:], k[:, 17:], v[:, 17:], initial_state=state, **kwargs)
    assert relative_error(torch.cat([first, second], 1), whole) < 1e-10
    for key in end:
        assert relative_error(end[key], whole_state[key]) < 1e-10, key


@parametrize("name, D, normalize, fused", [(name, 20, normalize, False)
                                                        for name in OPS
                                                        for normalize in (False, True)]
                         + [("hla3", 80, True, False), ("hla3", 80, False, True)], fast=[2])
def test_gradients_match_the_chunk_form(name, D, normalize, fused, monkeypatch):
    """Through the backward kernels, at a key dim of one block (20) and of two (hla3 at 80);
    `fused`: dq, dk and dv in one launch (grad_fused.py), where hla3's first link adds its
    value gradient into the buffer of its key gradient."""
    if fused:
        from mixers import chain

        plan_chain = chain.plan_chain
        monkeypatch.setattr(chain, "plan_chain", lambda *args: dataclasses.replace(
            plan_chain(*args), fused_backward=True))
    op, _, _, options = OPS[name]
    q, k, v = inputs(29, D, 24, positive=normalize)
    _, start = op(*inputs(5, D, 24, positive=normalize, seed=1), normalize=normalize,
                  output_final_state=True, **options)
    grads = {}
    for impl in ("triton", "chunk"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        initial = {key: x.clone().requires_grad_() for key, x in start.items()}
        o, end = op(*leaves, impl=impl, normalize=normalize, initial_state=initial,
                    output_final_state=True, **options)
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2),
                              dtype=o.dtype)
        ((o * weights).sum() + sum(x.sum() for x in end.values())).backward()
        grads[impl] = [x.grad for x in leaves] + [initial[key].grad for key in sorted(initial)]
    for got, want in zip(grads["triton"], grads["chunk"]):
        assert relative_error(got, want) < 1e-10


@pytest.mark.parametrize("name, normalize", [("ahla2-decay-per-head", True), ("hla3", False)])
def test_one_chunk_without_start_or_final_state(name, normalize):
    """T within one chunk, no initial state and no final state asked for: the links keep no
    state at all; outputs against the explicit sums, gradients against the chunk form."""
    op, naive, _, options = OPS[name]
    q, k, v = inputs(13, 24, 20, positive=normalize)
    grads = {}
    for impl in ("triton", "chunk"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, state = op(*leaves, impl=impl, normalize=normalize, chunk_size=16, **options)
        assert state is None
        if impl == "triton":
            assert relative_error(o, naive(q, k, v, normalize=normalize, **options)) < 1e-12
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2),
                              dtype=o.dtype)
        (o * weights).sum().backward()
        grads[impl] = [x.grad for x in leaves]
    for got, want in zip(grads["triton"], grads["chunk"]):
        assert relative_error(got, want) < 1e-12


@parametrize("name", OPS, fast=[2, 3])
@parametrize("normalize", [False, True], fast=[1])
def test_decode_steps_continue_the_forward(name, normalize):
    op, _, step, options = OPS[name]
    q, k, v = inputs(12, 24, 40, positive=normalize)
    o, _ = op(q, k, v, impl="chunk", normalize=normalize, **options)
    _, state = op(q[:, :8], k[:, :8], v[:, :8], impl="triton", normalize=normalize,
                  output_final_state=True, **options)
    for t in range(8, 12):
        before = {key: x.clone() for key, x in state.items()}
        out, state = step(q[:, t], k[:, t], v[:, t], state, impl="triton",
                          normalize=normalize, **options)
        assert relative_error(out, o[:, t]) < 1e-10
        _, torch_state = step(q[:, t], k[:, t], v[:, t], before, impl="torch",
                              normalize=normalize, **options)
        for key in state:
            assert relative_error(state[key], torch_state[key]) < 1e-10, key


@parametrize("name", ["ahla2-decay", "hla3"], fast=[0])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_low_precision_against_float64_on_the_same_rounded_inputs(name, dtype, tolerance):
    op, naive, _, options = OPS[name]
    q, k, v = inputs(70, 32, 48, dtype=dtype, positive=True)
    o = op(q, k, v, impl="triton", normalize=True, **options)[0]
    ref = naive(q.double(), k.double(), v.double(), normalize=True, **options)
    assert o.dtype == dtype and relative_error(o.double(), ref) < tolerance


@pytest.mark.parametrize("name", ["ahla2", "hla3"])
def test_unnormalized_16_bit_outputs_come_from_the_last_link_as_they_are(name, monkeypatch):
    """Not normalized, the last link's kernel writes bf16 outputs itself (the links before
    it keep float32 intermediates): nothing is cast after it, and the outputs stay within
    bf16 rounding of float64 on the same rounded inputs."""
    from mixers import chain

    written, forward = [], chain.forward
    monkeypatch.setattr(chain, "forward", lambda *args, **kwargs: (
        lambda result: written.append(result[0].dtype) or result)(forward(*args, **kwargs)))
    op, naive, _, options = OPS[name]
    q, k, v = inputs(40, 24, 16, dtype=torch.bfloat16)
    o = op(q, k, v, impl="triton", **options)[0]
    assert written[-1] == torch.bfloat16 and set(written[:-1]) == {torch.float32}
    ref = naive(q.double(), k.double(), v.double(), **options)
    assert o.dtype == torch.bfloat16 and relative_error(o.double(), ref) < 1e-2



@parametrize("D, Dv", [(80, 24), (192, 8), (300, 130)], fast=[0, 1])
def test_hla3_decode_step_at_large_and_odd_head_dims(D, Dv):
    """Key dims over several row blocks of 64 with a partial last one, and (Dv 130 plus the
    ones column) two value blocks, whose programs all read S^K and one writes it."""
    q, k, v = inputs(3, D, Dv, positive=True, B=1)
    _, state = hla3(q[:, :2], k[:, :2], v[:, :2], impl="chunk", normalize=True,
                    output_final_state=True)
    out, new = hla3_step(q[:, 2], k[:, 2], v[:, 2], state, impl="triton", normalize=True)
    want, want_state = hla3_step(q[:, 2], k[:, 2], v[:, 2], state, impl="torch", normalize=True)
    assert relative_error(out, want) < 1e-10
    assert new.keys() == want_state.keys()
    for key in new:
        assert relative_error(new[key], want_state[key]) < 1e-10, key

def test_plans_and_refusals():
    assert plan_launch(24, 41, torch.bfloat16).block_d == 32
    assert plan_launch(24, 41, torch.bfloat16).block_v == 64
    assert plan_launch(256, 256, torch.bfloat16).block_v == 16
    assert hla3_plan_launch(300, 131, torch.float64) == HLA3Plan(32, 128, 8)
    assert hla3_plan_launch(300, 64, torch.float64) == HLA3Plan(64, 64, 8)
    q, k, v = inputs(4, 520, 8)
    assert "above 512" in unsupported_reason(q, k, v)
    for op in (ahla2, hla3):
        with pytest.raises(ValueError, match="impl='triton' cannot run these inputs: head dims"):
            op(q, k, v, impl="triton")
        assert op(*inputs(8, 16, 16), impl="auto")[0].shape == (2, 8, H, 16)  # CPU: PyTorch
    q, k, v = inputs(4, 192, 8)
    assert relative_error(hla3(q, k, v, impl="triton")[0], hla3_naive(q, k, v)) < 1e-10
    q, k, v = inputs(6, 300, 8)  # above 256: five key blocks of 64
    assert relative_error(ahla2(q, k, v, impl="triton")[0], ahla2_naive(q, k, v)) < 1e-10
    with pytest.raises(ValueError, match="impl='triton' is not available for variant='paper'"):
        hla3(*inputs(8, 16, 16), variant="paper", impl="triton")
