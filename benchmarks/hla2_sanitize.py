"""A small hla2 Triton workload to run under compute-sanitizer, with warp counts forced.

    compute-sanitizer --tool memcheck python benchmarks/hla2_sanitize.py --warps 4
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python benchmarks/hla2_sanitize.py --warps 4 --only increments --forward-only

B = 1, T = 300 (a partial last chunk), H = 2, D = Dv = 128 (--head-dim), bf16, nonnegative q, k,
seeded. Four steps: a no-grad forward (chunk 128 at D = 128: the output in 64-row halves) and a
fwd+bwd, each plain and with normalize, decay (0.99, 0.8), an initial state and the final
state. Each step prints its output norm, its NaN count and the NaN count of the inputs, so
that a wrong result shows even where the tool reports no error. --warps replaces the autotune
configs of the per-chunk kernels (--only: a comma list of increments, output, grads,
grad_terms) by that one warp count, builds the tuning may never launch included.
"""

from __future__ import annotations

import argparse

import torch
import triton

from mixers.hla.hla2.triton import backward, hla2_triton, increments, output

# --only name -> (stage module, kernel)
KERNELS = {"increments": (increments, "chunk_increments_kernel"),
           "output": (output, "chunk_output_kernel"),
           "grads": (backward, "chunk_grads_kernel"),
           "grad_terms": (backward, "chunk_grad_terms_kernel")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warps", type=int, choices=(4, 8), default=None,
                        help="force this warp count (default: the kernels' own tuning)")
    parser.add_argument("--only", default=",".join(KERNELS),
                        help="comma list of the kernels --warps applies to")
    parser.add_argument("--forward-only", action="store_true", help="skip the fwd+bwd steps")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (compute-sanitizer checks native kernels)")
    if args.warps is not None:
        for name in args.only.split(","):
            if name not in KERNELS:
                parser.error(f"--only: unknown kernel {name!r} (choose from {', '.join(KERNELS)})")
            module, kernel = KERNELS[name]
            getattr(module, kernel).configs = [triton.Config({}, num_warps=args.warps)]
    torch.manual_seed(7)
    B, T, H, D = 1, 300, 2, args.head_dim
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).abs() * D ** -0.5
               for _ in range(3))
    state = {"S": torch.eye(D, device="cuda").expand(B, H, D, D).contiguous(),
             "A": torch.randn(B, H, D, D, device="cuda"),
             "a": torch.rand(B, H, D, device="cuda") + 1}
    decay = torch.tensor([0.99, 0.8], device="cuda")
    option_sets = {"plain": {}, "normalize, decay, states": dict(
        normalize=True, decay=decay, initial_state=state, output_final_state=True)}

    def inputs_nan():
        return [int(x.isnan().sum()) for x in (q, k, v, *state.values())]

    for label, options in option_sets.items():
        with torch.no_grad():
            o, _ = hla2_triton(q, k, v, **options)
        torch.cuda.synchronize()
        print(f"forward, {label}: norm {float(o.float().norm()):.6g}, NaN {int(o.isnan().sum())}, "
              f"NaN in inputs {inputs_nan()}", flush=True)
        if args.forward_only:
            continue
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = hla2_triton(*leaves, **options)
        o.float().sum().backward()
        torch.cuda.synchronize()
        print(f"fwd+bwd, {label}: dq norm {float(leaves[0].grad.float().norm()):.6g}, "
              f"NaN {sum(int(x.grad.isnan().sum()) for x in leaves)}", flush=True)


if __name__ == "__main__":
    main()
