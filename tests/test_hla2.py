"""hla2: every impl against the explicit sums, state continuation, decode steps, gradients,
input errors. All on CPU, float64 unless a test is about low precision."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from grids import pairs, parametrize
from hla_inputs import random_qkv
from mixers.hla import hla2, hla2_step
from mixers.hla.hla2 import hla2_flops, hla2_naive, hla2_naive_final_state, hla2_state_bytes
from mixers.errors import relative_error

B, H, D, DV = 2, 2, 4, 5
PER_HEAD = "per-head"


def make_inputs(T, *, kv_heads=H, dtype=torch.float64, seed=0, d=D, dv=DV, positive=False):
    return random_qkv(B, T, H, d, dv, kv_heads=kv_heads, dtype=dtype, seed=seed, positive=positive)


def decay_value(kind, kv_heads):
    """None, a float, or a per-head tensor (uniform under multi-query, where S is shared)."""
    if kind == PER_HEAD:
        return torch.tensor([0.85, 0.85] if kv_heads == 1 else [0.7, 0.95], dtype=torch.float64)
    return kind


def one_decay_if_shared(opts, kv_heads):
    """Multi-query shares S, so every head must decay alike."""
    if kv_heads == 1 and isinstance(opts.get("decay"), torch.Tensor):
        return dict(opts, decay=opts["decay"][:1].expand(H))
    return opts


def state_err(a, b):
    assert set(a) == set(b)
    return max(relative_error(a[key], b[key]) for key in a)


OPTIONS = list(itertools.product([True, False], [False, True], [0.0, 0.3], [None, 0.8, PER_HEAD],
                                 ["masked", "paper"], [H, 1]))


@parametrize("masked,normalize,ridge,decay,decay_form,kv_heads", OPTIONS, fast=pairs(OPTIONS))
def test_every_impl_matches_explicit_sums(masked, normalize, ridge, decay, decay_form, kv_heads):
    q, k, v = make_inputs(13, kv_heads=kv_heads)
    opts = dict(masked=masked, normalize=normalize, ridge=ridge,
                decay=decay_value(decay, kv_heads), decay_form=decay_form)
    ref = hla2_naive(q, k, v, **opts)
    o_serial, s_serial = hla2(q, k, v, impl="serial", output_final_state=True, **opts)
    assert relative_error(o_serial, ref) < 1e-10
    assert s_serial["S"].shape[1] == kv_heads
    for impl, chunk_size in [("scan", 1), ("scan", 5), ("chunk", 1), ("chunk", 4), ("chunk", 5),
                             ("chunk", 13), ("chunk", 64), ("parallel", 64)]:
        o, state = hla2(q, k, v, impl=impl, chunk_size=chunk_size, output_final_state=True, **opts)
        assert o.dtype == q.dtype
        assert relative_error(o, ref) < 1e-10, (impl, chunk_size)
        assert state_err(state, s_serial) < 1e-10, (impl, chunk_size)


def test_explicit_sums_match_the_matrix_form_of_the_masked_decay():
    """Against matrix forms of the definition (A = QK^T, L the causal mask, L_g[t, s] = g^(t-s)):
    masked with decay weights g^((t-i)+(t-j)) on i <= j <= t is ((L_g*A)(L*A)^T * L_g) V."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 3, generator=gen, dtype=torch.float64) for _ in "qkv")
    g = 0.8
    lag = torch.arange(9).view(-1, 1) - torch.arange(9).view(1, -1)
    L_g = torch.where(lag >= 0, g ** lag.clamp(min=0).double(), 0)
    A = torch.einsum("bthd,bshd->bhts", q, k)
    weights = ((L_g * A) @ torch.tril(A).transpose(-1, -2)) * L_g
    expected = (weights @ v.transpose(1, 2)).transpose(1, 2)
    assert torch.allclose(hla2_naive(q, k, v, decay=g), expected, rtol=1e-12, atol=1e-12)


