"""Triton hla2 kernels vs hla2's float64 explicit sums (mixers/hla/hla2/naive.py).

On CPU the kernels run in the Triton interpreter (tests/conftest.py) and the half-precision
test uses fp16 (the interpreter mishandles bf16 memory); on CUDA they run natively, in bf16,
plus bf16 shapes with D = 64 and 128. The bf16 normalize test runs under the interpreter too,
with its dots made exact on bf16 operands (the bf16_dots fixture).

Tolerances (relative Frobenius error against the float64 reference):
  fp32 inputs: outputs and states < 1e-4, gradients < 1e-4
  bf16 / fp16 inputs: outputs and states < 2e-2, gradients < 3e-2
"""

import functools
import itertools
import os
from dataclasses import replace

import pytest
import torch
from triton.runtime import Autotuner

from grids import parametrize
from hla2_plans import chunk_128_paths, num_chunks, split_output_rows, two_level_scans
from mixers.hla.hla2 import hla2, hla2_step
from mixers.hla.hla2.naive import hla2_naive, hla2_naive_final_state
from mixers.hla.hla2.triton import (ScanPlan, hla2_step_triton, hla2_triton, plan_call,
                                    plan_launch, triton_unsupported_reason)
from mixers.hla.hla2.triton import backward as backward_stage
from mixers.hla.hla2.triton import chunked, common, increments, output, paper, scans
from mixers.hla.hla2.triton import plan as planning
from mixers.errors import relative_error

RUNNABLE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 3e-2), torch.float16: (2e-2, 3e-2)}
# The interpreter mishandles bfloat16 memory, so on CPU the half-precision path runs in fp16.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16


def reference(q, k, v, state=None, **options):
    """hla2's float64 explicit sums (mixers/hla/hla2/naive.py) from `state`, differentiable:
    (o, final state)."""
    return (hla2_naive(q, k, v, initial_state=state, **options),
            hla2_naive_final_state(q, k, v, initial_state=state, **options))


# The tolerances above are set on the Frobenius norm.
frobenius_error = functools.partial(relative_error, norm="fro")


def decode_each_token(q, k, v, state, **options):
    """hla2_step_triton (masked decay form) over every token of `[B, T, *, *]` q, k, v from
    `state`: the outputs `[B, T, H, Dv]` and the last state."""
    outs = []
    for t in range(q.shape[1]):
        o_t, state = hla2_step_triton(q[:, t], k[:, t], v[:, t], state, decay_form="masked",
                                      **options)
        outs.append(o_t)
    return torch.stack(outs, 1), state


def make_inputs(B, T, H, D, Dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, d, generator=gen) * d ** -0.5 for d in (D, D, Dv))
    return [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)]


def weighted_loss(o, state, seed=1):
    """A loss that reaches every output and state entry with distinct random weights."""
    gen = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=gen).to(o.device, torch.float64)).sum()
    for key in sorted(state):
        w = torch.randn(state[key].shape, generator=gen).to(o.device, torch.float64)
        loss = loss + (state[key].double() * w).sum()
    return loss


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def planned(variant, q, k, v, **options):
    """The default plan of hla2_triton(q, k, v, **options) in the current grad mode, changed
    by variant(plan); None for variant None (the op then plans itself)."""
    return None if variant is None else variant(plan_call(q, k, v, **options))


def check_against_reference(q, k, v, *, chunk_size, initial_state=None, normalize=False,
                            decay=None, eps=1e-6, variant=None):
    """Outputs, final states and gradients against float64; variant(plan) changes the
    launch plan."""
    plan = planned(variant, q, k, v, normalize=normalize, decay=decay, chunk_size=chunk_size,
                   initial_state=initial_state)
    o, final = hla2_triton(q, k, v, normalize=normalize, eps=eps, decay=decay,
                           decay_form="masked", chunk_size=chunk_size,
                           initial_state=initial_state, output_final_state=True, plan=plan)
    ref_o, ref_final = reference(q, k, v, initial_state, decay=decay, normalize=normalize,
                                 eps=eps)
    assert_matches(q, k, v, initial_state, (o, final), (ref_o, ref_final), *TOL[q.dtype])


def check_forward_against_reference(q, k, v, state, *, chunk_size, normalize, decay,
                                    eps=1e-3, variant=None):
    """A forward without gradients: outputs and final states against float64, within the
    output tolerance of q's dtype; variant(plan) changes the launch plan."""
    with torch.no_grad():
        plan = planned(variant, q, k, v, normalize=normalize, decay=decay,
                       chunk_size=chunk_size, initial_state=state)
        o, final = hla2_triton(q, k, v, normalize=normalize, eps=eps, decay=decay,
                               chunk_size=chunk_size, initial_state=state,
                               output_final_state=True, plan=plan)
    ref_o, ref_final = reference(q, k, v, state, decay=decay, normalize=normalize, eps=eps)
    assert frobenius_error(o, ref_o) < TOL[q.dtype][0]
    for key in ref_final:
        assert frobenius_error(final[key], ref_final[key]) < TOL[q.dtype][0], key


def assert_matches(q, k, v, initial_state, got, want, out_tol, grad_tol):
    """Outputs, final states (fp32) and the gradients of every input and initial state of
    a Triton result `got` = (o, final) agree with the float64 reference `want`."""
    (o, final), (ref_o, ref_final) = got, want
    names = ["q", "k", "v"] + ([] if initial_state is None else sorted(initial_state))
    leaves = [q, k, v] + [initial_state[key] for key in names[3:]]
    assert o.dtype == q.dtype and o.shape == v.shape
    assert sorted(final) == sorted(ref_final)
    assert frobenius_error(o, ref_o) < out_tol
    for key in ref_final:
        assert final[key].dtype == torch.float32
        assert frobenius_error(final[key], ref_final[key]) < out_tol, key
    got_grads = grads(weighted_loss(o, final), leaves)
    want_grads = grads(weighted_loss(ref_o, ref_final), leaves)
    for name, a, b in zip(names, got_grads, want_grads):
        assert frobenius_error(a, b) < grad_tol, name


# the kernels of each stage module, as its launchers look them up
STAGE_KERNELS = {increments: ["chunk_increments_kernel"],
                 scans: ["state_scan_kernel", "grad_scan_kernel"],
                 output: ["chunk_output_kernel"],
                 backward_stage: ["chunk_grad_terms_kernel", "chunk_grads_kernel"],
                 paper: ["paper_forward_kernel", "paper_backward_kernel"]}


