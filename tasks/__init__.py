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

import hashlib
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


class MixSplits(NamedTuple):
    """Slices of (inputs, labels) per split, each of one length; `val[i]` is drawn with
    the parameters of `test[i]`. `train_params` / `test_params`: each slice's resolved task
    parameters."""

    train: list[tuple[torch.Tensor, torch.Tensor]]
    val: list[tuple[torch.Tensor, torch.Tensor]]
    test: list[tuple[torch.Tensor, torch.Tensor]]
    train_params: list[dict]
    test_params: list[dict]


MIX_PARTS = ("train", "val", "test")


def mix_rng(seed: int, part: str, entry: Mapping[str, Any]) -> np.random.Generator:
    """The generator of the slice `entry` of a mix's `part` for run seed `seed`: a stream of
    its own for every (seed, part, slice parameters), none of them a task's `split_seed`
    stream. A slice's examples depend on its parameters, not on the other slices of its mix
    or its place there (a mix names each slice once)."""
    if part not in MIX_PARTS:
        raise ValueError(f"part must be one of {MIX_PARTS}, got {part!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    digest = hashlib.sha256(mix_label(entry).encode()).digest()
    return np.random.default_rng([seed, MIX_PARTS.index(part), 0x6D6978,
                                  int.from_bytes(digest[:8], "little")])


def mix_entry(task: "Task", params: dict, entry: Mapping[str, Any]) -> tuple[dict, int]:
    """One mix entry (task parameters and `count`) as (its resolved parameters over
    `params`, its count); ValueError names what is wrong."""
    if not isinstance(entry, Mapping) or "count" not in entry:
        raise ValueError(f"a mix entry is a mapping of task parameters and `count`, got "
                         f"{entry!r}")
    count = entry["count"]
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PARAM:
        raise ValueError(f"a mix entry's count must be a positive int, got {count!r}")
    overrides = {key: value for key, value in entry.items() if key != "count"}
    return task.resolve_params({**params, **overrides}), count


def mix_label(entry: Mapping[str, Any] | None) -> str:
    """A slice's name: its entry's task parameters as written, `key=value` ("seq_len=64
    num_kv_pairs=4"); "all" for the one slice of a setting without a mix."""
    if entry is None:
        return "all"
    return " ".join(f"{key}={value}" for key, value in entry.items() if key != "count") or "all"


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

    def mix_splits(self, train_mix: list[dict] | None, test_mix: list[dict] | None,
                   num_train: int, num_val: int, num_test: int, seed: int = 0,
                   **params: Any) -> "MixSplits":
        """Train, validation and test data of one seed as slices: one per entry of
        `train_mix` / `test_mix` (each entry: task parameters over `params`, and `count`
        examples), or where a mix is None one slice of `params` with `num_train` /
        `num_test` examples from the task's own streams (`make`).

        Every slice of a mix has its own generator (`mix_rng`: the run seed, the part and
        the slice's parameters), so no two slices share a stream and a train stream is never
        a test one. Validation has one slice per test slice, `num_val` examples with that
        slice's parameters from a stream of its own, drawn as the task's validation is
        (`val_labels`), minus any example that also occurs in a training slice of the same
        length or in its test slice: choosing on it never looks at test."""
        resolved = self.resolve_params(params)
        train_entries = [(resolved, num_train)] if train_mix is None else [
            mix_entry(self, resolved, entry) for entry in train_mix]
        test_entries = [(resolved, num_test)] if test_mix is None else [
            mix_entry(self, resolved, entry) for entry in test_mix]
        if train_mix is None:
            train = [self.make("train", num_train, seed, **params)]
        else:
            train = [self._draw(mix_rng(seed, "train", entry), count, "train", seed, slice_params)
                     for entry, (slice_params, count) in zip(train_mix, train_entries)]
        if test_mix is None:
            test = [self.make("test", num_test, seed, **params)]
        else:
            test = [self._draw(mix_rng(seed, "test", entry), count, "test", seed, slice_params)
                    for entry, (slice_params, count) in zip(test_mix, test_entries)]
        kind = "test" if self.val_labels == "test" else "train"
        val = []
        for i, (slice_params, _) in enumerate(test_entries):
            if not num_val:
                val.append((test[i][0][:0], test[i][1][:0]))
                continue
            entry = None if test_mix is None else test_mix[i]
            val_x, val_y = self._draw(mix_rng(seed, "val", entry), num_val, kind, seed,
                                      slice_params)
            both = kind == "train"  # examples of one kind of target: inputs and labels
            length = val_x.shape[1]
            seen = set()
            for part in [*(t for t in train if t[0].shape[1] == length), test[i]]:
                seen |= set(_row_keys(*part) if both else _row_keys(part[0]))
            keys = _row_keys(val_x, val_y) if both else _row_keys(val_x)
            keep = torch.tensor([key not in seen for key in keys])
            val.append((val_x[keep], val_y[keep]))
        return MixSplits(train, val, test, [p for p, _ in train_entries],
                         [p for p, _ in test_entries])

    def _draw(self, rng: np.random.Generator, count: int, split: str, seed: int,
              params: dict) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = self.generate(rng, count, split, seed, **params)
        return torch.as_tensor(inputs, dtype=torch.long), torch.as_tensor(labels, dtype=torch.long)

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
