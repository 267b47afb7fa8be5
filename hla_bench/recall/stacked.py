"""N tiny LMs of one architecture as one computation, for training many runs at once.

`StackedLM(models)` copies the parameters of N `TinyLM`s (same parameter names and shapes)
into one buffer `flat [N, P]` (row n holds model n's parameters in `named_parameters` order)
and exposes each parameter as a view `[N, *shape]` of it. Each view's `.grad` is a view of a
second buffer `grad [N, P]`, into which backward accumulates in place, so one optimizer
(`FlatAdamW`) updates every parameter of every model with a handful of elementwise kernels,
each model with its own learning rate and weight decay.

`losses(tokens, labels)` takes `[N, B, T]` tokens and labels (model n reads its own batch)
and returns `[N]` mean cross-entropies over each model's labelled positions; their sum has,
for model n's parameters, exactly model n's own gradient.

Run eagerly (the CPU, and CUDA without torch.compile), the norms and the head's
cross-entropy go through fused kernels (`recall.kernels`): each norm one pass forward and one
backward that also forms its per-model weight gradients, its output in bf16 under autocast
where a matmul reads it next (the matmul would round it so), and the cross-entropy in chunks
of labelled rows, never the `[N, R, V]` logits in float32. Under torch.compile the plain
PyTorch forms run, for inductor to fuse. Mixer layers run stacked through
their `forward_stacked(params, x)` (x `[N, B, T, d_model]`); a single model (N = 1) runs any
mixer through `torch.func.functional_call`, so every mixer can train here.

Invariant: stacking, training and unstacking N models gives what training each alone with
`torch.optim.AdamW` gives (tests/test_stacked.py checks it to float64 rounding).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from tasks import IGNORE
from hla_bench.recall.kernels.adamw import adamw_step_
from hla_bench.recall.kernels.cross_entropy import labelled_cross_entropy
from hla_bench.recall.kernels.embedding import stacked_embedding
from hla_bench.recall.kernels.norm import stacked_norm
from hla_bench.recall.model import Block, LastStateDecoder, SwiGLU, TinyLM, at_least_float32

# Stacked parameters are strided rows of one buffer, and so are their gradients (in place,
# by design); autograd warns that such gradients do not follow its layout contract.
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout")

# How `StackedLM.hidden` forms the embedding's weight gradient: "dense", F.embedding's own
# backward (eagerly PyTorch's sort-based kernel, compiled inductor's atomic scatter-add), or
# "sorted", recall.kernels.stacked_embedding (the ids sorted on the device and each row's
# gradients summed by one program, every row written once; an opaque op under
# torch.compile). Both give the same gradient up to the order of the additions. "sorted"
# by default, the faster of the two on a GPU (docs/method.md; benchmarks/recall_throughput.py
# --embedding-backward times both); set this module attribute to switch.
EMBEDDING_BACKWARDS = ("dense", "sorted")
EMBEDDING_BACKWARD = "sorted"

_ELEMENTWISE = {nn.GELU: lambda m, x: F.gelu(x, approximate=m.approximate),
                nn.SiLU: lambda m, x: F.silu(x), nn.ReLU: lambda m, x: F.relu(x),
                nn.Identity: lambda m, x: x}


def stack_unsupported_reason(model: TinyLM, count: int) -> str | None:
    """Why `count` copies of `model` cannot run stacked, or None when they can."""
    if count == 1:
        return None
    for index, block in enumerate(model.blocks):
        if not callable(getattr(block.mixer, "forward_stacked", None)):
            return (f"the mixer layer of block {index} ({type(block.mixer).__name__}) has no "
                    "forward_stacked")
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Per-model vectors `[N, d]` broadcast over `[N, B, T, d]`."""
    return x[:, None, None, :]


