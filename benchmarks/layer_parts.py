"""Where a mixer layer's time goes: the registry's layer as configured, then with each of
its parts switched off in turn (short convolution, q/k norm, output norm) and with all
three off, beside the bare operator; and the layer's depthwise causal convolution alone,
two ways: torch's Conv1d as `mixers.layer.ShortConv` runs it, and the shifted sums of the
stacked training path (`mixers.short_conv.stacked_causal_conv`), eager and compiled.

    python benchmarks/layer_parts.py [--mixers fla-linear-attn,hla2] [--seq-lens 2048,65536]
        [--modes fwd,fwdbwd] [--yaml out.yaml]

bf16 on CUDA (float32 with --device cpu), d_model = heads x head dim (16 x 64), `--tokens`
a call (batch = tokens // T), timed with the harness's method (hla_bench.speed.timing:
a quarter second of samples, the L2 cache flushed between them on CUDA). A part a mixer's
layer does not have (an option it does not take) is left out of its rows.
"""

from __future__ import annotations

import argparse
import sys

import torch
import yaml

from hla_bench import registry
from hla_bench.speed.timing import percentile, spread, time_calls
from mixers.layer import ShortConv
from mixers.short_conv import stacked_causal_conv

PARTS = {"layer": {}, "no short conv": {"short_conv": 0}, "no q/k norm": {"qk_norm": "none"},
         "no output norm": {"output_norm": False},
         "none of the three": {"short_conv": 0, "qk_norm": "none", "output_norm": False}}
CONV_KERNEL = 4


def measure(fn, device: str) -> dict:
    times = time_calls(fn, warmup=3, repeats=5, device=device, min_time_s=0.25,
                       flush_cache=device.startswith("cuda"))
    return {"median_ms": round(percentile(times, 50), 4), "spread": spread(times)}


def layer_calls(layer, x, cotangent):
    """(forward, forward + backward) of a layer on x (parameter and input gradients dropped
    after each call), as the harness's layer level times them."""
    def fwd():
        with torch.no_grad():
            layer(x)

    def fwdbwd():
        layer(x).backward(cotangent)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    return fwd, fwdbwd


def op_calls(op, q, k, v, cotangent):
    def fwd():
        with torch.no_grad():
            op(q, k, v)

    def fwdbwd():
        op(q, k, v)[0].backward(cotangent)
        q.grad = k.grad = v.grad = None

    return fwd, fwdbwd


def conv_calls(x, device, dtype):
    """Each way of the short convolution over x `[B, T, C]`: name -> (fwd, fwdbwd)."""
    conv = ShortConv(x.shape[-1], CONV_KERNEL).to(device=device, dtype=dtype)
    weight = conv.conv.weight.detach().unsqueeze(0).requires_grad_()
    shifted = lambda y: stacked_causal_conv(y.unsqueeze(0), weight).squeeze(0)  # noqa: E731
    compiled = torch.compile(shifted)
    cotangent = torch.randn_like(x)
    ways = {}
    for name, fn in (("conv: Conv1d", conv), ("conv: shifted sums", shifted),
                     ("conv: shifted sums, compiled", compiled)):
        def fwd(fn=fn):
            with torch.no_grad():
                fn(x)

        def fwdbwd(fn=fn):
            fn(x).backward(cotangent)
            x.grad = None
            conv.zero_grad(set_to_none=True)
            weight.grad = None

        ways[name] = (fwd, fwdbwd)
    return ways


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixers", default="fla-linear-attn,hla2,ahla2,hla3")
    parser.add_argument("--seq-lens", default="2048,65536")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if set(modes) - {"fwd", "fwdbwd"}:
        parser.error(f"--modes takes fwd and fwdbwd, got {args.modes!r}")
    try:
        mixers = [registry.get(name) for name in args.mixers.split(",")]
    except registry.UnknownMixerError as error:
        parser.error(str(error))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("layer_parts.py: no CUDA device (--device cpu runs it on the CPU)", file=sys.stderr)
        return 2
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    d_model = args.heads * args.head_dim
    rows: list[dict] = []

    def add(row: dict) -> None:
        rows.append(row)
        print(f"T={row['T']:6d} {row['mode']:6s} {row['mixer']:18s} {row['part']:30s} "
              f"{row['median_ms']:9.3f} ms  spread {row['spread'] or 0:.1%}", flush=True)
        if args.yaml:  # rewritten after every row: a run cut short keeps what it measured
            with open(args.yaml, "w") as handle:
                yaml.safe_dump({"device": device, "gpu": torch.cuda.get_device_name()
                                if device.startswith("cuda") else None,
                                "torch": str(torch.__version__), "dtype": str(dtype),
                                "d_model": d_model, "heads": args.heads,
                                "tokens": args.tokens, "rows": rows}, handle, sort_keys=False)

    for T in (int(t) for t in args.seq_lens.split(",")):
        batch = max(1, args.tokens // T)
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(batch, T, d_model, device=device, dtype=dtype, generator=gen,
                        requires_grad=True)
        cotangent = torch.randn(batch, T, d_model, device=device, dtype=dtype, generator=gen)
        for mixer in mixers:
            for part, options in PARTS.items():
                if set(options) - set(mixer.options):
                    continue
                layer = mixer.layer(d_model, args.heads, **options).to(device=device, dtype=dtype)
                for mode, fn in zip(("fwd", "fwdbwd"), layer_calls(layer, x, cotangent)):
                    if mode in modes:
                        add({"T": T, "mode": mode, "mixer": mixer.name, "part": part,
                             **measure(fn, device)})
                del layer
            shape = (batch, T, args.heads, args.head_dim)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen)
                       .div_(args.head_dim ** 0.5).requires_grad_() for _ in range(3))
            for mode, fn in zip(("fwd", "fwdbwd"),
                                op_calls(mixer.op(), q, k, v, torch.randn_like(v))):
                if mode in modes:
                    add({"T": T, "mode": mode, "mixer": mixer.name, "part": "operator",
                         **measure(fn, device)})
        wide = torch.randn(batch, T, 3 * d_model, device=device, dtype=dtype, generator=gen,
                           requires_grad=True)
        for part, calls in conv_calls(wide, device, dtype).items():
            for mode, fn in zip(("fwd", "fwdbwd"), calls):
                if mode in modes:
                    add({"T": T, "mode": mode, "mixer": "-", "part": part,
                         **measure(fn, device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
