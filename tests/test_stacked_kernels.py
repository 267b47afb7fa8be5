"""The stacked-training kernels (hla_bench/recall/kernels) against the unstacked brute force.

stacked_norm: N models' LayerNorm / RMSNorm (optionally fused with the residual add) equal
F.layer_norm / F.rms_norm model by model, values and the gradients of x, residual, weight and
bias, to float64 rounding on both paths (the Triton kernels under the interpreter on the
CPU); the Triton path equals the PyTorch path in float32 and bfloat16.
labelled_cross_entropy: each model's mean cross-entropy over its labelled rows equals
F.cross_entropy model by model (and StackedLM.losses' formula under autocast), values and
gradients, with chunks that do not divide the rows, a model without labelled rows and
vocabularies past one block; it never holds every row's logits. Deliberately broken kernels
(no eps, no 1 / count) fail the same checks.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mixers.errors import relative_error
from tasks import IGNORE
from hla_bench.recall.kernels import cross_entropy, labelled_cross_entropy, norm, stacked_norm
from hla_bench.recall.model import at_least_float32

# where the Triton path runs: CUDA, or the CPU under the interpreter (tests/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch", "triton"]
EXACT = 1e-12  # float64 against the float64 brute force
FLOAT32 = 1e-5  # the Triton path against the PyTorch path, float32 results
BF16 = 2.0 ** -7  # bfloat16 results: a rounding that falls the other way moves an entry by
# one bfloat16 step, at most 2^-7 of the largest entry


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- stacked_norm


def norm_inputs(kind: str, shape, dtype, *, residual: bool, bias: bool = True, seed: int = 0,
                device=DEVICE):
    """x (rows with a mean and a spread of their own), residual, and weight and bias as
    strided rows of one buffer `[N, P]`, as StackedLM holds its parameters."""
    gen = generator(seed)
    N, d = shape[0], shape[-1]
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 1.5 + 0.7).to(device, dtype)
    res = torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype) \
        if residual else None
    flat = (torch.randn(N, 2 * d + 7, generator=gen, dtype=torch.float64) + 1).to(device)
    weight = flat[:, 3:3 + d]
    b = flat[:, 5 + d:5 + 2 * d] if kind == "layer" and bias else None
    return x, res, weight, b


def norm_brute_force(x, weight, bias, *, eps, kind, residual=None):
    """Model by model: F.layer_norm / F.rms_norm with that model's weight (and bias): y, or
    (y, s) with a residual."""
    s = x + residual if residual is not None else x
    d = x.shape[-1]
    ys = [F.layer_norm(s[n], (d,), weight[n], bias[n] if bias is not None else None, eps)
          if kind == "layer" else F.rms_norm(s[n], (d,), weight[n], eps)
          for n in range(x.shape[0])]
    return (torch.stack(ys), s) if residual is not None else torch.stack(ys)


def values_and_grads(fn, inputs, seed: int = 1):
    """fn(*inputs) -> y or (y, s); the outputs, then the gradients of every input that is
    not None for random upstream gradients of y (and s)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = generator(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)
                .to(o.device)).sum() for o in outs)
    present = [x for x in leaves if x is not None]
    return outs + list(torch.autograd.grad(loss, present))


