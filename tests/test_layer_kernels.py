"""The stacked layer's fused kernels (hla_bench/recall/kernels): conv_split_norm against
today's code path (stacked_causal_conv, split, reshape, F.normalize) and adamw_step_ against
FlatAdamW and torch.optim.AdamW.

The PyTorch paths in float64 on the CPU: equal to the code they replace (bit for bit), and
gradcheck (conv_split_norm). The Triton paths (the interpreter on the CPU,
tests/conftest.py; natively on CUDA) against the PyTorch paths, tolerances stated per test:
float64 to float64 rounding (which checks the kernels' gradients exactly, against the
gradcheck'd PyTorch path), float32 to a few ulps, bfloat16 and float16 bit for bit forward
(an ulp where "l2" sums squares in another order) and gradients within the 16-bit rounding
of the float64 gradient. Shapes are small (each case takes seconds in the interpreter) but
span two row blocks (block_t=8, T=13, with the convolution's window crossing the block
edge), N = 2 models, 2 heads and key_dim != value_dim.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from grids import parametrize
from mixers.short_conv import stacked_causal_conv
from mixers.errors import relative_error
from hla_bench.recall.kernels.adamw import adamw_step_
from mixers.short_conv import conv_split_norm
from hla_bench.recall.stacked import FlatAdamW, StackedLM

RUNNABLE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ("l2", "scale", "none")
H, DK, DV = 2, 8, 12
SPLIT = (H * DK, H * DK, H * DV)
C = sum(SPLIT)


def inputs(N=2, B=1, T=13, K=4, dtype=torch.float64, scale=1.0, seed=0, device="cpu",
           weight_dtype=None):
    """qkv `[N, B, T, C]` and a conv weight `[N, C, 1, K]` (None for K None) that is a
    strided view of a larger buffer, as StackedLM's parameters are; both leaves' grads land
    in `.grad` of the returned leaves (qkv, buffer)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (scale * torch.randn(N, B, T, C, generator=gen, dtype=torch.float64)).to(dtype)
    qkv = qkv.to(device).requires_grad_()
    if K is None:
        return qkv, None, None
    weight_dtype = weight_dtype or (dtype if dtype == torch.float64 else torch.float32)
    flat = torch.randn(N, C * K + 5, generator=gen, dtype=torch.float64) * 0.5
    flat = flat.to(weight_dtype).to(device).requires_grad_()
    return qkv, flat, flat[:, 3:3 + C * K].view(N, C, 1, K)


def todays_code(qkv, weight, qk_norm):
    """MixerLayer.forward_stacked's ops from the projection output to the op's inputs."""
    N, B, T, _ = qkv.shape
    if weight is not None:
        qkv = stacked_causal_conv(qkv, weight)
    q, k, v = qkv.split(SPLIT, dim=-1)
    q, k = (t.reshape(N * B, T, H, DK) for t in (q, k))
    v = v.reshape(N * B, T, H, DV)
    if qk_norm == "l2":
        q, k = F.normalize(q, dim=-1).to(v.dtype), F.normalize(k, dim=-1).to(v.dtype)
    elif qk_norm == "scale":
        q = q * DK ** -0.5
    return q, k, v


def run(fn, qkv, flat, weight, seed=1, **options):
    """Outputs of fn and the gradients of qkv and of the weight's buffer for random output
    gradients (the same for every fn given the seed)."""
    outs = fn(qkv, weight, **options)
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs]
    leaves = [qkv] + ([flat] if flat is not None else [])
    return [o.detach() for o in outs], torch.autograd.grad(outs, leaves, grads)


def fused(impl, qk_norm, **options):
    return lambda qkv, weight: conv_split_norm(qkv, weight, SPLIT, H, DK, DV, qk_norm,
                                               impl=impl, **options)


# --- conv_split_norm: the PyTorch path ---------------------------------------------------