@parametrize("masked,normalize,ridge,decay,decay_form,kv_heads", OPTIONS, fast=pairs(OPTIONS))
def test_explicit_sums_continue_from_an_initial_state(masked, normalize, ridge, decay,
                                                      decay_form, kv_heads):
    """From a state (a prefix's, perturbed: any state, not only a reachable one), the
    explicit sums' outputs and final state are those of the serial recurrence."""
    q, k, v = make_inputs(11, kv_heads=kv_heads, positive=True)
    opts = dict(masked=masked, normalize=normalize, ridge=ridge,
                decay=decay_value(decay, kv_heads), decay_form=decay_form)
    _, state = hla2(q[:, :5], k[:, :5], v[:, :5], impl="serial", output_final_state=True,
                    **opts)
    gen = torch.Generator().manual_seed(3)
    state = {key: x + 0.1 * torch.rand(x.shape, generator=gen, dtype=x.dtype)
             for key, x in state.items()}
    ref = hla2_naive(q, k, v, initial_state=state, **opts)
    ref_final = hla2_naive_final_state(q, k, v, initial_state=state, **opts)
    for impl in ("serial", "parallel"):
        o, final = hla2(q, k, v, impl=impl, initial_state=state, output_final_state=True,
                        **opts)
        assert relative_error(ref, o) < 1e-10, impl
        assert state_err(ref_final, final) < 1e-10, impl


@pytest.mark.parametrize("T,chunk_size", [(37, 8), (32, 8), (37, 37), (2, 16)])
@pytest.mark.parametrize("decay_form", ["masked", "paper"])
def test_longer_sequences_and_dims(T, chunk_size, decay_form):
    q, k, v = make_inputs(T, d=8, dv=3, seed=1)
    opts = dict(decay=torch.tensor([0.9, 0.75], dtype=torch.float64), decay_form=decay_form,
                ridge=0.1, normalize=True)
    ref = hla2_naive(q, k, v, **opts)
    _, s_serial = hla2(q, k, v, impl="serial", output_final_state=True, **opts)
    for impl in ("scan", "chunk", "parallel"):
        o, state = hla2(q, k, v, impl=impl, chunk_size=chunk_size, output_final_state=True, **opts)
        assert relative_error(o, ref) < 1e-10
        assert state_err(state, s_serial) < 1e-10


def test_paper_and_masked_decay_differ_below_one_and_agree_at_one():
    q, k, v = make_inputs(16)
    o_masked, _ = hla2(q, k, v, decay=0.8, decay_form="masked", impl="chunk", chunk_size=4)
    o_paper, s_paper = hla2(q, k, v, decay=0.8, decay_form="paper", impl="chunk", chunk_size=4,
                            output_final_state=True)
    assert relative_error(o_paper, o_masked) > 0.05
    assert set(s_paper) == {"S", "C", "G"}
    o_masked, _ = hla2(q, k, v, decay=1.0, decay_form="masked", impl="chunk", chunk_size=4)
    o_paper, _ = hla2(q, k, v, decay=1.0, decay_form="paper", impl="chunk", chunk_size=4)
    o_plain, _ = hla2(q, k, v, impl="chunk", chunk_size=4)
    assert relative_error(o_paper, o_masked) < 1e-12 and relative_error(o_plain, o_masked) < 1e-12


@pytest.mark.parametrize("decay_form,masked",
                         [("masked", True), ("paper", True), ("masked", False)])
def test_float32_forms_agree(decay_form, masked):
    q, k, v = make_inputs(33, dtype=torch.float32, d=8, dv=8)
    opts = dict(masked=masked, decay=0.9, decay_form=decay_form, ridge=0.2,
                output_final_state=True)
    o_serial, s_serial = hla2(q, k, v, impl="serial", **opts)
    assert o_serial.dtype == torch.float32 and s_serial["S"].dtype == torch.float32
    for impl in ("scan", "chunk"):
        o, state = hla2(q, k, v, impl=impl, chunk_size=8, **opts)
        assert relative_error(o, o_serial) < 1e-4 and state_err(state, s_serial) < 1e-4


