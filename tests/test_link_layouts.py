"""The link forward in fla's layout (ChainPlan.layout "fla", mixers/chain/tiled.py) under
the interpreter: against the float64 token-by-token sum of its definition (outputs, final
state, and the gradients the unchanged backward takes from its chunk start states) and
against the chunk layout's forward (launch.forward's default kernels) in float32 and on
bfloat16 inputs; with and without decay, a ones column and a start state, T not a multiple
of the chunk, key and value dims that are not powers of two and span one or two blocks."""

import dataclasses

import pytest
import torch

from grids import parametrize
from mixers.chain import ChainPlan, backward, forward, launch, plan_chain
from mixers.errors import relative_error

B, H = 2, 2
DECAY = torch.tensor([0.6, 0.97], dtype=torch.float64)


def token_by_token(q, k, v, S0, decay, ones):
    """o_t = q_t^T S_t, S_t = g S_{t-1} + k_t v_t^T (v with a column of ones when `ones`),
    in the inputs' dtype (float64 here)."""
    if ones:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    g = decay.view(1, H, 1, 1).to(q.dtype) if decay is not None else 1.0
    S, outputs = S0, []
    for t in range(q.shape[1]):
        S = g * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append((q[:, t, :, :, None] * S).sum(2))
    return torch.stack(outputs, 1), S


