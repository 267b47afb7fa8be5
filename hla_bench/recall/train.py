"""Train tiny LMs on a task and score them: many runs of one shape at once.

A run is a plain dict (`RunSpec.as_dict()`), so it crosses process boundaries and lands in
the result YAML unchanged. Runs that differ only in learning rate, weight decay and seed
form a group (`group_key`); `train_group` trains a group as one stacked model
(`hla_bench.recall.stacked`): one launch per op for all of its runs, each run with its own
initialisation (`torch.manual_seed` of its seed before its model is built), its own data
(its seed's splits) and batch order, its own learning rate and weight decay, and its own
early stop. A run that stops keeps its slot in the stack, its parameters frozen (its
learning rate is zero from then on), so the stack's shape, its compiled code and its captured
graph stay as they are; once at most half of the slots still train, the stack is compacted to
those (one new shape). On CUDA the training step is captured as a CUDA graph and replayed.
With `compile`, the stacked forward and backward are compiled by `torch.compile` (inductor
fuses the elementwise work of the tiny models; random ops stay PyTorch's own, so the captured
graph draws fresh dropout masks at every replay). Compiled code stays with the process: a
later group of the same model structure (`structure_key`) and stack size reuses it, compiling
nothing, and workers share torch's and Triton's caches on disk.

Protocol: each run evaluates its validation split every `eval_every` steps (0: once per
epoch) and stops early once validation accuracy exceeds `stop_accuracy`; its test split is
scored once, when it stops. With `group_stop`, a run that stops early also stops the runs
trained with it on the same seed (its other learning rates and weight decays) at that
evaluation: none of them can then be chosen over it on validation unless it would later
have passed `stop_accuracy` too. A run records its curve (training loss, validation loss and
accuracy per evaluation), steps to 0.5 and 0.9 validation accuracy, the final training
loss, and on test the accuracy and the in-context value rate (the share of answers that are
some value of the example's context, where the task defines its context values).

`metric`: "micro" is the share of labelled positions predicted right over the split;
"mad-macro" is MAD-lab's: `tasks.mad.macro_accuracy` per batch of 128 examples, the batches'
values averaged weighted by their number of examples. It scores validation (and so the
early stop) and test alike.

`test_at_best_val`: the test accuracy of each run is also recorded at its evaluation of
lowest validation loss (`test_accuracy_at_best_val_loss`), MAD-lab's choice of checkpoint
with validation in the place of its test split: the run's parameters at that evaluation are
kept and scored on test once, when it stops. Nothing the run does depends on it: test is
never used to stop or to choose.

This module knows no mixer registry: the caller passes `build_model(spec) -> TinyLM`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

import tasks
from tasks import IGNORE, Splits
from tasks.mad import MAD_METRIC_BATCH, macro_accuracy
from hla_bench.recall.model import TinyLM, at_least_float32
from hla_bench.recall.stacked import FlatAdamW, StackedLM
from hla_bench.recall.schema import METRICS, POSITIONS, SCHEDULES, ModelConfig, TrainConfig
from hla_bench.safe_files import replace_atomically

# A run's model and training keys default to the config's (hla_bench.recall.schema).
_MODEL, _TRAIN = ModelConfig(), TrainConfig()
MILESTONES = (0.5, 0.9)
# Tokens of each model in one evaluation forward (never fewer examples than the training
# batch): few forwards per evaluation, each holding no more activations than a training step
# of Zoology's 256/16 cell (256 x 256 tokens), which keeps no autograd state besides.
EVAL_TOKENS = 65_536
# The layout of a checkpoint (`_GroupTrainer._save`); one of another layout is not loaded.
CHECKPOINT_FORMAT = 2
# Spec fields that may differ between the runs of one group.
PER_RUN_FIELDS = ("lr", "weight_decay", "seed", "run_id")


@dataclass
class RunSpec:
    """Everything one training run needs.

    `eval_every` is in steps (0: once per epoch). `schedule`: "warmup-cosine" (linear warmup
    over `warmup_frac` of the steps, then cosine to 0, per step), "epoch-cosine" (Zoology's
    CosineAnnealingLR stepped once per epoch over `epochs`, no warmup) or "constant".
    `shuffle`: a fresh batch order every epoch (False: the same batches in the same order,
    as Zoology's loader). `num_val` validation examples come from the training stream.
    `norm`, `head`, `swiglu_hidden` and `decoder` shape the model
    (`hla_bench.recall.model.TinyLM`), `positions` its position embedding (POSITIONS; the
    harness's build_model reads it); `metric` and `test_at_best_val` are described in this
    module's docstring. `train_mix` / `test_mix`: the training and test mixes (module
    docstring, "Mixes"). The model and training fields default to the config's keys
    (`hla_bench.recall.schema`): a spec made without a config trains as a config that
    leaves them out.
    """

    task: str
    mixer: str
    d_model: int
    lr: float
    params: dict = field(default_factory=dict)
    # mixes of slices, each entry task parameters over `params` and its `count`; None: one
    # slice of `params` (num_train / num_test examples)
    train_mix: list | None = None
    test_mix: list | None = None
    mixer_options: dict = field(default_factory=dict)
    n_layers: int = _MODEL.n_layers
    n_heads: int = _MODEL.n_heads
    state_mixer: str = _MODEL.state_mixer
    embed_dropout: float = _MODEL.embed_dropout
    init: str = _MODEL.init
    norm: str = _MODEL.norm
    head: str = _MODEL.head
    swiglu_hidden: int | None = _MODEL.swiglu_hidden
    decoder: str = _MODEL.decoder
    positions: str = _MODEL.positions
    epochs: int = _TRAIN.epochs
    num_train: int | None = _TRAIN.num_train
    num_val: int = _TRAIN.num_val
    num_test: int | None = _TRAIN.num_test
    batch_size: int = _TRAIN.batch_size
    eval_every: int = _TRAIN.eval_every
    schedule: str = _TRAIN.schedule
    warmup_frac: float = _TRAIN.warmup_frac
    weight_decay: float = _TRAIN.weight_decay
    stop_accuracy: float = _TRAIN.stop_accuracy
    group_stop: bool = _TRAIN.group_stop
    shuffle: bool = _TRAIN.shuffle
    metric: str = _TRAIN.metric
    test_at_best_val: bool = _TRAIN.test_at_best_val
    seed: int = 0
    device: str = "cpu"
    setting: str = ""
    # the mixer entry as the config names it, where it has options of its own
    # ("sdpa:window=64"); "" for a plain mixer name
    variant: str = ""
    run_id: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


SPEC_FIELDS = tuple(f.name for f in fields(RunSpec))
# Spec fields that shape no computation of the training step's forward and backward (what
# runs and when, not how): runs that differ only in these share compiled code.
PROTOCOL_FIELDS = ("epochs", "num_train", "num_val", "num_test", "eval_every", "schedule",
                   "warmup_frac", "stop_accuracy", "group_stop", "shuffle", "metric",
                   "test_at_best_val", "setting", "init", "variant")


def group_key(spec: dict) -> str:
    """What runs of one group share: every spec field but learning rate, weight decay, seed
    and id (a field a stored run lacks, from a file older than the field, reads as None)."""
    return repr(sorted((key, repr(spec.get(key))) for key in SPEC_FIELDS
                       if key not in PER_RUN_FIELDS))


def seq_lens(spec: dict, part: str | None = None) -> list[int]:
    """The sequence length of each slice of a run's training mix (`part` "train"), test mix
    ("test") or both (None); a part without a mix is one slice of the setting's params."""
    task = tasks.get(spec["task"])
    params = task.resolve_params(spec["params"])
    lengths = []
    for name in ("train", "test") if part is None else (part,):
        mix = spec.get(f"{name}_mix")
        entries = [{}] if mix is None else [
            {k: v for k, v in entry.items() if k != "count"} for entry in mix]
        lengths += [int({**params, **entry}["seq_len"]) for entry in entries]
    return lengths


def checkpoint_key(specs: list[dict]) -> str:
    """What a group's checkpoint belongs to: its runs' specs, every field but the device
    (a group may resume on another GPU), in order; a sha256 hex digest."""
    text = "\n".join(repr(sorted((key, repr(spec.get(key))) for key in SPEC_FIELDS
                                  if key != "device")) for spec in specs)
    return hashlib.sha256(text.encode()).hexdigest()


def structure_key(spec: dict) -> str:
    """What the compiled training step of `spec`'s stack depends on: every spec field but the
    per-run ones and the protocol's (PROTOCOL_FIELDS; init sets values, not structure)."""
    return repr(sorted((key, repr(spec.get(key))) for key in SPEC_FIELDS
                       if key not in PER_RUN_FIELDS + PROTOCOL_FIELDS))


# This process's model templates by structure_key: a stacked model built on the template of
# an earlier group of its structure passes the guards of the code compiled for that group.
_TEMPLATES: dict[str, TinyLM] = {}
# Structures remembered at most; beyond them the process forgets its compiled code.
MAX_TEMPLATES = 32


def _compile_settings(n_layers: int) -> None:
    """torch.compile's settings for stacked steps (once per process, idempotent)."""
    import torch._dynamo as dynamo
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True  # graph-safe dropout
    # Each structure and stack size a process trains compiles once and stays cached; a
    # mixer op kept out of the trace makes each block's frames around it compile on their
    # own (StackedLM._blocks). Room for every structure remembered, three sizes each.
    limit = 4 * max(2, n_layers) * MAX_TEMPLATES
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, limit)
    if hasattr(dynamo.config, "accumulated_recompile_limit"):
        dynamo.config.accumulated_recompile_limit = max(
            dynamo.config.accumulated_recompile_limit, 8 * limit)