@pytest.mark.parametrize("decay", [None, 0.9])
def test_bf16_chunk_accumulates_in_float32(decay):
    q, k, v = make_inputs(40, dtype=torch.bfloat16, d=8, dv=8)
    o, state = hla2(q, k, v, decay=decay, impl="chunk", chunk_size=16, output_final_state=True)
    assert o.dtype == torch.bfloat16 and state["A"].dtype == torch.float32
    assert relative_error(o, hla2_naive(q, k, v, decay=decay)) < 2e-2


CONTINUATION_OPTIONS = [
    dict(),
    dict(decay=0.85, normalize=True),
    dict(decay=torch.tensor([0.8, 0.95]), decay_form="paper", ridge=0.2, normalize=True),
    dict(masked=False, decay=0.9, ridge=0.1),
    dict(ridge=0.3, decay=0.7),
]


@pytest.mark.parametrize("opts", CONTINUATION_OPTIONS)
@pytest.mark.parametrize("impl", ["serial", "scan", "chunk", "parallel"])
def test_split_sequence_continues_from_state(opts, impl):
    q, k, v = make_inputs(23)
    o_full, s_full = hla2(q, k, v, impl=impl, chunk_size=4, output_final_state=True, **opts)
    for split in (1, 7, 8, 20):
        o1, s1 = hla2(q[:, :split], k[:, :split], v[:, :split], impl=impl, chunk_size=4,
                      output_final_state=True, **opts)
        o2, s2 = hla2(q[:, split:], k[:, split:], v[:, split:], impl=impl, chunk_size=4,
                      initial_state=s1, output_final_state=True, **opts)
        assert relative_error(torch.cat([o1, o2], 1), o_full) < 1e-12
        assert state_err(s2, s_full) < 1e-12


@pytest.mark.parametrize("opts", CONTINUATION_OPTIONS)
@pytest.mark.parametrize("impl", ["serial", "scan", "chunk", "parallel"])
def test_empty_sequence_hands_the_state_through(opts, impl):
    q, k, v = make_inputs(9)
    _, state = hla2(q, k, v, impl=impl, output_final_state=True, **opts)
    o, final = hla2(q[:, :0], k[:, :0], v[:, :0], impl=impl, initial_state=state,
                    output_final_state=True, **opts)
    assert o.shape == (q.shape[0], 0, H, DV)
    assert sorted(final) == sorted(state) and state_err(final, state) == 0


@pytest.mark.parametrize("opts", CONTINUATION_OPTIONS)
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_prefill_then_steps_equals_one_call(opts, kv_heads):
    opts = one_decay_if_shared(opts, kv_heads)
    q, k, v = make_inputs(12, kv_heads=kv_heads)
    o_full, s_full = hla2(q, k, v, impl="chunk", chunk_size=4, output_final_state=True, **opts)
    _, state = hla2(q[:, :5], k[:, :5], v[:, :5], impl="chunk", output_final_state=True, **opts)
    for t in range(5, 12):
        o_t, state = hla2_step(q[:, t], k[:, t], v[:, t], state, **opts)
        assert relative_error(o_t, o_full[:, t]) < 1e-12
    assert state_err(state, s_full) < 1e-12
    o_0, _ = hla2_step(q[:, 0], k[:, 0], v[:, 0], None, impl="torch", **opts)
    assert relative_error(o_0, o_full[:, 0]) < 1e-12


GRAD_OPTIONS = [
    dict(),
    dict(decay=torch.tensor([0.8, 0.9], dtype=torch.float64), ridge=0.2),
    dict(decay=0.7, decay_form="paper"),
    dict(masked=False, decay=0.9),
]


