"""Launch-plan variants of the hla2 Triton op for the tests: paths the default plan takes only
at shapes too large for the interpreter (or too few chunks to need), forced at small ones by
changing fields of the default plan (mixers/hla/hla2/triton/plan.py)."""

from dataclasses import replace

from mixers.hla.hla2.triton import ScanPlan


def num_chunks(plan):
    return -(-plan.shape[1] // plan.chunk)


def two_level_scans(plan):
    """Both scans in 16-row programs over segments of 2 chunks (the last one partial at an
    odd chunk count): summaries, a scan over them, a rescan per segment."""
    scan = ScanPlan(16, 2, -(-num_chunks(plan) // 2))
    return replace(plan, state_scan=scan, grad_scan=scan if plan.backward else None)


def chunk_128_paths(plan):
    """The paths of a chunk of 128 at head dim 128: increments in two halves of tokens (all D
    rows in one block), late state loads in the output kernel and, without a backward pass,
    the states scanned into buffers of their own."""
    return replace(plan, increments_rows=plan.shape[3], increments_halves=True,
                   late_states=True, states_out_of_place=not plan.backward)


def split_output_rows(plan):
    """Each chunk's output as two programs of half its rows (the second also mixes with the
    first half's keys and values)."""
    return replace(plan, output_rows=plan.chunk // 2)
