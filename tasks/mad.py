"""The MAD synthetic tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures", arXiv 2403.17844), with the published baseline parameters.

Definitions follow MAD; where a causal LM or a MAD corner case needs a choice, it is noted:

- The recall tasks train on every next token (MAD's training targets are the shifted
  inputs) and are scored on the recalled values only (MAD's test targets).
- Multi-query recall sequences have MAD's length, `seq_len - 1` tokens.
- Fuzzy recall draws the position of the probed key-value pair where the generator always
  reaches it (MAD's range can, rarely, leave the final probe unseen).
- Compression is an auto-encoder: the model reads the whole sequence causally, and every
  token is reconstructed from the last position's state (`readout="last"`, see
  `tasks.model.LastStateDecoder`); noise positions, if any, are not scored.
- Memorization keeps its key-value map fixed by `kv_map_seed` across splits (the map is what
  is memorised); its test set is fresh sequences over the same map.
"""

from __future__ import annotations

import numpy as np

from tasks import IGNORE, Task, register


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_noise(noise_vocab_size: int, frac_noise: float) -> None:
    _check(isinstance(noise_vocab_size, int) and noise_vocab_size >= 0,
           f"noise_vocab_size must be a non-negative int, got {noise_vocab_size!r}")
    _check(0 <= frac_noise < 1, f"frac_noise must lie in [0, 1), got {frac_noise!r}")
    _check(frac_noise == 0 or noise_vocab_size > 0,
           f"noise_vocab_size must be > 0 when frac_noise > 0 (got {noise_vocab_size})")


def _stack(examples: list[tuple[list[int], list[int]]], split: str) -> tuple[np.ndarray, np.ndarray]:
    """Shift token streams for next-token prediction: train labels are every next token,
    test labels the scored targets only."""
    inputs = np.array([stream[:-1] for stream, _ in examples], dtype=np.int64)
    if split == "train":
        labels = np.array([stream[1:] for stream, _ in examples], dtype=np.int64)
    else:
        labels = np.array([target[1:] for _, target in examples], dtype=np.int64)
    return inputs, labels


def _vocab_roles(inputs, labels, key_end: int, value_end: int, noise_end: int) -> list[str]:
    roles = []
    for token, label in zip(inputs.tolist(), labels.tolist()):
        if label != IGNORE:
            roles.append("query")
        elif token < key_end:
            roles.append("key")
        elif token < value_end:
            roles.append("value")
        elif token < noise_end:
            roles.append("noise")
        else:
            roles.append("special")
    return roles


# in-context recall (plain and noisy) -------------------------------------------------------

def _recall_vocab(vocab_size: int, multi_query: bool, noise_vocab_size: int) -> tuple[int, int]:
    """(end of the key range, end of the value range); noise follows, then the copy prefix."""
    plain = vocab_size - (0 if multi_query else 1) - noise_vocab_size
    return plain // 2, plain


def generate_in_context_recall(rng, num_examples, split, seed, *, vocab_size, seq_len,
                               multi_query, noise_vocab_size, frac_noise):
    _check(isinstance(seq_len, int) and seq_len >= 4 and seq_len % 2 == 0,
           f"seq_len must be an even int >= 4, got {seq_len!r}")
    _check_noise(noise_vocab_size, frac_noise)
    key_end, value_end = _recall_vocab(vocab_size, multi_query, noise_vocab_size)
    _check(key_end >= 1 and value_end > key_end,
           f"vocab_size ({vocab_size}) leaves no key or value tokens after "
           f"noise_vocab_size ({noise_vocab_size}) and special tokens")
    num_pairs = seq_len // 2
    examples = []
    for _ in range(num_examples):
        kept_pair = rng.integers(num_pairs - 1)  # at least one real pair before the probe
        values, stream, target = {}, [], []
        for i in range(num_pairs - 1):
            if frac_noise > 0 and i != kept_pair and rng.random() < frac_noise:
                stream += rng.integers(value_end, value_end + noise_vocab_size, size=2).tolist()
                target += [IGNORE, IGNORE]
                continue
            key = int(rng.integers(key_end))
            seen = key in values
            if not seen:
                values[key] = int(rng.integers(key_end, value_end))
            stream += [key, values[key]]
            target += [IGNORE, values[key] if seen and multi_query else IGNORE]
        probe = list(values)[rng.integers(len(values))]
        if not multi_query:
            stream.append(vocab_size - 1)  # copy prefix
            target.append(IGNORE)
        stream += [probe, values[probe]]
        target += [IGNORE, values[probe]]
        examples.append((stream, target))
    return _stack(examples, split)


