"""Synthetic recall tasks, registered by name.

A `Task` turns (split, number of examples, seed, parameters) into `(inputs, labels)`
LongTensors of shape `[N, T]`; labels are -100 (ignored) except at the target tokens the
task scores. Train and test data come from disjoint seeds (`split_seed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

IGNORE = -100
SPLITS = ("train", "test")


def split_seed(seed: int, split: str) -> int:
    """The generator seed of one split: 2*seed for train, 2*seed+1 for test, never shared."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return 2 * seed + SPLITS.index(split)


@dataclass(frozen=True)
class Task:
    """One synthetic task.

    `generate(rng, num_examples, split, seed, **params)` returns numpy (inputs, labels);
    `roles(inputs, labels, **params)` names each token of one example ("key", "value",
    "query", "filler", "noise", "special") for display. `readout` is "causal" (a label
    at position t is predicted from tokens <= t) or "last" (every label is predicted from
    the last position's state, an encoder-style target such as MAD's compression).
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

    def resolve_params(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Defaults overridden by `params`; unknown names raise ValueError."""
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise ValueError(f"task {self.name!r} has no parameter {', '.join(map(repr, unknown))}"
                             f" (accepted: {', '.join(sorted(self.params))})")
        return {**self.params, **params}

    def make(self, split: str, num_examples: int, seed: int = 0,
             **params: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`num_examples` (inputs, labels) of `split`, reproducible from `seed`."""
        if not isinstance(num_examples, int) or num_examples < 1:
            raise ValueError(f"num_examples must be a positive int, got {num_examples!r}")
        rng = np.random.default_rng(split_seed(seed, split))
        inputs, labels = self.generate(rng, num_examples, split, seed, **self.resolve_params(params))
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
