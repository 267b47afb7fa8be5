"""Synthetic recall tasks, registered by name.

A `Task` turns (split, number of examples, seed, parameters) into `(inputs, labels)`
LongTensors of shape `[N, T]`; labels are -100 (ignored) except at the target tokens the
task scores. Train and test data come from disjoint seeds (`split_seed`). `Task.splits`
also carves a validation split from the training stream (for choosing learning rates
without looking at test) and guarantees it shares no example with train or test. Where a
task trains on other targets than it is tested on (`Task.val_labels == "test"`), validation
carries the test split's targets, so that it measures what test measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import torch

IGNORE = -100
MAX_PARAM = 2**31 - 1  # the largest int a task parameter takes (token ids, lengths, counts)
SPLITS = ("train", "test")
VAL_LABELS = ("train", "test")


def split_seed(seed: int, split: str) -> int:
    """The generator seed of one split: 2*seed for train, 2*seed+1 for test, never shared."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return 2 * seed + SPLITS.index(split)


class Splits(NamedTuple):
    """(inputs, labels) of each split; `val` comes from the training stream."""

    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]


def _row_keys(*parts: torch.Tensor) -> list[tuple[int, int]]:
    """A 128-bit hash per example (its rows of `parts`, e.g. inputs and labels): equal
    examples have equal keys, so filtering by key removes every duplicate (and, with
    negligible odds, a non-duplicate)."""
    both = torch.cat(parts, 1).numpy().astype(np.uint64)
    multipliers = np.random.default_rng(0).integers(1, 2**63, size=(2, both.shape[1]),
                                                    dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        first, second = ((both * m).sum(1, dtype=np.uint64) for m in multipliers)
    return list(zip(first.tolist(), second.tolist()))


@dataclass(frozen=True)
class Task:
    """One synthetic task.

    `generate(rng, num_examples, split, seed, **params)` returns numpy (inputs, labels);
    `roles(inputs, labels, **params)` names each token of one example ("key", "value",
    "query", "filler", "noise", "special") for display. `readout` is "causal" (a label
    at position t is predicted from tokens <= t) or "last" (every label is predicted from
    the last position's state, an encoder-style target such as MAD's compression).
    `context_values(inputs, **params)` (optional) gives `[N, K]` the value tokens present
    in each example's context, for the in-context value rate of a model's answers.
    `val_labels`: "train" when `generate` gives train and test examples the same kind of
    targets (validation is then more of the training stream); "test" when they differ (MAD's
    recall tasks train on every next token and test on the recalled values): validation
    examples are then drawn as test examples, from the training seed's generator after the
    training examples, so they carry test targets.
    """

    name: str
    description: str
    generate: Callable[..., tuple[np.ndarray, np.ndarray]]
    roles: Callable[..., list[str]]
    params: Mapping[str, Any] = field(default_factory=dict)
    num_train: int = 12_800
    num_test: int = 1_280
    readout: str = "causal"
    source: str = ""
    context_values: Callable[..., np.ndarray] | None = None
    val_labels: str = "train"

    def __post_init__(self):
        if self.val_labels not in VAL_LABELS:
            raise ValueError(f"val_labels must be one of {VAL_LABELS}, got {self.val_labels!r}")

    def resolve_params(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults overridden by `params`; unknown names raise ValueError."""
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise ValueError(f"task {self.name!r} has no parameter {', '.join(map(repr, unknown))}"
                             f" (accepted: {', '.join(sorted(self.params))})")
        for name, value in params.items():
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_PARAM:
                raise ValueError(f"task {self.name!r}: {name} must be at most {MAX_PARAM} "
                                 f"(token ids and lengths are int32), got {value}")
        return {**self.params, **params}

    def make(self, split: str, num_examples: int, seed: int = 0,
             **params: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`num_examples` (inputs, labels) of `split`, reproducible from `seed`."""
        if not isinstance(num_examples, int) or num_examples < 1:
            raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
        rng = np.random.default_rng(split_seed(seed, split))
        inputs, labels = self.generate(rng, num_examples, split, seed, **self.resolve_params(params))
        return torch.as_tensor(inputs, dtype=torch.long), torch.as_tensor(labels, dtype=torch.long)

    def splits(self, num_train: int, num_val: int, num_test: int, seed: int = 0,
               **params: Any) -> Splits:
        """Train, validation and test data of one seed. The first `num_train` examples of
        the training stream train; validation is drawn after them from the same stream,
        minus any example that also occurs in train or test, so choosing on it never looks
        at test. `num_val` may be 0 (an empty split).

        val_labels "train": validation is more of the training stream (training targets);
        an example is a duplicate when its inputs and labels both recur. val_labels "test":
        the generator, after drawing the training examples, draws the validation examples as
        test examples (test targets and the test split's distribution); a validation example
        is a duplicate when its inputs recur (its targets are of another kind than train's)."""
        if not isinstance(num_val, int) or num_val < 0:
            raise ValueError(f"num_val must be a non-negative int, got {num_val!r}")
        test = self.make("test", num_test, seed, **params)
        if self.val_labels == "train":
            inputs, labels = self.make("train", num_train + num_val, seed, **params)
            train = inputs[:num_train], labels[:num_train]
            val_x, val_y = inputs[num_train:], labels[num_train:]
            if num_val:
                seen = set(_row_keys(*train)) | set(_row_keys(*test))
                keep = torch.tensor([key not in seen for key in _row_keys(val_x, val_y)])
                val_x, val_y = val_x[keep], val_y[keep]
            return Splits(train, (val_x, val_y), test)
        if not isinstance(num_train, int) or num_train < 1:
            raise ValueError(f"num_examples must be a positive int, got {num_train!r}")
        rng = np.random.default_rng(split_seed(seed, "train"))
        resolved = self.resolve_params(params)
        train = tuple(torch.as_tensor(a, dtype=torch.long)
                      for a in self.generate(rng, num_train, "train", seed, **resolved))
        if not num_val:
            return Splits(train, (train[0][:0], train[1][:0]), test)
        val_x, val_y = (torch.as_tensor(a, dtype=torch.long)
                        for a in self.generate(rng, num_val, "test", seed, **resolved))
        seen = set(_row_keys(train[0])) | set(_row_keys(test[0]))
        keep = torch.tensor([key not in seen for key in _row_keys(val_x)])
        return Splits(train, (val_x[keep], val_y[keep]), test)

    def vocab_size(self, **params: Any) -> int:
        return int(self.resolve_params(params)["vocab_size"])


_TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    if task.name in _TASKS:
        raise ValueError(f"task {task.name!r} is already registered")
    _TASKS[task.name] = task
    return task


def get(name: str) -> Task:
    """The task called `name` (dashes and underscores are interchangeable)."""
    try:
        return _TASKS[name.replace("-", "_")]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; registered: {', '.join(sorted(_TASKS))}") from None


def all_tasks() -> list[Task]:
    return [_TASKS[name] for name in sorted(_TASKS)]


from tasks import mad, mqar  # noqa: E402,F401  (registers the built-in tasks)