def in_context_recall_roles(inputs, labels, *, vocab_size, multi_query, noise_vocab_size, **_):
    key_end, value_end = _recall_vocab(vocab_size, multi_query, noise_vocab_size)
    return _vocab_roles(inputs, labels, key_end, value_end, value_end + noise_vocab_size)


# fuzzy in-context recall --------------------------------------------------------------------

def _fuzzy_vocab(vocab_size: int, multi_query: bool, noise_vocab_size: int) -> tuple[int, int]:
    plain = vocab_size - (1 if multi_query else 2) - noise_vocab_size
    return plain // 2, plain


def generate_fuzzy_in_context_recall(rng, num_examples, split, seed, *, vocab_size, seq_len,
                                     k_motif_size, v_motif_size, multi_query,
                                     noise_vocab_size, frac_noise):
    _check_noise(noise_vocab_size, frac_noise)
    for name, size in (("k_motif_size", k_motif_size), ("v_motif_size", v_motif_size)):
        _check(isinstance(size, int) and size >= 1, f"{name} must be a positive int, got {size!r}")
    key_end, value_end = _fuzzy_vocab(vocab_size, multi_query, noise_vocab_size)
    _check(key_end >= k_motif_size and value_end - key_end >= v_motif_size,
           f"vocab_size ({vocab_size}) is too small for motifs of {k_motif_size} key and "
           f"{v_motif_size} value tokens")
    body_end = seq_len - 2 * (k_motif_size + v_motif_size)
    _check(isinstance(seq_len, int) and body_end - (k_motif_size + v_motif_size) >= 1,
           f"seq_len ({seq_len}) is too short for motifs of {k_motif_size} + {v_motif_size} tokens")
    pad = vocab_size - 1 if multi_query else vocab_size - 2
    key_sizes = range(1, k_motif_size + 1) if split == "train" else [k_motif_size]

    def motif(low, high, size):
        return tuple(int(t) for t in low + rng.permutation(high - low)[:size])

    examples = []
    for _ in range(num_examples):
        probe_key = motif(0, key_end, int(rng.choice(key_sizes)))
        probe_value = motif(key_end, value_end, int(rng.integers(1, v_motif_size + 1)))
        bound = seq_len - len(probe_key) - len(probe_value) - k_motif_size - v_motif_size
        probe_at = rng.integers(bound - k_motif_size - v_motif_size)
        probe_added, values, stream, target = False, {}, [], []
        while len(stream) < bound:
            key_size, value_size = int(rng.choice(key_sizes)), int(rng.integers(1, v_motif_size + 1))
            if len(stream) >= probe_at and not probe_added:
                stream += probe_key + probe_value
                target += [IGNORE] * (len(probe_key) + len(probe_value))
                values[probe_key], probe_added = probe_value, True
                continue
            if frac_noise > 0 and rng.random() < frac_noise:
                size = key_size + value_size
                stream += rng.integers(value_end, value_end + noise_vocab_size, size=size).tolist()
                target += [IGNORE] * size
                continue
            key = motif(0, key_end, key_size)
            seen = key in values
            if key == probe_key:
                values[key], probe_added = probe_value, True
            elif not seen:
                values[key] = motif(key_end, value_end, value_size)
            value = values[key]
            stream += key + value
            target += [IGNORE] * len(key) + (list(value) if seen and multi_query else [IGNORE] * len(value))
        if not multi_query:
            stream.append(vocab_size - 1)  # copy prefix
            target.append(IGNORE)
        stream += probe_key + probe_value
        target += [IGNORE] * len(probe_key) + list(probe_value)
        padding = seq_len + 1 - len(stream)
        examples.append(([pad] * padding + stream, [IGNORE] * padding + target))
    return _stack(examples, split)


