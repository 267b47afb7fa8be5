"""Generator properties of every synthetic task: label placement, token ranges, seeds, errors."""

import pytest
import torch

import tasks
from tasks import IGNORE
from tasks.mad import memorization_map

SMALL = {  # fast settings per task (defaults where they are already small)
    "mqar": dict(vocab_size=128, seq_len=64, num_kv_pairs=8),
    "in_context_recall": {},
    "noisy_in_context_recall": {},
    "fuzzy_in_context_recall": dict(seq_len=64),
    "selective_copying": dict(seq_len=64, num_tokens_to_copy=8),
    "compression": {},
    "memorization": {},
}


def test_every_task_is_registered_and_covered():
    assert sorted(SMALL) == [task.name for task in tasks.all_tasks()]
    assert tasks.get("in-context-recall").name == "in_context_recall"
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        tasks.get("nope")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_reproducible_shapes_and_split_disjoint(name):
    task = tasks.get(name)
    x1, y1 = task.make("test", 50, 3, **SMALL[name])
    x2, y2 = task.make("test", 50, 3, **SMALL[name])
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == y1.dtype == torch.long and x1.shape == y1.shape
    vocab = task.vocab_size(**SMALL[name])
    assert int(x1.min()) >= 0 and int(x1.max()) < vocab
    scored = y1[y1 != IGNORE]
    assert scored.numel() > 0 and int(scored.min()) >= 0 and int(scored.max()) < vocab
    train_x, _ = task.make("train", 50, 3, **SMALL[name])
    other_seed_x, _ = task.make("test", 50, 4, **SMALL[name])
    assert not torch.equal(train_x, x1) and not torch.equal(other_seed_x, x1)


def test_split_seeds_never_overlap():
    train = {tasks.split_seed(seed, "train") for seed in range(1000)}
    test = {tasks.split_seed(seed, "test") for seed in range(1000)}
    assert not train & test
    with pytest.raises(ValueError, match="split"):
        tasks.split_seed(0, "valid")
    with pytest.raises(ValueError, match="seed"):
        tasks.split_seed(-1, "train")


def test_unknown_param_and_bad_count_are_rejected():
    with pytest.raises(ValueError, match="no parameter 'seq_length'"):
        tasks.get("mqar").make("train", 4, seq_length=64)
    with pytest.raises(ValueError, match="num_examples"):
        tasks.get("mqar").make("train", 0)


# MQAR ------------------------------------------------------------------------------------------

