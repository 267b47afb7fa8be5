"""One link of the family's Triton chain (mixers/chain: causal linear attention with a
per-head decay, start and final states) under the interpreter, against the float64 token
by token sum of its definition: outputs, final state, and the gradients of q, k, v and the
start state, at head dims that span several blocks and a partial last chunk."""

import dataclasses

import pytest
import torch

from grids import parametrize
from mixers.chain import backward, forward, plan_chain
from mixers.errors import relative_error

B, H = 2, 2
DECAY = torch.tensor([0.6, 0.97], dtype=torch.float64)


def token_by_token(q, k, v, S0, decay, ones):
    """o_t = q_t^T S_t, S_t = g S_{t-1} + k_t v_t^T (v with a column of ones when `ones`)."""
    if ones:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    g = decay.view(1, H, 1, 1) if decay is not None else 1.0
    S, outputs = S0, []
    for t in range(q.shape[1]):
        S = g * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append((q[:, t, :, :, None] * S).sum(2))
    return torch.stack(outputs, 1), S


# Every pair of the seven options (head dims of one block or two, decay, a ones column, a
# start state, states walked instead of increments + scan, Q K^T formed once for all value
# blocks, the backward in one launch) in some case, each of the two values of each.
LINK_CASES = [
    (False, False, False, False, False, False, False),
    (True, False, True, True, False, False, True),
    (True, True, False, True, True, False, False),
    (False, False, True, False, True, True, False),
    (False, True, False, True, False, True, True),
    (True, True, True, False, True, True, True)]
OPTIONS = ("two-blocks", "decay", "ones-column", "start", "walked", "scores-once",
           "fused-backward")


@parametrize("two_blocks, with_decay, ones, start, walked, scores_once, fused", LINK_CASES,
             ids=["-".join(name for name, on in zip(OPTIONS, case) if on) or "plain"
                  for case in LINK_CASES], fast=[3])