def template_for(spec: dict, model: TinyLM) -> TinyLM:
    """The template of `spec`'s structure this process compiled for, else `model` (which
    becomes it)."""
    key = structure_key(spec)
    if key not in _TEMPLATES and len(_TEMPLATES) >= MAX_TEMPLATES:
        import torch._dynamo as dynamo

        dynamo.reset()
        _TEMPLATES.clear()
    return _TEMPLATES.setdefault(key, model)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo's own account)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - an older torch
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


# What a group's runs record of its wall time (which varies from run to run).
TIMING_FIELDS = ("seconds", "train_seconds", "eval_seconds", "setup_seconds", "warmup_seconds",
                 "compile_seconds")

_DATA_CACHE: dict[tuple, Splits] = {}


def task_splits(task: str, seed: int, num_train: int, num_val: int, num_test: int,
                params: dict) -> Splits:
    """Train, validation and test data of one seed, cached per process."""
    key = (task, seed, num_train, num_val, num_test, tuple(sorted(params.items())))
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = tasks.get(task).splits(num_train, num_val, num_test, seed, **params)
    return _DATA_CACHE[key]


def mix_splits(spec: "RunSpec", seed: int, num_train: int, num_test: int) -> tasks.MixSplits:
    """The slices of one seed of a run with a mix (`tasks.Task.mix_splits`), cached per
    process."""
    key = ("mix", spec.task, seed, repr(spec.train_mix), repr(spec.test_mix), num_train,
           spec.num_val, num_test, tuple(sorted(spec.params.items())))
    if key not in _DATA_CACHE:
        _DATA_CACHE[key] = tasks.get(spec.task).mix_splits(
            spec.train_mix, spec.test_mix, num_train, spec.num_val, num_test, seed, **spec.params)
    return _DATA_CACHE[key]


def mix_counts(mix: list | None, default: int) -> list[int]:
    """The examples of each slice of `mix` (`default` for the one slice of no mix)."""
    return [default] if mix is None else [int(entry["count"]) for entry in mix]


def steps_per_epoch(spec: dict, default_train: int, batch_size: int | None = None) -> int:
    """Training steps of an epoch: every slice of the training mix cut into batches (a short
    last batch padded), or the `num_train` (else `default_train`) examples of no mix."""
    batch = batch_size or spec["batch_size"]
    counts = mix_counts(spec.get("train_mix"), spec.get("num_train") or default_train)
    return sum(math.ceil(count / batch) for count in counts)