def _fused() -> bool:
    """Whether the fused kernels run: always but while torch.compile traces."""
    return not torch.compiler.is_compiling()


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul under the active autocast reads `x` in (x's own without one)."""
    if x.dtype != torch.float64 and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x `[N, ..., in]` through N linear maps (weight `[N, out, in]`, bias `[N, out]`)."""
    N = x.shape[0]
    flat = x.reshape(N, -1, x.shape[-1])
    out = (torch.bmm(flat, weight.transpose(1, 2)) if bias is None
           else torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2)))
    return out.view(*x.shape[:-1], weight.shape[1])


class StackedLM:
    """N `TinyLM`s with stacked parameters. The structural template is `template` (a model of
    the same structure whose own parameter values are never read: compiled code made for an
    earlier stack on it runs this one too), else the first model."""

    def __init__(self, models: list[TinyLM], template: TinyLM | None = None):
        if not models:
            raise ValueError("StackedLM needs at least one model")
        self.template = models[0] if template is None else template
        self.count = len(models)
        reason = stack_unsupported_reason(self.template, self.count)
        if reason:
            raise ValueError(f"cannot stack {self.count} models: {reason}")
        shapes = [(name, tuple(p.shape)) for name, p in self.template.named_parameters()]
        for model in models:
            other = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
            if other != shapes:
                raise ValueError("stacked models must have the same parameter names and shapes")
        self.shapes = dict(shapes)
        self.size = sum(math.prod(shape) for shape in self.shapes.values())
        rows = [torch.cat([p.detach().reshape(-1) for p in model.parameters()]) for model in models]
        self.flat = torch.stack(rows)                         # [N, P]
        self.grad = torch.zeros_like(self.flat)
        self._bind()
        self.training = True

    def _bind(self) -> None:
        """Parameter views `[N, *shape]` of `flat`, with `.grad` views of `grad`."""
        self.params: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            view = self.flat[:, offset:offset + size].view(self.count, *shape)
            param = view.detach().requires_grad_(True)
            param.grad = self.grad[:, offset:offset + size].view(self.count, *shape)
            self.params[name] = param
            offset += size

    # --- structure -------------------------------------------------------------------

    def to(self, device: torch.device | str) -> "StackedLM":
        self.template.to(device)
        self.flat, self.grad = self.flat.to(device), self.grad.to(device)
        self._bind()
        return self

    def select(self, keep: list[int]) -> "StackedLM":
        """The stacked models at `keep` (a new StackedLM on the same device)."""
        chosen = object.__new__(StackedLM)
        chosen.template, chosen.count, chosen.shapes, chosen.size = (
            self.template, len(keep), self.shapes, self.size)
        index = torch.as_tensor(keep, device=self.flat.device)
        chosen.flat = self.flat.index_select(0, index)
        chosen.grad = torch.zeros_like(chosen.flat)
        chosen.training = self.training
        chosen._bind()
        return chosen

    def unstack(self, index: int) -> dict[str, torch.Tensor]:
        """Model `index`'s parameters as a state dict (copies)."""
        return {name: p[index].detach().clone() for name, p in self.params.items()}

    def train(self, mode: bool = True) -> "StackedLM":
        self.training = mode
        self.template.train(mode)
        return self

    def eval(self) -> "StackedLM":
        return self.train(False)

    def zero_grad(self) -> None:
        self.grad.zero_()

    # --- forward ---------------------------------------------------------------------

    def _sub(self, prefix: str) -> dict[str, torch.Tensor]:
        return {name[len(prefix):]: p for name, p in self.params.items() if name.startswith(prefix)}

    def _apply(self, module: nn.Module, prefix: str, x: torch.Tensor,
               into_matmul: bool = False) -> torch.Tensor:
        """`module` (a part of the template) for every model: x `[N, B, T, d]`.
        `into_matmul`: a matmul reads the result next (a norm may then give it in the
        matmul's dtype)."""
        p = self.params
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and _fused():
            layer = isinstance(module, nn.LayerNorm)
            return stacked_norm(x, p[prefix + "weight"], p[prefix + "bias"] if layer else None,
                                eps=module.eps, kind="layer" if layer else "rms",
                                out_dtype=_matmul_dtype(x) if into_matmul else None)
        if isinstance(module, nn.LayerNorm):
            y = F.layer_norm(x, module.normalized_shape, eps=module.eps)
            return torch.addcmul(_rows(p[prefix + "bias"]), y, _rows(p[prefix + "weight"]))
        if isinstance(module, nn.RMSNorm):
            return F.rms_norm(x, module.normalized_shape, eps=module.eps) * _rows(p[prefix + "weight"])
        if isinstance(module, nn.Linear):
            return _linear(x, p[prefix + "weight"], p.get(prefix + "bias"))
        if isinstance(module, nn.Sequential):
            for index, child in enumerate(module):
                following = module[index + 1] if index + 1 < len(module) else None
                x = self._apply(child, f"{prefix}{index}.", x,
                                into_matmul=isinstance(following, (nn.Linear, SwiGLU)))
            return x
        if isinstance(module, SwiGLU):
            gate = F.silu(_linear(x, p[prefix + "w1.weight"], None))
            return _linear(gate * _linear(x, p[prefix + "w3.weight"], None),
                           p[prefix + "w2.weight"], None)
        if type(module) in _ELEMENTWISE:
            return _ELEMENTWISE[type(module)](module, x)
        raise TypeError(f"no stacked form for {type(module).__name__} ({prefix or 'model'})")

    def _mixer(self, block: Block, prefix: str, x: torch.Tensor) -> torch.Tensor:
        params = self._sub(prefix)
        # forward_stacked first: a stacked mixer never reads the stack size here, so a
        # compiled loss is not specialised to it
        if not callable(getattr(block.mixer, "forward_stacked", None)) and self.count == 1:
            single = {name: value[0] for name, value in params.items()}
            return functional_call(block.mixer, single, (x[0],)).unsqueeze(0)
        forward = block.mixer.forward_stacked
        if torch.compiler.is_compiling() and not getattr(block.mixer, "TRACEABLE_STACKED", False):
            # Mixers run their own kernels (Triton launchers, autotuners, fla and mamba ops)
            # that torch.compile cannot trace. A layer that marks itself TRACEABLE_STACKED
            # keeps what it cannot trace out itself (mixers.dispatch.opaque) and compiles around
            # it; any other mixer layer stays eager as a whole.
            forward = torch.compiler.disable(forward)
        return forward(params, x)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The states each model's head reads, `[N, B, T, d]`, for its own tokens (as
        `TinyLM.hidden`)."""
        model, p = self.template, self.params
        N, B, T = tokens.shape
        if T > model.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len {model.max_len}")
        embed = p["embed.weight"]                                      # [N, V, d]
        if EMBEDDING_BACKWARD == "sorted":
            x = stacked_embedding(tokens, embed)
        elif EMBEDDING_BACKWARD == "dense":
            vocab = embed.shape[1]
            offsets = torch.arange(N, device=tokens.device).mul_(vocab).view(N, 1, 1)
            x = F.embedding(tokens + offsets, embed.reshape(N * vocab, -1))
        else:
            raise ValueError(f"EMBEDDING_BACKWARD must be one of {EMBEDDING_BACKWARDS}, got "
                             f"{EMBEDDING_BACKWARD!r}")
        if model.positions is not None:
            x = x + p["positions.weight"][:, None, :T]
        x = self._blocks(tuple(model.blocks), F.dropout(x, model.embed_dropout, self.training))
        if model.decoder is None:  # the head reads the normed states
            return self._apply(model.norm, "norm.", x, into_matmul=True)
        if model.decoder_kind == "default":
            return self._decode(self._apply(model.norm, "norm.", x))
        return self._apply(model.norm, "norm.", self._decode(x), into_matmul=True)

    def _blocks(self, blocks: tuple[Block, ...], x: torch.Tensor) -> torch.Tensor:
        """The template's last `len(blocks)` blocks, one call per block rather than a loop:
        torch.compile runs a whole frame eagerly when a loop in it holds a graph break (a
        mixer op kept out of the trace), but compiles around a break in a plain call."""
        if not blocks:
            return x
        block = blocks[0]
        prefix = f"blocks.{len(self.template.blocks) - len(blocks)}."
        # every mixer layer's stacked forward begins with its input projection
        x = x + self._mixer(block, prefix + "mixer.",
                            self._apply(block.mixer_norm, prefix + "mixer_norm.", x,
                                        into_matmul=True))
        if block.state_mixer is not None:
            x = x + self._apply(block.state_mixer, prefix + "state_mixer.", x)
        return self._blocks(blocks[1:], x)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """The template's LastStateDecoder for every model: each position from the last."""
        decoder: LastStateDecoder = self.template.decoder
        last = x[:, :, -1:] + decoder.positions[:x.shape[2]].to(x.dtype)
        return self._apply(decoder.mlp, "decoder.mlp.", last)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of `[N, R, d]` states: the tied embedding or the untied Linear with bias."""
        p = self.params
        if "head.weight" in p:
            return torch.baddbmm(p["head.bias"].unsqueeze(1), hidden, p["head.weight"].transpose(1, 2))
        return torch.bmm(hidden, p["embed.weight"].transpose(1, 2))

    def labelled_hidden(self, tokens: torch.Tensor, labels: torch.Tensor, max_rows: int):
        """At each model's labelled positions: the head's input states `[N, R, d]` (R =
        `max_rows`, at least every model's count), targets `[N, R]` (IGNORE past a model's
        count), the counts `[N]` and the flat positions `[N, R]` (b * T + t). Row r of model
        n is its r-th labelled position in order."""
        hidden = self.hidden(tokens)
        N, B, T, d = hidden.shape
        rows, counts = labelled_rows(labels.reshape(N, B * T), max_rows)
        valid = torch.arange(max_rows, device=labels.device) < counts[:, None]
        targets = torch.where(valid, labels.reshape(N, B * T).gather(1, rows), IGNORE)
        picked = hidden.reshape(N, B * T, d).gather(1, rows[..., None].expand(-1, -1, d))
        return picked, targets, counts, rows

    def labelled_logits(self, tokens: torch.Tensor, labels: torch.Tensor, max_rows: int):
        """`labelled_hidden` with the head's logits `[N, R, V]` in place of its input."""
        picked, targets, counts, rows = self.labelled_hidden(tokens, labels, max_rows)
        return self._head(picked), targets, counts, rows

    def losses(self, tokens: torch.Tensor, labels: torch.Tensor, max_rows: int) -> torch.Tensor:
        """`[N]` mean cross-entropy of each model over its labelled positions."""
        if _fused():
            picked, targets, counts, _ = self.labelled_hidden(tokens, labels, max_rows)
            p = self.params
            weight = p["head.weight"] if "head.weight" in p else p["embed.weight"]
            return labelled_cross_entropy(picked, weight, targets, counts, p.get("head.bias"))
        logits, targets, counts, _ = self.labelled_logits(tokens, labels, max_rows)
        N, R, V = logits.shape
        ce = F.cross_entropy(at_least_float32(logits).reshape(N * R, V), targets.reshape(-1),
                             ignore_index=IGNORE, reduction="none").view(N, R)
        return ce.sum(1) / counts.clamp_min(1)


