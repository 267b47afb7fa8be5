"""The MAD synthetic tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures", arXiv 2403.17844), generated as athms/mad-lab's `mad/data/instances.py` does,
with MAD-lab's baseline settings (`configs/tasks/*.yml`) as defaults.

The per-example random draws follow MAD-lab's generators in kind and order, so from the same
`numpy.random.Generator` in-context recall (plain and noisy), compression and memorization
produce MAD-lab's examples token for token; fuzzy recall and selective copying produce MAD-lab's
distribution (MAD-lab draws their motifs by shuffling every permutation of the vocabulary, and
selective copying's blank positions from numpy's global generator). `docs/mad-protocol.md`
lists MAD-lab's protocol and every remaining difference. Choices this module makes:

- The recall tasks train on every next token (MAD-lab's training targets are the shifted
  inputs) and are scored on the recalled values only (MAD-lab's test targets); multi-query
  recall sequences have MAD-lab's length, `seq_len - 1` tokens. Their validation examples
  are drawn as test examples (`Task.val_labels == "test"`), so validation scores the
  recalled values as test does.
- In-context recall redraws an example whose every pair came out as noise: MAD-lab's
  generator cannot finish such an example (it has no key to probe).
- Fuzzy recall draws the probed pair's position from MAD-lab's range, so a few examples end
  on a probe the generator never placed earlier (see `docs/mad-protocol.md`).
- Compression is an auto-encoder: the model reads the whole sequence causally, and every
  token, noise included, is reconstructed from the last position's state (`readout="last"`,
  see `hla_bench.recall.model.LastStateDecoder`), as MAD-lab's generator returns the inputs
  as targets.
- Memorization keeps its key-value map fixed by `kv_map_seed` across splits (the map is what
  is memorised; MAD-lab's map for the same seed); its test set is fresh sequences over it.
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


def _recall_example(rng, num_pairs, key_end, value_end, noise_vocab_size, frac_noise,
                    multi_query, copy_prefix):
    """One (stream, target) of in-context recall in MAD-lab's order of draws, or None when
    every pair came out as noise (MAD-lab's generator fails there)."""
    # MAD-lab draws the protected pair from all num_pairs slots; the last slot is the final
    # probe's, so with probability 1 / num_pairs no body pair is protected from noise.
    kept_pair = rng.integers(num_pairs)
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
    if not values:
        return None
    probe = list(values)[rng.integers(len(values))]
    if not multi_query:
        stream.append(copy_prefix)
        target.append(IGNORE)
    stream += [probe, values[probe]]
    target += [IGNORE, values[probe]]
    return stream, target


def generate_in_context_recall(rng, num_examples, split, seed, *, vocab_size, seq_len,
                               multi_query, noise_vocab_size, frac_noise):
    _check(isinstance(seq_len, int) and seq_len >= 4 and seq_len % 2 == 0,
           f"seq_len must be an even int >= 4, got {seq_len!r}")
    _check_noise(noise_vocab_size, frac_noise)
    key_end, value_end = _recall_vocab(vocab_size, multi_query, noise_vocab_size)
    _check(key_end >= 1 and value_end > key_end,
           f"vocab_size ({vocab_size}) leaves no key or value tokens after "
           f"noise_vocab_size ({noise_vocab_size}) and special tokens")
    examples = []
    while len(examples) < num_examples:
        example = _recall_example(rng, seq_len // 2, key_end, value_end, noise_vocab_size,
                                  frac_noise, multi_query, vocab_size - 1)
        if example is not None:
            examples.append(example)
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
        probe_size = len(probe_key) + len(probe_value)
        bound = seq_len - probe_size - k_motif_size - v_motif_size
        # MAD-lab's range for the probed pair's position; where it lies near `bound` the body
        # can end before the pair is placed, and the final probe then asks for an unseen key.
        probe_at = rng.integers(seq_len - 2 * probe_size)
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
    # the compression token last; MAD-lab's draws: the data tokens, then noise position by position
    inputs = np.full((num_examples, seq_len), vocab_size - 1, dtype=np.int64)
    for row in range(num_examples):
        data = rng.integers(0, plain, size=seq_len - 1)
        if frac_noise > 0:
            for i in range(seq_len - 1):
                if rng.random() < frac_noise:
                    data[i] = plain + rng.integers(noise_vocab_size)
        inputs[row, :-1] = data
    # MAD-lab's targets are the inputs themselves: noise tokens and the compression token
    # are reconstructed too.
    return inputs, inputs.copy()


def compression_roles(inputs, labels, *, vocab_size, noise_vocab_size, **_):
    plain = vocab_size - 1 - noise_vocab_size
    return ["value" if token < plain else "noise" if token < vocab_size - 1 else "special"
            for token in inputs.tolist()]


# memorization ----------------------------------------------------------------------------------

def _memorization_pairs(vocab_size: int, noise_vocab_size: int,
                        kv_map_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys in MAD-lab's map order, value of each key indexed by key): the keys are the lower
    half of the plain vocabulary and the values the upper half, each shuffled by a generator of
    its own seeded with `kv_map_seed`, then paired in order (MAD-lab's `generate_kv_map`)."""
    plain = vocab_size - 1 - noise_vocab_size
    map_rng = np.random.default_rng(kv_map_seed)
    keys = map_rng.permutation(plain // 2)
    values = plain // 2 + map_rng.permutation(plain - plain // 2)
    value_of = np.empty(plain // 2, dtype=np.int64)
    value_of[keys] = values[:len(keys)]
    return keys, value_of


def memorization_map(vocab_size: int, noise_vocab_size: int, kv_map_seed: int) -> np.ndarray:
    """The fixed key -> value map (an array indexed by key), shared by every split."""
    return _memorization_pairs(vocab_size, noise_vocab_size, kv_map_seed)[1]


def generate_memorization(rng, num_examples, split, seed, *, vocab_size, seq_len,
                          noise_vocab_size, frac_noise, kv_map_seed):
    _check_noise(noise_vocab_size, frac_noise)
    _check(isinstance(seq_len, int) and seq_len >= 2 and seq_len % 2 == 0,
           f"seq_len must be an even int >= 2, got {seq_len!r}")
    plain = vocab_size - 1 - noise_vocab_size
    _check(plain >= 2, f"vocab_size ({vocab_size}) leaves no key-value tokens after "
                       f"noise_vocab_size ({noise_vocab_size}) and the insert token")
    keys, value_of = _memorization_pairs(vocab_size, noise_vocab_size, kv_map_seed)
    num_pairs = seq_len // 2
    inputs = np.empty((num_examples, seq_len), dtype=np.int64)
    labels = np.full((num_examples, seq_len), IGNORE, dtype=np.int64)
    for row in range(num_examples):  # MAD-lab's draws: the protected pair, then pair by pair
        kept_pair = rng.integers(num_pairs)
        for i in range(num_pairs):
            if frac_noise > 0 and i != kept_pair and rng.random() < frac_noise:
                inputs[row, 2 * i:2 * i + 2] = rng.integers(plain, plain + noise_vocab_size, size=2)
                continue
            key = keys[rng.integers(len(keys))]
            inputs[row, 2 * i], inputs[row, 2 * i + 1] = key, vocab_size - 1  # key, insert token
            labels[row, 2 * i + 1] = value_of[key]
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
    source=MAD_SOURCE, val_labels="test",
))
register(Task(
    name="noisy_in_context_recall",
    description="MAD noisy in-context recall: recall with noise tokens between the pairs",
    generate=generate_in_context_recall, roles=in_context_recall_roles,
    params=dict(vocab_size=32, seq_len=128, multi_query=True, noise_vocab_size=16, frac_noise=0.2),
    source=MAD_SOURCE, val_labels="test",
))
register(Task(
    name="fuzzy_in_context_recall",
    description="MAD fuzzy in-context recall: keys and values are motifs of 1-3 tokens",
    generate=generate_fuzzy_in_context_recall, roles=fuzzy_in_context_recall_roles,
    params=dict(vocab_size=16, seq_len=128, k_motif_size=3, v_motif_size=3, multi_query=True,
                noise_vocab_size=0, frac_noise=0.0),
    source=MAD_SOURCE, val_labels="test",
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


# MAD-lab's benchmark protocol -------------------------------------------------------------------

MAD_TASKS = ("in_context_recall", "noisy_in_context_recall", "fuzzy_in_context_recall",
             "memorization", "compression", "selective_copying")  # MAD-lab's registry order
MAD_LEARNING_RATES = (1e-4, 5e-4, 1e-3)  # mad/configs.py make_benchmark_mad_configs
MAD_WEIGHT_DECAYS = (0.0, 0.1)
_TRAIN_SIZES = (6400, 3200, 1600, 800)
# configs/tasks/*.yml `changes`: each value replaces the baseline's, one variable at a time
# (`num_train` is MAD-lab's `num_train_examples`; noisy recall's vocabularies include its 16
# noise tokens).
MAD_DIFFICULTY = {
    "in_context_recall": {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024),
                          "num_train": _TRAIN_SIZES},
    "noisy_in_context_recall": {"vocab_size": (48, 80, 144), "seq_len": (256, 512, 1024),
                                "num_train": _TRAIN_SIZES, "frac_noise": (0.4, 0.6, 0.8)},
    "fuzzy_in_context_recall": {"vocab_size": (32, 64, 128), "seq_len": (256, 512, 1024),
                                "num_train": _TRAIN_SIZES},
    "memorization": {"vocab_size": (512, 1024, 2048, 4096, 8192)},
    "compression": {"vocab_size": (32, 64, 128), "seq_len": (64, 128, 256),
                    "num_train": _TRAIN_SIZES},
    "selective_copying": {"vocab_size": (32, 64, 128), "seq_len": (512, 1024),
                          "num_train": _TRAIN_SIZES, "num_tokens_to_copy": (32, 64, 96)},
}


def mad_settings(task: str | None = None) -> list[dict]:
    """MAD-lab's benchmark settings, `{"task", "params", "num_train"}` each: per task the
    baseline (the registered defaults), then every difficulty change in MAD-lab's order.
    `params` holds only what differs from the task's defaults. A task's MAD score is the mean,
    over its settings, of the best test accuracy over MAD_LEARNING_RATES x MAD_WEIGHT_DECAYS."""
    from tasks import get

    names = MAD_TASKS if task is None else (get(task).name,)
    settings = []
    for name in names:
        baseline_train = get(name).num_train
        settings.append({"task": name, "params": {}, "num_train": baseline_train})
        for variable, values in MAD_DIFFICULTY[name].items():
            for value in values:
                if variable == "num_train":
                    settings.append({"task": name, "params": {}, "num_train": value})
                else:
                    settings.append({"task": name, "params": {variable: value},
                                     "num_train": baseline_train})
    return settings


MAD_METRIC_BATCH = 128  # MAD-lab's evaluation batch (MADConfig batch_size): the metric's unit


def macro_accuracy(predictions, targets, num_classes: int):
    """MAD-lab's accuracy (torchmetrics' MulticlassAccuracy, default macro average) of each
    of N batches at once: `predictions` and `targets` `[N, R]` class ids, positions labelled
    IGNORE dropped; returns `[N]` (float64). Per batch, each class's recall (correct /
    labelled) is averaged over the classes that occur as a label or as a prediction, so a
    predicted class that is never a label counts as a zero; a batch with no labelled
    position scores 0."""
    import torch

    predictions, targets = torch.as_tensor(predictions), torch.as_tensor(targets)
    N = targets.shape[0]
    valid = targets != IGNORE
    offsets = torch.arange(N, device=targets.device).view(N, 1) * num_classes
    labelled = (targets.clamp_min(0) + offsets)[valid]
    predicted = (predictions.long() + offsets)[valid]
    size = N * num_classes
    support = torch.bincount(labelled, minlength=size).view(N, num_classes)
    chosen = torch.bincount(predicted, minlength=size).view(N, num_classes)
    correct = torch.bincount(labelled[predicted == labelled], minlength=size).view(N, num_classes)
    occurs = (support + chosen) > 0
    recall = correct.double() / support.clamp(min=1).double()
    classes = occurs.sum(1)
    return torch.where(classes > 0, (recall * occurs).sum(1) / classes.clamp(min=1), 0.0)


def mad_accuracy(predictions, targets, num_classes: int) -> float:
    """MAD-lab's accuracy of one evaluation batch (mad/metrics.py): `macro_accuracy` over all
    its positions. `predictions` are logits `[..., num_classes]` or class ids shaped like
    `targets`. MAD-lab's score of a split is the batch-size-weighted mean of this over its
    batches of MAD_METRIC_BATCH examples (the trainer's metric "mad-macro")."""
    import torch

    predictions, targets = torch.as_tensor(predictions), torch.as_tensor(targets)
    if predictions.dim() == targets.dim() + 1:
        predictions = predictions.argmax(-1)
    return float(macro_accuracy(predictions.reshape(1, -1), targets.reshape(1, -1), num_classes)[0])
