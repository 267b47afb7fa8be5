"""State bytes per layer of every built-in mixer: each registry entry's count against a hand
count, the state knobs, and the decoders' own states."""

import pytest
import torch


# Hand counts of each built-in mixer's state per layer, in float32 elements, at (d_model 64,
# 1 head, 64 tokens) and (d_model 128, 2 heads of 64, 256 tokens); d = dv = 64 per head.
HAND_COUNTS = {
    "sdpa": (2 * 64 * 64, 2 * 256 * 128),                    # K and V of every token
    "flash-attn": (2 * 64 * 64, 2 * 256 * 128),
    "linear-attn": (64 * 64, 2 * 64 * 64),                   # S, d x dv a head
    "based": (273 * 64 + 273, 2 * (273 * 64 + 273)),         # 1 + 16 + 16^2 features, S and z
    "hla2": (64 * 64 + 64 * 64, 2 * (64 * 64 + 64 * 64)),    # S d x d, A d x dv
    "hla2-unmasked": (64 * 64 + 64 * 64, 2 * (64 * 64 + 64 * 64)),  # S, C
    "ahla2": (2 * 64 * 64, 2 * 2 * 64 * 64),                 # P, E
    "hla3": (3 * 64 * 64, 2 * 3 * 64 * 64),                  # S^K, P, F
    "mamba2-ssd": (64 * 128, 64 * 256),                      # d_state 64 x d_inner 2 d_model
    "fla-linear-attn": (64 * 64, 2 * 64 * 64),
    "fla-simple-gla": (64 * 64, 2 * 64 * 64),
    "fla-gla": (64 * 64, 2 * 64 * 64),
    "fla-delta-rule": (64 * 64, 2 * 64 * 64),
    "fla-gated-delta-rule": (64 * 64, 2 * 64 * 64),
    "fla-gla-learned": (32 * 64, 2 * 32 * 64),               # fla's keys d_model / 2 wide
    "fla-deltanet-learned": (64 * 64, 2 * 64 * 64),
    "fla-gated-deltanet": (64 * 128, 2 * 64 * 128),          # values 2x the head dim
}
SHAPES = ((64, 1, 64), (128, 2, 256))


@pytest.mark.parametrize("mixer", sorted(HAND_COUNTS))
def test_state_bytes_of_each_mixer_equal_a_hand_count_for_two_shapes(mixer):
    from hla_bench import registry

    entry = registry.get(mixer)
    for (d_model, heads, length), elements in zip(SHAPES, HAND_COUNTS[mixer]):
        assert entry.state_bytes(d_model, heads, length) == 4 * elements, (d_model, heads)
        assert entry.state_bytes(d_model, heads, length, element_bytes=2) == 2 * elements


@pytest.mark.parametrize("mixer,options,elements", [
    ("based", {"feature_dim": 8}, 73 * 64 + 73),              # 1 + 8 + 64 features
    ("based", {"feature_dim": 24}, 601 * 64 + 601),           # 1 + 24 + 576
    ("mamba2-ssd", {"d_state": 8}, 8 * 128),
    ("mamba2-ssd", {"d_state": 16, "layer_head_dim": 32}, 16 * 128),
    ("hla2", {"normalize": True}, 64 * 64 + 64 * 64 + 64),    # A's [d] twin
    ("hla2", {"decay": 0.9, "decay_form": "paper"}, 3 * 64 * 64),  # S, C, G
    ("hla3", {"variant": "paper"}, 4 * 64 * 64),              # S^K, S^Q, P, F
    ("linear-attn", {"normalize": True}, 64 * 64 + 64),
])
def test_state_knobs_change_the_state_as_counted_by_hand(mixer, options, elements):
    from hla_bench import registry

    assert registry.get(mixer).state_bytes(64, 1, 64, **options) == 4 * elements


def test_every_built_in_layer_counts_its_state_and_the_count_is_its_decoders_state():
    from mixers.builtin import builtin_mixers

    for entry in builtin_mixers():
        name = entry.name
        if entry.build_layer is None:
            continue
        assert entry.state_size is not None, name
        if entry.build_decoder is None or entry.unavailable_reason():
            continue
        heads, head_dim, value_dim = entry.state_dims(128, 2)
        decoder = entry.decoder()
        state = decoder.init_state(1, heads, head_dim, value_dim, 96, "cpu", torch.float32)
        assert entry.state_bytes(128, 2, 96) == decoder.state_bytes(state), name


def brute_window_attention(q, k, v, window):
    """Each query t attends to keys t - window + 1 .. t: the explicit masked softmax."""
    B, T, H, D = q.shape
    scores = torch.einsum("bthd,bshd->bhts", q, k) / D ** 0.5
    t = torch.arange(T)
    allowed = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", weights, v)


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_sliding_window_attention_equals_a_masked_brute_force_softmax(window):
    from mixers.attention import sdpa_attention

    torch.manual_seed(window)
    q, k, v = (torch.randn(2, 19, 3, 8, dtype=torch.float64) for _ in range(3))
    o, cache = sdpa_attention(q, k, v, window=window, backend="math", output_final_state=True)
    torch.testing.assert_close(o, brute_window_attention(q, k, v, window))
    assert cache.length == min(window, 19)
    if window < 19:  # the window is not full attention
        full, _ = sdpa_attention(q, k, v, backend="math")
        assert not torch.allclose(o, full)
    # a prefill then the rest from its cache: the same outputs
    first, kept = sdpa_attention(q[:, :11], k[:, :11], v[:, :11], window=window,
                                 backend="math", output_final_state=True)
    rest, _ = sdpa_attention(q[:, 11:], k[:, 11:], v[:, 11:], window=window, backend="math",
                             initial_state=kept)
    torch.testing.assert_close(torch.cat([first, rest], 1), o)


def test_sliding_window_decoder_keeps_the_last_window_tokens_and_matches_the_op():
    from mixers.attention import KVCacheDecoder, sdpa_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 4, dtype=torch.float64) for _ in range(3))
    decoder = KVCacheDecoder(backend="math", window=5)
    _, state = sdpa_attention(q[:, :3], k[:, :3], v[:, :3], window=5, output_final_state=True)
    outputs = []
    for t in range(3, 12):
        o, state = decoder.step(q[:, t], k[:, t], v[:, t], state)
        outputs.append(o)
        assert state.length == min(5, t + 1)
    expected = brute_window_attention(q, k, v, 5)[:, 3:]
    torch.testing.assert_close(torch.stack(outputs, 1), expected)


def test_sdpa_window_option_builds_a_layer_and_counts_2_w_d_of_state():
    from hla_bench import registry

    entry = registry.get("sdpa")
    assert entry.state_bytes(64, 1, 1024, window=16) == 4 * 2 * 16 * 64
    assert entry.state_bytes(128, 2, 1024, window=128) == 4 * 2 * 128 * 128
    assert entry.state_bytes(128, 2, 64, window=128) == 4 * 2 * 64 * 128  # not yet full
    layer = entry.layer(32, 2, window=4)
    x = torch.randn(2, 10, 32)
    y = layer(x)
    # a token's output depends on its last 4 tokens alone
    changed = x.clone()
    changed[:, 2] += 1
    assert torch.allclose(layer(changed)[:, 6:], y[:, 6:])
    assert not torch.allclose(layer(changed)[:, 2:6], y[:, 2:6])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="window must be 0"):
            entry.layer(32, 2, window=bad)