def test_a_link_equals_its_token_by_token_sum(two_blocks, with_decay, ones, start, walked,
                                              scores_once, fused):
    T, D, Dv = (21, 80, 70) if two_blocks else (37, 24, 40)
    decay = DECAY if with_decay else None
    gen = torch.Generator().manual_seed(0)
    q, k, v = (0.3 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
               for d in (D, D, Dv))
    W = Dv + ones
    S0 = torch.randn(B, H, D, W, generator=gen, dtype=torch.float64) if start else None
    plan = plan_chain(D, W, torch.float64, chunk_size=16)
    plan = dataclasses.replace(plan, walk_chunks=0, walk_from=1 if walked else None,
                               scores_once=scores_once, fused_backward=fused)
    log_g = torch.log(decay) if decay is not None else None
    out, S1, starts = forward(q, k, v, S0, log_g, ones, plan, torch.float64, keep_starts=True)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    S0_leaf = (S0 if start else torch.zeros(B, H, D, W, dtype=torch.float64)).requires_grad_()
    want_out, want_S1 = token_by_token(*leaves, S0_leaf, decay, ones)
    assert relative_error(out, want_out) < 1e-12
    assert relative_error(S1, want_S1) < 1e-12

    grad_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    grad_S1 = torch.randn(want_S1.shape, generator=gen, dtype=torch.float64)
    ((want_out * grad_out).sum() + (want_S1 * grad_S1).sum()).backward()
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    dv = torch.ones_like(v)  # the link adds into its buffers: start from ones
    dS0 = backward(q, k, v, log_g, ones, starts, grad_out, grad_S1, dq, dk, dv, plan,
                   want_dS0=True)
    for name, got, want in (("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                            ("dv", dv - 1, leaves[2].grad), ("dS0", dS0, S0_leaf.grad)):
        assert relative_error(got, want) < 1e-12, name


@pytest.mark.slow
@pytest.mark.parametrize("walked, scores_once, fused", [(False, False, False),
                                                        (True, True, True)])
def test_bf16_operands_round_every_product_and_stay_within_bf16_of_the_sum(walked,
                                                                          scores_once, fused):
    """A plan with precision "bf16" rounds both operands of every product to bfloat16 and
    accumulates in float32: on float32 inputs that bfloat16 cannot hold, its outputs, final
    state and gradients differ from the float32 ("ieee") plan's by more than float32
    rounding and stay within 2e-2 of the float64 token-by-token sum (decay, start state and
    a ones column on; both forward paths and both backward paths)."""
    T, D, Dv = 45, 80, 40
    gen = torch.Generator().manual_seed(5)
    q, k, v = (0.3 * torch.randn(B, T, H, d, generator=gen) for d in (D, D, Dv))
    S0 = torch.randn(B, H, D, Dv + 1, generator=gen)
    grad_out = torch.randn(B, T, H, Dv + 1, generator=gen)
    grad_S1 = torch.randn(B, H, D, Dv + 1, generator=gen)
    log_g = torch.log(DECAY.float())
    results = {}
    for precision in ("ieee", "bf16"):
        plan = dataclasses.replace(plan_chain(D, Dv + 1, torch.float32, chunk_size=16),
                                   precision=precision, walk_chunks=0,
                                   walk_from=1 if walked else None, scores_once=scores_once,
                                   fused_backward=fused)
        out, S1, starts = forward(q, k, v, S0, log_g, True, plan, torch.float32,
                                  keep_starts=True)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dS0 = backward(q, k, v, log_g, True, starts, grad_out, grad_S1, dq, dk, dv, plan,
                       want_dS0=True)
        results[precision] = [out, S1, dq, dk, dv, dS0]
    leaves = [x.double().requires_grad_() for x in (q, k, v, S0)]
    want_out, want_S1 = token_by_token(*leaves[:3], leaves[3], DECAY, True)
    ((want_out * grad_out.double()).sum() + (want_S1 * grad_S1.double()).sum()).backward()
    wants = [want_out, want_S1] + [x.grad for x in leaves]
    names = ("out", "S1", "dq", "dk", "dv", "dS0")
    for name, exact, rounded, want in zip(names, results["ieee"], results["bf16"], wants):
        assert relative_error(exact.double(), want) < 1e-5, name
        assert relative_error(rounded.double(), exact.double()) > 1e-4, name
        assert relative_error(rounded.double(), want) < 2e-2, name


def test_plans():
    plan = plan_chain(80, 70, torch.bfloat16)
    assert (plan.chunk, plan.block_k, plan.block_v, plan.precision) == (64, 64, 64, "tf32")
    assert plan_chain(24, 21, torch.float32).block_k == 32
    assert plan_chain(24, 21, torch.float32).precision == "ieee"
    assert plan_chain(24, 21, torch.float64).chunk == 16
    assert plan_chain(24, 21, torch.bfloat16, chunk_size=32).chunk == 32
    assert plan_chain(24, 21, torch.bfloat16, chunk_size=128).chunk == 64


@parametrize("feature_map, normalize", [
    ("identity", False), ("identity", True), ("elu1", True), ("relu", False), ("taylor", True)],
    fast=[1])
def test_linear_attention_through_the_link_equals_its_recurrence(feature_map, normalize):
    """linear_attn(impl="triton"): the link on phi's features (the denominator as a column of
    ones), from a start state, against the token-by-token form; gradients against the
    PyTorch chunk form."""
    from mixers.linear_attn import linear_attn, linear_attn_naive

    gen = torch.Generator().manual_seed(1)
    D = 8 if feature_map == "taylor" else 24  # taylor: 1 + 8 + 64 = 73 features
    q, k, v = (0.3 * torch.randn(B, 37, H, d, generator=gen, dtype=torch.float64)
               for d in (D, D, 20))
    if normalize:
        q, k = q.abs(), k.abs()
    options = dict(feature_map=feature_map, normalize=normalize)
    _, start = linear_attn(q[:, :5], k[:, :5], v[:, :5], output_final_state=True, **options)
    want, want_state = linear_attn_naive(q, k, v, initial_state=start, **options)
    grads = {}
    for impl in ("triton", "chunk"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, state = linear_attn(*leaves, impl=impl, chunk_size=16, initial_state=start,
                               output_final_state=True, **options)
        assert relative_error(o, want) < 1e-12, impl
        for key in want_state:
            assert relative_error(state[key], want_state[key]) < 1e-12, (impl, key)
        weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(2),
                              dtype=o.dtype)
        (o * weights).sum().backward()
        grads[impl] = [x.grad for x in leaves]
    for got, want_grad in zip(grads["triton"], grads["chunk"]):
        assert relative_error(got, want_grad) < 1e-12


@pytest.mark.slow
def test_the_link_takes_16_bit_inputs_as_they_are(monkeypatch):
    """linear_attn(impl="triton") in bf16 hands q, k, v to the link without a float32 copy,
    and the link's kernel writes the outputs in bf16 (no float32 buffer to cast): outputs
    and gradients come back in bf16, within bf16 rounding of the float64 chunk form on the
    same rounded inputs; the state (float32) closer still."""
    from mixers.chain import link
    from mixers.linear_attn import linear_attn

    received, apply = [], link._Link.apply

    def spy(q, k, v, *rest):
        out, S1 = apply(q, k, v, *rest)
        received.append(({q.dtype, k.dtype, v.dtype}, out.dtype))
        return out, S1
    monkeypatch.setattr(link._Link, "apply", spy)

    gen = torch.Generator().manual_seed(3)
    q, k, v = (0.3 * torch.randn(B, 40, H, d, generator=gen).to(torch.bfloat16)
               for d in (24, 24, 20))
    weights = torch.randn(B, 40, H, 20, generator=gen, dtype=torch.float64)
    results = {}
    for impl, dtype in (("triton", torch.bfloat16), ("chunk", torch.float64)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        o, state = linear_attn(*leaves, impl=impl, chunk_size=16, output_final_state=True)
        (o.double() * weights).sum().backward()
        results[impl] = (o, state["S"], [x.grad for x in leaves])
    (o, S, grads), (want_o, want_S, want_grads) = results["triton"], results["chunk"]
    assert received == [({torch.bfloat16}, torch.bfloat16)]
    assert o.dtype == torch.bfloat16 and {g.dtype for g in grads} == {torch.bfloat16}
    assert relative_error(o.double(), want_o) < 1e-2
    assert relative_error(S.double(), want_S) < 1e-4
    for got, want in zip(grads, want_grads):
        assert relative_error(got.double(), want) < 1e-2


def test_a_chained_call_notes_its_launch_plan():
    """What the harness records in a point's `resolved`: the form and the chain's plan."""
    from mixers.dispatch import noting
    from mixers.hla.ahla2 import ahla2

    q, k, v = (torch.randn(1, 20, H, 24) for _ in range(3))
    with noting() as notes:
        ahla2(q, k, v, impl="triton", output_final_state=True)
    assert notes == {"impl": "triton", "chain_plan":
                     "chunk 64, blocks 32 x 32, 4 warps, 2 stages, ieee, states walked"}
    with noting() as notes:  # one chunk from zeros, no final state: no state at all
        ahla2(q, k, v, impl="triton")
    assert notes["chain_plan"].endswith("ieee, no state")
    q, k, v = (torch.randn(1, 330, H, 24) for _ in range(3))  # 6 chunks: increments + scan
    with noting() as notes:
        ahla2(q, k, v, impl="triton")
    assert notes["chain_plan"].endswith("ieee, scan blocks of 256")


def test_linear_attention_takes_value_dims_up_to_512_normalized_or_not():
    """The link's bound is the value dim, not its width: a normalized Dv = 512 carries a
    513th column of ones, as ahla2's does."""
    from mixers.linear_attn import triton_unsupported

    q = torch.zeros(1, 4, 1, 16)
    assert triton_unsupported(q, torch.zeros(1, 4, 1, 512), 16) is None
    assert "value dim 513 above 512" in triton_unsupported(q, torch.zeros(1, 4, 1, 513), 16)
    assert "feature width 520" in triton_unsupported(q, torch.zeros(1, 4, 1, 8), 520)


@pytest.mark.parametrize("fused", [False, True], ids=["two-kernel-backward", "fused-backward"])
def test_a_one_chunk_link_from_zeros_without_final_state_has_no_state(fused):
    """need_final=False, no start state and one chunk: no states are made (None back), the
    kernels skip their state terms, and outputs and gradients are the token-by-token sum's."""
    T, D, Dv = 13, 80, 70  # one chunk of 16, two key and value blocks
    gen = torch.Generator().manual_seed(4)
    q, k, v = (0.3 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
               for d in (D, D, Dv))
    plan = dataclasses.replace(plan_chain(D, Dv + 1, torch.float64, chunk_size=16),
                               fused_backward=fused)
    log_g = torch.log(DECAY)
    out, S1, starts = forward(q, k, v, None, log_g, True, plan, torch.float64,
                              keep_starts=True, need_final=False)
    assert S1 is None and starts is None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, _ = token_by_token(*leaves, torch.zeros(B, H, D, Dv + 1, dtype=torch.float64),
                             DECAY, True)
    assert relative_error(out, want) < 1e-12
    grad_out = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    (want * grad_out).sum().backward()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    assert backward(q, k, v, log_g, True, None, grad_out, None, dq, dk, dv, plan,
                    want_dS0=True) is None
    for got, leaf in zip((dq, dk, dv), leaves):
        assert relative_error(got, leaf.grad) < 1e-12
    with pytest.raises(ValueError, match="no final-state gradient"):
        backward(q, k, v, log_g, True, None, grad_out, torch.ones(B, H, D, Dv + 1,
                                                                   dtype=torch.float64),
                 dq, dk, dv, plan, want_dS0=False)


def test_linear_attention_in_one_chunk_without_states():
    """linear_attn(impl="triton") on one chunk, no initial state, no final state: the link
    keeps no state; outputs against the recurrence, gradients against the chunk form."""
    from mixers.dispatch import noting
    from mixers.linear_attn import linear_attn, linear_attn_naive

    gen = torch.Generator().manual_seed(5)
    q, k, v = (0.3 * torch.randn(B, 13, H, d, generator=gen, dtype=torch.float64)
               for d in (24, 24, 20))
    options = dict(feature_map="elu1", normalize=True)
    want, _ = linear_attn_naive(q, k, v, **options)
    grads = {}
    for impl in ("triton", "chunk"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with noting() as notes:
            o, state = linear_attn(*leaves, impl=impl, chunk_size=16, **options)
        assert state is None and relative_error(o, want) < 1e-12
        assert impl == "chunk" or notes["chain_plan"].endswith("no state")
        (o * torch.randn(o.shape, generator=torch.Generator().manual_seed(6),
                         dtype=o.dtype)).sum().backward()
        grads[impl] = [x.grad for x in leaves]
    for got, want_grad in zip(grads["triton"], grads["chunk"]):
        assert relative_error(got, want_grad) < 1e-12