@pytest.fixture
def launches(monkeypatch):
    """[(kernel name, grid, keyword arguments)] of every launch of the chunked op's kernels
    during the test, in order."""
    seen = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((self.name, tuple(grid), kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for module, names in STAGE_KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, Recorder(name, getattr(module, name)))
    return seen


def launched(launches, name):
    """The (grid, keyword arguments) of each launch of kernel `name`."""
    return [(grid, kwargs) for kernel, grid, kwargs in launches if kernel == name]


@parametrize("T, chunk_size, D, Dv",
             [(37, 16, 16, 32), (100, 32, 32, 16), (32, 16, 16, 16), (1, 16, 16, 16)], fast=[0])
def test_matches_reference_fp32(T, chunk_size, D, Dv):
    q, k, v = make_inputs(2, T, 2, D, Dv, torch.float32)
    check_against_reference(q, k, v, chunk_size=chunk_size)


def random_state(B, H, D, Dv, normalize=False, seed=3):
    """A state that a previous run could have produced (S symmetric PSD)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, 2 * D, D, generator=gen) * D ** -0.5
    state = {"S": k.transpose(-1, -2) @ k, "A": torch.randn(B, H, D, Dv, generator=gen)}
    if normalize:
        state["a"] = torch.rand(B, H, D, generator=gen) + 1.0
    return {key: x.to(DEVICE).requires_grad_() for key, x in state.items()}


@parametrize("normalize, parts", [(False, ("qk", "v")), (True, ("qk", "v")),
                                  (True, ("q", "k", "v"))], fast=[1])
def test_split_gradient_launches(launches, normalize, parts):
    """Large head dims compute dq, dk and dv in several launches; force that path here."""
    q, k, v = make_inputs(1, 40, 2, 16, 32, torch.float32, seed=18)
    check_against_reference(q, k, v, chunk_size=16, decay=torch.tensor([0.9, 0.8]).to(DEVICE),
                            normalize=normalize, eps=1e-3,
                            variant=lambda plan: replace(plan, grad_launches=parts))
    wants = [(kw["WANT_Q"], kw["WANT_K"], kw["WANT_V"])
             for _, kw in launched(launches, "chunk_grads_kernel")]
    assert wants == [tuple(x in part for x in "qkv") for part in parts]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a race needs real warps")
def test_in_place_scans_read_before_they_write():
    """The scans and decode steps overwrite what they read: without a barrier between a step's
    loads and its stores a lagging warp may read a value another warp has overwritten (a
    normalize vector of the gradient scan, dk off now and then). The kernels are
    deterministic, so a race shows as repeated calls that differ; the interpreter cannot
    catch it. Nonnegative q, k keep the
    denominator away from zero (signed inputs of seed 6 reach gradients of 9e4, where the
    PyTorch chunk form is off by 2.2e-4 too)."""
    dec = torch.tensor([0.9, 0.8]).to(DEVICE)
    for seed in range(8):
        q, k, v = make_inputs(1, 40, 2, 16, 32, torch.float32, seed=seed)
        with torch.no_grad():
            q.abs_(), k.abs_()
        check_against_reference(q, k, v, chunk_size=16, decay=dec, normalize=True, eps=1e-3)

    def run():
        o, final = hla2_triton(q, k, v, normalize=True, eps=1e-3, decay=dec, chunk_size=16,
                               output_final_state=True)
        return (o, *final.values(), *grads(weighted_loss(o, final), [q, k, v]))

    first = run()
    for _ in range(16):
        assert all(torch.equal(a, b) for a, b in zip(run(), first))


@pytest.mark.slow
def test_backward_twice_with_retained_graph():
    """The backward reads the chunk states the forward kept and must not overwrite them: a
    second backward through the same graph gives the same gradients."""
    q, k, v = make_inputs(1, 50, 2, 16, 16, torch.float32, seed=32)
    o, final = hla2_triton(q, k, v, normalize=True, eps=1e-3, chunk_size=16,
                           initial_state=None, output_final_state=True)
    loss = weighted_loss(o, final)
    first = torch.autograd.grad(loss, [q, k, v], retain_graph=True)
    second = torch.autograd.grad(loss, [q, k, v])
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.slow
@pytest.mark.parametrize("T, normalize, decay", [(45, False, None), (77, True, (0.9, 0.7))])
def test_two_level_scans(launches, T, normalize, decay):
    """Long sequences scan in segments of chunks; force 2-chunk segments here (the last
    segment and chunk partial) with initial and final states and their gradients."""
    q, k, v = make_inputs(1, T, 2, 16, 32, torch.float32, seed=19)
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    check_against_reference(q, k, v, chunk_size=16, normalize=normalize, eps=1e-3, decay=g,
                            initial_state=random_state(1, 2, 16, 32, normalize),
                            variant=two_level_scans)
    n_seg = -(-(-(-T // 16)) // 2)  # of 2 chunks of 16 tokens
    for name in ("state_scan_kernel", "grad_scan_kernel"):  # summaries, chain, rescan
        scans_run = launched(launches, name)
        assert [(grid[1], kw["SUMMARY"]) for grid, kw in scans_run] == [
            (n_seg, True), (1, False), (n_seg, False)]


@pytest.mark.slow
@pytest.mark.parametrize("normalize, decay", [(False, None), (True, (0.9, 0.7))])
def test_wide_scan_rows(launches, normalize, decay):
    """Scans with programs to spare take wider row blocks (state scan 32 rows, gradient scan
    64); force them here at D = 64 with initial states and their gradients."""
    q, k, v = make_inputs(1, 70, 2, 64, 32, torch.float32, seed=21)
    g = None if decay is None else torch.tensor(decay, device=DEVICE)

    def wide(plan):
        NT = num_chunks(plan)
        return replace(plan, state_scan=ScanPlan(32, NT, 1), grad_scan=ScanPlan(64, NT, 1))

    check_against_reference(q, k, v, chunk_size=16, normalize=normalize, eps=1e-3, decay=g,
                            initial_state=random_state(1, 2, 64, 32, normalize), variant=wide)
    assert [(grid[0], kw["BD"]) for grid, kw in launched(launches, "state_scan_kernel")
            + launched(launches, "grad_scan_kernel")] == [(2, 32), (1, 64)]


@pytest.mark.slow
@pytest.mark.parametrize("normalize, decay", [(False, None), (True, [0.9, 0.75])])
def test_increments_and_grad_terms_in_row_blocks(launches, normalize, decay):
    """The increments and gradient-terms kernels split the state rows over programs (each
    recomputes the chunk's mixed values); force 16-row blocks at D = 64 (Dv = 32), outputs
    and gradients against float64, with initial states."""
    q, k, v = make_inputs(2, 45, 2, 64, 32, torch.float32, seed=23)
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    check_against_reference(q, k, v, chunk_size=16, normalize=normalize, eps=1e-3, decay=g,
                            initial_state=random_state(2, 2, 64, 32, normalize),
                            variant=lambda plan: replace(plan, increments_rows=16,
                                                         grad_terms_rows=16))
    for name in ("chunk_increments_kernel", "chunk_grad_terms_kernel"):
        (grid, kw), = launched(launches, name)
        assert (grid[0], kw["BR"]) == (4, 16), name


@pytest.mark.slow
@pytest.mark.parametrize("T, normalize, decay", [(45, False, None), (40, True, [0.9, 0.6]),
                                                 (77, True, [0.95, 0.7]), (77, False, None)])
def test_output_rows_split(launches, T, normalize, decay):
    """A chunk of 128 runs its output as two programs of half the rows (the second mixes with
    the first half); force 16-row halves of 32-token chunks, with partial last chunks
    (T = 40: its second half is empty; 77: partly filled), against float64 with initial
    states."""
    q, k, v = make_inputs(2, T, 2, 16, 32, torch.float32, seed=25)
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    check_against_reference(q, k, v, chunk_size=32, normalize=normalize, eps=1e-3, decay=g,
                            initial_state=random_state(2, 2, 16, 32, normalize),
                            variant=split_output_rows)
    (grid, kw), = launched(launches, "chunk_output_kernel")
    assert (grid[1], kw["BT"]) == (2 * -(-T // 32), 16)


@pytest.mark.slow
@pytest.mark.parametrize("T, normalize, decay, segments", [
    (77, False, None, False), (77, True, [0.9, 0.6], False), (100, True, [0.95, 0.7], True),
    (70, False, None, True)])
def test_chunk_128_paths_without_backward(monkeypatch, launches, T, normalize, decay,
                                          segments):
    """At chunk 128 and head dim 128 (a 16-bit forward alone runs chunk 128 there) the
    increments run in two halves of tokens, the output loads its states late and a forward
    without backward scans into state buffers of their own. Forced here at chunk 32, D = 32,
    Dv = 16 (partial last chunks), with initial and final states, one- and two-level scans,
    against float64; the states must not overwrite the increments (the scan's loads stay in
    flight across steps there)."""
    calls = []
    scan = chunked._scan_states
    monkeypatch.setattr(chunked, "_scan_states",
                        lambda inc, *args: calls.append((inc, args[-1])) or scan(inc, *args))
    q, k, v = (x.detach() for x in make_inputs(2, T, 2, 32, 16, torch.float32, seed=27))
    q.abs_(), k.abs_()
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    state = {key: x.detach() for key, x in random_state(2, 2, 32, 16, normalize).items()}
    variant = (lambda plan: two_level_scans(chunk_128_paths(plan))) if segments \
        else chunk_128_paths
    check_forward_against_reference(q, k, v, state, chunk_size=32, normalize=normalize,
                                    decay=g, variant=variant)
    (inc, out), = calls
    assert out is not None and all(a.data_ptr() != b.data_ptr()
                                   for a, b in zip(out[:2], (inc[0], inc[2])))
    (_, kw), = launched(launches, "chunk_increments_kernel")
    (_, kw_out), = launched(launches, "chunk_output_kernel")
    assert kw["HALVES"] and kw_out["LATE_STATES"]
    assert [kw["IN_PLACE"] for _, kw in launched(launches, "state_scan_kernel")] == (
        [False, True, False] if segments else [False])  # the summaries' chain runs in place


@pytest.mark.slow
@pytest.mark.parametrize("normalize, decay", [(False, None), (True, [0.9, 0.75])])
def test_chunk_128_paths_with_backward(launches, normalize, decay):
    """With a backward pass the states overwrite the increments; the increments in halves and
    the late state loads (forced at chunk 32) give the same outputs, final states and
    gradients as the float64 reference (nonnegative q, k keep the denominator away from
    zero: signed ones put the gradients 1e-4 off with or without these paths)."""
    q, k, v = make_inputs(1, 77, 2, 32, 16, torch.float32, seed=29)
    with torch.no_grad():
        q.abs_(), k.abs_()
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    check_against_reference(q, k, v, chunk_size=32, normalize=normalize, eps=1e-3, decay=g,
                            initial_state=random_state(1, 2, 32, 16, normalize),
                            variant=chunk_128_paths)
    (_, kw), = launched(launches, "chunk_increments_kernel")
    (_, kw_out), = launched(launches, "chunk_output_kernel")
    (_, kw_scan), = launched(launches, "state_scan_kernel")
    assert kw["HALVES"] and kw_out["LATE_STATES"] and kw_scan["IN_PLACE"]


def test_chunk_128_paths_only_at_head_dim_128():
    """The default plan takes the chunk-128 paths at chunks of 128 with D = Dv = 128 only (a
    16-bit forward alone there; bf16 with them at D = 16 makes an illegal memory access)."""
    def paths(D, DV, backward=False, dtype=torch.bfloat16):
        plan = plan_launch((1, 1024, 2, D, DV), dtype, "cpu", backward, chunk_size=128)
        return plan.increments_halves, plan.late_states, plan.states_out_of_place

    assert paths(128, 128) == (True, True, True)
    assert paths(128, 128, dtype=torch.float16) == (True, True, True)
    assert paths(128, 128, backward=True) == (False, False, False)  # chunk 64 there
    assert paths(128, 128, dtype=torch.float32) == (False, False, False)  # chunk 32
    assert paths(64, 64) == paths(128, 64) == paths(64, 128) == (False, False, False)


def test_scan_plan():
    """Wide row blocks in one level when the 16-row programs would take enough waves (state
    scan 1, gradient scan 4), 16-row blocks (and segments where they cannot fill the GPU)
    when few (64k x 1). Off CUDA the plan assumes 132 SMs: 264 resident programs at D <= 64,
    132 at 128."""
    def plan(B, H, D, T=8192):
        return plan_launch((B, T, H, D, D), torch.bfloat16, "cpu", True)  # chunk 64

    assert plan(8, 16, 128).grad_scan == ScanPlan(64, 128, 1)  # 1024 programs
    assert plan(8, 16, 128).state_scan == ScanPlan(32, 128, 1)
    assert plan(1, 16, 128, T=65536).state_scan.rows == 16  # 128 programs: under a wave
    long = plan(1, 16, 64, T=65536).state_scan
    assert long.rows == 16 and long.n_seg > 1 and long.seg * long.n_seg >= 1024
    assert plan(8, 16, 64).state_scan.rows == 32  # 512 programs: 2 waves
    assert plan(8, 16, 64).grad_scan.rows == 16
    assert plan(256, 16, 16).grad_scan.rows == 16  # never wider than the head dim
    assert plan_launch((8, 8192, 16, 64, 64), torch.bfloat16, "cpu", True,
                       resident=1024).state_scan.rows == 16  # a larger device: under a wave
    assert plan(8, 16, 64).backward and not plan_launch(
        (8, 8192, 16, 64, 64), torch.bfloat16, "cpu", False).grad_scan  # no backward


def test_segment_choice():
    """One level when the row-block programs already fill the device (B = 8 at 8k tokens),
    segments when they do not (B = 1 at 64k); segments always cover every chunk."""
    segments = planning._segments
    assert segments(128, 4 * 128, 264) == (128, 1)
    seg, n_seg = segments(1024, 4 * 16, 264)
    assert n_seg > 1 and seg * n_seg >= 1024
    for NT in (33, 100, 1000):
        seg, n_seg = segments(NT, 4, 264)
        assert seg * (n_seg - 1) < NT <= seg * n_seg


def test_initial_state_values_and_grads():
    q, k, v = make_inputs(1, 50, 2, 16, 16, torch.float32, seed=4)
    check_against_reference(q, k, v, chunk_size=16, initial_state=random_state(1, 2, 16, 16))


def test_initial_state_continues_the_sequence():
    q, k, v = make_inputs(1, 70, 2, 16, 32, torch.float32, seed=5)
    full, full_state = hla2_triton(q, k, v, normalize=False, eps=1e-6, decay=None,
                                   decay_form="masked", chunk_size=16, initial_state=None,
                                   output_final_state=True)
    kw = dict(normalize=False, eps=1e-6, decay=None, decay_form="masked", chunk_size=32,
              output_final_state=True)
    first, mid = hla2_triton(q[:, :23], k[:, :23], v[:, :23], initial_state=None, **kw)
    second, last = hla2_triton(q[:, 23:], k[:, 23:], v[:, 23:], initial_state=mid, **kw)
    assert frobenius_error(torch.cat([first, second], 1), full) < 1e-4
    for key in full_state:
        assert frobenius_error(last[key], full_state[key]) < 1e-4


def test_empty_sequence_returns_the_initial_state():
    q, k, v = make_inputs(1, 0, 2, 16, 32, torch.float32)
    state = {key: x.detach() for key, x in random_state(1, 2, 16, 32).items()}
    o, final = hla2(q, k, v, impl="triton", chunk_size=16, initial_state=state,
                    output_final_state=True)
    assert o.shape == (1, 0, 2, 32)
    assert all(torch.equal(final[key], state[key]) for key in state)


def test_no_final_state_unless_asked():
    q, k, v = make_inputs(1, 20, 2, 16, 16, torch.float32)
    o, final = hla2_triton(q, k, v, normalize=False, eps=1e-6, decay=None, decay_form="masked",
                           chunk_size=16, initial_state=None, output_final_state=False)
    assert final is None
    o.sum().backward()
    assert all(x.grad is not None for x in (q, k, v))


def test_normalize_matches_reference():
    q, k, v = make_inputs(1, 45, 2, 16, 16, torch.float32, seed=8)
    check_against_reference(q, k, v, chunk_size=16, normalize=True, eps=1e-3,
                            initial_state=random_state(1, 2, 16, 16, normalize=True))


def test_normalize_half_precision_without_state():
    q, k, v = make_inputs(1, 40, 2, 16, 32, HALF, seed=20)
    with torch.no_grad():  # nonnegative features keep the denominator away from zero
        q.abs_(), k.abs_()
    check_against_reference(q, k, v, chunk_size=16, normalize=True, eps=1e-3)


def test_normalize_runs_in_the_same_launches(launches):
    """The denominator rides along in the numerator's kernels: one launch of each kernel
    per forward pass, not a second op on a block of ones."""
    q, k, v = (x.detach() for x in make_inputs(1, 20, 2, 16, 16, torch.float32))
    hla2_triton(q, k, v, normalize=True, eps=1e-3, decay=None, decay_form="masked",
                chunk_size=16, initial_state=None, output_final_state=True)
    assert [name for name, _, _ in launches] == ["chunk_increments_kernel", "state_scan_kernel",
                                                 "chunk_output_kernel"]


def test_inference_skips_the_autograd_node(monkeypatch):
    """Without gradients the forward runs directly (no autograd node, no kept chunk states);
    with them it goes through the autograd function, and both give the same output."""
    calls = []
    apply = chunked._HLA2Masked.apply
    monkeypatch.setattr(chunked._HLA2Masked, "apply",
                        lambda *args: calls.append(1) or apply(*args))
    q, k, v = make_inputs(1, 20, 2, 16, 16, torch.float32)
    with torch.no_grad():
        o_inference, _ = hla2_triton(q, k, v, chunk_size=16)
    assert calls == []
    o_train, _ = hla2_triton(q, k, v, chunk_size=16)
    assert calls == [1] and o_train.requires_grad
    assert torch.equal(o_inference, o_train.detach())


def test_half_precision_matches_reference():
    q, k, v = make_inputs(1, 40, 2, 16, 16, HALF, seed=6)
    check_against_reference(q, k, v, chunk_size=16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large head dims run natively only")
@pytest.mark.parametrize("D", [64, 128])
def test_bf16_large_head_dims_cuda(D):
    q, k, v = make_inputs(2, 300, 4, D, D, torch.bfloat16, seed=7)
    check_against_reference(q, k, v, chunk_size=64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large head dims run natively only")
def test_bf16_head_dim_128_chunk_128():
    """A backward at head dim 128 runs with chunk 64 (chunk 128 would ask for 320 KiB of
    shared memory); the forward alone keeps 128. Both match the reference."""
    q, k, v = make_inputs(1, 300, 2, 128, 128, torch.bfloat16, seed=8)
    check_against_reference(q, k, v, chunk_size=128)
    with torch.no_grad():
        o, _ = hla2_triton(q, k, v, normalize=False, eps=1e-6, decay=None, decay_form="masked",
                           chunk_size=128, initial_state=None, output_final_state=False)
    ref_o, _ = reference(q, k, v, None, decay=None, normalize=False, eps=1e-6)
    assert frobenius_error(o, ref_o) < TOL[q.dtype][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large head dims run natively only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_alone_at_head_dim_128_every_option(dtype):
    """A 16-bit forward alone at head dim 128 runs chunk 128 whatever was asked: outputs and
    final states with normalize, decay and an initial state against float64 (300 tokens:
    a partial last chunk)."""
    B, H = 2, 4
    q, k, v = (x.detach() for x in make_inputs(B, 300, H, 128, 128, dtype, seed=12))
    q.abs_(), k.abs_()  # nonnegative q, k keep the denominator away from zero
    g = torch.tensor([0.99, 0.9, 0.8, 0.5], device=DEVICE)
    state = {key: x.detach() for key, x in random_state(B, H, 128, 128, True).items()}
    check_forward_against_reference(q, k, v, state, chunk_size=16, normalize=True, decay=g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large head dims run natively only")
def test_forward_alone_at_head_dim_128_two_level_scan():
    """Few heads over a long sequence scan in two levels; at head dim 128 a forward alone
    does so into state buffers of its own (the summary pass and the rescan without
    barriers): outputs and final states with normalize, decay and an initial state against
    float64, 4000 tokens (a partial last chunk of 128)."""
    B, H, T = 1, 2, 4000
    q, k, v = (x.detach() for x in make_inputs(B, T, H, 128, 128, torch.bfloat16, seed=31))
    q.abs_(), k.abs_()  # nonnegative q, k keep the denominator away from zero
    g = torch.tensor([0.999, 0.99], device=DEVICE)
    state = {key: x.detach() for key, x in random_state(B, H, 128, 128, True).items()}
    plan = plan_call(q, k, v, normalize=True, decay=g, chunk_size=128, initial_state=state)
    assert plan.chunk == 128 and plan.states_out_of_place and plan.state_scan.n_seg > 1
    check_forward_against_reference(q, k, v, state, chunk_size=128, normalize=True, decay=g)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="large head dims run natively only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_128_wide_scans_cuda(dtype):
    """Enough heads at D = 128 that both scans take their wide row blocks on the GPU itself
    (80 heads: 640 sixteen-row programs, over 4 waves of an H200), with normalize and decay:
    fp32 operands need the most shared memory there."""
    B, H = 5, 16
    q, k, v = make_inputs(B, 70, H, 128, 128, dtype, seed=9)
    plan = plan_call(q, k, v, normalize=True, chunk_size=64)
    assert [plan.state_scan.rows, plan.grad_scan.rows] == [32, 64]
    with torch.no_grad():  # nonnegative q, k keep the denominator away from zero
        q.abs_(), k.abs_()
    check_against_reference(q, k, v, chunk_size=64, normalize=True, eps=1e-3,
                            decay=torch.full((H,), 0.95, device=DEVICE))


def test_chunk_choice():
    def chunk(chunk_size, dtype, head_dim, backward, value_dim=None, form="masked"):
        shape = (1, 256, 2, head_dim, value_dim or head_dim)
        return plan_launch(shape, dtype, "cpu", backward, chunk_size=chunk_size,
                           form=form).chunk

    assert chunk(128, torch.bfloat16, 128, backward=True) == 64
    assert chunk(128, torch.bfloat16, 128, backward=False) == 128
    assert chunk(16, torch.bfloat16, 128, backward=False) == 128  # a forward alone at 128
    assert chunk(16, torch.bfloat16, 16, backward=False, value_dim=128) == 128  # Dv counts
    assert chunk(32, torch.bfloat16, 128, backward=True) == 32
    assert chunk(128, torch.float16, 64, backward=True) == 128
    assert chunk(64, torch.float32, 64, backward=False) == 32
    assert chunk(48, torch.bfloat16, 64, backward=True) == 64  # not a power of two
    assert chunk(128, torch.bfloat16, 64, backward=True, form="paper") == 16


# The launch constants the LaunchPlan replaced, and the code that chose from them: the default
# plan must choose as they did for every shape, dtype and direction.
OLD_CONSTANTS = dict(WARPS=8, SCAN_ROWS=16, WIDE_SCAN=((32, 1), (64, 4)),
                     HALVES_FROM_CHUNK=128, SPLIT_GRADS_FROM=128, SPLIT_GRADS=("qk", "v"),
                     PAPER_PREC="ieee", PAPER_CHUNK=16, PAPER_BV=32,
                     OUTPUT_BV={2: 128, 4: 64}, OUTPUT_ROWS=64, INCREMENTS_ROWS=64,
                     GRAD_TERMS_ROWS=128)


def old_launch_choices(B, T, H, D, DV, dtype, device, backward, chunk_size, normalize, paper):
    """{plan field: value} as the module constants chose them: each value computed by the
    expression that computed it at its launch."""
    c = OLD_CONSTANTS

    def _chunk(chunk_size, dtype, head_dim, backward):
        chunk = chunk_size if chunk_size in (16, 32, 64, 128) else 64
        if dtype == torch.float32:
            return min(chunk, 32)
        if head_dim >= 128:
            return min(chunk, 64) if backward else 128
        return chunk

    def _resident_programs(device, D):
        sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 132
        return sms * (2 if D <= 64 else 1)

    def _segments(NT, row_programs, resident):
        def waves(programs):
            return -(-programs // resident)

        best, best_cost = (NT, 1), waves(row_programs) * NT
        n_seg = 2
        while n_seg <= NT // 2:
            seg = 1 << (-(-NT // n_seg) - 1).bit_length()
            used = -(-NT // seg)
            cost = 2 * waves(row_programs * used) * seg + used
            if cost < best_cost:
                best, best_cost = (seg, used), cost
            n_seg *= 2
        return best

    def _scan_plan(NT, D, BH, device, wide):
        resident = _resident_programs(device, D)
        programs = D // c["SCAN_ROWS"] * BH
        wide_rows, waves = wide
        if programs >= waves * resident:
            return min(wide_rows, D), NT, 1
        return (c["SCAN_ROWS"], *_segments(NT, programs, resident))

    C = _chunk(chunk_size, dtype, max(D, DV), backward)
    if paper:
        width = 1 << DV.bit_length() if normalize else DV  # _pow2(DV + 1)
        return dict(chunk=min(C, c["PAPER_CHUNK"]), precision=c["PAPER_PREC"],
                    warps=c["WARPS"], paper_cols=min(width, c["PAPER_BV"]))
    NT = -(-T // C)
    halves = C >= c["HALVES_FROM_CHUNK"] and min(D, DV) >= 128  # _chunk_128_paths
    rows = D if C > 64 else min(D, c["INCREMENTS_ROWS"])
    keep_states = backward  # the autograd function's forward keeps them, inference does not
    choices = dict(chunk=C, precision="ieee" if dtype == torch.float32 else "tf32",
                   warps=c["WARPS"], increments_rows=rows,
                   increments_halves=halves and rows == D and C >= 32,
                   state_scan=_scan_plan(NT, D, B * H, device, c["WIDE_SCAN"][0]),
                   states_out_of_place=halves and not keep_states,
                   output_rows=min(C, c["OUTPUT_ROWS"]),
                   output_cols=min(DV, c["OUTPUT_BV"][torch.empty(0, dtype=dtype)
                                                      .element_size()]),
                   late_states=halves)
    if backward:
        choices.update(grad_terms_rows=D if C > 64 else min(D, c["GRAD_TERMS_ROWS"]),
                       grad_scan=_scan_plan(NT, D, B * H, device, c["WIDE_SCAN"][1]),
                       grad_launches=c["SPLIT_GRADS"] if max(D, DV) >= c["SPLIT_GRADS_FROM"]
                       else ("qkv",))
    return choices


def test_default_plan_chooses_as_the_launch_constants_did():
    """Every field of the default plan against the removed constants' choices, over batch x
    length from 64k x 1 to 1 x 1 tokens, 1 and 16 heads, every head and value dim, dtype,
    direction, asked chunk size (48: not a power of two), normalize and form; on this
    machine's device kinds (the scans' plan depends on the device's SM count)."""
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)]
                                       if torch.cuda.is_available() else [])
    fields = [f for f in planning.LaunchPlan.__dataclass_fields__
              if f not in ("shape", "dtype", "backward", "form")]
    seen = {name: set() for name in fields}
    for device, (B, T), H, D, DV, dtype, backward, chunk_size, normalize, paper in (
            itertools.product(devices, ((1, 65536), (8, 8192), (32, 2048), (64, 1024),
                                        (2, 300), (1, 1)), (1, 16), planning.HEAD_DIMS,
                              planning.HEAD_DIMS, planning.DTYPES, (False, True),
                              (16, 32, 48, 64, 128), (False, True), (False, True))):
        plan = plan_launch((B, T, H, D, DV), dtype, device, backward, chunk_size=chunk_size,
                           normalize=normalize, form="paper" if paper else "masked")
        got = {}
        for name in fields:
            value = getattr(plan, name)
            if isinstance(value, ScanPlan):
                value = (value.rows, value.seg, value.n_seg)
            seen[name].add(value)
            if value is not None:
                got[name] = value
        assert got == old_launch_choices(B, T, H, D, DV, dtype, device, backward, chunk_size,
                                         normalize, paper), (B, T, H, D, DV, dtype, backward,
                                                             chunk_size, normalize, paper)
    # the shapes reach both sides of every choice
    assert all(len(values - {None}) > 1 for name, values in seen.items() if name != "warps")
    assert any(scan[2] > 1 for scan in seen["state_scan"] - {None})