def interleave(batches: list[int]) -> list[int]:
    """The slice of each step of an epoch whose slice i has `batches[i]` batches: each
    slice's batches spread evenly over the epoch (its k-th batch at (k + 1/2) / batches[i]
    of the way, ties to the lower slice), the same for every epoch and every run."""
    at = [((k + 0.5) / count, index) for index, count in enumerate(batches)
          for k in range(count)]
    return [index for _, index in sorted(at)]


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warmup to 1, then cosine decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def lr_factors(schedule: str, epochs: int, steps_per_epoch: int, warmup_frac: float) -> list[float]:
    """The learning-rate factor of every step of a full run."""
    total = epochs * steps_per_epoch
    if schedule == "warmup-cosine":
        warmup = max(1, int(warmup_frac * total))
        return [warmup_cosine(step, total, warmup) for step in range(total)]
    if schedule == "epoch-cosine":
        return [0.5 * (1 + math.cos(math.pi * (step // steps_per_epoch) / epochs))
                for step in range(total)]
    if schedule == "constant":
        return [1.0] * total
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def first_step_reaching(curve: list[dict], threshold: float) -> int | None:
    """The first evaluated step whose validation accuracy is at least `threshold`."""
    return next((point["step"] for point in curve if point["accuracy"] >= threshold), None)


class Interrupted(Exception):
    """Training stopped at a deadline; the group's checkpoint holds its state."""


@dataclass
class _TrainSlice:
    """One training slice of a group on its device, seeds stacked (one row per seed); every
    example of a slice has one length, and a batch is drawn from one slice."""

    x: torch.Tensor                  # [S, n, T]
    y: torch.Tensor
    count: int                       # n
    offset: int                      # where its batch order starts in the group's order row
    max_rows_per_example: int        # labelled positions of its fullest example


@dataclass
class _Group:
    """The data of a group on its device. `train`: its training slices; `val` and `test`:
    per slice, one (inputs, labels) per seed (validation slice i is drawn as test slice i);
    `labels`: the test slices' names, `test_params` their task parameters."""

    seeds: list[int]
    train: list[_TrainSlice]
    val: list[list[tuple[torch.Tensor, torch.Tensor]]]
    test: list[list[tuple[torch.Tensor, torch.Tensor]]]
    labels: list[str]
    test_params: list[dict]
    counts: list[int]                # test examples of each test slice


def _load_group_data(spec: RunSpec, seeds: list[int], params: dict, num_train: int,
                     num_test: int, device: torch.device) -> _Group:
    if spec.train_mix is None and spec.test_mix is None:  # the task's own splits
        splits = [task_splits(spec.task, seed, num_train, spec.num_val, num_test, params)
                  for seed in seeds]
        train = [[s.train] for s in splits]
        val, test = [[s.val] for s in splits], [[s.test] for s in splits]
        test_params = [params]
    else:
        mixes = [mix_splits(spec, seed, num_train, num_test) for seed in seeds]
        train, val, test = ([list(getattr(m, part)) for m in mixes]
                            for part in ("train", "val", "test"))
        test_params = mixes[0].test_params
    to = lambda pair: tuple(t.to(device) for t in pair)  # noqa: E731
    slices, offset = [], 0
    for index in range(len(train[0])):
        parts = [seed_slices[index] for seed_slices in train]
        count = len(parts[0][0])
        rows = max(int((y != IGNORE).sum(1).max()) for _, y in parts)
        slices.append(_TrainSlice(torch.stack([x for x, _ in parts]).to(device),
                                  torch.stack([y for _, y in parts]).to(device), count, offset,
                                  rows))
        offset += count
    per_slice = lambda data: [[to(seed_slices[i]) for seed_slices in data]  # noqa: E731
                              for i in range(len(data[0]))]
    labels = ([tasks.mix_label(None)] if spec.test_mix is None else
              [tasks.mix_label(entry) for entry in spec.test_mix])
    return _Group(seeds, slices, per_slice(val), per_slice(test), labels, test_params,
                  [len(part[0][0]) for part in per_slice(test)])


class _Step:
    """One training step of the active stacked models over a batch. Every input it reads
    (batch position, global step, batch order, learning-rate table) lives in device tensors
    that the trainer updates in place, so on CUDA the step is captured as a graph and
    replayed with no host data: its first `WARM_STEPS` calls run eagerly on a side stream
    (cuBLAS, autotuners and the allocator warm up on real steps, which count), the next is
    captured and replayed.

    Every batch has the full `batch_size` rows, so one step (one compilation, one captured
    graph) serves the whole epoch: the rows past the end of the training set in the epoch's
    last batch repeat its last example with every label ignored, which adds nothing to any
    loss or gradient (the losses average over labelled positions)."""

    WARM_STEPS = 2

    def __init__(self, trainer: "_GroupTrainer", graph: bool, index: int = 0):
        self.trainer, self.use_graph, self.index = trainer, graph, index
        self.slice = trainer.data.train[index]
        self.batch = trainer.batch_size
        self.span = torch.arange(self.batch, device=trainer.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        # the first slice's graph goes to the trainer's pool; another slice's graph, replayed
        # in between, gets a pool of its own
        self.pool = (trainer.pool if index == 0 or not graph else
                     torch.cuda.graph_pool_handle())
        self.eager_steps = 0
        self.calls = 0  # calls before the graph replays (the warm-up ones are timed)

    def run(self) -> None:
        t, part = self.trainer, self.slice
        local = t.slice_batch[self.index] * t.batch_size + self.span           # [b]
        last = part.count - 1
        position = part.offset + local.clamp(max=last)
        rows = t.order.index_select(1, position)                                # [S, b]
        rows = rows.index_select(0, t.model_seed)                               # [N, b]
        seed_rows = t.model_seed[:, None]
        tokens, labels = part.x[seed_rows, rows], part.y[seed_rows, rows]
        labels = torch.where((local <= last)[None, :, None], labels, IGNORE)
        t.model.zero_grad()
        with t.autocast():
            losses = t.losses(tokens, labels, self.batch * part.max_rows_per_example)
        losses.sum().backward()
        t.optimizer.step(t.lr_table.index_select(0, t.global_step.view(1))[0]
                         .index_select(0, t.columns))
        with torch.no_grad():
            t.loss_sum.add_(losses.detach())
            t.batch_index.add_(1)
            t.slice_batch[self.index].add_(1)
            t.global_step.add_(1)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        if self.calls > self.WARM_STEPS:  # past the warm-up: plain eager steps
            self.run()
            return
        # a warm-up call: eager steps that compile and autotune, then the capture
        started = time.perf_counter()
        self._warm_call()
        if self.trainer.cuda:
            torch.cuda.synchronize()
        self.calls += 1
        warmup = self.trainer.warmup
        warmup["steps"] += 1
        warmup["seconds"] += time.perf_counter() - started

    def _warm_call(self) -> None:
        if not self.use_graph:
            self.run()
        elif self.eager_steps < self.WARM_STEPS:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.run()
            torch.cuda.current_stream().wait_stream(stream)
            self.eager_steps += 1
        else:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self.run()
            except RuntimeError as error:  # an op that syncs with the host cannot be captured
                self.trainer.graph_failure = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                self.use_graph = False
                torch.cuda.synchronize()
                self.run()
                return
            self.graph = graph
            self.trainer.graphed = True
            graph.replay()  # the capture recorded the step without running it


def in_context_hits(predictions: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
                    values: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per model, the answers that equal one of their example's context values.

    predictions, valid, rows `[N, R]` (rows: flat positions b * seq_len + t of the answers),
    values `[N, B, K]` (each example's context values); returns `[N]` counts."""
    example = rows.div(seq_len, rounding_mode="floor")                     # [N, R]
    candidates = values.gather(1, example[..., None].expand(-1, -1, values.shape[-1]))
    return ((candidates == predictions[..., None]).any(-1) & valid).sum(1)


def _macro_by_batch(predictions: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                    seq_len: int, examples: int, num_classes: int) -> torch.Tensor:
    """`[N]` sums over the MAD_METRIC_BATCH-example batches of one forward of `examples`
    examples of each batch's macro accuracy times its number of examples.

    predictions, targets, rows `[N, R]` (rows: flat positions b * seq_len + t); a batch is
    scored on its own positions only (the others read as unlabelled)."""
    N, R = targets.shape
    batches = -(-examples // MAD_METRIC_BATCH)
    batch_of = rows.div(seq_len * MAD_METRIC_BATCH, rounding_mode="floor")       # [N, R]
    mine = batch_of[:, None, :] == torch.arange(batches, device=rows.device)[None, :, None]
    own = torch.where(mine, targets[:, None, :], IGNORE).reshape(N * batches, R)
    scores = macro_accuracy(predictions[:, None, :].expand(-1, batches, -1).reshape(N * batches, R),
                            own, num_classes).view(N, batches)
    sizes = (examples - torch.arange(batches, device=rows.device) * MAD_METRIC_BATCH
             ).clamp(max=MAD_METRIC_BATCH)
    return (scores * sizes.double()).sum(1)


class _GroupTrainer:
    """The state of one group's training: stacked models, optimizer, counters, curves."""

    def __init__(self, specs: list[RunSpec], build_model: Callable[[dict], TinyLM],
                 graphs: bool, progress: Callable[[dict], None] | None, compile: bool = False,
                 code_version: str = ""):
        self.building = time.perf_counter()
        first = specs[0]
        self.code_version = code_version
        self.checkpoint_key = checkpoint_key([spec.as_dict() for spec in specs])
        task = tasks.get(first.task)
        self.specs, self.task, self.progress = specs, task, progress or (lambda event: None)
        self.params = task.resolve_params(first.params)
        self.device = torch.device(first.device)
        self.cuda = self.device.type == "cuda"
        num_train = first.num_train or task.num_train
        num_test = first.num_test or task.num_test
        if first.metric == "mad-macro" and (first.train_mix or first.test_mix):
            raise ValueError("metric mad-macro scores batches of one split: a mix takes "
                             "metric micro")
        self.seeds = sorted({spec.seed for spec in specs})
        self.data = _load_group_data(first, self.seeds, self.params, num_train, num_test,
                                     self.device)
        self.batch_size = first.batch_size
        batches = [math.ceil(part.count / self.batch_size) for part in self.data.train]
        self.schedule = interleave(batches)  # the training slice of each step of an epoch
        self.steps_per_epoch = len(self.schedule)
        self.total = first.epochs * self.steps_per_epoch
        self.eval_every = first.eval_every or self.steps_per_epoch
        num_train = sum(part.count for part in self.data.train)
        self.sizes = {"num_train": num_train,
                      "num_val": sum(len(part[0][0]) for part in self.data.val),
                      "num_test": sum(self.data.counts)}

        models = []
        for spec in specs:
            torch.manual_seed(spec.seed)
            models.append(build_model(spec.as_dict()))
        self.n_params = sum(p.numel() for p in models[0].parameters())
        template = None
        if compile:
            _compile_settings(first.n_layers)
            template = template_for(first.as_dict(), models[0])  # moved with the stack
        self.model = StackedLM(models, template=template).to(self.device)
        self.optimizer = FlatAdamW(self.model, weight_decay=[spec.weight_decay for spec in specs])
        factors = torch.tensor(lr_factors(first.schedule, first.epochs, self.steps_per_epoch,
                                          first.warmup_frac), dtype=torch.float64)
        base = torch.tensor([spec.lr for spec in specs], dtype=torch.float64)
        dtype = self.model.flat.dtype  # float32 parameters, or float64 in exactness tests
        self.lr_table = (factors[:, None] * base[None, :]).to(self.device, dtype)

        self.slots = list(range(len(specs)))        # indices into specs, in stack order
        self.retired: set[int] = set()  # runs that stopped, their slots frozen in the stack
        self.columns = torch.arange(len(specs), device=self.device)
        self.model_seed = self._seed_rows(self.slots)
        self.batch_index = torch.zeros((), dtype=torch.long, device=self.device)
        # the batches of each training slice taken so far in this epoch
        self.slice_batch = torch.zeros(len(self.data.train), dtype=torch.long,
                                       device=self.device)
        self.global_step = torch.zeros((), dtype=torch.long, device=self.device)
        self.loss_sum = torch.zeros(len(specs), device=self.device, dtype=dtype)
        # [S, num_train]: row s, the batch order of seed s's epoch, slice after slice (each
        # slice's part holds indices into that slice); rewritten in place
        self.order = torch.cat([torch.arange(part.count) for part in self.data.train]).to(
            self.device).repeat(len(self.seeds), 1)
        self.order_generators = [torch.Generator().manual_seed(seed) for seed in self.seeds]
        self.step, self.last_eval = 0, 0
        self.curves: list[list[dict]] = [[] for _ in specs]
        self.best: dict[int, dict] = {}     # run index -> its evaluation of lowest val loss
        # with test_at_best_val: row i, run i's parameters at that evaluation
        self.best_params = (torch.zeros_like(self.model.flat) if first.test_at_best_val
                            else None)
        self.results: dict[int, dict] = {}
        if first.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {first.metric!r}")
        self.vocab_size = task.vocab_size(**self.params)
        self.use_graphs = graphs and self.cuda
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.programs: dict[int, _Step] = {}  # per training slice
        self.graphed, self.graph_failure = False, None
        self.compile = compile
        self._compiled: tuple[StackedLM, Callable] | None = None
        self._labelled: dict[int, int] = {}
        self.started = time.perf_counter()
        self.train_seconds = self.eval_seconds = self.setup_seconds = 0.0
        # until the step replays as a graph: its eager calls (compilation, autotuning,
        # allocator warm-up) and their wall time; compile seconds from dynamo's account
        self.warmup = {"steps": 0, "seconds": 0.0, "compile_seconds": 0.0}

    # --- helpers ---------------------------------------------------------------------

    def autocast(self):
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def losses(self, tokens: torch.Tensor, labels: torch.Tensor, max_rows: int) -> torch.Tensor:
        """The stacked models' losses, through the compiled forward with `compile`."""
        if not self.compile:
            return self.model.losses(tokens, labels, max_rows)
        if self._compiled is None or self._compiled[0] is not self.model:
            self._compiled = (self.model, torch.compile(self.model.losses, dynamic=None))
        return self._compiled[1](tokens, labels, max_rows)

    @property
    def active(self) -> list[int]:
        """The runs still training, in stack order."""
        return [index for index in self.slots if index not in self.retired]

    def _seed_rows(self, runs: list[int]) -> torch.Tensor:
        """The data row (index into the group's seeds) of each run in `runs`."""
        return torch.tensor([self.seeds.index(self.specs[i].seed) for i in runs],
                            device=self.device)

    def _program(self, index: int = 0) -> _Step:
        if index not in self.programs:
            self.programs[index] = _Step(self, self.use_graphs and self.graph_failure is None,
                                         index)
        return self.programs[index]

    def _new_epoch_order(self) -> None:
        if self.specs[0].shuffle:  # each slice's examples in a fresh order of each seed
            orders = [torch.cat([torch.randperm(part.count, generator=g)
                                 for part in self.data.train]) for g in self.order_generators]
            self.order.copy_(torch.stack(orders))  # in place: a captured step reads this tensor
        self.batch_index.zero_()
        self.slice_batch.zero_()

    def _restore_slice_batches(self) -> None:
        """Each slice's batches taken in the current epoch, as the schedule gives them up to
        the current step (a checkpoint keeps the step and the epoch's position)."""
        done = self.schedule[:self.step % self.steps_per_epoch]
        self.slice_batch.copy_(torch.tensor([done.count(i) for i in range(len(self.data.train))]))

    def _keep(self, keep: list[int]) -> None:
        """Only the stack slots `keep` stay (the stack is compacted); the captured graphs
        belong to the old stack and are dropped."""
        index = torch.as_tensor(keep, device=self.device)
        self.slots = [self.slots[slot] for slot in keep]
        self.retired &= set(self.slots)
        self.model = self.model.select(keep)
        self.optimizer = self.optimizer.select(self.model, keep)
        self.columns = self.columns.index_select(0, index)
        self.model_seed = self.model_seed.index_select(0, index)
        self.loss_sum = self.loss_sum.index_select(0, index)
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forget the captured step. Its memory pool may still hold live blocks after the
        graph is gone, and CUDA's allocator refuses a new capture into such a pool: the
        next capture gets a pool of its own."""
        self.programs = {}
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()

    # --- training --------------------------------------------------------------------

    def run(self, deadline: float | None, checkpoint: Path | None) -> list[dict]:
        self.progress({"event": "start", "total": self.total, "runs": len(self.specs)})
        if checkpoint is not None and checkpoint.exists():
            self._load(checkpoint)
            self._restore_slice_batches()
        self.model.train()
        self.setup_seconds = time.perf_counter() - self.building  # data, models, state
        while self.active and self.step < self.total:
            self.train_to(min(self.total, self.last_eval + self.eval_every), deadline)
            if self.step - self.last_eval >= self.eval_every or self.step >= self.total:
                started = time.perf_counter()
                self._evaluate()
                self.eval_seconds += time.perf_counter() - started
            if (deadline is not None and time.time() > deadline and self.active
                    and self.step < self.total):
                if checkpoint is not None:
                    self._save(checkpoint)
                raise Interrupted(f"deadline reached at step {self.step} of {self.total}")
        started = time.perf_counter()
        for index in list(self.active):
            self._finish(index, early=False)
        self.eval_seconds += time.perf_counter() - started
        if checkpoint is not None and checkpoint.exists():
            checkpoint.unlink()
        return [self.results[i] for i in range(len(self.specs))]

    def train_to(self, target: int, deadline: float | None = None) -> None:
        """Train every active run up to global step `target` (a new batch order at each
        epoch start), or until the `time.time()` value `deadline` has passed: a group
        stopped between two evaluations checkpoints there, so a cut costs at most a step."""
        started = time.perf_counter()
        while self.step < target:
            if deadline is not None and time.time() > deadline:
                break
            if self.step % self.steps_per_epoch == 0:
                self._new_epoch_order()
            self._program(self.schedule[self.step % self.steps_per_epoch])()
            self.step += 1
        if self.cuda:
            torch.cuda.synchronize()
        self.train_seconds += time.perf_counter() - started

    def _eval_rows(self, seq_len: int) -> int:
        """Examples of each model in one evaluation forward: at least the training batch, and
        up to EVAL_TOKENS tokens a model; with "mad-macro", a multiple of its batch of
        MAD_METRIC_BATCH examples, so no metric batch straddles two forwards."""
        rows = max(self.batch_size, EVAL_TOKENS // max(1, seq_len))
        if self.specs[0].metric == "mad-macro":
            rows = max(MAD_METRIC_BATCH, rows // MAD_METRIC_BATCH * MAD_METRIC_BATCH)
        return rows

    def _labelled_per_example(self, split: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """The most labelled positions of any example of `split` (any seed), read once."""
        key = id(split)
        if key not in self._labelled:
            self._labelled[key] = max(int((labels != IGNORE).sum(-1).max()) for _, labels in split)
        return self._labelled[key]

    @torch.no_grad()
    def _scores(self, slices: list[list[tuple[torch.Tensor, torch.Tensor]]],
                context: bool = False) -> tuple[list[float], list[float], list[float | None],
                                                list[list[float | None]]]:
        """Accuracy (the runs' `metric`), mean cross-entropy over the labelled positions and,
        with `context`, the in-context value rate (None where the task defines no context
        values) of the model in every stack slot (retired ones too) on its seed's part of
        every slice of a split (`slices`: the group's `val` or `test`), all slices together:
        each labelled position of each slice counts once. Also each slice's accuracy on its
        own (`[slice][slot]`; None for an empty slice).

        A slice goes through the models in forwards of `_eval_rows` examples; the sums
        stay on the device and are read once at the end (the in-context values, computed on
        the host, read each forward's tokens). "mad-macro" (one slice) scores each batch of
        MAD_METRIC_BATCH examples of a forward on its own, as MAD-lab's evaluation batches."""
        self.model.eval()
        sums = [self._slice_sums(split, params, context)
                for split, params in zip(slices, self.data.test_params)]
        self.model.train()
        correct, total, hits, loss_sum, macro_sum = (
            sum(part[key] for part in sums).cpu()
            for key in ("correct", "total", "hits", "loss_sum", "macro_sum"))
        size = sum(part["size"] for part in sums)
        macro = self.specs[0].metric == "mad-macro"
        accuracy = (macro_sum / max(1, size) if macro else
                    correct.double() / total.clamp_min(1)).tolist()
        loss = (loss_sum / total.clamp_min(1).double()).tolist()
        per_slice = [None if not part["size"] else
                     (part["macro_sum"].cpu() / part["size"] if macro else
                      part["correct"].cpu().double() / part["total"].cpu().clamp_min(1)).tolist()
                     for part in sums]
        if not context or self.task.context_values is None:
            return accuracy, loss, [None] * len(self.slots), per_slice
        return accuracy, loss, (hits.double() / total.clamp_min(1)).tolist(), per_slice

    def _slice_sums(self, split: list[tuple[torch.Tensor, torch.Tensor]], params: dict,
                    context: bool) -> dict:
        """The device sums of `_scores` over one slice (its task parameters `params`)."""
        n, device = len(self.slots), self.device
        macro = self.specs[0].metric == "mad-macro"
        size, seq_len = split[0][0].shape
        correct = torch.zeros(n, dtype=torch.long, device=device)
        total, hits = torch.zeros_like(correct), torch.zeros_like(correct)
        loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
        macro_sum = torch.zeros(n, dtype=torch.float64, device=device)
        sums = {"correct": correct, "total": total, "hits": hits, "loss_sum": loss_sum,
                "macro_sum": macro_sum, "size": size}
        if not size:
            return sums
        chunk = self._eval_rows(seq_len)
        per_example = self._labelled_per_example(split)
        seeds = [self.seeds.index(self.specs[i].seed) for i in self.slots]
        values_fn = self.task.context_values if context else None
        for start in range(0, size, chunk):
            tokens = torch.stack([split[s][0][start:start + chunk] for s in seeds])
            labels = torch.stack([split[s][1][start:start + chunk] for s in seeds])
            N, B, T = tokens.shape
            with self.autocast():
                logits, targets, _, rows = self.model.labelled_logits(tokens, labels,
                                                                      B * per_example)
            predictions, valid = logits.argmax(-1), targets != IGNORE
            correct += ((predictions == targets) & valid).sum(1)
            total += valid.sum(1)
            ce = F.cross_entropy(at_least_float32(logits).flatten(0, 1), targets.flatten(),
                                 ignore_index=IGNORE, reduction="none")
            loss_sum += ce.view(N, -1).double().sum(1)
            if macro:
                macro_sum += _macro_by_batch(predictions, targets, rows, T, B, self.vocab_size)
            if values_fn is not None:
                values = values_fn(tokens.reshape(N * B, T).cpu().numpy(), **params)
                values = torch.as_tensor(np.asarray(values), device=device).view(N, B, -1)
                hits += in_context_hits(predictions, valid, rows, values, T)
        return sums

    def _evaluate(self) -> None:
        accuracy, val_loss, _, slice_accuracy = self._scores(self.data.val)
        mean_loss = (self.loss_sum / max(1, self.step - self.last_eval)).tolist()
        self.loss_sum.zero_()
        self.last_eval = self.step
        stopped = []
        live = [(slot, index) for slot, index in enumerate(self.slots)
                if index not in self.retired]
        for slot, index in live:
            self.curves[index].append({"step": self.step,
                                       "epoch": round(self.step / self.steps_per_epoch, 3),
                                       "loss": round(mean_loss[slot], 5),
                                       "val_loss": round(val_loss[slot], 5),
                                       "accuracy": round(accuracy[slot], 5),
                                       **self._slice_point(slice_accuracy, slot)})
            if accuracy[slot] > self.specs[index].stop_accuracy:
                stopped.append(index)
        if self.specs[0].test_at_best_val:
            self._record_best(val_loss)
        self.progress({"event": "eval", "step": self.step, "total": self.total,
                       "accuracy": max(accuracy[slot] for slot, _ in live),
                       "active": len(live)})
        for index in stopped:
            self._finish(index, early=True)
        if stopped and self.specs[0].group_stop:
            won = {self.specs[index].seed for index in stopped}
            for index in [i for i in self.active if self.specs[i].seed in won]:
                self._finish(index, early=False, by_group=True)
        self._compact()

    def _test_lengths(self) -> list[int]:
        """The sequence length of each test slice."""
        return [int(part[0][0].shape[-1]) for part in self.data.test]

    def _slice_records(self, accuracy: list[list[float | None]], curve: list[dict]) -> list[dict]:
        """Per test slice of a finished run: its name, sequence length, examples, test
        accuracy, and validation accuracy at the last evaluation (validation slice i is
        drawn as test slice i)."""
        last = curve[-1] if curve else {}
        val = last.get("slices") or [last.get("accuracy")] * len(accuracy)
        return [{"slice": label, "seq_len": length, "count": count,
                 "accuracy": None if part is None else round(part[0], 5),
                 "val_accuracy": val[i] if i < len(val) else None}
                for i, (label, length, count, part) in enumerate(zip(
                    self.data.labels, self._test_lengths(), self.data.counts, accuracy))]

    def _slice_point(self, slice_accuracy: list[list[float | None]], slot: int) -> dict:
        """A curve point's validation accuracy per slice, where the split has several."""
        if len(slice_accuracy) < 2:
            return {}
        return {"slices": [None if part is None else round(part[slot], 5)
                           for part in slice_accuracy]}

    def _compact(self) -> None:
        """Once at most half of the stack's slots still train (and some do), the stack
        keeps only those: until then a retired run's slot costs its share of each step, after
        it a new stack shape costs a compilation and a capture."""
        live = [slot for slot, index in enumerate(self.slots) if index not in self.retired]
        if live and 2 * len(live) <= len(self.slots):
            self._keep(live)

    def _record_best(self, val_loss: list[float]) -> None:
        """For each active run whose validation loss is below every earlier one (strictly:
        the first of equal evaluations is kept), its parameters now (`best_params`, one row
        per run), scored on test once, when the run stops (`_finish`)."""
        improved = [slot for slot, index in enumerate(self.slots) if index not in self.retired
                    and val_loss[slot] < self.best.get(index, {}).get("val_loss", math.inf)]
        if not improved:
            return
        runs = [self.slots[slot] for slot in improved]
        self.best_params.index_copy_(
            0, torch.tensor(runs, device=self.device),
            self.model.flat.index_select(0, torch.tensor(improved, device=self.device)))
        for slot, index in zip(improved, runs):
            self.best[index] = {"val_loss": val_loss[slot], "step": self.step}

    def _score_alone(self, slot: int, split: list[tuple[torch.Tensor, torch.Tensor]],
                     context: bool = False, params: torch.Tensor | None = None):
        """`_scores` of the run at stack slot `slot` alone, with the `[1, P]` parameters
        `params` in place of its own where given."""
        stack, slots = self.model, self.slots
        self.model, self.slots = stack.select([slot]), [slots[slot]]
        if params is not None:
            self.model.flat.copy_(params)
        try:
            return self._scores(split, context)
        finally:
            self.model, self.slots = stack, slots

    def _finish(self, index: int, early: bool, by_group: bool = False) -> None:
        """Score run `index` on test, once, and retire it: its slot stays in the stack with
        its learning rate zero from this step on, so its parameters no longer change
        (`by_group`: stopped by another run's early stop, `group_stop`). A run stops right
        after an evaluation: where that evaluation had its lowest validation loss, its test
        accuracy there is the one just scored."""
        slot = self.slots.index(index)
        (test_accuracy,), _, (rate,), test_slices = self._score_alone(slot, self.data.test,
                                                                      context=True)
        best = self.best.get(index)
        at_best = (None if best is None else test_accuracy if best["step"] == self.step else
                   self._score_alone(slot, self.data.test,
                                     params=self.best_params[index:index + 1])[0][0])
        spec, curve = self.specs[index], self.curves[index]
        self.results[index] = {
            **spec.as_dict(),
            "resolved": {"params": self.params, **self.sizes},
            "status": "ok",
            "val_accuracy": curve[-1]["accuracy"] if curve else None,
            "val_loss": curve[-1]["val_loss"] if curve else None,
            "test_accuracy": round(test_accuracy, 5),
            "in_context_rate": None if rate is None else round(rate, 5),
            "steps": self.step, "early_stopped": early, "stopped_by_group": by_group,
            **{f"steps_to_{m}": first_step_reaching(curve, m) for m in MILESTONES},
            "final_train_loss": curve[-1]["loss"] if curve else None,
            "best_val_loss": None if best is None else round(best["val_loss"], 5),
            "best_val_loss_step": None if best is None else best["step"],
            "test_accuracy_at_best_val_loss": None if at_best is None else round(at_best, 5),
            "n_params": self.n_params, "seq_len": max(self._test_lengths()),
            "test_slices": self._slice_records(test_slices, curve),
            "curve": curve,
        }
        self.retired.add(index)
        self.lr_table[:, index] = 0  # in place: a captured step reads this table
        if not self.active:
            self.slots, self.retired = [], set()
        self.progress({"event": "finished", "run_id": spec.run_id, "step": self.step})

    # --- checkpoints -----------------------------------------------------------------

    def _save(self, path: Path) -> None:
        """Everything a later call needs to continue exactly here, as tensors, dicts,
        lists, ints, floats, strings and None only (it loads with weights_only=True),
        with the code version and the group's key (`_load` uses nothing else); written
        atomically, never through a symbolic link."""
        state = {
            "format": CHECKPOINT_FORMAT, "code_version": self.code_version,
            "group": self.checkpoint_key,
            "run_ids": [spec.run_id for spec in self.specs], "slots": list(self.slots),
            "retired": sorted(self.retired),
            "flat": self.model.flat.cpu(),
            "optimizer": {k: v.cpu() for k, v in self.optimizer.state().items()},
            "columns": self.columns.cpu(), "step": self.step, "last_eval": self.last_eval,
            "curves": self.curves, "best": self.best, "results": self.results,
            "best_params": None if self.best_params is None else self.best_params.cpu(),
            "loss_sum": self.loss_sum.cpu(),
            "order_generators": [g.get_state() for g in self.order_generators],
            "order": self.order.cpu(), "batch_index": int(self.batch_index),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.cuda else None,
            "train_seconds": self.train_seconds, "eval_seconds": self.eval_seconds,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, lambda handle: torch.save(state, handle), what="checkpoint")

    def _checkpoint_problem(self, state: object) -> str | None:
        """Why a loaded checkpoint is not this group's to continue, or None when it is."""
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            return "it is of an older layout"
        if state.get("code_version") != self.code_version:
            return (f"it was written by other code (version {state.get('code_version')!r}, "
                    f"this code {self.code_version!r})")
        if (state.get("group") != self.checkpoint_key
                or state.get("run_ids") != [spec.run_id for spec in self.specs]):
            return "it holds another group's runs"
        return None

    def _discard(self, path: Path, reason: str) -> None:
        """Remove a checkpoint that is not to be continued (never loaded), and say so."""
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self.progress({"event": "checkpoint_ignored", "path": str(path),
                       "reason": f"checkpoint {path.name} ignored and removed ({reason}); "
                                 "the group starts over"})

    def _load(self, path: Path) -> None:
        try:  # weights_only: an unpickled object never runs code
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unreadable file is ignored the same way
            return self._discard(path, "it is not a checkpoint of plain tensors and values: "
                                 f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                                 if str(error) else type(error).__name__)
        problem = self._checkpoint_problem(state)
        if problem:
            return self._discard(path, problem)
        self.results, self.curves = state["results"], state["curves"]
        self.best = state.get("best", {})
        if self.best_params is not None and state.get("best_params") is not None:
            self.best_params.copy_(state["best_params"].to(self.device))
        self._keep(list(state["slots"]))  # slot i of a new trainer holds run i
        self.retired = set(state["retired"])
        for index in self.retired:
            self.lr_table[:, index] = 0
        self.model.flat.copy_(state["flat"].to(self.device))
        self.optimizer.load_state({k: v.to(self.device) for k, v in state["optimizer"].items()})
        self.columns = state["columns"].to(self.device)
        self.step, self.last_eval = state["step"], state["last_eval"]
        self.loss_sum = state["loss_sum"].to(self.device)
        for generator, saved in zip(self.order_generators, state["order_generators"]):
            generator.set_state(saved)
        self.order.copy_(state["order"])
        self.batch_index.fill_(state["batch_index"])
        self.global_step.fill_(self.step)
        torch.set_rng_state(state["rng"])
        if state["cuda_rng"] is not None and self.cuda:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.train_seconds = state["train_seconds"]
        self.eval_seconds = state.get("eval_seconds", 0.0)
        self.progress({"event": "resumed", "step": self.step})


def device_name(device: str | torch.device) -> str:
    """What a group trained on: the GPU's model name, or the device type ("cpu")."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def train_group(specs: list[dict], build_model: Callable[[dict], TinyLM], *,
                progress: Callable[[dict], None] | None = None, graphs: bool = True,
                compile: bool = False, deadline: float | None = None,
                checkpoint: str | Path | None = None, code_version: str = "") -> list[dict]:
    """Train the runs `specs` (one group: they differ only in lr, weight decay, seed and run
    id) as one stack; returns one result per spec, in order. `deadline` (a `time.time()` value) stops
    training at the first step after it, saving `checkpoint` (raises `Interrupted`);
    a later call with the same checkpoint path continues from it, when the checkpoint
    records the same `code_version` (the caller's name for the code that trains: a
    checkpoint of other code is removed, never loaded) and the same group (its runs' specs
    but the device)."""
    runs = [RunSpec(**spec) for spec in specs]
    keys = {group_key(run.as_dict()) for run in runs}
    if len(keys) != 1:
        raise ValueError("train_group needs runs that differ only in lr, weight_decay, seed "
                         "and run_id")
    device = torch.device(runs[0].device)
    if device.type == "cuda":  # from here the group's own peak (earlier groups freed theirs)
        torch.cuda.init()  # the allocator's statistics exist only once CUDA is initialised
        torch.cuda.reset_peak_memory_stats(device)
    compiled_before = compile_seconds()
    trainer = _GroupTrainer(runs, build_model, graphs, progress, compile=compile,
                            code_version=code_version)
    results = trainer.run(deadline, Path(checkpoint) if checkpoint else None)
    warmup = trainer.warmup
    seconds = round(time.perf_counter() - trainer.started, 2)
    # the most GPU memory the group's process held from PyTorch's allocator (its CUDA graph
    # pools included): what a group of this shape needs beside others on one GPU
    memory = (round(torch.cuda.max_memory_reserved(device) / 2**20)
              if device.type == "cuda" else None)
    for result in results:
        result.update({"seconds": seconds, "train_seconds": round(trainer.train_seconds, 2),
                       "eval_seconds": round(trainer.eval_seconds, 2),
                       "setup_seconds": round(trainer.setup_seconds, 2),
                       "group_size": len(runs), "graphs": trainer.graphed,
                       "compiled": compile, "device_name": device_name(device),
                       "gpu_memory_mib": memory,
                       # the steps before the step replays as a graph (compilation,
                       # autotuning, capture): their wall time, and dynamo's compile time
                       "warmup_steps": warmup["steps"],
                       "warmup_seconds": round(warmup["seconds"], 2),
                       "compile_seconds": round(compile_seconds() - compiled_before, 2)})
        if trainer.graph_failure:
            result["graph_failure"] = trainer.graph_failure
    return results