def labelled_rows(labels: torch.Tensor, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `[N, L]` labels: the positions `[N, max_rows]` of each row's labelled entries in
    order (0 past its count) and the counts `[N]`, computed on the labels' device without a
    host sync: a running count gives each labelled entry its slot; unlabelled entries go to
    a spare slot past the end, which is dropped."""
    N, L = labels.shape
    labelled = labels != IGNORE
    slots = torch.where(labelled, labelled.cumsum(1) - 1, max_rows)
    rows = torch.zeros(N, max_rows + 1, dtype=torch.long, device=labels.device)
    rows.scatter_(1, slots, torch.arange(L, device=labels.device).expand(N, -1))
    return rows[:, :max_rows], labelled.sum(1)


class FlatAdamW:
    """torch.optim.AdamW's update (decoupled weight decay) on `StackedLM.flat` rows, one
    learning rate and one weight decay per row (`weight_decay`: a number for every row, or
    one per row). All state lives on the parameters' device and `step` reads the learning
    rates from a device tensor, so a CUDA graph can capture it."""

    def __init__(self, model: StackedLM, *, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | list[float] | torch.Tensor = 0.0):
        self.model, self.betas, self.eps = model, betas, eps
        rows = model.flat.shape[0]
        decay = torch.as_tensor(weight_decay, dtype=model.flat.dtype, device=model.flat.device)
        if decay.dim() == 0:
            decay = decay.expand(rows)
        if decay.shape != (rows,):
            raise ValueError(f"weight_decay needs one value or {rows} (one per row), "
                             f"got shape {tuple(decay.shape)}")
        self.weight_decay = decay.reshape(rows, 1).clone()      # [N, 1]
        self.exp_avg = torch.zeros_like(model.flat)
        self.exp_avg_sq = torch.zeros_like(model.flat)
        self.steps = torch.zeros((), dtype=model.flat.dtype, device=model.flat.device)

    def select(self, model: StackedLM, keep: list[int]) -> "FlatAdamW":
        """This optimizer's state for the rows `keep`, bound to `model` (= old.select(keep))."""
        index = torch.as_tensor(keep, device=self.exp_avg.device)
        chosen = FlatAdamW(model, betas=self.betas, eps=self.eps,
                           weight_decay=self.weight_decay.index_select(0, index).view(-1))
        chosen.exp_avg = self.exp_avg.index_select(0, index)
        chosen.exp_avg_sq = self.exp_avg_sq.index_select(0, index)
        chosen.steps = self.steps.clone()
        return chosen

    def state(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            getattr(self, name).copy_(value)

    @torch.no_grad()
    def step(self, lr: torch.Tensor) -> None:
        """One update with learning rates `lr` `[N]` (a tensor on the parameters' device)."""
        beta1, beta2 = self.betas
        self.steps.add_(1)
        # the same ops as torch.optim.AdamW's; the one-pass Triton path stays opt-in (impl=)
        # until it replays inside a captured CUDA graph, as the stacked steps are run
        adamw_step_(self.model.flat, self.model.grad, self.exp_avg, self.exp_avg_sq, lr,
                    self.weight_decay, self.steps, beta1=beta1, beta2=beta2, eps=self.eps,
                    impl="torch")