def assert_norm_matches(x, res, weight, bias, *, eps, kind, impl, tol=EXACT):
    names = ["y"] + (["s"] if res is not None else []) + ["dx"] + \
        (["dresidual"] if res is not None else []) + ["dweight"] + \
        (["dbias"] if bias is not None else [])
    got = values_and_grads(lambda x, r, w, b: stacked_norm(x, w, b, eps=eps, kind=kind,
                                                           residual=r, impl=impl),
                           (x, res, weight, bias))
    want = values_and_grads(lambda x, r, w, b: norm_brute_force(x, w, b, eps=eps, kind=kind,
                                                                residual=r),
                            (x, res, weight, bias))
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape, name
        assert relative_error(a, b) < tol, name


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 rows (d <= 64) and backward blocks of several tiles, so that a few dozen
    rows span several tiles, several row blocks and a partial last block and tile."""
    monkeypatch.setattr(norm, "TILE_ENTRIES", 512)
    monkeypatch.setattr(norm, "BACKWARD_PROGRAMS", 4)


NORM_CASES = [("layer", True, False, (3, 5, 9, 37)), ("layer", True, True, (3, 45, 37)),
              ("layer", False, True, (3, 45, 37)), ("rms", False, False, (3, 45, 37)),
              ("rms", False, True, (3, 5, 9, 37))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind, bias, residual, shape", NORM_CASES,
                         ids=[f"{k}{'' if b or k == 'rms' else '-no-bias'}"
                              f"{'-residual' if r else ''}-{len(s)}d"
                              for k, b, r, s in NORM_CASES])
def test_stacked_norm_equals_each_models_norm_in_float64(kind, bias, residual, shape, impl,
                                                        small_tiles):
    """d = 37 (no power of two), 45 rows per model (several tiles and row blocks in the
    Triton backward), per-model weights as strided rows of one buffer, eps that matters."""
    x, res, weight, b = norm_inputs(kind, shape, torch.float64, residual=residual, bias=bias)
    if impl == "triton":
        assert norm.plan_norm(3, 45, 37).tiles > 1
    assert_norm_matches(x, res, weight, b, eps=0.05, kind=kind, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_stacked_norm_gradcheck(kind, impl, small_tiles):
    """Full gradcheck on the PyTorch path; the fast (random projection) one on the
    interpreted kernels, whose every gradient entry the float64 test checks."""
    x, res, weight, bias = norm_inputs(kind, (2, 3, 5), torch.float64, residual=True)
    inputs = [t.detach().clone().requires_grad_() for t in (x, res, weight, bias)
              if t is not None]

    def fn(x, res, weight, bias=None):
        return stacked_norm(x, weight, bias, eps=1e-3, kind=kind, residual=res, impl=impl)

    assert torch.autograd.gradcheck(fn, tuple(inputs), fast_mode=impl == "triton")


NORM_DTYPES = [(torch.float32, None), (torch.float32, torch.bfloat16),
               (torch.bfloat16, None), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype, out_dtype", NORM_DTYPES,
                         ids=[f"{str(a)[6:]}-out-{str(b)[6:] if b else 'same'}"
                              for a, b in NORM_DTYPES])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_norm_equals_the_pytorch_path(kind, dtype, out_dtype):
    """The default plan, 70 rows of 48 per model, with the residual: float32 results within
    FLOAT32, bfloat16 ones (y in bfloat16, the gradients of bfloat16 x and residual) within
    one bfloat16 step (BF16); the weight and bias gradients are float32 either way."""
    x, res, weight, bias = norm_inputs(kind, (2, 70, 48), dtype, residual=True, seed=3)
    weight, bias = weight.float(), bias.float() if bias is not None else None
    results = {}
    for impl in IMPLS:
        results[impl] = values_and_grads(
            lambda x, r, w, b: stacked_norm(x, w, b, eps=1e-5, kind=kind, residual=r,
                                            out_dtype=out_dtype, impl=impl),
            (x, res, weight, bias), seed=4)
    y_dtype = out_dtype or dtype
    assert results["triton"][0].dtype == y_dtype and results["triton"][1].dtype == dtype
    for got, want in zip(results["triton"], results["torch"], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = FLOAT32 if got.dtype == torch.float32 else BF16
        assert relative_error(got, want) < tol


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:invalid value:RuntimeWarning")  # rows past M: 1 / sqrt(0)
def test_a_norm_kernel_without_eps_fails_the_checks(monkeypatch):
    """The float64 check with the kernel handed eps = 0 (as if it dropped eps) fails."""
    x, res, weight, bias = norm_inputs("layer", (3, 20, 24), torch.float64, residual=True)
    assert_norm_matches(x, res, weight, bias, eps=1e-5, kind="layer", impl="triton")
    monkeypatch.setattr(norm, "_eps_parts", lambda eps, acc: (0.0, 0.0))
    with pytest.raises(AssertionError):
        assert_norm_matches(x, res, weight, bias, eps=1e-5, kind="layer", impl="triton")


def test_norm_plans():
    plan = norm.plan_norm(8, 16384, 128)
    assert (plan.block_d, plan.tile, plan.warps) == (128, 32, 4)
    assert plan.tiles == 4 and 8 * math.ceil(16384 / (plan.tile * plan.tiles)) == 1024
    assert norm.plan_norm(3, 45, 37) == norm.NormPlan(64, 64, 1, 4)
    wide = norm.plan_norm(2, 100, norm.MAX_D)
    assert (wide.block_d, wide.tile, wide.tiles, wide.warps) == (8192, 1, 1, 8)


def test_stacked_norm_rejects_bad_arguments():
    x, res, weight, bias = norm_inputs("layer", (2, 6, 8), torch.float32, residual=True,
                                       device="cpu")
    cases = [
        (dict(kind="batch"), "kind"),
        (dict(x=x[0]), "x must have shape"),
        (dict(x=x.long()), "x must be float"),
        (dict(weight=weight[:, :4]), "weight must have shape"),
        (dict(weight=weight[:1]), "weight must have shape"),
        (dict(bias=bias[:, :4]), "bias must have shape"),
        (dict(kind="rms"), "bias must be None"),
        (dict(residual=res[:, :3]), "residual must have shape"),
        (dict(residual=res.double()), "residual must have x's dtype"),
        (dict(eps=0.0), "eps"),
        (dict(eps=True), "eps"),
        (dict(out_dtype=torch.int32), "out_dtype"),
        (dict(impl="cuda"), "impl"),
    ]
    for change, message in cases:
        args = dict(x=x, weight=weight, bias=bias, eps=1e-5, kind="layer", residual=res)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            stacked_norm(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)
    wide, ones = torch.zeros(1, 2, norm.MAX_D + 1, device=DEVICE), \
        torch.ones(1, norm.MAX_D + 1, device=DEVICE)
    with pytest.raises(ValueError, match="above"):
        stacked_norm(wide, ones, eps=1e-5, kind="rms", impl="triton")
    # "auto" takes the PyTorch path for such widths
    assert stacked_norm(wide, ones, eps=1e-5, kind="rms").shape == wide.shape


# ---------------------------------------------------------------- labelled_cross_entropy


def ce_inputs(N, R, d, V, counts, dtype, *, bias: bool, seed: int = 0, device=DEVICE):
    """hidden, weight (strided rows of a buffer `[N, P]`, as StackedLM's embedding), bias,
    targets (IGNORE past each model's count) and counts."""
    gen = generator(seed)
    hidden = torch.randn(N, R, d, generator=gen, dtype=torch.float64).to(device, dtype)
    flat = torch.randn(N, V * d + 9, generator=gen, dtype=torch.float64).to(device, dtype)
    weight = flat[:, 4:4 + V * d].view(N, V, d)
    b = (torch.randn(N, V, generator=gen, dtype=torch.float64) * 0.5).to(device, dtype) \
        if bias else None
    counts = torch.tensor(counts, device=device)
    targets = torch.randint(0, V, (N, R), generator=gen).to(device)
    targets = torch.where(torch.arange(R, device=device) < counts[:, None], targets, IGNORE)
    return hidden, weight, b, targets, counts


def ce_brute_force(hidden, weight, targets, counts, bias=None):
    """Model by model: the head, then F.cross_entropy summed over the labelled rows and
    divided by max(count, 1)."""
    losses = []
    for n in range(hidden.shape[0]):
        logits = hidden[n] @ weight[n].T + (bias[n] if bias is not None else 0)
        losses.append(F.cross_entropy(logits, targets[n], ignore_index=IGNORE, reduction="sum")
                      / max(int(counts[n]), 1))
    return torch.stack(losses)


def ce_values_and_grads(fn, hidden, weight, bias, seed: int | None = 1):
    """The losses and the gradients of hidden, weight (and bias) of sum(g[n] * loss[n]) for
    random positive g (so each model's upstream gradient is its own; seed None: g = 1)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None
              for x in (hidden, weight, bias)]
    losses = fn(*leaves)
    g = (torch.rand(losses.shape, generator=generator(seed), dtype=torch.float64) + 0.5
         if seed is not None else torch.ones(losses.shape, dtype=torch.float64))
    present = [x for x in leaves if x is not None]
    return [losses] + list(torch.autograd.grad((losses.double() * g.to(losses.device)).sum(),
                                               present))


def assert_ce_matches(hidden, weight, bias, targets, counts, *, impl, chunk_rows, tol=EXACT):
    got = ce_values_and_grads(
        lambda h, w, b: labelled_cross_entropy(h, w, targets, counts, b, chunk_rows=chunk_rows,
                                               impl=impl), hidden, weight, bias)
    want = ce_values_and_grads(lambda h, w, b: ce_brute_force(h, w, targets, counts, b),
                               hidden, weight, bias)
    names = ["losses", "dhidden", "dweight"] + (["dbias"] if bias is not None else [])
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert relative_error(a, b) < tol, name


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias", [False, True], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk_rows", [5, 23, 64])
def test_labelled_cross_entropy_equals_each_models_loss_in_float64(chunk_rows, bias, impl):
    """Three models with 23, 11 and 0 labelled rows of 23, d = 19, V = 150; chunks of 5
    rows (the last one partial), all rows, and more than all rows."""
    inputs = ce_inputs(3, 23, 19, 150, [23, 11, 0], torch.float64, bias=bias)
    assert_ce_matches(*inputs, impl=impl, chunk_rows=chunk_rows)


@pytest.mark.parametrize("bias", [False, True], ids=["tied", "untied"])
def test_the_row_kernel_loops_over_vocabulary_blocks(bias, monkeypatch):
    """Blocks of 64 vocabulary entries: V = 150 takes three, the last one partial (the online
    log-sum-exp and the gradient's second pass)."""
    monkeypatch.setattr(cross_entropy, "MAX_BLOCK_V", 64)
    inputs = ce_inputs(3, 23, 19, 150, [23, 11, 0], torch.float64, bias=bias, seed=2)
    assert_ce_matches(*inputs, impl="triton", chunk_rows=7)


@pytest.mark.parametrize("impl", IMPLS)
def test_labelled_cross_entropy_gradcheck(impl):
    """Full gradcheck on the PyTorch path, the fast one on the interpreted kernel."""
    hidden, weight, bias, targets, counts = ce_inputs(2, 4, 3, 5, [3, 2], torch.float64,
                                                      bias=True, seed=5)

    def fn(hidden, weight, bias):
        return labelled_cross_entropy(hidden, weight, targets, counts, bias, chunk_rows=3,
                                      impl=impl)

    inputs = tuple(t.detach().clone().requires_grad_() for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=impl == "triton")


def test_triton_cross_entropy_equals_the_pytorch_path_in_float32():
    inputs = ce_inputs(2, 60, 40, 300, [60, 37], torch.float32, bias=True, seed=6)
    hidden, weight, bias, targets, counts = inputs
    results = [ce_values_and_grads(
        lambda h, w, b: labelled_cross_entropy(h, w, targets, counts, b, chunk_rows=16,
                                               impl=impl), hidden, weight, bias)
        for impl in IMPLS]
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype == torch.float32
        assert relative_error(got, want) < FLOAT32


def todays_losses(hidden, weight, targets, counts, bias=None):
    """StackedLM.losses' head and loss on gathered rows: bmm (baddbmm with a bias), the
    logits in at least float32, F.cross_entropy, the sum over rows over max(count, 1)."""
    logits = (torch.baddbmm(bias.unsqueeze(1), hidden, weight.transpose(1, 2))
              if bias is not None else torch.bmm(hidden, weight.transpose(1, 2)))
    N, R, V = logits.shape
    ce = F.cross_entropy(at_least_float32(logits).reshape(N * R, V), targets.reshape(-1),
                         ignore_index=IGNORE, reduction="none").view(N, R)
    return ce.sum(1) / counts.clamp_min(1)


@pytest.mark.parametrize("impl", IMPLS)
def test_under_bf16_autocast_the_head_runs_in_bf16_as_the_unfused_head_does(impl):
    """Under autocast both paths compute bfloat16 logits, float32 losses and the gradient of
    the logits rounded to bfloat16. Against StackedLM.losses' formula under the same
    autocast: the losses within float32 rounding (equal on the PyTorch path on the CPU; on
    CUDA a chunk's matmul may take another cuBLAS kernel than all rows' and round a logit
    the other way: within one bfloat16 step there), d hidden within one bfloat16 step (the
    unfused path's, rounded the same way); d weight and d bias, which the unfused path
    rounds to bfloat16 once and the fused one keeps in float32, within one bfloat16 step.
    Inputs float32, as the master weights and the final norm's output are; the gradients
    come back in float32."""
    hidden, weight, bias, targets, counts = ce_inputs(3, 40, 24, 300, [40, 17, 0],
                                                      torch.float32, bias=True, seed=7)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = ce_values_and_grads(
            lambda h, w, b: labelled_cross_entropy(h, w, targets, counts, b, chunk_rows=16,
                                                   impl=impl), hidden, weight, bias)
        want = ce_values_and_grads(lambda h, w, b: todays_losses(h, w, targets, counts, b),
                                   hidden, weight, bias)
    for name, a, b, tol in zip(("losses", "dhidden", "dweight", "dbias"), got, want,
                               (FLOAT32 if DEVICE == "cpu" else BF16, BF16, BF16, BF16),
                               strict=True):
        assert a.dtype == b.dtype == torch.float32, name
        assert relative_error(a, b) < tol, name
    if impl == "torch" and DEVICE == "cpu":  # the same matmul rows, the same loss ops
        assert torch.equal(got[0], want[0])
    # the logits are rounded to bfloat16: the float32 head's losses differ by more
    float32_losses = todays_losses(hidden, weight, targets, counts, bias)
    assert relative_error(got[0], float32_losses) > 10 * FLOAT32


@pytest.mark.parametrize("impl", IMPLS)
def test_under_autocast_bf16_hidden_rows_are_the_float32_rows_rounded(impl):
    """hidden in bfloat16 (a final norm with out_dtype bfloat16) gives exactly the losses of
    its float32 rows, which autocast rounds the same way, and d hidden in bfloat16 holds
    exactly the float32 rows' d hidden (both are the bfloat16 matmul's results; upstream
    gradients of 1, as training's sum of the losses gives)."""
    hidden, weight, _, targets, counts = ce_inputs(2, 30, 16, 120, [30, 12], torch.float32,
                                                   bias=False, seed=12)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        wide, narrow = (ce_values_and_grads(
            lambda h, w, b: labelled_cross_entropy(h, w, targets, counts, chunk_rows=8,
                                                   impl=impl), h, weight, None, seed=None)
            for h in (hidden, hidden.bfloat16()))
    assert narrow[1].dtype == torch.bfloat16 and wide[1].dtype == torch.float32
    assert torch.equal(narrow[0], wide[0]) and torch.equal(narrow[1].float(), wide[1])
    assert torch.equal(narrow[2], wide[2])


class LargestTensor(TorchDispatchMode):
    """The largest floating-point tensor any op creates while active (entries): outputs
    on storage of their own, not views of or in-place results on an input's."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs))
                 if isinstance(x, torch.Tensor)}
        for x in tree_leaves(out):
            if (isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.untyped_storage().data_ptr() not in given):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("impl", IMPLS)
def test_the_cross_entropy_never_holds_every_rows_logits(impl):
    """Forward and backward with chunks of 8 of 64 rows: no tensor reaches the N x R x V
    entries of every row's logits (the largest are a chunk's logits, N x 8 x V, and the
    weight gradient, N x V x d); the unfused head creates such a tensor."""
    N, R, d, V = 3, 64, 16, 200
    hidden, weight, bias, targets, counts = ce_inputs(N, R, d, V, [64, 30, 0], torch.float32,
                                                      bias=True, seed=8)
    leaves = [x.detach().clone().requires_grad_() for x in (hidden, weight, bias)]
    with LargestTensor() as fused:
        labelled_cross_entropy(leaves[0], leaves[1], targets, counts, leaves[2], chunk_rows=8,
                               impl=impl).sum().backward()
    assert fused.largest <= max(N * 8 * V, N * V * d) < N * R * V
    with LargestTensor() as unfused:
        todays_losses(*leaves[:2], targets, counts, leaves[2]).sum().backward()
    assert unfused.largest >= N * R * V


@pytest.mark.parametrize("impl", IMPLS)
def test_a_cross_entropy_without_the_count_fails_the_checks(impl, monkeypatch):
    """The float64 check with the gradient's 1 / count dropped (counts read as 1) fails."""
    inputs = ce_inputs(3, 23, 19, 150, [23, 11, 0], torch.float64, bias=True, seed=9)
    assert_ce_matches(*inputs, impl=impl, chunk_rows=5)
    monkeypatch.setattr(cross_entropy, "inverse_counts",
                        lambda counts, dtype: torch.ones(counts.shape, dtype=dtype,
                                                         device=counts.device))
    with pytest.raises(AssertionError, match="dhidden"):
        assert_ce_matches(*inputs, impl=impl, chunk_rows=5)


@pytest.mark.parametrize("impl", IMPLS)
def test_without_gradients_only_the_losses_are_computed(impl):
    hidden, weight, bias, targets, counts = ce_inputs(2, 30, 12, 100, [30, 9], torch.float32,
                                                      bias=True, seed=10)
    with_grad = labelled_cross_entropy(hidden.requires_grad_(), weight, targets, counts, bias,
                                       chunk_rows=7, impl=impl)
    with torch.no_grad(), LargestTensor() as mode:
        plain = labelled_cross_entropy(hidden, weight, targets, counts, bias, chunk_rows=7,
                                       impl=impl)
    assert not plain.requires_grad and relative_error(plain, with_grad) < 1e-6
    assert mode.largest <= 2 * 7 * 100 < 2 * 100 * 12  # a chunk's logits, no `[N, V, d]` gradient


@pytest.mark.parametrize("impl", IMPLS)
def test_a_target_outside_the_vocabulary_makes_its_models_loss_nan(impl):
    hidden, weight, _, targets, counts = ce_inputs(3, 10, 8, 50, [10, 10, 4], torch.float32,
                                                   bias=False, seed=11)
    targets[1, 3] = 50
    targets[2, 0] = -1
    losses = labelled_cross_entropy(hidden, weight, targets, counts, chunk_rows=4, impl=impl)
    assert losses[0].isfinite() and losses[1:].isnan().all()


@pytest.mark.parametrize("impl", IMPLS)
def test_int32_targets_and_counts_give_the_same_losses(impl):
    hidden, weight, _, targets, counts = ce_inputs(2, 9, 8, 40, [9, 5], torch.float32,
                                                   bias=False, seed=13)
    wide = labelled_cross_entropy(hidden, weight, targets, counts, chunk_rows=4, impl=impl)
    narrow = labelled_cross_entropy(hidden, weight, targets.int(), counts.int(), chunk_rows=4,
                                    impl=impl)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_rows_give_zero_losses_and_gradients(impl):
    hidden, weight, bias, targets, counts = ce_inputs(2, 0, 6, 20, [0, 0], torch.float32,
                                                      bias=True)
    losses, dh, dw, db = ce_values_and_grads(
        lambda h, w, b: labelled_cross_entropy(h, w, targets, counts, b, impl=impl),
        hidden, weight, bias)
    assert losses.tolist() == [0.0, 0.0] and dh.shape == (2, 0, 6)
    assert not dw.any() and not db.any()


def test_default_chunks_keep_a_chunks_logits_within_the_budget():
    rows = cross_entropy.default_chunk_rows(8, 8192, torch.bfloat16)
    assert rows % 64 == 0 and 8 * rows * 8192 * 2 <= cross_entropy.CHUNK_BYTES
    assert 8 * (rows + 64) * 8192 * 2 > cross_entropy.CHUNK_BYTES
    assert cross_entropy.default_chunk_rows(1, 10 ** 9, torch.float32) == 1


def test_labelled_cross_entropy_rejects_bad_arguments():
    hidden, weight, bias, targets, counts = ce_inputs(2, 5, 4, 10, [5, 2], torch.float32,
                                                      bias=True, device="cpu")
    cases = [
        (dict(hidden=hidden[0]), "hidden must have shape"),
        (dict(hidden=hidden.long()), "hidden must be float"),
        (dict(weight=weight[:, :, :3]), "weight must have shape"),
        (dict(weight=weight[:1]), "weight must have shape"),
        (dict(bias=bias[:, :4]), "bias must have shape"),
        (dict(targets=targets[:, :4]), "targets must have shape"),
        (dict(targets=targets.float()), "targets must have an integer dtype"),
        (dict(counts=counts[:1]), "counts must have shape"),
        (dict(counts=counts.double()), "counts must have an integer dtype"),
        (dict(chunk_rows=0), "chunk_rows"),
        (dict(chunk_rows=2.0), "chunk_rows"),
        (dict(impl="fast"), "impl"),
    ]
    for change, message in cases:
        args = dict(hidden=hidden, weight=weight, targets=targets, counts=counts, bias=bias)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            labelled_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("targets"),
                                   args.pop("counts"), args.pop("bias"), **args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_both_kernels_replay_inside_a_cuda_graph():
    """A bf16-autocast step of both (the fused add + norm into bfloat16 rows, their head and
    loss, backward) captured as a CUDA graph, after two eager warm-up steps on a side
    stream, replays the eager step's losses and gradients (within one bfloat16 step: the
    captured matmuls may take other cuBLAS algorithms)."""
    N, M, d, V, R = 3, 64, 48, 300, 40
    gen = generator(14)
    x, res = (torch.randn(N, M, d, generator=gen).cuda().requires_grad_() for _ in range(2))
    w = (torch.randn(N, d, generator=gen) + 1).cuda().requires_grad_()
    b = torch.randn(N, d, generator=gen).cuda().requires_grad_()
    _, weight, _, targets, counts = ce_inputs(N, R, d, V, [40, 21, 0], torch.float32,
                                              bias=False, seed=15, device="cuda")
    weight.requires_grad_()
    params = (x, res, w, b, weight)

    def step():
        for p in params:
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, s = stacked_norm(x, w, b, eps=1e-5, kind="layer", residual=res,
                                out_dtype=torch.bfloat16)
            losses = labelled_cross_entropy(y[:, :R], weight, targets, counts, chunk_rows=16)
        (losses.sum() + s.square().mean()).backward()
        return losses

    eager = [step().detach().clone()] + [p.grad.clone() for p in params]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip([captured] + [p.grad for p in params], eager, strict=True):
        assert relative_error(got, want) < BF16
