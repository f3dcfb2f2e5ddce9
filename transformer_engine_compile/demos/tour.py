"""Format tour: ``python -m transformer_engine_compile.demos.tour [--device cuda]``.

Quantizes one random activation-like tensor in every format and prints the
error and the storage cost per element (rowwise copy, and both copies).
"""

from __future__ import annotations

import argparse

import torch

import transformer_engine_compile as te


def tour_quantizers(device):
    return [
        ("FP8 delayed (E4M3)", lambda: te.Float8Quantizer(
            torch.ones(1, device=device), torch.zeros(1, device=device), "e4m3")),
        ("FP8 current (E4M3)", lambda: te.Float8CurrentScalingQuantizer("e4m3")),
        ("FP8 current (E5M2)", lambda: te.Float8CurrentScalingQuantizer("e5m2")),
        ("MXFP8 (E4M3, 1x32)", lambda: te.MXFP8Quantizer("e4m3")),
        ("FP8 blockwise 1x128", lambda: te.Float8BlockQuantizer(block_scaling_dim=1)),
        ("FP8 blockwise 128x128", lambda: te.Float8BlockQuantizer(block_scaling_dim=2)),
        ("NVFP4 (1x16)", lambda: te.NVFP4Quantizer()),
        ("NVFP4 (16x16)", lambda: te.NVFP4Quantizer(with_2d_quantization=True)),
    ]


def bytes_per_element(t) -> float:
    total = sum(b.numel() * b.element_size() for b in t.buffers().values())
    return total / t.numel()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=int, nargs=2, default=(1024, 4096), metavar=("M", "K"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    x = torch.randn(*args.shape, device=args.device, dtype=torch.bfloat16)
    x[torch.rand_like(x, dtype=torch.float32) < 1e-3] *= 50  # a few outliers, like activations
    print(f"transformer_engine_compile {te.__version__} | torch {torch.__version__} | "
          f"device {args.device} | x {tuple(x.shape)} bf16 (2.00 B/elem)")
    ok, reason = te.compile_support()
    print(f"torch.compile support: {'yes' if ok else 'no (' + str(reason) + ')'}")
    header = f"{'format':24} {'rel. RMS err':>12} {'max |err|':>10} {'B/elem row':>10} {'B/elem both':>11}"
    print(header)
    print("-" * len(header))
    xf = x.float()
    for name, make in tour_quantizers(args.device):
        both = make().quantize(x)
        row = make().with_usage(columnwise=False).quantize(x)
        err = both.dequantize(dtype=torch.float32) - xf
        rel = (err.norm() / xf.norm()).item()
        print(f"{name:24} {rel:12.4%} {err.abs().max().item():10.4f} "
              f"{bytes_per_element(row):10.3f} {bytes_per_element(both):11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
