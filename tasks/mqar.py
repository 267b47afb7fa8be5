"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al. 2023, arXiv 2312.04927).

A sequence starts with `num_kv_pairs` key-value pairs (keys from the lower half of the
vocabulary, values from the upper half, keys unique within a sequence). Every key is then
queried once, in random order, at positions `2 * num_kv_pairs + 2 * gap`, the gaps drawn
without replacement with probability proportional to `a * i ** (a - 1)` (i = 1..space,
a = `power_a`): small a puts most queries close to the context. The label at a query is its
key's value; every other label is -100. Filler tokens are random (`random_non_queries`) or 0.
"""

from __future__ import annotations

import numpy as np

from tasks import IGNORE, Task, register


def check_mqar_params(vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float) -> None:
    if not isinstance(seq_len, int) or seq_len < 4 or seq_len % 2:
        raise ValueError(f"seq_len must be an even int >= 4, got {seq_len!r}")
    if not isinstance(vocab_size, int) or vocab_size <= seq_len:
        raise ValueError(f"vocab_size must be an int > seq_len ({seq_len}), got {vocab_size!r}")
    if not isinstance(num_kv_pairs, int) or num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be a positive int, got {num_kv_pairs!r}")
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"num_kv_pairs ({num_kv_pairs}) must be at most seq_len / 4 "
                         f"({seq_len // 4}): the queries need as much room as the context")
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a!r}")


def distinct_draws(rng: np.random.Generator, low: int, high: int, rows: int, k: int,
                   block: int = 4096) -> np.ndarray:
    """`rows` x `k` integers from [low, high), distinct within each row, uniformly."""
    span = high - low
    if k * k <= span:  # few collisions: redraw the rows that have one
        out = rng.integers(low, high, size=(rows, k))
        while True:
            ordered = np.sort(out, axis=1)
            clash = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
            if not clash.any():
                return out
            out[clash] = rng.integers(low, high, size=(int(clash.sum()), k))
    parts = [np.argsort(rng.random((min(block, rows - start), span)), axis=1)[:, :k]
             for start in range(0, rows, block)]
    return np.concatenate(parts) + low


def query_gaps(rng: np.random.Generator, rows: int, space: int, k: int, power_a: float) -> np.ndarray:
    """`k` distinct gaps in [0, space) per row, drawn without replacement with probability
    proportional to a * i**(a-1) (Gumbel top-k: the same law as sequential weighted draws)."""
    i = np.arange(1, space + 1, dtype=np.float64)
    log_p = np.log(power_a) + (power_a - 1) * np.log(i)
    scores = log_p + rng.gumbel(size=(rows, space))
    return np.argsort(-scores, axis=1)[:, :k]


def generate_mqar(rng: np.random.Generator, num_examples: int, split: str, seed: int, *,
                  vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float,
                  random_non_queries: bool) -> tuple[np.ndarray, np.ndarray]:
    check_mqar_params(vocab_size, seq_len, num_kv_pairs, power_a)
    n, k = num_examples, num_kv_pairs
    half = vocab_size // 2
    keys = distinct_draws(rng, 1, half, n, k)
    values = distinct_draws(rng, half, vocab_size, n, k)
    inputs = np.zeros((n, seq_len), dtype=np.int64)
    labels = np.full((n, seq_len), IGNORE, dtype=np.int64)
    inputs[:, 0:2 * k:2] = keys
    inputs[:, 1:2 * k:2] = values
    positions = 2 * k + 2 * query_gaps(rng, n, (seq_len - 2 * k) // 2, k, power_a)
    rows = np.arange(n)[:, None]
    inputs[rows, positions] = keys
    labels[rows, positions] = values
    if random_non_queries:
        filler = inputs == 0
        inputs[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
    return inputs, labels


def mqar_roles(inputs, labels, *, num_kv_pairs: int, **_) -> list[str]:
    roles = []
    for t, label in enumerate(labels.tolist()):
        if t < 2 * num_kv_pairs:
            roles.append("key" if t % 2 == 0 else "value")
        else:
            roles.append("query" if label != IGNORE else "filler")
    return roles


def mqar_context_values(inputs, *, num_kv_pairs: int, **_) -> np.ndarray:
    """The values of each example's key-value pairs, `[N, num_kv_pairs]`."""
    return np.asarray(inputs)[:, 1:2 * num_kv_pairs:2]


MQAR = register(Task(
    name="mqar",
    description="Multi-query associative recall (Zoology): recall each queried key's value",
    generate=generate_mqar,
    roles=mqar_roles,
    params=dict(vocab_size=8192, seq_len=64, num_kv_pairs=4, power_a=0.01,
                random_non_queries=True),
    num_train=100_000,
    num_test=3_000,
    source="Arora et al. 2023, Zoology, arXiv 2312.04927",
    context_values=mqar_context_values,
))