@pytest.mark.parametrize("qk_norm", MODES)
@pytest.mark.parametrize("K", [4, None], ids=["conv", "no-conv"])
def test_the_pytorch_path_is_todays_code_path(qk_norm, K):
    """float64 on the CPU: outputs and the gradients of qkv and conv_weight bit for bit."""
    qkv, flat, weight = inputs(B=2, T=21, K=K)
    outs, grads = run(fused("torch", qk_norm), qkv, flat, weight)
    want_outs, want_grads = run(lambda x, w: todays_code(x, w, qk_norm), qkv, flat, weight)
    for got, want, width in zip(outs, want_outs, (DK, DK, DV)):
        assert got.shape == (4, 21, H, width) and got.is_contiguous()
        assert torch.equal(got, want)
    for got, want in zip(grads, want_grads):
        assert torch.equal(got, want)


@parametrize("qk_norm", MODES, fast=[1])
def test_the_pytorch_path_passes_gradcheck(qk_norm):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 1, 5, C, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, C, 1, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: conv_split_norm(x, w, SPLIT, H, DK, DV, qk_norm, impl="torch"),
        (qkv, weight))


# --- conv_split_norm: the Triton path ----------------------------------------------------

TRITON_CASES = [("l2", 4, 1e-12), ("l2", None, 1e-12), ("l2", 2, 1.0), ("scale", 3, 1e-12),
                ("scale", 1, 1e-12), ("none", 4, 1e-12), ("none", None, 1e-12)]


@needs_triton
@parametrize("qk_norm, K, eps", TRITON_CASES,
             ids=[f"{m}-K{k}-eps{e:g}" for m, k, e in TRITON_CASES], fast=[1, 2, 4, 6])
def test_the_triton_path_in_float64_equals_the_pytorch_path(qk_norm, K, eps):
    """Every operation of the kernels is float64 here, so outputs agree to 1e-14 and
    gradients to 1e-12 (max-norm relative): the backward's transposed convolution, its
    shifted recomputation, the norms' gradient and the weight's partial sums exactly. eps=1
    on inputs whose head norms straddle it runs both sides of the eps clamp."""
    scale = 0.5 if eps == 1.0 else 1.0
    qkv, flat, weight = inputs(K=K, scale=scale, device=DEVICE)
    outs, grads = run(fused("triton", qk_norm, eps=eps, block_t=8), qkv, flat, weight)
    want_outs, want_grads = run(fused("torch", qk_norm, eps=eps), qkv, flat, weight)
    if eps == 1.0:
        with torch.no_grad():
            qk = stacked_causal_conv(qkv, weight)[..., :2 * H * DK].unflatten(-1, (2 * H, DK))
        clamped = (qk.norm(dim=-1) < eps).double().mean().item()
        assert 0.2 < clamped < 0.8
    for got, want in zip(outs, want_outs):
        assert got.is_contiguous() and got.dtype == torch.float64
        assert relative_error(got, want) < 1e-14
    for name, got, want in zip(("qkv", "conv_weight"), grads, want_grads):
        assert relative_error(got, want) < 1e-12, name


@needs_triton
@parametrize("qk_norm", MODES, fast=[2])
def test_the_triton_path_in_float32_equals_the_pytorch_path(qk_norm):
    """float32: the convolution and the scaling bit for bit (products and sums rounded as
    the PyTorch ops round them); "l2" within 3e-7 (an ulp or two: the sum of squares in
    another order); gradients within 1e-6 of the PyTorch path's (max-norm relative: each
    path rounds in float32, in its own order)."""
    qkv, flat, weight = inputs(dtype=torch.float32, device=DEVICE)
    outs, grads = run(fused("triton", qk_norm, block_t=8), qkv, flat, weight)
    want_outs, want_grads = run(fused("torch", qk_norm), qkv, flat, weight)
    for index, (got, want) in enumerate(zip(outs, want_outs)):
        if qk_norm == "l2" and index < 2:
            assert relative_error(got, want) < 3e-7
        else:
            assert torch.equal(got, want)
    for name, got, want in zip(("qkv", "conv_weight"), grads, want_grads):
        assert relative_error(got, want) < 1e-6, name


