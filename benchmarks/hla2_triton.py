"""Focused GPU benchmark of the hla2 Triton kernels (masked, no decay).

    python benchmarks/hla2_triton.py [results.yaml] [--budget-s 150] [--profile]
                                     [--variants 32,64,128 [--variants-vs-chunk]]
                                     [--forward-variants] [--backward-variants]
    TRITON_INTERPRET=1 python benchmarks/hla2_triton.py out.yaml --check-len 40   # CPU smoke

1. Correctness on random data against hla2's float64 explicit sums (mixers/hla/hla2/naive.py,
   differentiated by torch autograd): outputs, final states and q/k/v gradients (relative
   Frobenius errors).
2. Timings (hla_bench.speed.timing.median_ms: the harness's method, median ms) of forward
   and forward+backward in bf16 with B*T = 65536, H = 16, D = Dv in {64, 128}, T in {2k,
   8k, 32k, 64k}, for the Triton op, the PyTorch chunk form (mixers.hla.hla2, impl="chunk")
   and fla's chunk_linear_attn when it imports; with the peak memory of one forward+backward.
3. --profile: CUDA time per kernel of one forward+backward (D = 64, T = 2k, 8k, 32k, 64k).
4. --variants: the Triton op at other chunk sizes and launch shapes (dq/dk and dv in two
   launches, scans planned for 4 resident programs per SM, scans in 32-row blocks) at
   T = 8k, 32k and 64k, and with normalize / masked decay at 8k (--variants-vs-chunk: also
   the PyTorch chunk form of those, and the paper decay form), D = 64.
5. --forward-variants: the forward alone at D = 128 (chunk 128) and D = 64 under kernel and
   launch variants (FORWARD_VARIANTS), T = 2k..64k, beside fla, with CUDA time per kernel;
   --backward-variants: the same for forward+backward (chunk 64; state scan rows).
Every failure is printed and the script goes on; it stops timing new rows once the time
budget is spent, and rewrites the YAML after each stage (a run cut short keeps what it did).
"""

from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import replace

import torch
import yaml

from hla_bench.speed.timing import median_ms
from hla_bench.results.bench_files import git_commit
from mixers.hla.hla2.naive import hla2_naive, hla2_naive_final_state
from mixers.errors import relative_error

TOKENS, HEADS = 65536, 16
SEQ_LENS = (2048, 8192, 32768, 65536)
HEAD_DIMS = (64, 128)


def check_correctness(results, device, seq_len, head_dims):
    from mixers.hla.hla2.triton import hla2_triton

    # bf16 only natively: the Triton interpreter (CPU smoke runs) mishandles bf16 memory
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for D in head_dims:
            name = f"{str(dtype).split('.')[-1]} D={D}"
            try:
                gen = torch.Generator(device=device).manual_seed(0)
                B, T, H = 2, seq_len, 4
                q, k, v = (torch.randn(B, T, H, D, device=device, generator=gen) * D ** -0.5
                           for _ in range(3))
                q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
                o, st = hla2_triton(q, k, v, normalize=False, eps=1e-6, decay=None,
                                    decay_form="masked", chunk_size=64, initial_state=None,
                                    output_final_state=True)
                ro = hla2_naive(q, k, v)
                reference_state = hla2_naive_final_state(q, k, v)
                rS, rA = reference_state["S"], reference_state["A"]
                w = torch.randn_like(ro)
                errs = {key: relative_error(computed, expected, norm="fro")
                        for key, computed, expected in (("o", o, ro), ("S", st["S"], rS),
                                                        ("A", st["A"], rA))}
                got = torch.autograd.grad((o.double() * w).sum() + st["A"].double().sum(),
                                          (q, k, v))
                want = torch.autograd.grad((ro * w).sum() + rA.sum(), (q, k, v))
                errs.update({f"d{n}": relative_error(a, b, norm="fro")
                             for n, a, b in zip("qkv", got, want)})
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                ok = all(e < tol for e in errs.values())
                print(f"correctness {name}: {'OK' if ok else 'FAIL'} "
                      + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
                results["correctness"][name] = {"ok": ok, **errs}
            except Exception as exc:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                results["correctness"][name] = {"error": repr(exc)}


def implementations():
    from mixers.hla.hla2.triton import hla2_triton

    impls = {"triton": lambda q, k, v: hla2_triton(
        q, k, v, normalize=False, eps=1e-6, decay=None, decay_form="masked", chunk_size=64,
        initial_state=None, output_final_state=False)[0]}
    try:
        from mixers.hla import hla2

        impls["torch-chunk"] = lambda q, k, v: hla2(q, k, v, impl="chunk", chunk_size=64)[0]
    except Exception as exc:  # noqa: BLE001
        print(f"torch chunk form unavailable: {exc!r}")
    try:
        from fla.ops.linear_attn import chunk_linear_attn

        impls["fla-linear-attn"] = lambda q, k, v: chunk_linear_attn(
            q=q, k=k, v=v, scale=1.0, normalize=False)[0]
    except Exception as exc:  # noqa: BLE001
        print(f"fla chunk_linear_attn unavailable: {exc!r}")
    return impls


def time_one(fn, q, k, v):
    out = {}
    with torch.no_grad():
        out["fwd_ms"] = median_ms(lambda: fn(q, k, v))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(v)

    def fwd_bwd():
        o = fn(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), do)

    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    out["fwd_bwd_ms"] = median_ms(fwd_bwd)
    return out