def _with_state(impl, opts, shapes_from):
    """Loss inputs (q, k, v, *initial state) -> outputs incl. the final state, for gradcheck."""
    keys = sorted(shapes_from)

    def fn(q, k, v, *state):
        o, final = hla2(q, k, v, impl=impl, chunk_size=2, output_final_state=True,
                        initial_state=dict(zip(keys, state)), **opts)
        return (o,) + tuple(final[key] for key in keys)
    return fn, keys


@pytest.mark.parametrize("opts", GRAD_OPTIONS)
@parametrize("impl", ["chunk", "parallel", "serial"], fast=[0])
def test_gradcheck(opts, impl):
    q, k, v = (x[:1, :5, :, :3].clone() for x in make_inputs(5, seed=2))
    v = v[..., :2].clone()
    _, prefix = hla2(q, k, v, impl="serial", output_final_state=True, **opts)
    fn, keys = _with_state(impl, opts, prefix)
    inputs = [x.requires_grad_() for x in (q, k, v, *(prefix[key].clone() for key in keys))]
    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_normalized_chunk():
    q, k, v = (x[:1, :5, :, :3].clone() for x in make_inputs(5, seed=3, positive=True))
    opts = dict(normalize=True, decay=0.9)
    inputs = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: hla2(*x, impl="chunk", chunk_size=2, **opts)[0],
                                    inputs)


@pytest.mark.parametrize("opts", GRAD_OPTIONS + [dict(normalize=True, decay=0.9, ridge=0.1)])
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_chunk_and_parallel_gradients_equal_serial_gradients(opts, kv_heads):
    opts = one_decay_if_shared(opts, kv_heads)
    q, k, v = make_inputs(11, kv_heads=kv_heads, seed=4, positive=True)
    weights = torch.randn(B, 11, H, DV, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)
    grads = {}
    for impl in ("serial", "chunk", "parallel"):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, final = hla2(*inputs, impl=impl, chunk_size=4, output_final_state=True, **opts)
        ((o * weights).sum() + sum(x.sum() for x in final.values())).backward()
        grads[impl] = [x.grad for x in inputs]
    for impl in ("chunk", "parallel"):
        for g_form, g_serial in zip(grads[impl], grads["serial"]):
            assert relative_error(g_form, g_serial) < 1e-10, impl


def _error_cases():
    q, k, v = make_inputs(6)
    good = dict(q=q, k=k, v=v)
    state = hla2(q, k, v, output_final_state=True)[1]
    return [
        (dict(good, q=q[0]), {}, "q must have shape"),
        (dict(good, k=k[:, :5]), {}, "batch and length"),
        (dict(good, k=k[:1]), {}, "batch and length"),
        (dict(good, k=k[..., :3]), {}, "k must have the head dim"),
        (dict(good, v=v.float()), {}, "share a dtype"),
        (good, dict(decay=0.0), "decay must lie in"),
        (good, dict(decay=1.5), "decay must lie in"),
        (good, dict(decay=torch.tensor([0.9, 0.9, 0.9])), "decay must be a float or a per-head"),
        (good, dict(impl="cuda"), "impl must be one of"),
        (good, dict(decay_form="gla"), "decay_form must be one of"),
        (good, dict(chunk_size=0), "chunk_size"),
        (good, dict(chunk_size=2.5), "chunk_size"),
        (good, dict(eps=0.0), "eps"),
        (good, dict(ridge=-1.0), "ridge"),
        (good, dict(initial_state={"S": state["S"]}), r"initial_state must be a dict with keys"),
        (good, dict(initial_state=state, normalize=True), "initial_state must be a dict with keys"),
        (good, dict(initial_state=dict(state, A=state["A"][..., :2])), r"initial_state\['A'\]"),
        (good, dict(impl="triton", ridge=0.5), "impl='triton' cannot run.*ridge"),
        (dict(good, k=k[:, :, :1], v=v[:, :, :1]), dict(decay=torch.tensor([0.9, 0.8])),
         "decay must be the same for every head"),
    ]


