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
    from hla_bench import registry
    from tests.conftest import PROJECT_MIXERS

    for name in PROJECT_MIXERS:
        entry = registry.get(name)
        if entry.build_layer is None:
            continue
        assert entry.state_size is not None, name
        if entry.build_decoder is None or entry.unavailable_reason():
            continue
        heads, head_dim, value_dim = entry.state_dims(128, 2)
        decoder = entry.decoder()
        state = decoder.init_state(1, heads, head_dim, value_dim, 96, "cpu", torch.float32)
        assert entry.state_bytes(128, 2, 96) == decoder.state_bytes(state), name