def fuzzy_in_context_recall_roles(inputs, labels, *, vocab_size, multi_query, noise_vocab_size, **_):
    key_end, value_end = _fuzzy_vocab(vocab_size, multi_query, noise_vocab_size)
    return _vocab_roles(inputs, labels, key_end, value_end, value_end + noise_vocab_size)


# selective copying ----------------------------------------------------------------------------

def generate_selective_copying(rng, num_examples, split, seed, *, vocab_size, seq_len,
                               num_tokens_to_copy):
    n = num_tokens_to_copy
    _check(isinstance(n, int) and n >= 1, f"num_tokens_to_copy must be a positive int, got {n!r}")
    _check(isinstance(seq_len, int) and seq_len > 2 * n + 1,
           f"seq_len must be > 2 * num_tokens_to_copy + 1 = {2 * n + 1}, got {seq_len!r}")
    _check(isinstance(vocab_size, int) and vocab_size >= 3,
           f"vocab_size must be an int >= 3 (blank and copy tokens), got {vocab_size!r}")
    blank, copy = vocab_size - 2, vocab_size - 1
    num_blanks = seq_len - 2 * n - 1
    inputs = np.empty((num_examples, seq_len), dtype=np.int64)
    labels = np.full((num_examples, seq_len), IGNORE, dtype=np.int64)
    for row in range(num_examples):
        to_copy = rng.integers(0, blank, size=n)
        spread = np.insert(to_copy, rng.integers(0, n, size=num_blanks), blank)
        inputs[row] = np.concatenate([spread, [copy], np.full(n, blank)])
        labels[row, seq_len - n:] = to_copy
    return inputs, labels


def selective_copying_roles(inputs, labels, *, vocab_size, **_):
    return [
        "query" if label != IGNORE else "value" if token < vocab_size - 2
        else "filler" if token == vocab_size - 2 else "special"
        for token, label in zip(inputs.tolist(), labels.tolist())]


# compression -----------------------------------------------------------------------------------

def generate_compression(rng, num_examples, split, seed, *, vocab_size, seq_len,
                         noise_vocab_size, frac_noise):
    _check_noise(noise_vocab_size, frac_noise)
    _check(isinstance(seq_len, int) and seq_len >= 2, f"seq_len must be an int >= 2, got {seq_len!r}")
    plain = vocab_size - 1 - noise_vocab_size
    _check(plain >= 1, f"vocab_size ({vocab_size}) leaves no data tokens after "
                       f"noise_vocab_size ({noise_vocab_size}) and the compression token")
    inputs = rng.integers(0, plain, size=(num_examples, seq_len))
    inputs[:, -1] = vocab_size - 1  # compression token
    labels = inputs.copy()
    if frac_noise > 0:
        noisy = rng.random((num_examples, seq_len)) < frac_noise
        noisy[:, -1] = False
        inputs[noisy] = rng.integers(plain, plain + noise_vocab_size, size=int(noisy.sum()))
        labels[noisy] = IGNORE
    return inputs, labels


def compression_roles(inputs, labels, *, vocab_size, noise_vocab_size, **_):
    plain = vocab_size - 1 - noise_vocab_size
    return ["value" if token < plain else "noise" if token < vocab_size - 1 else "special"
            for token in inputs.tolist()]


# memorization ----------------------------------------------------------------------------------