@pytest.mark.parametrize("tensors,opts,message", _error_cases())
def test_bad_arguments_raise(tensors, opts, message):
    with pytest.raises(ValueError, match=message):
        hla2(tensors["q"], tensors["k"], tensors["v"], **opts)


def test_step_bad_arguments_raise():
    q, k, v = (x[:, 0] for x in make_inputs(1))
    with pytest.raises(ValueError, match="q_t must have shape"):
        hla2_step(q[0], k, v)
    with pytest.raises(ValueError, match="impl must be one of"):
        hla2_step(q, k, v, impl="chunk")
    with pytest.raises(ValueError, match=r"state\['S'\] must have shape"):
        hla2_step(q, k, v, {"S": torch.zeros(B, H, 3, 3), "A": torch.zeros(B, H, D, DV)})
    with pytest.raises(ValueError, match="impl='triton'"):
        hla2_step(q, k, v, impl="triton")


def test_state_bytes_and_flops():
    q, k, v = make_inputs(3, kv_heads=1)
    _, state = hla2(q, k, v, normalize=True, output_final_state=True)
    assert hla2_state_bytes(state) == 8 * (B * D * D + B * H * D * DV + B * H * D)
    fwd = hla2_flops(1, 128, 1, 64, 64, chunk_size=64)
    assert fwd == 2 * 2 * 12 * 64 ** 3  # two chunks of twelve 64^3 products
    assert hla2_flops(1, 128, 1, 64, 64, mode="fwdbwd") == 3 * fwd
    assert hla2_flops(2, 10, 3, 4, 5, mode="decode") == 2 * 2 * 3 * (2 * 16 + 2 * 20)
    assert hla2_flops(2, 10, 3, 4, 5, mode="decode") == hla2_flops(2, 10_000, 3, 4, 5, mode="decode")


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_impl_is_routed_with_validated_state():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (x.to(device) for x in make_inputs(20, dtype=torch.float32, d=16, dv=16))
    q, k = q * 0.25, k * 0.25
    _, state = hla2(q[:, :4], k[:, :4], v[:, :4], normalize=True, impl="chunk",
                    output_final_state=True)
    outs = [hla2(q[:, 4:], k[:, 4:], v[:, 4:], normalize=True, impl=impl, chunk_size=16,
                 initial_state=state, output_final_state=True) for impl in ("triton", "chunk")]
    (o_triton, s_triton), (o_chunk, s_chunk) = outs
    assert relative_error(o_triton, o_chunk) < 1e-4 and state_err(s_triton, s_chunk) < 1e-4


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_step_is_routed():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (x[:, 0].to(device) for x in make_inputs(1, dtype=torch.float32, d=16, dv=16))
    _, state = hla2_step(q, k, v, impl="torch", normalize=True, decay=0.9)
    o_torch, s_torch = hla2_step(q, k, v, {key: x.clone() for key, x in state.items()},
                                 impl="torch", normalize=True, decay=0.9)
    o_triton, s_triton = hla2_step(q, k, v, state, impl="triton", normalize=True, decay=0.9)
    assert relative_error(o_triton, o_torch) < 1e-4 and state_err(s_triton, s_torch) < 1e-4


def test_auto_routes_to_triton_on_cuda_except_the_untimed_paper_decay_kernel(monkeypatch):
    import importlib
    from types import SimpleNamespace

    module = importlib.import_module("mixers.hla.hla2")
    monkeypatch.setattr(module, "_triton_unsupported", lambda *args, **kwargs: None)
    on_cuda = SimpleNamespace(is_cuda=True)
    g = torch.tensor([0.9, 0.9])

    def resolve(**options):
        return module._resolve_impl("auto", "chunk", on_cuda, None, None, masked=True,
                                    ridge=0.0, **options)

    assert resolve(decay=None, decay_form="paper") == "triton"
    assert resolve(decay=g, decay_form="masked") == "triton"
    assert resolve(decay=g, decay_form="paper") == "chunk"