def test_a_plan_is_checked_against_the_call():
    """A plan passed in runs as the default does; one made for another call, or with fields
    the kernels cannot run, is refused with the reason."""
    q, k, v = make_inputs(1, 40, 2, 16, 32, torch.float32)
    plan = plan_call(q, k, v, chunk_size=16)
    assert plan.backward and plan.state_scan == ScanPlan(16, 3, 1)
    o, _ = hla2_triton(q, k, v, chunk_size=16, plan=plan)
    want, _ = hla2_triton(q, k, v, chunk_size=16)
    assert torch.equal(o, want)
    with torch.no_grad(), pytest.raises(ValueError, match="plan is for"):
        hla2_triton(q, k, v, plan=plan)  # made for a call with a backward pass
    with pytest.raises(ValueError, match="plan is for"):
        hla2_triton(q[:, :20], k[:, :20], v[:, :20], plan=plan)
    with pytest.raises(ValueError, match="plan is for"):
        hla2_triton(q, k, v, decay=torch.tensor([0.9, 0.9], device=DEVICE), decay_form="paper",
                    plan=plan)
    for change, reason in [
            (dict(output_rows=4), "output_rows must be the chunk"),
            (dict(output_rows=8), "at least 16"),  # half of this chunk, too few rows
            (dict(output_cols=64), "output_cols must be a power of two in"),
            (dict(increments_rows=24), "increments_rows must be a power of two"),
            (dict(increments_halves=True), "increments_halves needs"),
            (dict(late_states=None), "late_states must be True or False"),
            (dict(state_scan=ScanPlan(16, 1, 2)), "does not cover the 3 chunks"),
            (dict(grad_scan=(16, 3, 1)), "grad_scan must be a ScanPlan"),
            (dict(grad_launches=("qk",)), "grad_launches must name q, k and v"),
            (dict(chunk=8), "chunk must be one of")]:
        with pytest.raises(ValueError, match=reason):
            hla2_triton(q, k, v, plan=replace(plan, **change))
    with pytest.raises(ValueError, match="must be a LaunchPlan"):
        hla2_triton(q, k, v, plan={"chunk": 16})
    g = torch.tensor([0.9, 0.9], device=DEVICE)
    paper_plan = plan_call(q, k, v, decay=g, decay_form="paper", normalize=True)
    assert paper_plan.paper_cols == 32 and paper_plan.state_scan is None
    with pytest.raises(ValueError, match=r"paper_cols must be a power of two in \[16, 64\]"):
        hla2_triton(q, k, v, decay=g, decay_form="paper", normalize=True,
                    plan=replace(paper_plan, paper_cols=128))


