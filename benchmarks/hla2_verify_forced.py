"""hla-bench verify's masked hla2 checks on the Triton op with its chunk-128 paths forced.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/hla2_verify_forced.py --from-chunk 16 \\
        --dtype bfloat16 [--yaml out.yaml]
    TRITON_INTERPRET=1 python benchmarks/hla2_verify_forced.py --device cpu --dtype float32
                                                                              # CPU smoke

The default launch plan takes the increments in token halves, the output's late state loads
and the out-of-place state scan only at chunks of 128 with D = Dv = 128 (plan_launch). This
runs verify's masked hla2 cases (its inputs, options, tolerances and float64 reference;
the whole sequence, and a prefill continued from its final state) through hla2_triton on a
plan that takes those paths from --from-chunk tokens per chunk on, at verify's head dim 16
(the halves need 32 tokens: below that only the late state loads and the out-of-place
scan). Natively in bf16 the output kernel with late state loads makes an illegal memory
access there, which is why the default plan keeps the paths at head dim 128. Exit code 1
when a check fails.

    python benchmarks/hla2_verify_forced.py --normalize-precision [--yaml out.yaml]

checks instead normalize's outputs on the default plan in bf16 at T up to 65,536 and head
dims 16 to 192 (80 and 192 are not powers of two; verify's positive features, one batch
row, two heads): the max-abs error against the PyTorch chunk form in float64 on the same
rounded inputs must stay within 1e-2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch
import yaml

from hla_bench import registry, verify
from mixers.common import check_decay
from mixers.hla.hla2 import hla2
from mixers.hla.hla2.triton import hla2_triton, plan_call
from mixers.errors import relative_error


def forced(plan, from_chunk):
    """The plan with the chunk-128 paths taken from `from_chunk` tokens per chunk on."""
    if plan.chunk < from_chunk:
        return plan
    D = plan.shape[3]
    return replace(plan, late_states=True, states_out_of_place=not plan.backward,
                   increments_halves=plan.increments_rows == D and plan.chunk >= 32)


def run_case(case, *, from_chunk, chunk_size, seed, seq_len, dtype_name, device):
    """Rows (option, pair, error, tolerance, status) of one verify case."""
    dtype, tolerance = verify.DTYPES[dtype_name], verify.TOLERANCES[dtype_name]
    q, k, v = verify.random_inputs(seed, seq_len, dtype, case.shared_kv)
    reference = registry.get(case.mixer).reference(**case.options)(q, k, v)
    qd, kd, vd = (x.to(device, dtype) for x in (q, k, v))
    options = {"normalize": case.options.get("normalize", False),
               "decay": check_decay(case.options.get("decay"), qd.shape[2], qd.device),
               "chunk_size": chunk_size}

    def op(q, k, v, **state):
        plan = forced(plan_call(q, k, v, initial_state=state.get("initial_state"),
                                **options), from_chunk)
        return hla2_triton(q, k, v, plan=plan, **options, **state)

    def whole():
        return op(qd, kd, vd)[0]

    def split_run():
        split = (2 * seq_len) // 3
        first, state = op(qd[:, :split], kd[:, :split], vd[:, :split], output_final_state=True)
        second, _ = op(qd[:, split:], kd[:, split:], vd[:, split:], initial_state=state)
        return torch.cat([first, second], dim=1)

    rows = []
    checks = {"triton vs naive": whole}
    if case.continuation:
        checks["split via initial_state vs naive"] = split_run
    for pair, compute in checks.items():
        with torch.no_grad():
            error = relative_error(compute(), reference)
        rows.append({"option": case.option, "pair": pair, "error": error,
                     "tolerance": tolerance, "status": "pass" if error <= tolerance else "FAIL"})
        print(f"{case.option:40s} {pair:34s} {error:9.2e} {rows[-1]['status']}")
    return rows


PRECISION_LENGTHS = (1100, 4096, 16384, 65536)
PRECISION_DIMS = (16, 32, 64, 80, 128, 192)  # 80 and 192: held in padded blocks
PRECISION_TOLERANCE = 1e-2


def normalize_precision_rows(device, seed):
    """Rows (option, pair, error, tolerance, status) of normalize's max-abs error in bf16."""
    rows = []
    for D in PRECISION_DIMS:
        for T in PRECISION_LENGTHS:
            gen = torch.Generator().manual_seed(seed)
            q, k = (torch.randn(1, T, 2, D, generator=gen).abs() / D ** 0.5 for _ in "qk")
            v = torch.randn(1, T, 2, D, generator=gen)
            q, k, v = (x.to(device, torch.bfloat16) for x in (q, k, v))
            with torch.no_grad():
                o, _ = hla2_triton(q, k, v, normalize=True, eps=1e-6)
                want, _ = hla2(*(x.double() for x in (q, k, v)), normalize=True, eps=1e-6,
                               impl="chunk")
            error = (o.double() - want).abs().max().item()
            rows.append({"option": f"normalize D={D} T={T}", "pair": "bf16 max-abs vs float64",
                         "error": error, "tolerance": PRECISION_TOLERANCE,
                         "status": "pass" if error <= PRECISION_TOLERANCE else "FAIL"})
            print(f"{rows[-1]['option']:40s} {rows[-1]['pair']:34s} {error:9.2e} "
                  f"{rows[-1]['status']}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-chunk", type=int, default=16,
                        help="take the chunk-128 paths from this many tokens per chunk on")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: under TRITON_INTERPRET=1 (bfloat16 is not interpreted)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--normalize-precision", action="store_true",
                        help="check normalize's bf16 max-abs error up to T = 65536 instead")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (--device cpu runs under TRITON_INTERPRET=1)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu needs TRITON_INTERPRET=1")
    if args.normalize_precision and args.device == "cpu":
        parser.error("--normalize-precision runs in bf16, which is not interpreted")
    if args.normalize_precision:
        rows = normalize_precision_rows(args.device, args.seed)
    else:
        masked = [case for case in verify.cases("cuda") if case.mixer == "hla2"
                  and "triton" in case.forms and not case.options.get("ridge")
                  and case.options.get("decay_form", "masked") == "masked"]
        rows = [row for case in masked
                for row in run_case(case, from_chunk=args.from_chunk,
                                    chunk_size=args.chunk_size, seed=args.seed,
                                    seq_len=args.seq_len, dtype_name=args.dtype,
                                    device=args.device)]
    if args.yaml:
        with open(args.yaml, "w") as f:
            yaml.safe_dump({"command": " ".join(sys.argv[1:]), "rows": rows}, f,
                           sort_keys=False)
    sys.exit(0 if all(row["status"] == "pass" for row in rows) else 1)


if __name__ == "__main__":
    main()