def time_row(table, key, fn, q, k, v):
    """time_one into table[key] (or the error), printed as one line."""
    try:
        row = time_one(fn, q, k, v)
        table[key] = row
        print(f"{key:36s} fwd {row['fwd_ms']:8.3f} ms  fwd+bwd {row['fwd_bwd_ms']:8.3f} ms  "
              f"peak {row['peak_mib']:8.0f} MiB")
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"{key}: FAILED {exc!r}")
        table[key] = {"error": repr(exc)}
    torch.cuda.empty_cache()


def run_timings(results, deadline):
    impls = implementations()
    for D in HEAD_DIMS:
        for T in SEQ_LENS:
            B = TOKENS // T
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, T, HEADS, D, device="cuda", generator=gen,
                                   dtype=torch.bfloat16) * D ** -0.5 for _ in range(3))
            for name, fn in impls.items():
                key = f"D={D} T={T} {name}"
                if time.time() > deadline:
                    print(f"{key}: skipped (time budget spent)")
                    results["timings"][key] = {"skipped": "time budget"}
                    continue
                time_row(results["timings"], key, fn, q, k, v)
            del q, k, v


def cuda_time_per_kernel(step, calls=5):
    """[(kernel, CUDA ms per call, launches per call)] of `calls` calls of step (already
    warmed up), slowest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return sorted(((e.key, e.device_time_total / 1e3 / calls, e.count // calls)
                   for e in prof.key_averages() if e.device_time_total > 0),
                  key=lambda row: -row[1])


def profile_kernels(results, shapes=((32, 2048, 64), (8, 8192, 64), (2, 32768, 64),
                                    (1, 65536, 64))):
    """CUDA time per kernel of forward+backward of the Triton op (torch.profiler, 5 calls
    after 3 warm-up calls): where the time of a step goes."""
    fn = implementations()["triton"]
    for B, T, D in shapes:
        key = f"D={D} T={T}"
        try:
            q, k, v = (torch.randn(B, T, HEADS, D, device="cuda", dtype=torch.bfloat16)
                       .mul_(D ** -0.5).requires_grad_() for _ in range(3))
            do = torch.randn_like(v)
            for _ in range(3):
                torch.autograd.grad(fn(q, k, v), (q, k, v), do)
            torch.cuda.synchronize()
            rows = cuda_time_per_kernel(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do))
            results["profile"][key] = {name: {"ms_per_step": round(ms, 4), "launches": n}
                                       for name, ms, n in rows}
            print(f"profile {key}: " + ", ".join(f"{name[:40]} {ms:.3f} ms x{n}"
                                                 for name, ms, n in rows[:10]))
        except Exception as exc:  # noqa: BLE001
            print(f"profile {key}: FAILED {exc!r}")
            results["profile"][key] = {"error": repr(exc)}


def planned(variant):
    """The Triton op (chunk 64) on its default launch plan changed by variant(plan)."""
    from mixers.hla.hla2.triton import hla2_triton, plan_call

    def fn(q, k, v):
        return hla2_triton(q, k, v, plan=variant(plan_call(q, k, v)))[0]
    return fn


def replanned(**options):
    """variant(plan): the scans planned again with plan_launch's options (resident,
    scan_rows), the other launches as they were."""
    from mixers.hla.hla2.triton import plan_launch

    def variant(plan):
        new = plan_launch(plan.shape, plan.dtype, "cuda", plan.backward, chunk_size=plan.chunk,
                          **options)
        return replace(plan, state_scan=new.state_scan, grad_scan=new.grad_scan)
    return variant


def time_variants(results, chunk_sizes, with_chunk_form):
    """fwd and fwd+bwd of chunk sizes, launch shapes and option sets at D = 64: which chunk
    size and launch shapes to default to (T = 8k, 32k, 64k), and what normalize and each decay
    form cost (8k; against the PyTorch chunk form and with the paper decay form only when
    with_chunk_form: those rows take most of the time). The launch-shape rows call the
    Triton op with a changed plan, the others hla2."""
    from mixers.hla import hla2

    decay = torch.full((HEADS,), 0.99, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {f"chunk {c}": (dict(chunk_size=c), None) for c in chunk_sizes}
    variants.update({
        "normalize": (dict(normalize=True), None), "masked decay": (dict(decay=decay), None),
        "paper decay": (dict(decay=decay, decay_form="paper"), None),
        "dq/dk and dv in two launches": ({}, lambda plan: replace(
            plan, grad_launches=("qk", "v") if plan.backward else None)),
        "scans assume 4 programs per SM": ({}, replanned(resident=4 * sms)),
        "scans in blocks of 32 rows": ({}, replanned(scan_rows=32))})
    for T in (8192, 32768, 65536):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(TOKENS // T, T, HEADS, 64, device="cuda", generator=gen,
                               dtype=torch.bfloat16) / 8 for _ in range(3))
        for name, (options, variant) in variants.items():
            is_option = "decay" in name or name == "normalize"
            if T > 8192 and (is_option or name.startswith("chunk ") and name != "chunk 64"):
                continue  # options and chunk sizes: 8k says enough
            if name == "paper decay" and not with_chunk_form:
                continue  # its kernels walk the chunks one by one (slow to time)
            impls = ("triton", "chunk") if is_option and with_chunk_form else ("triton",)
            for impl in impls:
                fn = planned(variant) if variant is not None else (
                    lambda a, b, c, impl=impl, options=options:
                    hla2(a, b, c, impl=impl, **options)[0])
                time_row(results["variants"], f"T={T} {name} {impl}", fn, q, k, v)


# The forward alone at D = 128 (chunk 128) and D = 64 (chunk 64): the default plan, and the
# plan with the chunk-128 paths (increments in halves, late state loads, the states scanned
# into buffers of their own) off. variant(plan) -> plan, None for the default.
FORWARD_VARIANTS = {"base": None, "chunk-128 paths off": lambda plan: replace(
    plan, increments_halves=False, late_states=False, states_out_of_place=False)}
# fwd+bwd at head dim 128 runs chunk 64; the state scan there in 64-row blocks where
# 16-row blocks would need 4 waves (T = 2k, 8k): planned as the gradient scan is (a plan
# without backward has no gradient scan and keeps its state scan)
BACKWARD_VARIANTS = {"base": None,
                     "state scan in 64-row blocks": lambda plan: replace(
                         plan, state_scan=plan.grad_scan) if plan.backward else plan}


def _tuned_warps():
    """{kernel: {autotune key: num_warps}} of the autotuned kernels' choices so far."""
    from mixers.hla.hla2.triton import increments, output

    picks = {}
    for module, name in ((increments, "chunk_increments_kernel"),
                         (output, "chunk_output_kernel")):
        cache = getattr(getattr(module, name), "cache", {})
        picks[name] = {str(key): config.num_warps for key, config in cache.items()}
    return picks


