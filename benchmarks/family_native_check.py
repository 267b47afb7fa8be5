"""The ahla2 and causal hla3 Triton kernels compiled for the GPU, checked against the PyTorch
chunk form in float64 on the same rounded inputs.

    python benchmarks/family_native_check.py [--yaml out.yaml]
    python benchmarks/family_native_check.py --normalize-precision [--yaml out.yaml]
    TRITON_INTERPRET=1 python benchmarks/family_native_check.py --device cpu --quick
                                                                        # CPU smoke

tests/test_family_triton.py checks the kernels under the interpreter in float64; this runs
the compiled kernels in float32 and bfloat16 at the tests' odd head dims and at 64 and 128:
outputs, final states, the gradients of q, k and v, a continuation from a prefix's state, and
decode steps. Errors are max-abs over the reference's largest magnitude (relative_error);
gradients use the Frobenius ratio. Tolerances: float32 1e-4, bfloat16 2e-2 (outputs,
states, decode) and 3e-2 (gradients). Exit code 1 when a check fails.

`--normalize-precision` checks instead the normalized outputs in bf16 at T up to 65,536
and head dims 16 to 192 (one batch row, two heads, positive q and k): the max-abs error
against the PyTorch chunk form in float64 on the same rounded inputs, on the GPU, must
stay within 1e-2, as benchmarks/hla2_verify_forced.py checks hla2's.
"""

from __future__ import annotations

import argparse
import sys

import torch
import yaml

from mixers.hla.ahla2 import ahla2, ahla2_step
from mixers.hla.hla3 import hla3, hla3_step
from mixers.errors import relative_error

H = 2
OPS = {
    "ahla2": (ahla2, ahla2_step, {}),
    "ahla2-decay": (ahla2, ahla2_step, {"decay": 0.9}),
    "hla3": (hla3, hla3_step, {"variant": "causal"}),
}
# (T, D, Dv): partial last chunks, head dims that are not powers of two, Dv != D
SHAPES = [(37, 16, 16), (41, 24, 40), (23, 48, 16), (300, 64, 64), (700, 96, 80),
          (260, 128, 128)]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 3e-2)}
PRECISION_LENGTHS = (1100, 4096, 16384, 65536)
PRECISION_DIMS = (16, 32, 64, 80, 128, 192)  # 80 and 192: held in padded blocks
PRECISION_TOLERANCE = 1e-2


def inputs(T, D, Dv, dtype, positive, seed=0, B=2):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) / D ** 0.5
            for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    if positive:
        q, k = q.abs(), k.abs()
    # rounded to the checked dtype once: the reference sees the same numbers
    return [x.to(dtype).to(torch.float64) for x in (q, k, v)]


def run(op, q, k, v, impl, dtype, device, options, normalize, initial_state=None):
    xs = [x.detach().to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
    o, state = op(*xs, impl=impl, normalize=normalize, output_final_state=True,
                  initial_state=initial_state, **options)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device=device,
                                                                     dtype=o.dtype)
    (o * do).sum().backward()
    return o.detach(), {k: s.detach() for k, s in state.items()}, [x.grad for x in xs]


def check(name, shape, dtype, normalize, device):
    op, step, options = OPS[name]
    q, k, v = inputs(*shape, dtype, positive=normalize)
    ref_o, ref_state, ref_grads = run(op, q, k, v, "chunk", torch.float64, "cpu", options,
                                      normalize)
    o, state, grads = run(op, q, k, v, "triton", dtype, device, options, normalize)
    errors = {"output": relative_error(o.cpu(), ref_o)}
    for key in ref_state:
        errors[f"state.{key}"] = relative_error(state[key].cpu(), ref_state[key])
    for letter, g, ref in zip("qkv", grads, ref_grads):
        errors[f"grad.{letter}"] = relative_error(g.cpu(), ref, norm="fro")
    # a continuation from a prefix's state, then three decode steps from the whole state
    cut = shape[0] // 3
    _, prefix, _ = run(op, q[:, :cut], k[:, :cut], v[:, :cut], "triton", dtype, device,
                       options, normalize)
    rest, _, _ = run(op, q[:, cut:], k[:, cut:], v[:, cut:], "triton", dtype, device,
                     options, normalize, initial_state=prefix)
    errors["continuation"] = relative_error(rest.cpu(), ref_o[:, cut:])
    step_options = {key: value for key, value in options.items()}
    ref_carry = {key: s.clone() for key, s in ref_state.items()}
    carry = {key: s.clone() for key, s in state.items()}
    nq, nk, nv = inputs(3, shape[1], shape[2], dtype, positive=normalize, seed=2, B=2)
    worst = 0.0
    for t in range(3):
        ref_out, ref_carry = step(nq[:, t], nk[:, t], nv[:, t], ref_carry, impl="torch",
                                  normalize=normalize, **step_options)
        out, carry = step(*(x[:, t].to(device=device, dtype=dtype) for x in (nq, nk, nv)),
                          carry, impl="triton", normalize=normalize, **step_options)
        worst = max(worst, relative_error(out.cpu(), ref_out))
    errors["decode"] = worst
    values, grads_tol = TOLERANCE[dtype]
    failed = [key for key, err in errors.items()
              if not err <= (grads_tol if key.startswith("grad") else values)]
    return {"op": name, "T": shape[0], "D": shape[1], "Dv": shape[2],
            "dtype": str(dtype).removeprefix("torch."), "normalize": normalize,
            "errors": {key: float(f"{err:.3g}") for key, err in errors.items()},
            "ok": not failed, "failed": failed}


