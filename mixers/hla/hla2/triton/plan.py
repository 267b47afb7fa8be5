"""What the hla2 Triton kernels run, and the launch plan of one call.

plan_launch(shape, dtype, device, backward, ...) computes a frozen LaunchPlan: the chunk the
kernels run, each launch's row and column blocks, the scans' levels, warps and the kernel
paths. hla2_triton computes it once per call (plan=None) and passes it down to every
launcher. A caller that wants another variant (a test forcing a path the defaults take only
at other shapes, a benchmark timing one) changes fields of the default plan with
dataclasses.replace and passes it in: hla2_triton refuses a plan made for another call
(shape, dtype, backward or form) or one whose fields the kernels cannot run
(plan_unfit_reason). The defaults below are read by plan_launch alone.

Head dims: D and Dv, independently, from 1 to MAX_HEAD_DIM (256). The kernels hold each in a
block of the next power of two from 16 (common._block) and mask their loads and stores by
the true dim; every choice here is made on the blocks, so 16, 32, 64 and 128 (HEAD_DIMS,
their own blocks) choose as tuned, and blocks of 256 take the smaller tiles of _LARGE_*.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mixers.hla.hla2.triton.common import _block, _cdiv, _pow2
from mixers.tiles import interpreted

# Head dims D and Dv (independent) run from 1 to MAX_HEAD_DIM. The kernels hold a head dim in
# a block of _block(dim) entries, the next power of two from 16, with loads and stores masked
# by the true dim; HEAD_DIMS are the dims that are their own block, whose launch choices
# below were tuned, and every other dim takes the choices of its block.
MAX_HEAD_DIM = 256
HEAD_DIMS = (16, 32, 64, 128)
CHUNK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORMS = ("masked", "paper")
# decay_form="paper": the largest head dim whose kernels fit an H100/H200's shared memory in
# plain fp32 (at 128 they do not launch).
PAPER_MAX_HEAD_DIM = 64


def triton_unsupported_reason(q, k, v, *, masked, ridge, decay_form, decay,
                              step=False) -> str | None:
    """None when the Triton kernels can run these inputs and options (the chunked op, or
    with step=True the decode step on one token), else why not."""
    if not masked:
        return "the Triton kernels implement masked hla2 only (masked=False)"
    if ridge != 0:
        return "the Triton kernels do not implement ridge != 0"
    if q.device.type != "cuda" and not interpreted():
        return f"the Triton kernels need a CUDA device (got {q.device}) or TRITON_INTERPRET=1"
    if q.dtype not in DTYPES:
        return f"the Triton kernels support float16, bfloat16 and float32, got {q.dtype}"
    if k.shape[2] not in (1, q.shape[2]):
        return f"k and v must have {q.shape[2]} heads or one shared head, got {k.shape[2]}"
    if not (1 <= q.shape[-1] <= MAX_HEAD_DIM and 1 <= v.shape[-1] <= MAX_HEAD_DIM):
        return (f"the Triton kernels need head dims from 1 to {MAX_HEAD_DIM}, got "
                f"D={q.shape[-1]}, Dv={v.shape[-1]}")
    if (not step and q.dtype != torch.bfloat16 and call_form(decay, decay_form) == "masked"
            and max(_block(q.shape[-1]), _block(v.shape[-1])) > _LARGE_BLOCK):
        return (f"above head dim {_LARGE_BLOCK} the Triton kernels take bf16 inputs only "
                f"(got {q.dtype}, D={q.shape[-1]}, Dv={v.shape[-1]}): fp16 and fp32 inputs "
                f"keep fp32 per-chunk states, whose [D, D] tiles in the output and dq/dk/dv "
                f"kernels need more shared memory than an H100 or H200 has (227 KiB)")
    if decay is not None and decay_form == "paper" and q.shape[-1] > PAPER_MAX_HEAD_DIM:
        return (f"the paper decay form's Triton kernels need head dim <= {PAPER_MAX_HEAD_DIM} "
                f"(at 128 they need 346 KiB of shared memory, an H100 or H200 has 227), "
                f"got D={q.shape[-1]}")
    return None


# ---- the defaults of plan_launch ---------------------------------------------------------
# The scans' launch shape on sm_90: 8 warps and 16-row blocks keep the scan kernels free of
# register spills at D = Dv = 64 (little at 128), with their next step's inputs loaded ahead,
# at few enough registers that two programs fit an SM. The per-chunk kernels (increments,
# output, dq/dk/dv) pick their warps by autotuning (see common._autotuned).
_WARPS, _SCAN_ROWS = 8, 16
# Scans with programs to spare take wider row blocks: each program loads the whole [D, Dv] X
# at every step, so fewer, wider programs move less data. (rows, waves) of the state scan and
# of the gradient scan: the rows they take once a one-level scan in _SCAN_ROWS-row blocks
# would need that many waves of resident programs (under a wave, wider blocks only leave SMs
# idle; the gradient scan's 64-row blocks pay from 4 waves on).
_WIDE_SCAN = ((32, 1), (64, 4))
# Chunks of at least this many tokens (the 16-bit forward alone at head dim 128 runs 128)
# compute the increments in two halves of tokens (W's zero block skipped, 4 warps tuned in,
# two programs per SM), load the carried states late in the output kernel (less shared
# memory at once), and, without a backward pass to keep the states for, scan into state
# buffers of their own (no barrier in the scan's loop, so Triton pipelines its loads and the
# program fits 128 registers). These pay at chunk 128 only: at chunk 64 the halves' 32-token
# products cost more than the skipped block saves. Only at head dims (D and Dv) of 128: in
# bf16 at D = Dv = 16 the output kernel with late state loads makes an illegal memory access.
_HALVES_FROM_CHUNK = 128
# From this head dim on, dq, dk and dv are computed by the launches in _SPLIT_GRADS (each
# string names the gradients of one launch): fewer register spills. Each launch recomputes
# the chunk's shared terms, so two launches, not three.
_SPLIT_GRADS_FROM, _SPLIT_GRADS = 128, ("qk", "v")
# Value columns per program of the output kernel, by element size (16-bit, fp32 inputs): each
# program recomputes the chunk's [C, C] mixing matrix, so wider slices repeat less work; fp32
# operands take twice the shared memory, so half as many columns.
_OUTPUT_COLS = {2: 128, 4: 64}
# Query rows per program of the output kernel: a chunk of 128 runs as two programs of 64 rows
# (the second also mixes with the first half), skipping the zero upper blocks of its C x C
# products.
_OUTPUT_ROWS = 64
# State rows per program of the increments and gradient-terms kernels (at most D; chunks
# above 64 keep all D): each row block recomputes the chunk's [C, Dv] mixed values, so
# smaller blocks trade repeated work for more, smaller programs: the increments at D = 128
# run in two blocks of 64 rows, the gradient terms in one block (two cost more than they
# save there), and chunks above 64 in one block.
_INCREMENTS_ROWS, _GRAD_TERMS_ROWS = 64, 128
# decay_form="paper": its kernels multiply fp32 operands (states, decayed products) whose
# terms cancel (o = Y C0 - b Q G0 + M V), so in plain fp32 (no tensor cores): TF32 gives
# about 4e-2 relative error with normalize in bf16, and Triton 3.6's 3xTF32 builds (fp32
# products on tensor cores) make illegal memory accesses at head dim 64.
_PAPER_PRECISION = "ieee"
# decay_form="paper": chunk size of its sequential walk (one program per head holds every
# state and chunk temporary: smaller chunks keep the registers in bounds; at 16 tokens and 32
# value columns the D = 64 forward does not spill, and chunks of 32 spill more).
_PAPER_CHUNK = 16
# decay_form="paper": value columns per program (C, G, O columns are independent; backward
# sums the per-slice parts of dq, dk and dS0).
_PAPER_COLS = 32


# Head dims above 128 (blocks of 256): the tiles the kernels above were tuned with would not
# fit an SM there, so these blocks take smaller ones: chunks of at most _LARGE_CHUNK tokens,
# _LARGE_ROWS state rows per increments and gradient-terms program, _LARGE_OUTPUT_COLS value
# columns per output program, and scans in 16-row programs that split their columns so that
# the X tile a program loads per step keeps at most _SCAN_TILE entries (as at D = Dv = 128).
# The output and dq/dk/dv kernels still load whole [D, D] and [D, Dv] chunk states: in bf16
# they fit an SM's shared memory at D = Dv = 256 (with register spills: correct, not tuned);
# fp16 and fp32 inputs keep fp32 chunk states, which do not, so triton_unsupported_reason
# refuses those above 128.
_LARGE_BLOCK = 128
_LARGE_CHUNK, _LARGE_ROWS, _LARGE_OUTPUT_COLS = 32, 32, 64
_SCAN_TILE = 128 * 128


@dataclass(frozen=True)
class ScanPlan:
    """How a scan over the chunks runs: `rows` state rows per program (a power of two that
    divides D's block), in one level over every chunk (n_seg = 1; seg is then the chunk
    count) or in n_seg segments of seg chunks (seg * n_seg >= the chunk count): segment
    summaries in parallel, a scan over them, a rescan per segment. `cols`: None, or the
    columns per program where the scan also splits its matrices' columns over programs (the
    state scan A's value columns, the gradient scan gS's key columns: a power of two that
    divides that dim's block), which keeps the X tile each program loads per step small at
    head dims above 128."""

    rows: int
    seg: int
    n_seg: int
    cols: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """How one hla2_triton call launches its kernels (plan_launch; variants by
    dataclasses.replace). shape, dtype, backward and form name the call the plan is for;
    the other fields choose the launches. The other form's fields are None, and so are the
    backward's in a plan without a backward pass."""

    shape: tuple[int, int, int, int, int]  # (B, T, H, D, Dv), H the query heads
    dtype: torch.dtype
    backward: bool                          # a backward pass follows (autograd records it)
    form: str                               # "masked", or "paper" (decay_form="paper")
    chunk: int                              # tokens per chunk
    precision: str                          # input_precision of the kernels' tl.dot
    warps: int                              # num_warps of the scans and the paper walks
    # masked form, forward
    increments_rows: int | None = None      # state rows per increments program
    increments_halves: bool | None = None   # increments in two halves of tokens (all D rows)
    state_scan: ScanPlan | None = None
    states_out_of_place: bool | None = None  # the state scan writes the states to buffers
                                             # of their own, not over the increments
    output_rows: int | None = None          # query rows per output program: chunk or half
    output_cols: int | None = None          # value columns per output program
    late_states: bool | None = None         # the output kernel loads A0 for its last product
    # masked form, backward
    grad_terms_rows: int | None = None      # state rows per gradient-terms program
    grad_scan: ScanPlan | None = None
    grad_launches: tuple[str, ...] | None = None  # the gradients ("q", "k", "v") of each
                                                  # dq/dk/dv launch
    # paper form
    paper_cols: int | None = None           # value columns per program of the walks