def test_unsupported_reasons():
    q, k, v = make_inputs(1, 8, 2, 16, 16, torch.float32)
    kw = dict(masked=True, ridge=0.0, decay_form="masked", decay=None)
    assert triton_unsupported_reason(q, k, v, **kw) is None
    assert "masked" in triton_unsupported_reason(q, k, v, **{**kw, "masked": False})
    assert "ridge" in triton_unsupported_reason(q, k, v, **{**kw, "ridge": 0.1})
    q24 = torch.zeros(1, 8, 2, 24, device=DEVICE)
    assert triton_unsupported_reason(q24, q24, v, **kw) is None  # any head dim up to 256
    q257 = torch.zeros(1, 8, 2, 257, device=DEVICE)
    assert "head dims from 1 to 256" in triton_unsupported_reason(q257, q257, v, **kw)
    assert "head dims" in triton_unsupported_reason(q, k, q257, **kw)
    q136 = torch.zeros(1, 8, 2, 136, device=DEVICE)  # fp32 above 128: the chunked op only
    assert "bf16 inputs only" in triton_unsupported_reason(q, k, q136, **kw)
    assert "bf16 inputs only" in triton_unsupported_reason(*(x.half() for x in (q, k, q136)),
                                                           **kw)
    assert triton_unsupported_reason(q136, q136, v, **kw, step=True) is None
    assert triton_unsupported_reason(q136.bfloat16(), q136.bfloat16(), v.bfloat16(),
                                     **kw) is None
    assert "float" in triton_unsupported_reason(q.double(), k.double(), v.double(), **kw)
    g = torch.tensor([0.9, 0.9], device=DEVICE)
    assert triton_unsupported_reason(q, k, v, **{**kw, "decay": g}) is None
    assert triton_unsupported_reason(q, k, v, **{**kw, "decay": g, "decay_form": "paper"}) is None
    k3 = torch.zeros(1, 8, 3, 16, device=DEVICE)
    assert "heads" in triton_unsupported_reason(q, k3, k3, **kw)
    with pytest.raises(ValueError, match="ridge"):
        hla2(q, k, v, ridge=0.1, decay=g, decay_form="paper", impl="triton")


