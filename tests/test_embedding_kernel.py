"""The stacked embedding (hla_bench/recall/kernels/embedding.py) against F.embedding.

stacked_embedding's lookup and weight gradient equal F.embedding model by model: exactly in
float64 (every row, repeated ids, ids never used, one id for every token, 1 and 3 models),
on both paths (the Triton kernel under the interpreter on the CPU); float32 and bfloat16
gradients lie within their rounding of the float64 sums; the Triton path equals the PyTorch
path; bad arguments raise ValueError. With StackedLM.EMBEDDING_BACKWARD "sorted" the stacked
loss and every gradient equal those with F.embedding's own backward ("dense"); torch.compile traces the op without a
graph break, its backward one opaque call.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import hla_bench.recall.stacked as stacked_module
from hla_bench.recall.kernels import embedding_row_sums, stacked_embedding
from hla_bench.recall.pool import build_model
from hla_bench.recall.stacked import StackedLM
from hla_bench.recall.train import RunSpec
from tasks import IGNORE

# where the Triton path runs: CUDA, or the CPU under the interpreter (tests/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["torch", "triton"]
EXACT = 1e-12  # float64 against float64 sums in another order
FLOAT32 = 2e-6  # float32 sums against float64 ones, relative to the largest |sum| of a row
BF16 = 2.0 ** -8  # bfloat16: the float32 sum rounded once, half a step: 2^-9 of the entry


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference(tokens: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """Model by model F.embedding and its own weight gradient (autograd)."""
    weight = weight.detach().clone().requires_grad_(True)
    out = torch.stack([F.embedding(tokens[n], weight[n]) for n in range(weight.shape[0])])
    (dweight,) = torch.autograd.grad(out, weight, grad)
    return out.detach(), dweight


def ours(tokens, weight, grad, impl, device=DEVICE):
    """stacked_embedding's lookup and weight gradient, computed on `device`, on the CPU."""
    weight = weight.detach().to(device).requires_grad_(True)
    out = stacked_embedding(tokens.to(device), weight, impl=impl)
    (dweight,) = torch.autograd.grad(out, weight, grad.to(device))
    return out.detach().to(grad.device), dweight.to(grad.device)


def dyadic(shape, seed, dtype=torch.float64):
    """Values k / 8 with |k| <= 64: their sums of up to 2^40 terms are exact in float64."""
    return (torch.randint(-64, 65, shape, generator=generator(seed)) / 8).to(dtype)


# token cases: (name, N, V, tokens builder); every case leaves some ids unused
def _random(N, B, T, V, seed):
    return torch.randint(0, V - 4, (N, B, T), generator=generator(seed))  # the last 4 never


def _one_id(N, B, T, V, seed):
    return torch.full((N, B, T), 3, dtype=torch.long)


def _few(N, B, T, V, seed):
    return torch.randint(0, 3, (N, B, T), generator=generator(seed)) * 5  # ids 0, 5, 10


CASES = [("random-N1", 1, 40, 3, 37, _random), ("random-N3", 3, 40, 3, 37, _random),
         ("one-id-N3", 3, 23, 2, 41, _one_id), ("few-ids-N1", 1, 17, 3, 29, _few),
         ("few-ids-N3", 3, 17, 3, 29, _few)]
D = 37  # columns: not a power of two


def _case(case, seed=0):
    _, N, V, B, T, build = case
    tokens = build(N, B, T, V, seed)
    weight = torch.randn(N, V, D, generator=generator(seed + 1), dtype=torch.float64)
    return tokens, weight


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_float64_equals_f_embedding_exactly(case, impl):
    """Dyadic gradients: every sum is exact, so every row of the weight gradient, used or
    not, must equal F.embedding's own bit for bit; a row never looked up is exactly 0."""
    tokens, weight = _case(case)
    grad = dyadic((*tokens.shape, D), seed=2)
    out, dweight = ours(tokens, weight, grad, impl)
    ref_out, ref_dweight = reference(tokens, weight, grad)
    assert torch.equal(out, ref_out)
    assert torch.equal(dweight, ref_dweight)
    N, V = weight.shape[:2]
    for n in range(N):
        unused = torch.ones(V, dtype=torch.bool)
        unused[tokens[n].unique()] = False
        assert unused.any()
        assert torch.equal(dweight[n][unused], torch.zeros_like(dweight[n][unused]))
        counts = torch.bincount(tokens[n].reshape(-1), minlength=V)
        assert counts.max() > 1  # ids repeat


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_float64_random_gradients_to_rounding(case, impl):
    tokens, weight = _case(case, seed=5)
    grad = torch.randn(*tokens.shape, D, generator=generator(7), dtype=torch.float64)
    _, dweight = ours(tokens, weight, grad, impl)
    _, ref_dweight = reference(tokens, weight, grad)
    torch.testing.assert_close(dweight, ref_dweight, rtol=EXACT, atol=EXACT)