def normalize_precision(name: str, T: int, D: int, device: str) -> dict:
    """The max-abs error of one op's normalized bf16 outputs against float64."""
    op, _, options = OPS[name]
    q, k, v = inputs(T, D, D, torch.bfloat16, positive=True, B=1)
    with torch.no_grad():
        o, _ = op(*(x.to(device, torch.bfloat16) for x in (q, k, v)), impl="triton",
                  normalize=True, **options)
        want, _ = op(*(x.to(device) for x in (q, k, v)), impl="chunk", normalize=True,
                     **options)
    error = (o.double() - want).abs().max().item()
    return {"op": name, "T": T, "D": D, "Dv": D, "dtype": "bfloat16", "normalize": True,
            "errors": {"output max-abs": float(f"{error:.3g}")},
            "ok": error <= PRECISION_TOLERANCE,
            "failed": [] if error <= PRECISION_TOLERANCE else ["output max-abs"]}


def write_rows(path: str, device: str, rows: list[dict]) -> None:
    name = torch.cuda.get_device_name() if device == "cuda" else device
    with open(path, "w") as fh:
        yaml.safe_dump({"device": name, "torch": str(torch.__version__), "rows": rows}, fh,
                       sort_keys=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--yaml", help="also write the rows to this YAML file")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1")
    parser.add_argument("--quick", action="store_true", help="the first two shapes only")
    parser.add_argument("--normalize-precision", action="store_true",
                        help="the normalized bf16 outputs' max-abs error up to T = 65536")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.normalize_precision and args.device != "cuda":
        print("--normalize-precision runs in bf16, which is not interpreted", file=sys.stderr)
        return 2
    rows = []
    if args.normalize_precision:
        for name in OPS:
            for D in PRECISION_DIMS:
                for T in PRECISION_LENGTHS:
                    row = normalize_precision(name, T, D, args.device)
                    rows.append(row)
                    print(("ok  " if row["ok"] else "FAIL"), name, f"T={T} D={D}",
                          row["errors"], flush=True)
                    if args.yaml:
                        write_rows(args.yaml, args.device, rows)
    for dtype in () if args.normalize_precision else TOLERANCE:
        for name in OPS:
            for shape in SHAPES[:2] if args.quick else SHAPES:
                for normalize in (False, True):
                    try:
                        row = check(name, shape, dtype, normalize, args.device)
                    except Exception as error:  # a kernel that fails to build or run
                        row = {"op": name, "T": shape[0], "D": shape[1], "Dv": shape[2],
                               "dtype": str(dtype).removeprefix("torch."),
                               "normalize": normalize, "ok": False,
                               "failed": [f"{type(error).__name__}: {error}"[:300]]}
                    rows.append(row)
                    print(("ok  " if row["ok"] else "FAIL"), row["op"], row["dtype"],
                          "T=%d D=%d Dv=%d" % shape, "normalize" if normalize else "",
                          row.get("errors", row["failed"]), flush=True)
                    if args.yaml:  # rewritten after every row: a run cut short keeps its rows
                        write_rows(args.yaml, args.device, rows)
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows) - failed}/{len(rows)} ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
