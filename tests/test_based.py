"""Based: the Taylor feature map, linear attention with it, and the `based` registry entry."""

import math

import pytest
import torch

from hla_bench.registry import get
from mixers.linear_attn import (FEATURE_MAPS, feature_size, linear_attn, linear_attn_flops,
                                linear_attn_naive, linear_attn_step, state_shapes)
from hla_bench.recall.plan import state_bytes

taylor = FEATURE_MAPS["taylor"]


def qkv(B=2, T=21, H=3, D=4, Dv=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, d, generator=generator, dtype=torch.float64)
            for d in (D, D, Dv)]


def taylor_kernel(q, k):
    """1 + s + s^2 / 2 with s = q.k / sqrt(D), computed from q.k directly."""
    s = (q * k).sum(-1) / math.sqrt(q.shape[-1])
    return 1 + s + s * s / 2


# --- the feature map ---------------------------------------------------------------------

@pytest.mark.parametrize("D", [1, 4, 16])
def test_taylor_features_give_the_second_order_expansion_of_exp(D):
    generator = torch.Generator().manual_seed(D)
    x, y = (torch.randn(7, D, generator=generator, dtype=torch.float64) for _ in range(2))
    assert taylor(x).shape == (7, 1 + D + D * D) == (7, feature_size("taylor", D))
    torch.testing.assert_close((taylor(x) * taylor(y)).sum(-1), taylor_kernel(x, y),
                               rtol=1e-12, atol=1e-12)


def test_taylor_kernel_is_at_least_one_half():
    """1 + s + s^2/2 has its minimum 1/2 at s = -1: normalised outputs need no bound on q, k."""
    D = 16
    x = torch.randn(200, D, dtype=torch.float64) * 3
    y = -x * math.sqrt(D) / (x * x).sum(-1, keepdim=True)   # x.y / sqrt(D) = -1 exactly
    torch.testing.assert_close((taylor(x) * taylor(y)).sum(-1),
                               torch.full((200,), 0.5, dtype=torch.float64))
    random_pairs = (taylor(x) * taylor(torch.randn(200, D, dtype=torch.float64) * 3)).sum(-1)
    assert bool((random_pairs >= 0.5 - 1e-9).all())


def test_feature_sizes_follow_each_map():
    assert [feature_size(name, 16) for name in ("identity", "elu1", "relu", "taylor")] == \
        [16, 16, 16, 273]
    assert state_shapes(2, 3, 16, 8, True, "taylor") == {"S": (2, 3, 273, 8), "z": (2, 3, 273)}
    with pytest.raises(ValueError, match="feature_map"):
        feature_size("softmax", 4)


# --- linear attention with the Taylor map, float64 ----------------------------------------

@pytest.mark.parametrize("impl", ["chunk", "parallel"])
@pytest.mark.parametrize("normalize", [False, True])
def test_taylor_op_equals_the_explicit_kernel_sum(normalize, impl):
    """Weights 1 + s + s^2/2 from q.k itself, so a wrong scale in the map (or in the
    parallel form's kernel of q.k) shows here."""
    q, k, v = qkv(T=23)
    o, _ = linear_attn(q, k, v, feature_map="taylor", normalize=normalize, chunk_size=8,
                       impl=impl)
    weights = taylor_kernel(q.unsqueeze(2), k.unsqueeze(1))              # [B, t, i, H]
    weights = weights * torch.ones(23, 23, dtype=torch.float64).tril()[None, :, :, None]
    expected = torch.einsum("btih,bihe->bthe", weights, v)
    if normalize:
        expected = expected / (weights.sum(2).unsqueeze(-1) + 1e-6)
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("impl,chunk_size", [("chunk", 1), ("chunk", 8), ("chunk", 64),
                                             ("parallel", 64)])