def _sums64(tokens, grad, V):
    """The float64 row sums `[N, V, d]` of `grad` (as rounded to its dtype), model by model."""
    d = grad.shape[-1]
    return torch.stack([torch.zeros(V, d, dtype=torch.float64).index_add_(
        0, tokens[n].reshape(-1), grad[n].reshape(-1, d).double())
        for n in range(tokens.shape[0])])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[1:3], ids=[c[0] for c in CASES[1:3]])
def test_low_precision_gradients_within_their_rounding(case, dtype, impl):
    """float32: the float32 sums within FLOAT32 of the largest float64 sum of the row;
    bfloat16: each entry the float32 sum rounded once (BF16 of the entry, plus the float32
    sums' error)."""
    tokens, weight = _case(case, seed=11)
    grad = torch.randn(*tokens.shape, D, generator=generator(13)).to(dtype)
    out, dweight = ours(tokens, weight.to(dtype), grad, impl)
    assert dweight.dtype == dtype and out.dtype == dtype
    exact = _sums64(tokens, grad, weight.shape[1])
    scale = exact.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    error = (dweight.double() - exact).abs()
    if dtype == torch.float32:
        assert (error <= FLOAT32 * scale).all(), (error / scale).max()
    else:
        assert (error <= BF16 * exact.abs() + FLOAT32 * scale).all(), \
            ((error - FLOAT32 * scale) / exact.abs()).max()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_triton_path_equals_torch_path(dtype):
    tokens, weight = _case(CASES[1], seed=17)
    grad = torch.randn(*tokens.shape, D, generator=generator(19)).to(dtype)
    _, torch_dweight = ours(tokens, weight.to(dtype), grad, "torch")
    _, triton_dweight = ours(tokens, weight.to(dtype), grad, "triton")
    tolerance = {torch.float64: EXACT, torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}[dtype]
    torch.testing.assert_close(triton_dweight, torch_dweight, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("impl", IMPLS)
def test_row_sums_wide_rows_and_strided_gradients(impl):
    """Rows wider than one program's column block, a gradient with a row stride past its
    width, and ids of another integer dtype."""
    grad = dyadic((50, 300), seed=23)[:, :260]
    ids = torch.randint(0, 9, (50,), generator=generator(29)).to(torch.int32)
    got = embedding_row_sums(grad.to(DEVICE), ids.to(DEVICE), 12, impl=impl).cpu()
    expected = torch.zeros(12, 260, dtype=torch.float64).index_add_(0, ids.long(), grad)
    assert torch.equal(got, expected)
    assert torch.equal(got[9:], torch.zeros(3, 260, dtype=torch.float64))


def test_bad_arguments_raise_value_error():
    weight = torch.randn(2, 5, 3)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    bad = [
        (lambda: stacked_embedding(tokens, weight, impl="cuda"), "impl"),
        (lambda: stacked_embedding(tokens, weight[0]), "weight"),
        (lambda: stacked_embedding(tokens, weight.long()), "weight"),
        (lambda: stacked_embedding(tokens.float(), weight), "tokens"),
        (lambda: stacked_embedding(tokens[:1], weight), "tokens"),
        (lambda: stacked_embedding(tokens.new_zeros(()), weight), "tokens"),
        (lambda: stacked_embedding([[0]], weight), "tokens"),
        (lambda: stacked_embedding(tokens.to("meta"), weight), "tokens"),
        (lambda: embedding_row_sums(torch.randn(4), tokens[0], 5), "grad"),
        (lambda: embedding_row_sums(torch.randn(4, 3).long(), tokens[0], 5), "grad"),
        (lambda: embedding_row_sums(torch.randn(4, 3), tokens[0, :3], 5), "ids"),
        (lambda: embedding_row_sums(torch.randn(4, 3), tokens[0].float(), 5), "ids"),
        (lambda: embedding_row_sums(torch.randn(4, 3), tokens[0].to("meta"), 5), "ids"),
        (lambda: embedding_row_sums(torch.randn(4, 3), tokens[0], -1), "rows"),
        (lambda: embedding_row_sums(torch.randn(4, 3), tokens[0], True), "rows"),
        (lambda: embedding_row_sums(torch.randn(4, 3), tokens[0], 5, impl="fast"), "impl"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()


def test_stacked_embedding_runs_without_triton_on_the_cpu(monkeypatch):
    """impl="triton" is refused where Triton cannot run (no CUDA, no interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="cannot run here"):
        stacked_embedding(torch.zeros(1, 2, dtype=torch.long), torch.randn(1, 3, 2),
                          impl="triton")


# ---------------------------------------------------------------- StackedLM's switch

def _stack(dtype=torch.float64):
    runs = [RunSpec(mixer="sdpa", d_model=16, lr=1e-3, seed=seed, task="mqar",
                    params=dict(vocab_size=64, seq_len=32, num_kv_pairs=4)).as_dict()
            for seed in (0, 1, 2)]
    models = []
    for run in runs:
        torch.manual_seed(run["seed"])
        models.append(build_model(run).to(dtype))
    tokens = torch.randint(0, 60, (3, 5, 32), generator=generator(31))  # ids 60-63 unused
    labels = torch.full_like(tokens, IGNORE)
    labels[..., -6:] = tokens[..., -6:]
    return StackedLM(models), tokens, labels


def _loss_and_grads(backward: str, monkeypatch):
    monkeypatch.setattr(stacked_module, "EMBEDDING_BACKWARD", backward)
    stack, tokens, labels = _stack()
    loss = stack.losses(tokens, labels, 32).sum()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in stack.params.items()}


def test_stacked_sorted_backward_equals_the_dense_one(monkeypatch):
    """float64, CPU: the loss and every parameter's gradient (the embedding's, tied to the
    head, included) are the same with the sorted backward, the default, as with
    F.embedding's."""
    assert stacked_module.EMBEDDING_BACKWARD == "sorted"  # the default
    loss_off, grads_off = _loss_and_grads("dense", monkeypatch)
    loss_on, grads_on = _loss_and_grads("sorted", monkeypatch)
    torch.testing.assert_close(loss_on, loss_off, rtol=EXACT, atol=0)
    assert grads_on.keys() == grads_off.keys() and "embed.weight" in grads_on
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=EXACT, atol=EXACT,
                                   msg=f"{name} differs")
    assert grads_on["embed.weight"][:, 60:].abs().sum() > 0  # the tied head reaches every row


def test_stacked_switch_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setattr(stacked_module, "EMBEDDING_BACKWARD", "atomic")
    stack, tokens, labels = _stack()
    with pytest.raises(ValueError, match="EMBEDDING_BACKWARD"):
        stack.losses(tokens, labels, 32)


# ---------------------------------------------------------------- torch.compile

def _recording_backend(graphs: dict):
    """aot_eager that keeps the forward and backward graphs it is given."""
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(graph, example_inputs):
            graphs.setdefault(kind, []).append(graph)
            return graph.forward
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def _targets(graph) -> set[str]:
    return {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}


def test_compiled_without_a_graph_break_backward_one_opaque_op():
    from torch._dynamo.utils import counters

    tokens, weight = _case(CASES[1])
    positions = torch.randn(3, 1, tokens.shape[2], D, dtype=torch.float64, generator=generator(37))

    def loss(weight):
        return (stacked_embedding(tokens, weight) + positions).square().sum()

    torch._dynamo.reset()
    counters.clear()
    graphs: dict = {}
    compiled = torch.compile(loss, backend=_recording_backend(graphs), fullgraph=True)
    w = weight.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(compiled(w), w)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(graphs["forward"]) == len(graphs["backward"]) == 1
    backward = _targets(graphs["backward"][0])
    assert "hla_bench.embedding_row_sums.default" in backward, backward
    assert not {t for t in backward if "embedding_dense_backward" in t or "index_put" in t
                or "scatter" in t}, backward
    w = weight.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(loss(w), w)
    torch.testing.assert_close(got, expected, rtol=EXACT, atol=EXACT)


@pytest.mark.slow
def test_compiled_stacked_loss_with_the_switch_on_traces_one_graph(monkeypatch):
    """The stacked loss with the sorted backward compiles (inductor, CPU) into one graph and
    gives the eager loss and embedding gradient."""
    monkeypatch.setattr(stacked_module, "EMBEDDING_BACKWARD", "sorted")
    stack, tokens, labels = _stack()
    explained = torch._dynamo.explain(stack.losses)(tokens, labels, 32)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [str(reason.reason)[:200] for reason in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(stack.losses), fullgraph=True)
    loss = compiled(tokens, labels, 32).sum()
    loss.backward()
    got = stack.params["embed.weight"].grad.clone()
    stack.zero_grad()
    eager = stack.losses(tokens, labels, 32).sum()
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-10, atol=0)
    torch.testing.assert_close(got, stack.params["embed.weight"].grad, rtol=1e-10, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_backward_replays_inside_a_cuda_graph():
    """The lookup and its sorted backward captured as a CUDA graph (after two eager warm-up
    calls on a side stream) replay, for new tokens copied into the captured tensor, the
    PyTorch path's weight gradient: sort, searchsorted and the kernel read the ids on the
    device, nothing reaches the host."""
    N, V, B, T = 3, 300, 4, 64
    tokens = torch.randint(0, V, (N, B, T), generator=generator(41)).cuda()
    weight = torch.randn(N, V, D, generator=generator(43)).cuda().requires_grad_()
    grad = torch.randn(N, B, T, D, generator=generator(47)).cuda()

    def step():
        weight.grad = None
        stacked_embedding(tokens, weight).backward(grad)
        return weight.grad

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (53, 59):
        tokens.copy_(torch.randint(0, V - 7, (N, B, T), generator=generator(seed)))
        graph.replay()
        _, expected = ours(tokens, weight, grad, "torch", device="cuda")
        torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(captured[:, V - 7:], torch.zeros_like(captured[:, V - 7:]))