@needs_triton
@parametrize("dtype, grad_tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)],
             ids=["bf16", "fp16"], fast=[1])
@parametrize("qk_norm", ["l2", "scale"], fast=[1])
def test_the_triton_path_in_16_bits_rounds_as_the_pytorch_path(dtype, grad_tol, qk_norm):
    """16-bit qkv with float32 weights (autocast's case): outputs bit for bit where no norm
    is taken and within one ulp of the dtype where it is; gradients of qkv and of the
    weight within `grad_tol` (max-norm relative) of the float64 gradient of the same
    inputs: the 16-bit rounding of the forward's values (the kernels take the gradient in
    float32 and round d qkv once; the weight's gradient stays float32)."""
    qkv, flat, weight = inputs(dtype=dtype, device=DEVICE)
    outs, grads = run(fused("triton", qk_norm, block_t=8), qkv, flat, weight)
    assert all(o.dtype == dtype for o in outs) and grads[1].dtype == torch.float32
    want_outs, _ = run(fused("torch", qk_norm), qkv, flat, weight)
    for index, (got, want) in enumerate(zip(outs, want_outs)):
        if qk_norm == "l2" and index < 2:
            ulp = torch.finfo(dtype).eps * want.float().abs()
            assert ((got.float() - want.float()).abs() <= ulp).all()
        else:
            assert torch.equal(got, want)
    qkv64 = qkv.detach().double().requires_grad_()
    flat64 = flat.detach().double().requires_grad_()
    weight64 = flat64[:, 3:3 + C * 4].view(weight.shape)
    _, exact = run(fused("torch", qk_norm), qkv64, flat64, weight64)
    for name, got, want in zip(("qkv", "conv_weight"), grads, exact):
        assert relative_error(got, want) < grad_tol, name


@pytest.mark.slow
@needs_triton
def test_the_triton_path_leaves_out_the_weight_gradient_it_is_not_asked_for():
    qkv, _, _ = inputs(K=None, device=DEVICE)
    weight = torch.randn(2, C, 1, 4, dtype=torch.float64, device=DEVICE)  # no grad
    outs = conv_split_norm(qkv, weight, SPLIT, H, DK, DV, "l2", impl="triton", block_t=8)
    want = conv_split_norm(qkv, weight, SPLIT, H, DK, DV, "l2", impl="torch")
    got_grad, = torch.autograd.grad(sum(o.sum() for o in outs), qkv)
    want_grad, = torch.autograd.grad(sum(o.sum() for o in want), qkv)
    assert relative_error(got_grad, want_grad) < 1e-12


def test_conv_split_norm_names_its_bad_arguments():
    qkv, _, weight = inputs()
    call = lambda **changes: conv_split_norm(**{  # noqa: E731
        **dict(qkv=qkv, conv_weight=weight, split=SPLIT, heads=H, key_dim=DK, value_dim=DV),
        **changes})
    for changes, match in [
            (dict(qkv=qkv[0]), "qkv must be a \\[N, B, T, C\\]"),
            (dict(qkv=qkv.int()), "qkv must be bfloat16"),
            (dict(split=(DK, DK, DV)), "split must be"),
            (dict(qkv=qkv[..., :-1], conv_weight=None), "last dim must be sum\\(split\\)"),
            (dict(heads=0), "heads must be a positive int"),
            (dict(qk_norm="rms"), "qk_norm must be one of"),
            (dict(eps=-1.0), "eps must be"),
            (dict(impl="cuda"), "impl must be one of"),
            (dict(block_t=12), "block_t must be a power of two"),
            (dict(conv_weight=weight[:1]), "conv_weight must be \\[N, C, 1, K\\]"),
            (dict(conv_weight=torch.zeros(2, C, 1, 9, dtype=torch.float64)),
             "kernel size K must lie in \\[1, 8\\]")]:
        with pytest.raises(ValueError, match=match):
            call(**changes)


# --- adamw_step_ ---------------------------------------------------------------------------

LRS, DECAYS = (1e-2, 3e-3, 1e-1), (0.0, 0.1, 0.3)