def test_taylor_forms_match_token_by_token(normalize, impl, chunk_size):
    """T = 21 is not a multiple of 8 or 64: padded tokens must not reach the final state."""
    q, k, v = qkv()
    options = {"feature_map": "taylor", "normalize": normalize}
    o, state = linear_attn(q, k, v, impl=impl, chunk_size=chunk_size, output_final_state=True,
                           **options)
    o_ref, state_ref = linear_attn_naive(q, k, v, **options)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    assert set(state) == ({"S", "z"} if normalize else {"S"})
    assert state["S"].shape == (2, 3, 1 + 4 + 16, 5)
    for key in state:
        torch.testing.assert_close(state[key], state_ref[key], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["chunk", "parallel"])
@pytest.mark.parametrize("normalize", [False, True])
def test_taylor_continues_from_an_initial_state(normalize, impl):
    q, k, v = qkv(T=30)
    map_options = {"feature_map": "taylor", "normalize": normalize}
    options = {**map_options, "impl": impl}
    full, full_state = linear_attn(q, k, v, chunk_size=8, output_final_state=True, **options)
    head, state = linear_attn(q[:, :13], k[:, :13], v[:, :13], chunk_size=8,
                              output_final_state=True, **options)
    tail, tail_state = linear_attn(q[:, 13:], k[:, 13:], v[:, 13:], chunk_size=8,
                                   initial_state=state, output_final_state=True, **options)
    tail_ref, tail_state_ref = linear_attn_naive(q[:, 13:], k[:, 13:], v[:, 13:],
                                                 initial_state=state, **map_options)
    torch.testing.assert_close(torch.cat([head, tail], 1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(tail, tail_ref, rtol=1e-10, atol=1e-10)
    for key in full_state:
        torch.testing.assert_close(tail_state[key], full_state[key], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(tail_state_ref[key], full_state[key], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["chunk", "parallel"])
@pytest.mark.parametrize("normalize", [False, True])
def test_taylor_steps_continue_the_chunk_and_parallel_forms(normalize, impl):
    q, k, v = qkv(T=20)
    map_options = {"feature_map": "taylor", "normalize": normalize}
    options = {**map_options, "impl": impl}
    full, full_state = linear_attn(q, k, v, chunk_size=8, output_final_state=True, **options)
    _, state = linear_attn(q[:, :16], k[:, :16], v[:, :16], chunk_size=8,
                           output_final_state=True, **options)
    for t in range(16, 20):
        o_t, state = linear_attn_step(q[:, t], k[:, t], v[:, t], state, **map_options)
        torch.testing.assert_close(o_t, full[:, t], rtol=1e-10, atol=1e-10)
    for key in full_state:
        torch.testing.assert_close(state[key], full_state[key], rtol=1e-10, atol=1e-10)


def test_taylor_state_shape_is_checked():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"initial_state\['S'\].*\(2, 3, 21, 5\)"):
        linear_attn(q, k, v, feature_map="taylor",
                    initial_state={"S": torch.zeros(2, 3, 4, 5, dtype=torch.float64)})


def test_flops_count_the_features_after_the_map():
    taylor_16 = linear_attn_flops(1, 1024, 2, 16, 64, "fwd", feature_map="taylor")
    assert taylor_16 == linear_attn_flops(1, 1024, 2, 273, 64, "fwd")
    assert linear_attn_flops(1, 1024, 2, 64, 64, "fwd", feature_map="taylor",
                             feature_dim=16) == taylor_16
    assert linear_attn_flops(1, 10, 2, 16, 64, "decode", feature_map="taylor",
                             normalize=True) == 2 * (4 * 273 * 64 + 4 * 273)


# --- the registry entries ------------------------------------------------------------------

def test_based_entry_options():
    options = get("based").resolve_options({})
    assert {key: options[key] for key in ("feature_map", "feature_dim", "normalize", "eps",
                                          "qk_norm", "short_conv", "output_norm")} == {
        "feature_map": "taylor", "feature_dim": 16, "normalize": True, "eps": 1e-12,
        "qk_norm": "none", "short_conv": 4, "output_norm": False}
    assert get("based").family == "linear"


def test_based_op_is_normalised_taylor_linear_attention():
    q, k, v = qkv(D=16, T=19)
    o, _ = get("based").op(chunk_size=8)(q, k, v)
    expected, _ = linear_attn_naive(q, k, v, feature_map="taylor", normalize=True, eps=1e-12)
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)


def test_based_layer_hands_its_op_raw_feature_dim_q_k_and_head_dim_v():
    torch.manual_seed(0)
    layer = get("based").layer(32, 2)
    assert (layer.key_dim, layer.head_dim, layer.qk_norm, layer.out_norm) == (16, 16, "none", None)
    assert layer.split == (2 * 16, 2 * 16, 2 * 16) and layer.conv.kernel_size == 4
    layer = get("based").layer(64, 2)                       # head dim 32, feature dim 16
    assert layer.split == (2 * 16, 2 * 16, 2 * 32)
    seen = {}
    op = layer.op

    def recording_op(q, k, v, **kwargs):
        seen.update(q=q, k=k, v=v)
        return op(q, k, v, **kwargs)

    layer.op = recording_op
    x = torch.randn(2, 9, 64)
    y = layer(x)
    q, k, v = layer.conv(layer.qkv(x)).split(layer.split, dim=-1)
    torch.testing.assert_close(seen["q"], q.reshape(2, 9, 2, 16))    # no norm, no scaling
    torch.testing.assert_close(seen["k"], k.reshape(2, 9, 2, 16))
    assert seen["v"].shape == (2, 9, 2, 32) and y.shape == x.shape


def test_linear_attn_feature_dim_projects_q_and_k():
    assert get("linear-attn").layer(64, 2).key_dim == 32
    layer = get("linear-attn").layer(64, 2, feature_dim=8, feature_map="taylor")
    assert (layer.key_dim, layer.head_dim) == (8, 32)
    assert layer(torch.randn(1, 5, 64)).shape == (1, 5, 64)


def test_based_state_bytes_count_273_features():
    """The recall harness asks with the head dim (64 here); q, k are 16 wide, phi 273."""
    assert state_bytes("based", {}, d_model=64, n_heads=1, n_layers=2, seq_len=64) == \
        2 * (273 * 64 + 273) * 4
    assert state_bytes("based", {"feature_dim": 8}, 128, 2, 1, 64) == \
        2 * (73 * 64 + 73) * 4


def test_based_op_and_decoder_refuse_q_k_of_another_width():
    q, k, v = qkv(D=8)
    with pytest.raises(ValueError, match="feature_dim=16"):
        get("based").op()(q, k, v)
    decoder = get("based").decoder()
    state = decoder.init_state(2, 3, 8, 5, 10, "cpu", torch.float64)
    assert state["S"].shape == (2, 3, 273, 5)
    with pytest.raises(ValueError, match="feature_dim=16"):
        decoder.step(q[:, 0], k[:, 0], v[:, 0], state)


@pytest.mark.parametrize("feature_map", ["identity", "elu1", "taylor"])
def test_parallel_gradients_equal_the_chunk_forms(feature_map):
    """Gradients of outputs and final state, start state included, in float64."""
    q, k, v = qkv(T=19)
    options = {"feature_map": feature_map, "normalize": feature_map != "identity"}
    _, start = linear_attn(q[:, :5], k[:, :5], v[:, :5], output_final_state=True, **options)
    weights = torch.randn(q.shape[0], 19, q.shape[2], v.shape[-1], dtype=torch.float64,
                          generator=torch.Generator().manual_seed(7))
    grads = {}
    for impl in ("chunk", "parallel"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *start.values())]
        state = dict(zip(start, leaves[3:]))
        o, final = linear_attn(*leaves[:3], impl=impl, chunk_size=4, initial_state=state,
                               output_final_state=True, **options)
        ((o * weights).sum() + sum(x.square().sum() for x in final.values())).backward()
        grads[impl] = [x.grad for x in leaves]
    for g_chunk, g_parallel in zip(grads["chunk"], grads["parallel"]):
        torch.testing.assert_close(g_parallel, g_chunk, rtol=1e-10, atol=1e-10)