@parametrize("normalize, decay", [(False, None), (True, None),
                                  (False, "per-head"), (True, "per-head")], fast=[0, 3])
def test_decode_step_matches_reference(normalize, decay):
    B, T, H, D, Dv = 2, 9, 2, 16, 64
    q, k, v = (x.detach() for x in make_inputs(B, T, H, D, Dv, torch.float32, seed=9))
    if normalize:
        # Nonnegative features (as normalized HLA uses) keep q^T a away from zero. With
        # random signs it cancels to ~5e-4 |q| |a| here, and fp32 round-off alone (the GPU
        # sums in another order than the interpreter) then exceeds the 1e-4 tolerance.
        q, k = q.abs(), k.abs()
    g = None if decay is None else torch.tensor([0.9, 0.75], device=DEVICE)
    state = {key: x.detach().clone() for key, x in random_state(B, H, D, Dv, normalize).items()}
    ref_o, ref_state = reference(q, k, v, state, decay=g, normalize=normalize, eps=1e-3)
    tensors = dict(state)
    outs = []
    for t in range(T):
        o_t, state = hla2_step_triton(q[:, t], k[:, t], v[:, t], state, normalize=normalize,
                                      eps=1e-3, decay=g, decay_form="masked")
        outs.append(o_t)
    assert all(state[key] is tensors[key] for key in state)  # updated in place
    assert frobenius_error(torch.stack(outs, 1), ref_o) < 1e-4
    for key in ref_state:
        assert frobenius_error(state[key], ref_state[key]) < 1e-4, key


@pytest.mark.slow
def test_decode_step_continues_the_chunked_op():
    q, k, v = (x.detach() for x in make_inputs(1, 33, 2, 32, 32, torch.float32, seed=10))
    kw = dict(normalize=False, eps=1e-6, decay=None, decay_form="masked")
    full, _ = hla2_triton(q, k, v, chunk_size=16, initial_state=None, output_final_state=False,
                          **kw)
    _, state = hla2_triton(q[:, :32], k[:, :32], v[:, :32], chunk_size=16, initial_state=None,
                           output_final_state=True, **kw)
    o_last, _ = hla2_step_triton(q[:, 32], k[:, 32], v[:, 32], state, **kw)
    assert frobenius_error(o_last, full[:, 32]) < 1e-4


@parametrize("decay, normalize, with_state", [
    ((0.9, 0.6), False, False), ((0.95, 0.05), False, True), ((0.8, 1.0), True, True)],
    fast=[0])
def test_masked_decay_matches_reference(decay, normalize, with_state):
    q, k, v = make_inputs(1, 45, 2, 16, 32, torch.float32, seed=11)
    state = random_state(1, 2, 16, 32, normalize) if with_state else None
    check_against_reference(q, k, v, chunk_size=16, normalize=normalize, eps=1e-3,
                            decay=torch.tensor(decay, device=DEVICE), initial_state=state)