def adam_rows(N=3, P=2500, dtype=torch.float64, seed=0, device="cpu"):
    """Rows `[N, P]` (P not a multiple of the kernel's block) with zero moments, per-row lr
    and weight decay, and a zero step count."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(N, P, generator=gen, dtype=torch.float64).to(dtype).to(device)
    lr = torch.tensor(LRS[:N], dtype=torch.float64, device=device)
    decay = torch.tensor(DECAYS[:N], dtype=dtype, device=device)
    return (param, torch.zeros_like(param), torch.zeros_like(param), lr, decay,
            torch.zeros((), dtype=dtype, device=device))


def gradients(step, shape, dtype, device, seed=7):
    """The gradient of `step`: a new scale each step (1e-2 to 1e3)."""
    gen = torch.Generator().manual_seed(seed + step)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 10.0 ** (step - 2)).to(
        dtype).to(device)


def test_the_adamw_pytorch_path_is_flat_adamw_bit_for_bit():
    """float32, six steps, per-row lr and weight decay: the same values as FlatAdamW.step."""
    param, m, v, lr, decay, steps = adam_rows(dtype=torch.float32)
    stacked = object.__new__(StackedLM)
    stacked.flat, stacked.grad = param.clone(), torch.zeros_like(param)
    optimizer = FlatAdamW(stacked, betas=(0.9, 0.999), eps=1e-8, weight_decay=list(DECAYS))
    for step in range(6):
        grad = gradients(step, param.shape, torch.float32, "cpu")
        stacked.grad.copy_(grad)
        optimizer.step(lr)
        steps.add_(1)
        adamw_step_(param, grad, m, v, lr, decay, steps, beta1=0.9, beta2=0.999, eps=1e-8,
                    impl="torch")
        for got, want in ((param, stacked.flat), (m, optimizer.exp_avg),
                          (v, optimizer.exp_avg_sq)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.0)], ids=["betas-0.9-0.999",
                                                                   "betas-0.3-0"])
def test_adamw_step_is_torch_adamw_on_each_row_in_float64(impl, betas):
    """float64, five steps: each row is torch.optim.AdamW(foreach=False) on its own
    parameters with its own lr and weight decay, to 1e-12 relative (betas (0.3, 0) take
    the lerp's other form and an addcmul of value one)."""
    device = DEVICE if impl == "triton" else "cpu"
    param, m, v, lr, decay, steps = adam_rows(device=device)
    rows = [row.detach().cpu().clone().requires_grad_() for row in param]
    references = [torch.optim.AdamW([row], lr=rate, betas=betas, eps=1e-8, weight_decay=wd,
                                    foreach=False) for row, rate, wd in zip(rows, LRS, DECAYS)]
    for step in range(5):
        grad = gradients(step, param.shape, torch.float64, device)
        steps.add_(1)
        adamw_step_(param, grad, m, v, lr, decay, steps, beta1=betas[0], beta2=betas[1],
                    eps=1e-8, impl=impl)
        for row, reference, g in zip(rows, references, grad.cpu()):
            row.grad = g.clone()
            reference.step()
    for got, row in zip(param.cpu(), rows):
        torch.testing.assert_close(got, row.detach(), rtol=1e-12, atol=1e-14)


@needs_triton
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.6, 0.95), (0.3, 0.0)])
def test_the_adamw_kernel_in_float32_is_the_pytorch_path_to_a_few_ulps(betas):
    """float32 rows (param a strided view: row stride > P) stepped six times; each step
    from the same state in both paths. The paths differ only where their fused
    multiply-adds differ (PyTorch's CPU addcmul rounds (1 - beta2) g first, the kernel
    rounds g^2 first and fuses, as PyTorch's CUDA addcmul does), so per entry
    |kernel - PyTorch| <= 4 eps32 s, s = |v| for v, |m_old| + |g| for m and
    |p_old| + |p| for p (which bounds the decayed parameter and the update)."""
    beta1, beta2 = betas
    base, m, v, lr, decay, steps = adam_rows(dtype=torch.float32, device=DEVICE)
    param = torch.zeros(base.shape[0], base.shape[1] + 3, device=DEVICE)[:, :base.shape[1]]
    param.copy_(base)
    eps32 = torch.finfo(torch.float32).eps
    for step in range(6):
        grad = gradients(step, param.shape, torch.float32, DEVICE)
        steps.add_(1)
        before = [param.clone(), m.clone(), v.clone()]
        want = [x.clone() for x in before]
        adamw_step_(want[0], grad, want[1], want[2], lr, decay, steps, beta1=beta1,
                    beta2=beta2, eps=1e-8, impl="torch")
        adamw_step_(param, grad, m, v, lr, decay, steps, beta1=beta1, beta2=beta2, eps=1e-8,
                    impl="triton")
        scales = (before[0].abs() + want[0].abs(), before[1].abs() + grad.abs(), want[2].abs())
        for name, got, expected, scale in zip(("param", "exp_avg", "exp_avg_sq"),
                                              (param, m, v), want, scales):
            assert ((got - expected).abs() <= 4 * eps32 * scale).all(), (name, step)
        param.copy_(want[0]), m.copy_(want[1]), v.copy_(want[2])