def memorization_map(vocab_size: int, noise_vocab_size: int, kv_map_seed: int) -> np.ndarray:
    """The fixed key -> value map (an array indexed by key), shared by every split."""
    plain = vocab_size - 1 - noise_vocab_size
    map_rng = np.random.default_rng(kv_map_seed)
    keys = map_rng.permutation(plain // 2)
    values = plain // 2 + map_rng.permutation(plain - plain // 2)
    value_of = np.empty(plain // 2, dtype=np.int64)
    value_of[keys] = values[:len(keys)]
    return value_of


def generate_memorization(rng, num_examples, split, seed, *, vocab_size, seq_len,
                          noise_vocab_size, frac_noise, kv_map_seed):
    _check_noise(noise_vocab_size, frac_noise)
    _check(isinstance(seq_len, int) and seq_len >= 2 and seq_len % 2 == 0,
           f"seq_len must be an even int >= 2, got {seq_len!r}")
    plain = vocab_size - 1 - noise_vocab_size
    _check(plain >= 2, f"vocab_size ({vocab_size}) leaves no key-value tokens after "
                       f"noise_vocab_size ({noise_vocab_size}) and the insert token")
    value_of = memorization_map(vocab_size, noise_vocab_size, kv_map_seed)
    num_pairs = seq_len // 2
    keys = rng.integers(0, len(value_of), size=(num_examples, num_pairs))
    inputs = np.empty((num_examples, seq_len), dtype=np.int64)
    labels = np.full((num_examples, seq_len), IGNORE, dtype=np.int64)
    inputs[:, 0::2], inputs[:, 1::2] = keys, vocab_size - 1  # key, insert token
    labels[:, 1::2] = value_of[keys]
    if frac_noise > 0:
        noisy = rng.random((num_examples, num_pairs)) < frac_noise
        noisy[np.arange(num_examples), rng.integers(num_pairs, size=num_examples)] = False
        noise = rng.integers(plain, plain + noise_vocab_size, size=(num_examples, seq_len))
        pair_noisy = np.repeat(noisy, 2, axis=1)
        inputs[pair_noisy] = noise[pair_noisy]
        labels[pair_noisy] = IGNORE
    return inputs, labels


def memorization_roles(inputs, labels, *, vocab_size, noise_vocab_size, **_):
    plain = vocab_size - 1 - noise_vocab_size
    return _vocab_roles(inputs, labels, plain // 2, plain // 2, plain)


MAD_SOURCE = "Poli et al. 2024, MAD, arXiv 2403.17844 (baseline settings of athms/mad-lab)"

register(Task(
    name="in_context_recall",
    description="MAD in-context recall: key-value pairs, recall a value when its key recurs",
    generate=generate_in_context_recall, roles=in_context_recall_roles,
    params=dict(vocab_size=16, seq_len=128, multi_query=True, noise_vocab_size=0, frac_noise=0.0),
    source=MAD_SOURCE,
))
register(Task(
    name="noisy_in_context_recall",
    description="MAD noisy in-context recall: recall with noise tokens between the pairs",
    generate=generate_in_context_recall, roles=in_context_recall_roles,
    params=dict(vocab_size=32, seq_len=128, multi_query=True, noise_vocab_size=16, frac_noise=0.2),
    source=MAD_SOURCE,
))
register(Task(
    name="fuzzy_in_context_recall",
    description="MAD fuzzy in-context recall: keys and values are motifs of 1-3 tokens",
    generate=generate_fuzzy_in_context_recall, roles=fuzzy_in_context_recall_roles,
    params=dict(vocab_size=16, seq_len=128, k_motif_size=3, v_motif_size=3, multi_query=True,
                noise_vocab_size=0, frac_noise=0.0),
    source=MAD_SOURCE,
))
register(Task(
    name="selective_copying",
    description="MAD selective copying: copy the data tokens scattered among blanks",
    generate=generate_selective_copying, roles=selective_copying_roles,
    params=dict(vocab_size=16, seq_len=256, num_tokens_to_copy=16),
    source=MAD_SOURCE,
))
register(Task(
    name="compression",
    description="MAD compression: reconstruct the whole sequence from the last position's state",
    generate=generate_compression, roles=compression_roles,
    params=dict(vocab_size=16, seq_len=32, noise_vocab_size=0, frac_noise=0.0),
    readout="last",
    source=MAD_SOURCE,
))
register(Task(
    name="memorization",
    description="MAD memorization: recall values of a fixed key-value map learned in training",
    generate=generate_memorization, roles=memorization_roles,
    params=dict(vocab_size=256, seq_len=32, noise_vocab_size=0, frac_noise=0.0, kv_map_seed=12345),
    num_train=256,
    source=MAD_SOURCE,
))