@pytest.mark.slow
def test_multi_query_shares_k_v_and_S():
    B, T, H, D, Dv = 1, 40, 3, 16, 16
    q, _, _ = make_inputs(B, T, H, D, Dv, torch.float32, seed=12)
    _, k, v = make_inputs(B, T, 1, D, Dv, torch.float32, seed=13)
    s0 = random_state(B, 1, D, Dv, seed=14)["S"]
    a0 = random_state(B, H, D, Dv, seed=15)["A"]
    o, final = hla2_triton(q, k, v, normalize=False, eps=1e-6, decay=None, decay_form="masked",
                           chunk_size=16, initial_state={"S": s0, "A": a0},
                           output_final_state=True)
    kh, vh = k.expand(B, T, H, D), v.expand(B, T, H, Dv)
    ref_o, ref_final = reference(q, kh, vh, {"S": s0.expand(B, H, D, D), "A": a0})
    ref_final["S"] = ref_final["S"][:, :1]
    assert final["S"].shape == (B, 1, D, D)
    assert frobenius_error(o, ref_o) < 1e-4
    for key in ref_final:
        assert frobenius_error(final[key], ref_final[key]) < 1e-4, key
    leaves = (q, k, v, s0, a0)
    got = grads(weighted_loss(o, final), leaves)
    want = grads(weighted_loss(ref_o, ref_final), leaves)
    for name, a, b in zip(["q", "k", "v", "S", "A"], got, want):
        assert frobenius_error(a, b) < 1e-4, name


def test_multi_query_decode_step():
    B, T, H, D, Dv = 2, 5, 3, 16, 32
    q, _, _ = (x.detach() for x in make_inputs(B, T, H, D, Dv, torch.float32, seed=16))
    _, k, v = (x.detach() for x in make_inputs(B, T, 1, D, Dv, torch.float32, seed=17))
    g = torch.full((H,), 0.8, device=DEVICE)
    state = {"S": random_state(B, 1, D, Dv)["S"].detach(),
             "A": random_state(B, H, D, Dv)["A"].detach()}
    ref_o, ref_final = reference(q, k.expand(B, T, H, D), v.expand(B, T, H, Dv),
                                 {"S": state["S"].expand(B, H, D, D), "A": state["A"]}, decay=g)
    o, state = decode_each_token(q, k, v, state, normalize=False, eps=1e-6, decay=g)
    assert frobenius_error(o, ref_o) < 1e-4
    assert frobenius_error(state["S"], ref_final["S"][:, :1]) < 1e-4
    assert frobenius_error(state["A"], ref_final["A"]) < 1e-4


# ---- decay_form="paper" (the paper's §4.3 recurrence with S, C, G) ----------------------

