"""decoderlm's block kernels layer by layer: fp32, int16 and int8 activations, one row and a batch.

SmolLM2-135M-Instruct's layer shapes (Q4_1: its fused q/k/v, gate/up, down and o projections; Q8_0: its
LM head) with random weights, multiplied by `decoderlm.kernels.matmul` in each of its arithmetics for
1 and 8 rows of x. Each timed call multiplies the next of `--layers` copies of the layer, so the weights
stream from memory as in a decode step; the arithmetics are interleaved within each repeat and the
median is reported, with each one's speed over fp32's and its error against the fp32 product of the
rounded weights (relative Frobenius norm).

    python benchmarks/block_kernels.py [--isa native|avx2|avx512|default] [--threads 2] [--repeats 7] [--layers 30]

`--isa avx2` runs decoderlm's AVX2 variant (`decoderlm.isa.env`) and writes block_kernels_avx2.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from decoderlm import isa, kernels
from decoderlm.quantize import BlockLinear

RESULTS = Path(__file__).parent / "results" / "block_kernels.json"
SHAPES = {"qkv (960×576, Q4_1)": (960, 576, 4), "gate_up (3072×576, Q4_1)": (3072, 576, 4), "down (576×1536, Q4_1)": (576, 1536, 4),
          "o (576×576, Q4_1)": (576, 576, 4), "LM head (49152×576, Q8_0)": (49152, 576, 8)}
ARITHMETICS = ("fp32", "int16", "int8")


def measure(n: int, k: int, bits: int, rows: int, copies: int, repeats: int) -> dict:
    """Median µs a call and error, per arithmetic, for `rows` rows through `copies` layers of one shape."""
    layers = [BlockLinear.from_weight(torch.randn(n, k) * 0.05, bits) for _ in range(copies)]
    x = torch.randn(rows, k)
    args = [(lay.blocks, lay.block_scales, lay.block_offsets) for lay in layers]
    exact = x.double() @ kernels.dequantize(*args[0]).double().T
    times: dict[str, list[float]] = {a: [] for a in ARITHMETICS}
    for _ in range(repeats):
        for a in ARITHMETICS:  # interleaved
            t0 = time.perf_counter()
            for blocks in args:
                kernels.matmul(x, *blocks, a)
            times[a].append((time.perf_counter() - t0) / copies * 1e6)
    out = {}
    for a in ARITHMETICS:
        y = kernels.matmul(x, *args[0], a).double()
        out[a] = {"us": statistics.median(times[a]), "error": ((y - exact).norm() / exact.norm()).item()}
    for a in ARITHMETICS:
        out[a]["x_fp32"] = out["fp32"]["us"] / out[a]["us"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", choices=("native", *isa.LEVELS), default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30, help="copies of each layer the calls cycle through (the LM head: 3)")
    args = ap.parse_args()
    if args.isa != "native" and args.isa != isa.current():  # torch reads its level once: run again under it
        if args.isa not in isa.supported():
            raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")
        os.execve(sys.executable, [sys.executable, *sys.argv], isa.env(args.isa))
    if not kernels.available():
        raise SystemExit("decoderlm's kernels cannot be built here (no C compiler, or not x86-64)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    results: dict[str, dict] = {}
    print(f"| layer | rows | {' | '.join(f'{a} µs' for a in ARITHMETICS)} | int16 × fp32 | int8 × fp32 | error int16 / int8 |")
    print("|---|---:|" + "---:|" * (len(ARITHMETICS) + 3))
    for name, (n, k, bits) in SHAPES.items():
        for rows in (1, 8):
            r = measure(n, k, bits, rows, 3 if bits == 8 else args.layers, args.repeats)
            results[f"{name}, {rows} row{'s' * (rows > 1)}"] = r
            us = " | ".join(f"{r[a]['us']:.1f}" for a in ARITHMETICS)
            print(f"| {name} | {rows} | {us} | {r['int16']['x_fp32']:.2f} | {r['int8']['x_fp32']:.2f} | "
                  f"{r['int16']['error']:.1e} / {r['int8']['error']:.1e} |")
    out = RESULTS if args.isa == "native" else RESULTS.with_stem(f"{RESULTS.stem}_{args.isa}")
    meta = {"machine": isa.describe(), "isa": isa.current(), "kernels_level": kernels.level(), "threads": args.threads,
            "repeats": args.repeats, "layers": args.layers, "torch": torch.__version__}
    out.write_text(json.dumps(meta | {"results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