def test_adamw_step_names_its_bad_arguments():
    param, m, v, lr, decay, steps = adam_rows(N=2, P=5)
    grad = torch.zeros_like(param)
    arguments = dict(param=param, grad=grad, exp_avg=m, exp_avg_sq=v, lr=lr, weight_decay=decay,
                     steps=steps)
    for changes, match in [
            (dict(grad=grad[:, :4]), "grad must have param's shape"),
            (dict(exp_avg=m.float()), "exp_avg must have param's dtype"),
            (dict(param=param.half(), grad=grad.half(), exp_avg=m.half(),
                  exp_avg_sq=v.half()), "param must be float32 or float64"),
            (dict(lr=lr[:1]), "lr must be a tensor of shape \\[2\\]"),
            (dict(weight_decay=decay.float()), "weight_decay must be a torch.float64"),
            (dict(steps=steps.view(1)), "steps must be a tensor of shape \\[\\]"),
            (dict(exp_avg_sq=v.t().contiguous().t()), "exp_avg_sq's last dim must be")]:
        with pytest.raises(ValueError, match=match):
            adamw_step_(**{**arguments, **changes}, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="beta2 must lie in"):
        adamw_step_(**arguments, beta1=0.9, beta2=1.0, eps=1e-8)


# --- on CUDA: the automatic choice, inside a captured graph ------------------------------

@needs_cuda
def test_on_cuda_both_kernels_replay_in_a_cuda_graph_as_they_run_eagerly():
    """bfloat16 qkv (float32 weight) through conv_split_norm forward and backward, then an
    AdamW step of float32 rows, captured once and replayed: the replay's values equal the
    eager call's (impl="auto" takes Triton for both)."""
    qkv, flat, weight = inputs(B=4, T=64, dtype=torch.bfloat16, device="cuda")
    param, m, v, lr, decay, steps = adam_rows(dtype=torch.float32, device="cuda")
    grad = gradients(0, param.shape, torch.float32, "cuda")

    def step():
        outs = conv_split_norm(qkv, weight, SPLIT, H, DK, DV, "l2")
        dx, dflat = torch.autograd.grad(sum(o.float().square().sum() for o in outs),
                                        (qkv, flat))
        steps.add_(1)
        adamw_step_(param, grad, m, v, lr, decay, steps, beta1=0.9, beta2=0.999, eps=1e-8)
        return [o.detach() for o in outs] + [dx, dflat]

    state = [x.clone() for x in (param, m, v, steps)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager call, which also compiles the kernels
        eager = [x.clone() for x in step()]
        eager_state = [x.clone() for x in (param, m, v, steps)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for x, saved in zip((param, m, v, steps), state):
        x.copy_(saved)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
    for got, want in zip((param, m, v, steps), eager_state):
        assert torch.equal(got, want)