def inputs(T, D, Dv, ones, start, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (0.3 * torch.randn(B, T, H, d, generator=gen, dtype=torch.float64).to(dtype)
               for d in (D, D, Dv))
    S0 = (torch.randn(B, H, D, Dv + ones, generator=gen, dtype=torch.float64)
          if start else None)
    return q, k, v, S0


def fla_plan(D, W, dtype, **fields):
    return dataclasses.replace(plan_chain(D, W, dtype, chunk_size=16, layout="fla"), **fields)


# (T, D, Dv, decay, ones column, start state): T of one partial chunk, exact chunks and a
# partial last chunk; key and value dims of one block (24, 40) and of two (80, 70).
FLOAT64_CASES = [
    (5, 24, 40, False, False, False),
    (37, 24, 40, True, True, True),
    (48, 24, 20, True, False, False),
    (21, 80, 70, False, True, True),
    (50, 80, 70, True, False, True),
    (37, 24, 40, False, False, True)]


@parametrize("T, D, Dv, with_decay, ones, start", FLOAT64_CASES,
             ids=[f"T{c[0]}-D{c[1]}-Dv{c[2]}" + "-decay" * c[3] + "-ones" * c[4] + "-start" * c[5]
                  for c in FLOAT64_CASES], fast=[1, 2])
def test_the_fla_layout_equals_the_token_by_token_sum(T, D, Dv, with_decay, ones, start):
    """Outputs and final state to 1e-12 of the float64 sum; the chunk start states it keeps
    give the backward gradients of q, k, v and S0 to 1e-12 of autograd's."""
    q, k, v, S0 = inputs(T, D, Dv, ones, start)
    decay = DECAY if with_decay else None
    log_g = torch.log(decay) if decay is not None else None
    W = Dv + ones
    plan = fla_plan(D, W, torch.float64)
    out, S1, starts = forward(q, k, v, S0, log_g, ones, plan, torch.float64, keep_starts=True)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    S0_leaf = (S0 if start else torch.zeros(B, H, D, W, dtype=torch.float64)).requires_grad_()
    want_out, want_S1 = token_by_token(*leaves, S0_leaf, decay, ones)
    assert relative_error(out, want_out) < 1e-12
    assert relative_error(S1, want_S1) < 1e-12

    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    grad_S1 = torch.randn(want_S1.shape, generator=gen, dtype=torch.float64)
    ((want_out * grad_out).sum() + (want_S1 * grad_S1).sum()).backward()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dS0 = backward(q, k, v, log_g, ones, starts, grad_out, grad_S1, dq, dk, dv, plan,
                   want_dS0=True)
    for name, got, want in (("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad),
                            ("dv", dv, leaves[2].grad), ("dS0", dS0, S0_leaf.grad)):
        assert relative_error(got, want) < 1e-12, name


# (input dtype, T, D, Dv, decay, ones column, start state)
LOW_CASES = [
    (torch.float32, 37, 24, 40, True, True, True),
    (torch.float32, 50, 80, 70, False, False, False),
    (torch.bfloat16, 37, 24, 40, False, True, True),
    (torch.bfloat16, 50, 80, 70, True, False, True),
    (torch.bfloat16, 21, 48, 20, True, True, False)]
# float32 inputs run exact float32 products ("ieee"); bfloat16 inputs the plan's TF32,
# whose products of bfloat16 values are exact and whose float32 operands (states, scores,
# decayed keys) round to TF32's 10-bit mantissa: on a GPU the two layouts differ by the
# order of their float32 sums and, at most, by a TF32 rounding of the same operands.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 5e-3)}


@parametrize("dtype, T, D, Dv, with_decay, ones, start", LOW_CASES,
             ids=[f"{str(c[0])[6:]}-T{c[1]}-D{c[2]}-Dv{c[3]}" + "-decay" * c[4] + "-ones" * c[5]
                  + "-start" * c[6] for c in LOW_CASES], fast=[0, 2])
def test_the_fla_layout_equals_the_chunk_layout_and_the_float64_sum(dtype, T, D, Dv,
                                                                    with_decay, ones, start):
    """float32 states and outputs of float32 or bfloat16 inputs: within the first tolerance
    of the chunk layout's forward (the same plan but its layout), within the second of the
    float64 sum on the same rounded inputs; the chunk start states the backward reads, too."""
    q, k, v, S0 = inputs(T, D, Dv, ones, start, seed=2, dtype=dtype)
    S0 = S0.float() if S0 is not None else None
    log_g = torch.log(DECAY.float()) if with_decay else None
    W = Dv + ones
    plan = fla_plan(D, W, dtype)
    got = forward(q, k, v, S0, log_g, ones, plan, torch.float32, keep_starts=True)
    chunks = forward(q, k, v, S0, log_g, ones, dataclasses.replace(plan, layout="chunks"),
                     torch.float32, keep_starts=True)
    to_layout, to_sum = TOLERANCES[dtype]
    for name, x, y in zip(("out", "S1", "starts"), got, chunks):
        assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape, name
        assert relative_error(x, y) < to_layout, name
    start64 = S0.double() if start else torch.zeros(B, H, D, W, dtype=torch.float64)
    want_out, want_S1 = token_by_token(q.double(), k.double(), v.double(), start64,
                                       DECAY if with_decay else None, ones)
    assert relative_error(got[0], want_out) < to_sum
    assert relative_error(got[1], want_S1) < to_sum


def test_16_bit_outputs_are_rounded_once_as_stored():
    """out_dtype bfloat16: the float32 outputs rounded to bfloat16 as the kernel stores them
    (within bfloat16's rounding of the float32 outputs), as the chunk layout stores them;
    the final state stays float32."""
    q, k, v, S0 = inputs(37, 24, 40, False, True, seed=3, dtype=torch.bfloat16)
    plan = fla_plan(24, 40, torch.bfloat16)
    wide, _, _ = forward(q, k, v, S0.float(), None, False, plan, torch.float32)
    narrow, S1, _ = forward(q, k, v, S0.float(), None, False, plan, torch.float32,
                            out_dtype=torch.bfloat16)
    chunks, _, _ = forward(q, k, v, S0.float(), None, False,
                           dataclasses.replace(plan, layout="chunks"), torch.float32,
                           out_dtype=torch.bfloat16)
    assert narrow.dtype == chunks.dtype == torch.bfloat16 and S1.dtype == torch.float32
    assert 0 < relative_error(narrow, wide) < 2 ** -7
    assert relative_error(narrow, chunks) < 2 ** -7


def test_a_one_chunk_link_without_states_runs_only_the_output_kernel(monkeypatch):
    """One chunk from a zero start without a final state: no state kernel, no states; the
    outputs are the float64 sum's."""
    def refuse(*args, **kwargs):
        raise AssertionError("a link without states launched its state kernel")

    class Refused:
        def __getitem__(self, grid):
            return refuse

    monkeypatch.setattr(launch, "chain_tiled_states_kernel", Refused())
    q, k, v, _ = inputs(11, 24, 40, False, False, seed=4)
    out, S1, starts = forward(q, k, v, None, torch.log(DECAY), False,
                              fla_plan(24, 40, torch.float64), torch.float64,
                              keep_starts=True, need_final=False)
    assert S1 is None and starts is None
    want, _ = token_by_token(q, k, v, torch.zeros(B, H, 24, 40, dtype=torch.float64), DECAY,
                             False)
    assert relative_error(out, want) < 1e-12


def test_the_fla_layout_launches_its_two_kernels_and_no_other(monkeypatch):
    """With layout "fla" the chunk layout's forward kernels (increments, scan, walk, output)
    are never launched: the link runs tiled.py's state and output kernels."""
    launched = []

    class Recorded:
        def __init__(self, name, kernel=None):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(self.name)
                if self.kernel is None:
                    raise AssertionError(f"{self.name} launched under the fla layout")
                return self.kernel[grid](*args, **kwargs)
            return run

    for name in ("chain_states_kernel", "chain_scan_kernel", "chain_walk_kernel",
                 "chain_output_kernel"):
        monkeypatch.setattr(launch, name, Recorded(name))
    for name in ("chain_tiled_states_kernel", "chain_tiled_output_kernel"):
        monkeypatch.setattr(launch, name, Recorded(name, getattr(launch, name)))
    q, k, v, S0 = inputs(37, 24, 40, False, True, seed=5)
    out, S1, _ = forward(q, k, v, S0, None, False, fla_plan(24, 40, torch.float64),
                         torch.float64)
    assert launched == ["chain_tiled_states_kernel", "chain_tiled_output_kernel"]
    want_out, want_S1 = token_by_token(q, k, v, S0, None, False)
    assert relative_error(out, want_out) < 1e-12
    assert relative_error(S1, want_S1) < 1e-12


def test_non_finite_inputs_reach_the_same_entries_in_both_layouts():
    """A NaN value of one token and an inf key of another: the outputs and states are
    non-finite exactly where the chunk layout's are (from the token's row of its chunk on,
    and every later chunk), and equal elsewhere."""
    q, k, v, S0 = inputs(50, 24, 40, True, True, seed=6)
    v[0, 20, 1, 3] = float("nan")
    k[1, 40, 0, 5] = float("inf")
    plan = fla_plan(24, 41, torch.float64)
    log_g = torch.log(DECAY)
    got = forward(q, k, v, S0, log_g, True, plan, torch.float64, keep_starts=True)
    want = forward(q, k, v, S0, log_g, True, dataclasses.replace(plan, layout="chunks"),
                   torch.float64, keep_starts=True)
    for name, x, y in zip(("out", "S1", "starts"), got, want):
        bad = ~torch.isfinite(y)
        assert bad.any(), name
        assert torch.equal(~torch.isfinite(x), bad), name
        assert relative_error(x[~bad], y[~bad]) < 1e-12, name


@pytest.mark.slow
def test_bf16_operands_in_the_fla_layout_stay_within_bf16_of_the_sum():
    """precision "bf16": every product's operands rounded to bfloat16 (the rounding of
    fla's kernels): on float32 inputs that bfloat16 cannot hold, outputs and final state
    differ from exact float32 products by more than float32 rounding and stay within 2e-2
    of the float64 sum (decay, start state, a ones column, two key blocks)."""
    q, k, v, S0 = inputs(45, 80, 40, True, True, seed=7, dtype=torch.float32)
    S0 = S0.float()
    log_g = torch.log(DECAY.float())
    results = {}
    for precision in ("ieee", "bf16"):
        plan = fla_plan(80, 41, torch.float32, precision=precision)
        results[precision] = forward(q, k, v, S0, log_g, True, plan, torch.float32)[:2]
    want = token_by_token(q.double(), k.double(), v.double(), S0.double(), DECAY, True)
    for name, exact, rounded, wanted in zip(("out", "S1"), results["ieee"], results["bf16"],
                                            want):
        assert relative_error(exact, wanted) < 1e-5, name
        assert relative_error(rounded, exact) > 1e-4, name
        assert relative_error(rounded, wanted) < 2e-2, name


@pytest.mark.parametrize("with_decay", [False, True], ids=["no-decay", "decay"])
def test_narrow_starts_change_no_product(with_decay):
    """narrow_starts (with precision "bf16"): the start states come back in bfloat16, the
    final state in float32; outputs, final state and the gradients the backward takes from
    the narrow states are those of float32 states to 1e-6 (the products round the states to
    bfloat16 either way) and within 2e-2 of the float64 sum (bfloat16 inputs, a ones column,
    a start state, two key blocks, a partial last chunk; the backward's end-state gradients
    through its increments and scan, which stay float32)."""
    T, D, Dv = 37, 80, 20
    q, k, v, S0 = inputs(T, D, Dv, True, True, seed=8, dtype=torch.bfloat16)
    S0 = S0.float()
    log_g = torch.log(DECAY.float()) if with_decay else None
    gen = torch.Generator().manual_seed(9)
    grad_out = torch.randn(B, T, H, Dv + 1, generator=gen)
    grad_S1 = torch.randn(B, H, D, Dv + 1, generator=gen)
    results = {}
    for narrow in (False, True):
        plan = fla_plan(D, Dv + 1, torch.bfloat16, precision="bf16", narrow_starts=narrow,
                        walk_chunks=0)
        out, S1, starts = forward(q, k, v, S0, log_g, True, plan, torch.float32,
                                  keep_starts=True)
        assert starts.dtype == (torch.bfloat16 if narrow else torch.float32)
        assert out.dtype == S1.dtype == torch.float32
        dq, dk, dv = (torch.zeros(x.shape) for x in (q, k, v))
        dS0 = backward(q, k, v, log_g, True, starts, grad_out, grad_S1, dq, dk, dv, plan,
                       want_dS0=True)
        results[narrow] = [out, S1, dq, dk, dv, dS0]
    want_out, want_S1 = token_by_token(q.double(), k.double(), v.double(), S0.double(),
                                       DECAY if with_decay else None, True)
    names = ("out", "S1", "dq", "dk", "dv", "dS0")
    for name, wide, narrow in zip(names, results[False], results[True]):
        assert relative_error(narrow, wide, norm="fro") < 1e-6, name
    for name, got, want in zip(("out", "S1"), results[True], (want_out, want_S1)):
        assert relative_error(got, want) < 2e-2, name


@parametrize("name", ["ahla2-decay", "hla3"], fast=[0])
def test_chained_operators_take_the_fla_layout(name, monkeypatch):
    """ahla2 (per-head decay, normalized) and causal hla3 with every link's plan in the fla
    layout: outputs, final states and the gradients of q, k and v equal the default
    layout's to 1e-12 in float64, and the fla layout's kernels are the ones launched."""
    from mixers import chain
    from mixers.hla.ahla2 import ahla2
    from mixers.hla.hla3 import hla3

    op, options = {"ahla2-decay": (ahla2, {"decay": DECAY, "normalize": True}),
                   "hla3": (hla3, {"variant": "causal", "normalize": False})}[name]
    gen = torch.Generator().manual_seed(10)
    q, k, v = (0.3 * torch.randn(B, 37, H, d, generator=gen, dtype=torch.float64).abs()
               for d in (24, 24, 20))
    grad = torch.randn(B, 37, H, 20, generator=gen, dtype=torch.float64)

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, state = op(*leaves, impl="triton", chunk_size=16, output_final_state=True,
                        **options)
        (out * grad).sum().backward()
        return out, state, [x.grad for x in leaves]

    want_out, want_state, want_grads = run()
    planned = chain.plan_chain
    monkeypatch.setattr(chain, "plan_chain",
                        lambda *args, **kwargs: planned(*args, **kwargs, layout="fla"))
    launched = []
    tiled = launch.chain_tiled_output_kernel

    class Counted:
        def __getitem__(self, grid):
            launched.append(grid)
            return tiled[grid]

    monkeypatch.setattr(launch, "chain_tiled_output_kernel", Counted())
    out, state, grads = run()
    assert len(launched) == (2 if name == "ahla2-decay" else 3)
    assert relative_error(out, want_out) < 1e-12
    for key in want_state:
        assert relative_error(state[key], want_state[key]) < 1e-12, key
    for axis, got, want in zip("qkv", grads, want_grads):
        assert relative_error(got, want) < 1e-12, axis


def test_plans_take_a_layout():
    assert plan_chain(64, 64, torch.bfloat16).layout == "chunks"
    assert plan_chain(64, 64, torch.bfloat16, layout="fla").layout == "fla"
    with pytest.raises(ValueError, match="layout"):
        plan_chain(64, 64, torch.bfloat16, layout="tiles")
    with pytest.raises(ValueError, match="layout"):
        ChainPlan(chunk=64, block_k=64, block_v=64, warps=4, stages=2, precision="tf32",
                  layout="flat")
    with pytest.raises(ValueError, match="narrow_starts"):
        dataclasses.replace(plan_chain(64, 64, torch.bfloat16, layout="fla"), narrow_starts=True)
    with pytest.raises(ValueError, match="narrow_starts"):
        dataclasses.replace(plan_chain(64, 64, torch.bfloat16), precision="bf16",
                            narrow_starts=True)