def _chunk(chunk_size: int, dtype, head_dim: int, backward: bool) -> int:
    """The chunk the kernels run (the result does not depend on it, up to rounding):
    chunk_size where it is a power of two in [16, 128], else 64. fp32 inputs (exact,
    non-tensor-core dots) use at most 32, which keeps the D = 128 backward within the shared
    memory of an H100/H200; for the same reason a backward at head dim (D or Dv) 128 uses at
    most 64 (chunk 128 needs 320 KiB there, an H100 or H200 has 227). A 16-bit forward alone
    at head dim 128 runs chunk 128 whatever was asked: half the chunk states to scan and
    store. head_dim is the block (_block) of the larger head dim; blocks above 128 use at
    most _LARGE_CHUNK."""
    chunk = chunk_size if chunk_size in CHUNK_SIZES else 64
    if head_dim > _LARGE_BLOCK:
        return min(chunk, _LARGE_CHUNK)
    if dtype == torch.float32:
        return min(chunk, 32)
    if head_dim >= 128:
        return min(chunk, 64) if backward else 128
    return chunk


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache
def _resident_programs(device: torch.device, D: int) -> int:
    """About how many scan programs the device runs at once (8 warps each: two fit an SM's
    registers at D <= 64, one at D = 128). Off CUDA (the interpreter) the count of an H200,
    132 SMs."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 132
    return sms * (2 if D <= 64 else 1)


def _segments(NT, row_programs, resident):
    """(chunks per segment, segment count) for a scan over NT chunks whose single level
    would run row_programs programs. Each scan step is a dependent load + matmul, so the
    time goes as waves x steps: one level costs ceil(P / R) NT, two levels (twice the
    memory passes) 2 ceil(P NSEG / R) SEG + NSEG. Picks the cheapest power-of-two SEG, so
    that B = 1 at 64k tokens fills the GPU while batches that already fill it keep one
    level."""
    def waves(programs):
        return -(-programs // resident)

    best, best_cost = (NT, 1), waves(row_programs) * NT
    n_seg = 2
    while n_seg <= NT // 2:
        seg = _pow2(_cdiv(NT, n_seg))  # few compiles over T
        used = _cdiv(NT, seg)
        cost = 2 * waves(row_programs * used) * seg + used
        if cost < best_cost:
            best, best_cost = (seg, used), cost
        n_seg *= 2
    return best


def _plan_scan(NT, D, BH, resident, wide, rows, cols=None) -> ScanPlan:
    """The plan of a scan over NT chunks of B*H = BH heads at head dim (block) D with
    `resident` programs at once: wide = (rows, waves), taken in one level when `rows`-row
    programs would need that many waves, else `rows` rows and, where those programs cannot
    fill the GPU, two levels (see _segments); cols: the scan's column blocks (ScanPlan)."""
    programs = D // rows * BH
    wide_rows, waves = wide
    if programs >= waves * resident:
        return ScanPlan(min(wide_rows, D), NT, 1, cols)
    return ScanPlan(rows, *_segments(NT, programs, resident), cols)