def time_kernel_variants(results, backward):
    """The forward (backward=False: chunk 128 at D = 128; also D = 64) or forward+backward
    (chunk 64, D = 128) under launch variants, side by side in this process (median_ms
    medians; relative difference of the outputs, and of dq with backward, to the first
    variant), with fla's chunk_linear_attn alongside when it imports, CUDA time per kernel
    of each variant and the autotuner's warp choices: where the time goes."""
    from mixers.hla.hla2.triton import hla2_triton, plan_call

    def run(q, k, v, variant):
        plan = None if variant is None else variant(plan_call(q, k, v))
        return hla2_triton(q, k, v, plan=plan)

    fla = implementations().get("fla-linear-attn")
    table = results["backward_variants" if backward else "forward_variants"]
    variants = BACKWARD_VARIANTS if backward else FORWARD_VARIANTS
    for D in ((128,) if backward else (128, 64)):
        for T in SEQ_LENS:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(TOKENS // T, T, HEADS, D, device="cuda", generator=gen,
                                   dtype=torch.bfloat16) / D ** 0.5 for _ in range(3))
            if backward:
                q.requires_grad_()
                do = torch.randn_like(v)

                def step(variant):
                    return torch.autograd.grad(run(q, k, v, variant)[0], q, do)[0]
            else:
                def step(variant):
                    with torch.no_grad():
                        return run(q, k, v, variant)[0]
            base = None
            if fla is not None and not backward:
                with torch.no_grad():
                    ms = median_ms(lambda: fla(q, k, v))
                table[f"D={D} T={T} fla-linear-attn"] = {"ms": round(ms, 4)}
                print(f"D={D} T={T} fla-linear-attn fwd {ms:8.3f} ms")
            for name, variant in variants.items():
                key = f"D={D} T={T} {name}"
                try:
                    out = step(variant).float()
                    base = out if base is None else base
                    diff = relative_error(out, base, norm="fro")
                    ms = median_ms(lambda: step(variant))
                    per_kernel = cuda_time_per_kernel(lambda: step(variant))
                    table[key] = {"ms": round(ms, 4), "rel_to_first": diff,
                                  "cuda_ms_per_kernel": {kernel: round(t, 4)
                                                         for kernel, t, _ in per_kernel}}
                    print(f"{key:60s} {'fwd+bwd' if backward else 'fwd'} {ms:8.3f} ms  "
                          f"rel {diff:.1e}  " + ", ".join(f"{kernel[:24]} {t:.3f}"
                                                          for kernel, t, _ in per_kernel))
                except Exception as exc:  # noqa: BLE001 - report and go on
                    table[key] = {"error": repr(exc)[:300]}
                    print(f"{key}: FAILED {exc!r}"[:300])
            del q, k, v, base
            torch.cuda.empty_cache()
    table["autotune_warps"] = _tuned_warps()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", nargs="?", default="hla2_triton_bench.yaml",
                        help="YAML file for the results")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="stop starting new timings after this many seconds")
    parser.add_argument("--check-len", type=int, default=1000,
                        help="sequence length of the correctness check")
    parser.add_argument("--check-only", action="store_true",
                        help="correctness only (a CPU smoke run with TRITON_INTERPRET=1)")
    parser.add_argument("--profile", action="store_true",
                        help="also: CUDA time per kernel of one forward+backward")
    parser.add_argument("--variants", metavar="CHUNK_SIZES", default=None,
                        help="also: time chunk sizes (e.g. 32,64,128), launch shapes, "
                             "normalize and decay forms")
    parser.add_argument("--forward-variants", action="store_true",
                        help="also: the forward alone at head dims 128 and 64 under kernel "
                             "variants, with CUDA time per kernel")
    parser.add_argument("--backward-variants", action="store_true",
                        help="also: forward+backward at head dim 128 under launch-shape "
                             "variants, with CUDA time per kernel")
    parser.add_argument("--variants-vs-chunk", action="store_true",
                        help="with --variants: also time the options' PyTorch chunk form and the "
                             "paper decay form")
    args = parser.parse_args()
    start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "git_commit": git_commit(),
               "tokens": TOKENS, "heads": HEADS, "dtype": "bfloat16", "correctness": {},
               "timings": {}, "profile": {}, "variants": {}, "forward_variants": {},
               "backward_variants": {}}
    def save():
        results["wall_s"] = round(time.time() - start, 1)
        with open(args.output, "w") as f:
            yaml.safe_dump(results, f, sort_keys=False)

    check_correctness(results, device, args.check_len,
                      HEAD_DIMS if device == "cuda" else (16,))
    save()
    if args.check_only or device != "cuda":
        print("timings skipped" + ("" if device == "cuda" else ": they need a CUDA device"))
    else:
        if args.profile:
            profile_kernels(results)
            save()
        if args.variants:
            time_variants(results, [int(c) for c in args.variants.split(",") if c],
                          args.variants_vs_chunk)
            save()
        if args.forward_variants:
            time_kernel_variants(results, backward=False)
            save()
        if args.backward_variants:
            time_kernel_variants(results, backward=True)
            save()
        run_timings(results, start + args.budget_s)
    save()
    print(f"wrote {args.output} ({results['wall_s']} s)")


if __name__ == "__main__":
    main()