def paper_state(B, H, D, Dv, normalize=False, kv_heads=None, seed=21):
    """A paper-form state: S symmetric PSD, C and G (and m, h) random."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, kv_heads or H, 2 * D, D, generator=gen) * D ** -0.5
    state = {"S": k.transpose(-1, -2) @ k}
    for key, twin in (("C", "m"), ("G", "h")):
        state[key] = torch.randn(B, H, D, Dv, generator=gen) * 0.5
        if normalize:
            state[twin] = torch.rand(B, H, D, generator=gen) + 1.0
    return {key: x.to(DEVICE).requires_grad_() for key, x in state.items()}


def check_paper(q, k, v, *, decay, chunk_size=16, initial_state=None, normalize=False,
                eps=1e-3, grad_tol=None, variant=None):
    out_tol, default_grad_tol = TOL[q.dtype]
    plan = planned(variant, q, k, v, normalize=normalize, decay=decay, decay_form="paper",
                   chunk_size=chunk_size, initial_state=initial_state)
    o, final = hla2_triton(q, k, v, normalize=normalize, eps=eps, decay=decay,
                           decay_form="paper", chunk_size=chunk_size,
                           initial_state=initial_state, output_final_state=True, plan=plan)
    ref_o, ref_final = reference(q, k, v, initial_state, decay_form="paper", decay=decay,
                                       normalize=normalize, eps=eps)
    assert_matches(q, k, v, initial_state, (o, final), (ref_o, ref_final), out_tol,
                   grad_tol or default_grad_tol)


# The paper form's output is a difference, q^T (S C - G); with normalize and a carried state
# its fp32 gradients lose digits in any form: on (37, 64, ...) below the PyTorch chunk and
# serial forms are off by up to 2.7e-4 against float64, and so may the Triton form be
# natively (it sums in another order than the interpreter). That row gets 5e-4.
@parametrize("T, chunk_size, D, Dv, decay, normalize, with_state, grad_tol", [
    (45, 16, 16, 32, (0.9, 1.0), False, True, None),   # per-head decay including 1, partial chunk
    (37, 64, 16, 16, (0.8, 0.95), True, True, 5e-4),   # normalize (m, h), chunk capped
    (20, 16, 32, 16, (0.6, 0.9), False, False, None),
    (2, 16, 16, 16, (0.5, 0.9), True, False, None)], fast=[0, 3])
def test_paper_matches_reference(T, chunk_size, D, Dv, decay, normalize, with_state, grad_tol):
    q, k, v = make_inputs(1, T, 2, D, Dv, torch.float32, seed=22)
    if normalize:  # nonnegative features keep the denominator away from zero
        with torch.no_grad():
            q.abs_(), k.abs_()
    state = paper_state(1, 2, D, Dv, normalize) if with_state else None
    check_paper(q, k, v, decay=torch.tensor(decay, device=DEVICE), chunk_size=chunk_size,
                initial_state=state, normalize=normalize, grad_tol=grad_tol)


@pytest.mark.slow
def test_paper_value_slices(launches):
    """Programs split the value columns (backward sums their dq, dk, dS0 parts); force 4
    slices of 16."""
    q, k, v = make_inputs(1, 20, 2, 16, 64, torch.float32, seed=30)
    check_paper(q, k, v, decay=torch.tensor([1.0, 0.85], device=DEVICE),
                initial_state=paper_state(1, 2, 16, 64),
                variant=lambda plan: replace(plan, paper_cols=16))
    assert [(name, grid, kw["BV"]) for name, grid, kw in launches] == [
        ("paper_forward_kernel", (4, 2), 16), ("paper_forward_kernel", (4, 2), 16),
        ("paper_backward_kernel", (4, 2), 16)]  # forward; backward: the walk again, reversed


@pytest.mark.slow
def test_paper_head_dim_64():
    """Head dim 64, the largest the paper kernels take (their plain fp32 products: Triton
    3.6's 3xTF32 builds make illegal memory accesses there)."""
    q, k, v = make_inputs(2, 70, 2, 64, 64, HALF if torch.cuda.is_available() else torch.float32,
                          seed=31)
    check_paper(q, k, v, decay=torch.tensor([0.95, 0.9], device=DEVICE))


def test_paper_head_dim_128_is_refused_with_its_reason():
    """At head dim 128 the paper kernels need more shared memory than an H200 has: Triton
    refuses with the reason, and "auto" computes with a PyTorch form (the parallel one at
    20 tokens)."""
    q, k, v = make_inputs(1, 20, 2, 128, 64, torch.float32, seed=33)
    g = torch.tensor([0.95, 0.9], device=DEVICE)
    with pytest.raises(ValueError, match="head dim <= 64"):
        hla2(q, k, v, decay=g, decay_form="paper", impl="triton")
    o, _ = hla2(q, k, v, decay=g, decay_form="paper", impl="auto")
    want, _ = hla2(q, k, v, decay=g, decay_form="paper", impl="parallel")
    assert torch.equal(o, want)


@pytest.mark.slow
def test_paper_half_precision():
    q, k, v = make_inputs(1, 40, 2, 16, 16, HALF, seed=23)
    check_paper(q, k, v, decay=torch.tensor([0.9, 0.8], device=DEVICE))


def test_paper_initial_state_continues_the_sequence():
    q, k, v = (x.detach() for x in make_inputs(1, 70, 2, 16, 32, torch.float32, seed=24))
    kw = dict(decay=torch.tensor([0.95, 0.85], device=DEVICE), decay_form="paper",
              normalize=False, eps=1e-6, output_final_state=True)
    full, full_state = hla2_triton(q, k, v, chunk_size=16, initial_state=None, **kw)
    first, mid = hla2_triton(q[:, :23], k[:, :23], v[:, :23], chunk_size=32,
                             initial_state=None, **kw)
    second, last = hla2_triton(q[:, 23:], k[:, 23:], v[:, 23:], chunk_size=16,
                               initial_state=mid, **kw)
    assert frobenius_error(torch.cat([first, second], 1), full) < 1e-4
    assert sorted(last) == ["C", "G", "S"]
    for key in full_state:
        assert frobenius_error(last[key], full_state[key]) < 1e-4, key


@pytest.mark.slow
def test_paper_multi_query():
    B, T, H, D, Dv = 1, 40, 3, 16, 16
    q, _, _ = make_inputs(B, T, H, D, Dv, torch.float32, seed=25)
    _, k, v = make_inputs(B, T, 1, D, Dv, torch.float32, seed=26)
    g = torch.full((H,), 0.9, device=DEVICE)
    state = paper_state(B, H, D, Dv, kv_heads=1, seed=27)
    o, final = hla2_triton(q, k, v, normalize=False, eps=1e-6, decay=g, decay_form="paper",
                           chunk_size=16, initial_state=state, output_final_state=True)
    ref_o, ref_final = reference(q, k, v, state, decay_form="paper", decay=g)
    assert final["S"].shape == (B, 1, D, D)
    assert frobenius_error(o, ref_o) < 1e-4
    for key in ref_final:
        assert frobenius_error(final[key], ref_final[key]) < 1e-4, key
    leaves = [q, k, v] + [state[key] for key in sorted(state)]
    got = grads(weighted_loss(o, final), leaves)
    want = grads(weighted_loss(ref_o, ref_final), leaves)
    for name, a, b in zip(["q", "k", "v"] + sorted(state), got, want):
        assert frobenius_error(a, b) < 1e-4, name


def test_paper_dispatch_runs_triton(launches):
    """hla2(impl="triton") routes decay_form="paper" to the paper kernels."""
    q, k, v = (x.detach() for x in make_inputs(1, 20, 2, 16, 16, torch.float32, seed=28))
    g = torch.tensor([0.9, 0.7], device=DEVICE)
    o, _ = hla2(q, k, v, decay=g, decay_form="paper", impl="triton")
    ref_o, _ = reference(q, k, v, decay_form="paper", decay=g)
    assert [(name, grid) for name, grid, _ in launches] == [("paper_forward_kernel", (1, 2))]
    assert frobenius_error(o, ref_o) < 1e-4


@parametrize("normalize, shared_kv", [(False, False), (True, False), (False, True)], fast=[0])
def test_paper_decode_step(normalize, shared_kv):
    B, T, H, D, Dv = 2, 5, 2, 32, 16
    q, k, v = (x.detach() for x in make_inputs(B, T, H, D, Dv, torch.float32, seed=29))
    if shared_kv:
        k, v = k[:, :, :1], v[:, :, :1]
    q, k = q.abs(), k.abs()
    g = torch.tensor([0.8, 0.8] if shared_kv else [0.9, 1.0], device=DEVICE)
    state = {key: x.detach() for key, x in
             paper_state(B, H, D, Dv, normalize, kv_heads=k.shape[2]).items()}
    ref_o, ref_state = reference(q, k, v, state, decay_form="paper", decay=g,
                                 normalize=normalize, eps=1e-3)
    outs = []
    for t in range(T):
        o_t, state = hla2_step(q[:, t], k[:, t], v[:, t], state, decay=g, decay_form="paper",
                               normalize=normalize, eps=1e-3, impl="triton")
        outs.append(o_t)
    assert frobenius_error(torch.stack(outs, 1), ref_o) < 1e-4
    assert sorted(state) == sorted(ref_state)
    for key in ref_state:
        assert frobenius_error(state[key], ref_state[key]) < 1e-4, key


# kernel -> (its stage module, its warp counts)
TUNED_KERNELS = {"chunk_increments_kernel": (increments, increments.INCREMENTS_WARPS),
                 "chunk_grad_terms_kernel": (backward_stage, increments.INCREMENTS_WARPS),
                 "chunk_output_kernel": (output, output.OUTPUT_WARPS),
                 "chunk_grads_kernel": (backward_stage, backward_stage.GRADS_WARPS)}


@pytest.mark.parametrize("name", sorted(TUNED_KERNELS))
def test_per_chunk_kernels_autotune_only_natively(name):
    """Under the interpreter the plain kernel runs (nothing to time); natively the autotuner,
    whose first config is the fixed launch shape of the scans (so tuning can only match or
    beat it)."""
    module, warps = TUNED_KERNELS[name]
    kernel = getattr(module, name)
    assert warps[0] == plan_launch((1, 16, 1, 16, 16), torch.float32, "cpu", False).warps
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not isinstance(kernel, Autotuner)
    else:
        assert [c.num_warps for c in kernel.configs] == list(warps)
        # kernels tuned over several warp counts retune per launch-size class
        assert ("SIZE_CLASS" in kernel.keys) == (len(warps) > 1)


def test_autotuned_configs_pruning_and_key_check(monkeypatch):
    """The native wrapping: one config per warp count at the default num_stages, the given
    key, only the first config where first_only says so; a key naming no argument is an
    error (triton.autotune would ignore it)."""
    plain = output.chunk_output_kernel
    if isinstance(plain, Autotuner):
        plain = plain.fn
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tuned = common._autotuned((8, 4), ("D", "BV"), first_only=lambda meta: meta["D"] >= 128)(
        plain)
    assert isinstance(tuned, Autotuner) and tuned.keys == ["D", "BV"]
    assert [(c.num_warps, c.num_stages) for c in tuned.configs] == [(8, 3), (4, 3)]
    tuned.nargs = {}
    assert [c.num_warps for c in tuned.prune_configs({"D": 64, "BV": 64})] == [8, 4]
    assert [c.num_warps for c in tuned.prune_configs({"D": 128, "BV": 64})] == [8]
    with pytest.raises(ValueError, match="BW"):
        common._autotuned((8,), ("D", "BW"))(plain)


_NORMALIZE_SEQUENCE = """
import torch
from mixers.hla import hla2
for T in (8192, 65536):
    q, k, v = (torch.randn(65536 // T, T, 16, 64, device="cuda", dtype=torch.bfloat16)
               .mul_(0.3).requires_grad_() for _ in range(3))
    with torch.no_grad():
        hla2(q, k, v, impl="triton", normalize=True)
    for _ in range(3):
        o, _ = hla2(q, k, v, impl="triton", normalize=True)
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a native launch sequence")
def test_normalize_at_8k_then_64k_in_one_process():
    """normalize at 8k tokens (B = 8), then at 64k (two-level scans), fwd+bwd three times
    each in one process: the increments kernel tuned to 4 warps at 8k then runs at 64k, where
    its normalize vectors computed by dots instead of fp32 sums make an illegal memory access
    (see common.py). A subprocess keeps a poisoned CUDA context out of the other tests."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run([sys.executable, "-c", _NORMALIZE_SEQUENCE], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.fixture
def bf16_dots(monkeypatch):
    """Under the interpreter, tl.dot on bf16 operands as the GPU computes it (each product
    exact, fp32 sums): the interpreter keeps bf16 tensors as their uint16 bits and would
    multiply those. Natively a no-op."""
    if torch.cuda.is_available():
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def as_fp32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x.data
        return (x.data.astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(
            np.matmul(as_fp32(a), as_fp32(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)
    monkeypatch.setattr(builder, "create_dot", create_dot)


@pytest.mark.slow
def test_bf16_normalize_max_abs_error(bf16_dots):
    """bf16 with normalize over 1,100 tokens (18 chunks of 64, bf16 chunk buffers): the
    max-abs error against float64 on the same rounded inputs stays within 1e-2 (verify's
    positive features keep the denominator away from zero). The GPU check up to 65,536
    tokens and head dim 128 is benchmarks/hla2_verify_forced.py --normalize-precision."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1100, 1, 16, generator=gen).abs() / 4 for _ in "qk")
    v = torch.randn(1, 1100, 1, 16, generator=gen)
    q, k, v = (x.to(DEVICE, torch.bfloat16) for x in (q, k, v))
    with torch.no_grad():
        o, _ = hla2_triton(q, k, v, normalize=True, eps=1e-6, chunk_size=64)
    want = hla2_naive(q.double(), k.double(), v.double(), normalize=True, eps=1e-6)
    assert (o.double() - want).abs().max() < 1e-2


# ---- head dims that are not powers of two, and above 128 ----------------------------------
# The kernels hold a head dim in a block of the next power of two from 16 and mask their
# loads and stores by the true dim. q, k, v and the states are contiguous with their true
# dims and two heads, so a load past a row's end would read the next head's or token's
# entries and a store there would overwrite them: unmasked padding changes the results.

@pytest.mark.slow
@pytest.mark.parametrize("D, Dv, T, chunk_size, normalize, decay, with_state", [
    (24, 40, 37, 16, False, (0.9, 0.75), True),
    (48, 16, 50, 32, True, None, True),
    (80, 96, 40, 32, True, (0.95, 0.8), False)])
def test_odd_head_dims_match_reference(D, Dv, T, chunk_size, normalize, decay, with_state):
    """Outputs, final states and the gradients of q, k, v and the initial state against
    float64 at head dims that are not powers of two (Dv != D)."""
    q, k, v = make_inputs(1, T, 2, D, Dv, torch.float32, seed=40)
    if normalize:  # nonnegative features keep the denominator away from zero
        with torch.no_grad():
            q.abs_(), k.abs_()
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    state = random_state(1, 2, D, Dv, normalize, seed=41) if with_state else None
    check_against_reference(q, k, v, chunk_size=chunk_size, normalize=normalize, eps=1e-3,
                            decay=g, initial_state=state)


@pytest.mark.slow
def test_head_dim_above_128_matches_reference(bf16_dots):
    """D = 136 is held in a block of 256: the plan's tiles for blocks above 128 (chunks of at
    most 32, 32-row increments and gradient terms, 16-row scans), with normalize, decay and
    an initial state, against float64. In bf16: fp16 and fp32 inputs are refused there (their
    fp32 chunk states' [D, D] tiles do not fit an SM's shared memory), except in the decode
    step."""
    q, k, v = make_inputs(1, 37, 2, 136, 24, torch.bfloat16, seed=42)
    with torch.no_grad():
        q.abs_(), k.abs_()
    plan = plan_call(q, k, v, normalize=True, chunk_size=64)
    assert (plan.chunk, plan.increments_rows, plan.state_scan.rows) == (32, 32, 16)
    check_against_reference(q, k, v, chunk_size=64, normalize=True, eps=1e-3,
                            decay=torch.tensor([0.95, 0.9], device=DEVICE),
                            initial_state=random_state(1, 2, 136, 24, True, seed=43))


@pytest.mark.slow
def test_scans_split_columns(launches):
    """At head dims whose X tile would exceed 128 x 128 entries (D = Dv = 256, say) the state
    scan splits A's value columns and the gradient scan gS's key columns over programs, the
    states going to buffers of their own (the other column blocks still read the
    increments); forced here in 16-column blocks at D = 24, Dv = 40 over two-level scans, with
    normalize, decay and an initial state."""
    q, k, v = make_inputs(1, 40, 2, 24, 40, torch.float32, seed=44)
    with torch.no_grad():
        q.abs_(), k.abs_()

    def split(plan):
        plan = two_level_scans(plan)
        return replace(plan, states_out_of_place=True,
                       state_scan=replace(plan.state_scan, cols=16),
                       grad_scan=replace(plan.grad_scan, cols=16))

    check_against_reference(q, k, v, chunk_size=16, normalize=True, eps=1e-3,
                            decay=torch.tensor([0.9, 0.8], device=DEVICE),
                            initial_state=random_state(1, 2, 24, 40, True, seed=45),
                            variant=split)
    grids = [(name, grid[0], kw["BC"]) for name in ("state_scan_kernel", "grad_scan_kernel")
             for grid, kw in launched(launches, name)]
    # 2 row blocks of 16 (D = 24 in a block of 32) x 4 (Dv = 40 in 64) or 2 (D) column blocks
    assert grids == [("state_scan_kernel", 8, 16)] * 3 + [("grad_scan_kernel", 4, 16)] * 3
    plan = plan_launch((1, 64, 2, 256, 256), torch.bfloat16, "cpu", True)
    assert plan.state_scan.cols == plan.grad_scan.cols == 64 and plan.states_out_of_place
    with pytest.raises(ValueError, match="needs states_out_of_place"):
        hla2_triton(q, k, v, chunk_size=16, plan=replace(
            split(plan_call(q, k, v, chunk_size=16)), states_out_of_place=False))


@parametrize("D, Dv, normalize, decay, shared_kv", [
    (24, 40, True, (0.9, 0.75), False), (40, 24, False, (0.8, 0.8), True),
    (200, 72, False, None, False)], fast=[0, 1])
def test_odd_head_dims_decode_step(D, Dv, normalize, decay, shared_kv):
    B, T, H = 2, 2, 2
    q, k, v = (x.detach() for x in make_inputs(B, T, H, D, Dv, torch.float32, seed=46))
    if shared_kv:
        k, v = k[:, :, :1], v[:, :, :1]
    q, k = q.abs(), k.abs()
    g = None if decay is None else torch.tensor(decay, device=DEVICE)
    state = {key: x.detach().clone() for key, x in random_state(B, H, D, Dv, normalize).items()}
    if shared_kv:
        state["S"] = state["S"][:, :1].contiguous()
    kh, vh = k.expand(B, T, H, D), v.expand(B, T, H, Dv)
    ref_o, ref_state = reference(q, kh, vh, {**state, "S": state["S"].expand(B, H, D, D)},
                                 decay=g, normalize=normalize, eps=1e-3)
    o, state = decode_each_token(q, k, v, state, normalize=normalize, eps=1e-3, decay=g)
    assert frobenius_error(o, ref_o) < 1e-4
    if shared_kv:
        ref_state["S"] = ref_state["S"][:, :1]
    for key in ref_state:
        assert frobenius_error(state[key], ref_state[key]) < 1e-4, key


def test_odd_head_dims_continue_and_multi_query():
    """Multi-query k, v (one head) at D = 24, Dv = 40: a prefill's final state continues the
    sequence in a second call and then in decode steps, as the whole sequence does."""
    B, T, H, D, Dv = 1, 45, 2, 24, 40
    q, _, _ = (x.detach() for x in make_inputs(B, T, H, D, Dv, torch.float32, seed=47))
    _, k, v = (x.detach() for x in make_inputs(B, T, 1, D, Dv, torch.float32, seed=48))
    kw = dict(normalize=False, eps=1e-6, decay=torch.tensor([0.9, 0.9], device=DEVICE),
              decay_form="masked", output_final_state=True)
    full, full_state = hla2_triton(q, k, v, chunk_size=16, initial_state=None, **kw)
    ref_o, ref_final = reference(q, k.expand(B, T, H, D), v.expand(B, T, H, Dv),
                                 decay=kw["decay"])
    assert full_state["S"].shape == (B, 1, D, D)
    assert frobenius_error(full, ref_o) < 1e-4
    assert frobenius_error(full_state["A"], ref_final["A"]) < 1e-4
    first, mid = hla2_triton(q[:, :20], k[:, :20], v[:, :20], chunk_size=32,
                             initial_state=None, **kw)
    second, last = hla2_triton(q[:, 20:42], k[:, 20:42], v[:, 20:42], chunk_size=16,
                               initial_state=mid, **kw)
    outs = [first, second]
    for t in range(42, T):
        o_t, last = hla2_step_triton(q[:, t], k[:, t], v[:, t], last, normalize=False,
                                     eps=1e-6, decay=kw["decay"], decay_form="masked")
        outs.append(o_t.unsqueeze(1))
    assert frobenius_error(torch.cat(outs, 1), full) < 1e-4
    for key in full_state:
        assert frobenius_error(last[key], full_state[key]) < 1e-4, key


@pytest.mark.slow
def test_paper_odd_head_dims():
    """The paper decay form at D = 40 (a block of 64), Dv = 24, with an initial state,
    against float64 (outputs, states, gradients), and its decode step with normalize."""
    q, k, v = make_inputs(1, 37, 2, 40, 24, torch.float32, seed=49)
    g = torch.tensor([0.9, 0.8], device=DEVICE)
    check_paper(q, k, v, decay=g, initial_state=paper_state(1, 2, 40, 24, seed=50))
    q, k, v = (x.detach().abs()[:, :4] for x in (q, k, v))
    state = {key: x.detach() for key, x in paper_state(1, 2, 40, 24, True, seed=51).items()}
    ref_o, ref_state = reference(q, k, v, state, decay_form="paper", decay=g, normalize=True,
                                 eps=1e-3)
    outs = []
    for t in range(4):
        o_t, state = hla2_step(q[:, t], k[:, t], v[:, t], state, decay=g, decay_form="paper",
                               normalize=True, eps=1e-3, impl="triton")
        outs.append(o_t)
    assert frobenius_error(torch.stack(outs, 1), ref_o) < 1e-4
    for key in ref_state:
        assert frobenius_error(state[key], ref_state[key]) < 1e-4, key