def plan_launch(shape, dtype, device, backward, *, chunk_size=64, normalize=False,
                form="masked", resident=None, scan_rows=None) -> LaunchPlan:
    """The default launch plan of a call on q [B, T, H, D] (H query heads) and v [.., Dv],
    shape = (B, T, H, D, Dv), in `dtype` on `device`, with a backward pass to follow or not;
    chunk_size as asked (see _chunk), normalize, form "masked" or "paper" (the paper decay
    form). The scans' plans assume `resident` programs at once (default: the device's, see
    _resident_programs) and `scan_rows` rows per program where they are not wide (default
    16). Plans are immutable and cached: equal arguments give the same object."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    return _plan_launch(tuple(shape), dtype, torch.device(device), bool(backward), chunk_size,
                        bool(normalize), form, resident, scan_rows or _SCAN_ROWS)


@functools.lru_cache(maxsize=1024)
def _plan_launch(shape, dtype, device, backward, chunk_size, normalize, form, resident,
                 scan_rows):
    B, T, H, D, DV = shape
    # every choice is made on the blocks the head dims are held in (a power-of-two dim from
    # 16 is its own block, so those choose as tuned)
    PD, PDV = _block(D), _block(DV)
    large = max(PD, PDV) > _LARGE_BLOCK
    chunk = _chunk(chunk_size, dtype, max(PD, PDV), backward)
    call = dict(shape=shape, dtype=dtype, backward=backward, form=form, warps=_WARPS)
    if form == "paper":
        width = _block(DV + 1) if normalize else PDV  # normalize: a ones column, padded
        return LaunchPlan(**call, chunk=min(chunk, _PAPER_CHUNK), precision=_PAPER_PRECISION,
                          paper_cols=min(width, _PAPER_COLS))
    NT = _cdiv(T, chunk)
    resident = _resident_programs(device, PD) if resident is None else resident
    halves = chunk >= _HALVES_FROM_CHUNK and min(PD, PDV) >= 128
    increments_rows = PD if chunk > 64 else min(PD, _INCREMENTS_ROWS)
    grad_terms_rows = PD if chunk > 64 else min(PD, _GRAD_TERMS_ROWS)
    wide = _WIDE_SCAN
    output_cols = min(PDV, _OUTPUT_COLS[dtype.itemsize])
    state_cols = grad_cols = None
    if large:
        increments_rows = grad_terms_rows = min(PD, _LARGE_ROWS)
        wide = ((scan_rows, 1), (scan_rows, 1))
        output_cols = min(PDV, _LARGE_OUTPUT_COLS)
        state_cols = _scan_cols(PDV, PD)
        grad_cols = _scan_cols(PD, PDV)
    grads = {}
    if backward:
        grads = dict(grad_terms_rows=grad_terms_rows,
                     grad_scan=_plan_scan(NT, PD, B * H, resident, wide[1], scan_rows,
                                          grad_cols),
                     grad_launches=_SPLIT_GRADS if max(PD, PDV) >= _SPLIT_GRADS_FROM
                     else ("qkv",))
    return LaunchPlan(
        **call, chunk=chunk, precision=_precision(dtype), increments_rows=increments_rows,
        # the halves take all D rows in one block, and 16 or more tokens each
        increments_halves=halves and increments_rows == PD and chunk >= 32,
        state_scan=_plan_scan(NT, PD, B * H, resident, wide[0], scan_rows, state_cols),
        # value-column blocks of the state scan all read dS: the states go elsewhere
        states_out_of_place=halves and not backward or state_cols is not None,
        output_rows=min(chunk, _OUTPUT_ROWS),
        output_cols=output_cols, late_states=halves, **grads)


def _scan_cols(width, other):
    """Columns per program of a scan whose matrices have `width` columns (blocks) and whose
    X tile per step is `other` x columns: all (None) while the tile stays within
    _SCAN_TILE entries, else the fewest that keep it there."""
    cols = min(width, _SCAN_TILE // other)
    return None if cols >= width else cols


def needs_backward(q, k, v, initial_state=None) -> bool:
    """Whether autograd records a call on these inputs (a backward pass may follow)."""
    return torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, *(initial_state or {}).values()))


def call_form(decay, decay_form) -> str:
    """The kernels' form of a call: "paper" for the paper decay form with a decay, else
    "masked" (without decay both forms are the plain one)."""
    return "paper" if decay is not None and decay_form == "paper" else "masked"


def plan_call(q, k, v, *, normalize=False, decay=None, decay_form="masked", chunk_size=64,
              initial_state=None) -> LaunchPlan:
    """The plan hla2_triton(q, k, v, ...) with these arguments computes (plan=None) in the
    current grad mode: the start of a variant (dataclasses.replace)."""
    B, T, H, D = q.shape
    return plan_launch((B, T, H, D, v.shape[-1]), q.dtype, q.device,
                       needs_backward(q, k, v, initial_state), chunk_size=chunk_size,
                       normalize=normalize, form=call_form(decay, decay_form))


def _pow2_in(n, low, high) -> bool:
    return isinstance(n, int) and low <= n <= high and n & (n - 1) == 0


def plan_unfit_reason(plan, shape, dtype, backward, form, normalize) -> str | None:
    """None when `plan` is one for this call (shape (B, T, H, D, Dv), dtype, backward, form)
    whose fields the kernels can run, else why not: block sizes the kernels' tiles take
    (powers of two from 16 that divide their dim's block, _block), output rows of a whole
    or half chunk (the second half mixes with the first only), scans that cover every
    chunk (with their columns split only where the states go to buffers of their own), and
    dq, dk and dv each computed by one launch."""
    if not isinstance(plan, LaunchPlan):
        return f"plan must be a LaunchPlan (see plan_launch), got {type(plan).__name__}"
    call = (tuple(shape), dtype, backward, form)
    made = (plan.shape, plan.dtype, plan.backward, plan.form)
    if made != call:
        return f"the plan is for (shape, dtype, backward, form) = {made}, the call {call}"
    B, T, H, D, DV = shape
    D, DV = _block(D), _block(DV)  # the blocks the kernels hold the head dims in
    if plan.chunk not in CHUNK_SIZES:
        return f"plan.chunk must be one of {CHUNK_SIZES}, got {plan.chunk!r}"
    if form == "paper":
        width = _block(shape[4] + 1) if normalize else DV
        blocks = {"paper_cols": (plan.paper_cols, width)}
    else:
        scans = {"state_scan": plan.state_scan}
        if backward:
            scans["grad_scan"] = plan.grad_scan
        for name, scan in scans.items():
            if not isinstance(scan, ScanPlan):
                return f"plan.{name} must be a ScanPlan, got {scan!r}"
        blocks = {"increments_rows": (plan.increments_rows, D),
                  "output_cols": (plan.output_cols, DV),
                  **{f"{name}.rows": (scan.rows, D) for name, scan in scans.items()}}
        for name, width in (("state_scan", DV), ("grad_scan", D)):
            if name in scans and scans[name].cols is not None:
                blocks[f"{name}.cols"] = (scans[name].cols, width)
        if backward:
            blocks["grad_terms_rows"] = (plan.grad_terms_rows, D)
    for name, (n, dim) in blocks.items():
        if not _pow2_in(n, 16, dim):
            return f"plan.{name} must be a power of two in [16, {dim}], got {n!r}"
    if form == "paper":
        return None
    for name in ("increments_halves", "states_out_of_place", "late_states"):
        if not isinstance(getattr(plan, name), bool):
            return f"plan.{name} must be True or False, got {getattr(plan, name)!r}"
    if plan.state_scan.cols is not None and not plan.states_out_of_place:
        return ("plan.state_scan.cols needs states_out_of_place (every value-column block "
                "reads the increments the states would overwrite)")
    if plan.increments_halves and (plan.increments_rows != D or plan.chunk < 32):
        return "plan.increments_halves needs increments_rows = D and a chunk of 32 or more"
    if plan.output_rows not in (plan.chunk, plan.chunk // 2) or plan.output_rows < 16:
        return (f"plan.output_rows must be the chunk ({plan.chunk}) or half of it, and at "
                f"least 16 (tl.dot's smallest size), got {plan.output_rows!r}")
    NT = _cdiv(T, plan.chunk)
    for name, scan in scans.items():
        if scan.n_seg < 1 or scan.n_seg > 1 and (scan.seg < 1 or scan.seg * scan.n_seg < NT):
            return f"plan.{name} = {scan} does not cover the {NT} chunks"
    if backward and (not isinstance(plan.grad_launches, tuple)
                     or sorted("".join(plan.grad_launches)) != ["k", "q", "v"]):
        return f"plan.grad_launches must name q, k and v once each, got {plan.grad_launches!r}"
    return None