def test_mqar_structure():
    V, T, K = 256, 64, 8
    x, y = tasks.get("mqar").make("train", 200, 0, vocab_size=V, seq_len=T, num_kv_pairs=K)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0:2 * K:2], row_x[1:2 * K:2]
        assert len(set(keys)) == K and all(1 <= k < V // 2 for k in keys)
        assert all(V // 2 <= v < V for v in values)
        assert all(label == IGNORE for label in row_y[:2 * K])
        queried = [t for t, label in enumerate(row_y) if label != IGNORE]
        assert len(queried) == K and all((t - 2 * K) % 2 == 0 for t in queried)
        assert sorted(row_x[t] for t in queried) == sorted(keys)  # each key queried once
        pair = dict(zip(keys, values))
        assert all(row_y[t] == pair[row_x[t]] for t in queried)
    assert len({tuple(row[:2 * K:2]) for row in x.tolist()}) > 150  # query orders vary


def test_mqar_fillers_zero_or_random():
    x, y = tasks.get("mqar").make("test", 20, 0, vocab_size=128, seq_len=64, num_kv_pairs=4,
                                  random_non_queries=False)
    filler = torch.ones_like(x, dtype=torch.bool)
    filler[:, :8] = False
    filler &= y == IGNORE
    assert int(x[filler].abs().sum()) == 0
    x, y = tasks.get("mqar").make("test", 20, 0, vocab_size=128, seq_len=64, num_kv_pairs=4)
    assert len(set(x[:, 8:][y[:, 8:] == IGNORE].tolist())) > 60


def test_mqar_power_law_puts_queries_near_the_context():
    def mean_query_position(power_a):
        _, y = tasks.get("mqar").make("test", 400, 0, vocab_size=512, seq_len=256, num_kv_pairs=4,
                                      power_a=power_a)
        return (y != IGNORE).nonzero()[:, 1].float().mean().item()

    assert mean_query_position(0.01) < 0.6 * mean_query_position(1.0)


def test_mqar_large_key_share_draws_distinct_keys():
    x, _ = tasks.get("mqar").make("train", 30, 1, vocab_size=130, seq_len=128, num_kv_pairs=32)
    assert all(len(set(row[0:64:2])) == 32 for row in x.tolist())


@pytest.mark.parametrize("params, message", [
    (dict(seq_len=63), "seq_len must be an even"),
    (dict(vocab_size=64, seq_len=64), "vocab_size must be an int > seq_len"),
    (dict(num_kv_pairs=17, seq_len=64), "num_kv_pairs .17. must be at most seq_len / 4"),
    (dict(num_kv_pairs=0), "num_kv_pairs must be a positive"),
    (dict(power_a=0.0), "power_a must be > 0"),
])
def test_mqar_errors(params, message):
    with pytest.raises(ValueError, match=message):
        tasks.get("mqar").make("train", 2, **params)


# MAD -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["in_context_recall", "noisy_in_context_recall"])
def test_in_context_recall_labels_recall_earlier_values(name):
    task = tasks.get(name)
    x, y = task.make("test", 100, 0)
    assert x.shape[1] == 127  # MAD's multi-query length, seq_len - 1
    params = task.resolve_params({})
    key_end = (params["vocab_size"] - params["noise_vocab_size"]) // 2
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        assert row_y[-1] != IGNORE  # the final probe is always scored
        for t, label in enumerate(row_y):
            if label == IGNORE:
                continue
            assert row_x[t] < key_end
            earlier = [s for s in range(0, t, 2) if row_x[s] == row_x[t]]
            assert earlier and row_x[earlier[-1] + 1] == label
    train_x, train_y = task.make("train", 10, 0)
    assert torch.equal(train_y[:, :-1], train_x[:, 1:])  # MAD trains on every next token


def test_noisy_recall_has_unscored_noise_tokens():
    x, y = tasks.get("noisy_in_context_recall").make("test", 50, 0)
    noise = (x >= 16) & (x < 32)
    assert 0.1 < noise.float().mean() < 0.3
    assert bool((y[noise] == IGNORE).all())


def test_fuzzy_recall_final_probe_repeats_an_earlier_pair():
    x, y = tasks.get("fuzzy_in_context_recall").make("test", 100, 0)
    assert x.shape == (100, 128)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        tail = len(row_y) - 1
        while row_y[tail - 1] != IGNORE:
            tail -= 1
        value = row_y[tail:]
        key = row_x[tail - 2:tail + 1]  # test keys are always 3 tokens
        assert row_x[tail + 1:] == value[:-1]
        seq = row_x[:tail - 2]
        hits = [s for s in range(len(seq) - 2) if seq[s:s + 3] == key]
        assert any(seq[s + 3:s + 3 + len(value)] == value for s in hits)


def test_selective_copying_targets_the_data_tokens_in_order():
    n, T, V = 8, 64, 16
    x, y = tasks.get("selective_copying").make("train", 50, 0, seq_len=T, num_tokens_to_copy=n)
    assert bool((x[:, T - n - 1] == V - 1).all()) and bool((x[:, T - n:] == V - 2).all())
    assert bool((y[:, :T - n] == IGNORE).all())
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        data = [t for t in row_x[:T - n - 1] if t < V - 2]
        assert data == row_y[T - n:]


def test_compression_reconstructs_the_whole_sequence_from_the_last_state():
    task = tasks.get("compression")
    x, y = task.make("train", 20, 0)
    assert task.readout == "last" and torch.equal(x, y) and bool((x[:, -1] == 15).all())
    x, y = task.make("train", 20, 0, noise_vocab_size=4, frac_noise=0.3)
    noisy = (x >= 11) & (x < 15)
    assert noisy.any() and bool((y[noisy] == IGNORE).all())


def test_memorization_map_is_fixed_across_splits():
    task = tasks.get("memorization")
    value_of = memorization_map(256, 0, 12345)
    assert len(value_of) == len(set(value_of.tolist())) == 127
    assert int(value_of.min()) >= 127 and int(value_of.max()) < 255
    for split, seed in (("train", 0), ("test", 0), ("test", 5)):
        x, y = task.make(split, 30, seed)
        assert bool((x[:, 1::2] == 255).all()) and bool((y[:, 0::2] == IGNORE).all())
        assert torch.equal(y[:, 1::2], torch.as_tensor(value_of)[x[:, 0::2]])


@pytest.mark.parametrize("name, params, message", [
    ("in_context_recall", dict(seq_len=7), "seq_len must be an even"),
    ("noisy_in_context_recall", dict(noise_vocab_size=0), "noise_vocab_size must be > 0"),
    ("noisy_in_context_recall", dict(frac_noise=1.0), "frac_noise must lie in"),
    ("fuzzy_in_context_recall", dict(vocab_size=6), "vocab_size .6. is too small"),
    ("fuzzy_in_context_recall", dict(seq_len=16), "seq_len .16. is too short"),
    ("selective_copying", dict(seq_len=33), "seq_len must be > 2"),
    ("compression", dict(vocab_size=1), "leaves no data tokens"),
    ("memorization", dict(seq_len=31), "seq_len must be an even"),
])
def test_mad_errors(name, params, message):
    with pytest.raises(ValueError, match=message):
        tasks.get(name).make("train", 2, **params)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_roles_cover_every_token(name):
    task = tasks.get(name)
    x, y = task.make("test", 1, 0, **SMALL[name])
    roles = task.roles(x[0], y[0], **task.resolve_params(SMALL[name]))
    assert len(roles) == x.shape[1]
    assert set(roles) <= {"key", "value", "query", "filler", "noise", "special"}
