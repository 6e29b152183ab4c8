"""Two versions of qdot.c's batch kernel in one process: A/B at the call level, for changes of a few percent.

This VM moves a kernel's time by 10-30 % between processes (and serve_throughput's ratios by up to 0.15
between runs), so A/B runs in separate processes cannot see a 5 % change. Here both versions are compiled
(the int16 entry points, `-DDIGITS=2`, at the level this process runs, with kernels.variants()'s flags) into
two standalone libraries that one process loads side by side; for each of SmolLM2-135M's layer shapes and
each row count the two are called in turn, alternating which goes first, and the medians compared. Each
call multiplies the next of `--layers` copies of the layer, so the weights stream from memory as in a
decode step. The two must give the same bits (an A/B of arithmetic changes is not what this measures):
`same_bits` says whether they did.

    python benchmarks/qdot_ab.py BASE [NEW] [--rows 4,8,16] [--repeats 15] [--layers 30] [--threads 2]

BASE and NEW are git revisions (NEW: the working tree if left out). Writes benchmarks/results/qdot_ab.json
(or --out), with the machine, the level and both revisions.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from decoderlm import isa, kernels
from decoderlm.quantize import BlockLinear

sys.path.insert(0, str(Path(__file__).parent))
from block_kernels import SHAPES  # a sibling file: SmolLM2-135M's layer shapes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "qdot_ab.json"
SOURCES = ["qdot.c", *(p.name for p in kernels.HEADERS)]


def build(revision: str | None, name: str, folder: Path) -> ctypes.CDLL:
    """qdot.c (and the headers it includes) as of `revision` (None: the working tree), compiled with entry
    points q4x16_matmul_`name` / q8x16_matmul_`name`."""
    src = folder / name
    src.mkdir()
    for file in SOURCES:
        path = f"decoderlm/kernels/{file}"
        if revision is None:
            (src / file).write_bytes((ROOT / path).read_bytes())
            continue
        shown = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True)
        if shown.returncode and file != "qdot.c":
            continue  # a header this revision did not have (qdot.c fails to compile if it includes it)
        if shown.returncode:
            raise SystemExit(f"qdot_ab: no {path} at revision {revision!r} ({shown.stderr.decode().strip().splitlines()[-1]})")
        (src / file).write_bytes(shown.stdout)
    width, flags = kernels.variants()[kernels.level()]
    lib = folder / f"qdot_{name}.so"
    built = subprocess.run(["cc", *kernels.FLAGS, *flags, "-DDIGITS=2", f"-DVL={width}", f"-DNAME={name}", "-shared",
                            str(src / "qdot.c"), "-o", str(lib)], capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"qdot_ab: qdot.c of {revision or 'the working tree'} does not compile: {built.stderr.strip()[:300]}")
    lib = ctypes.CDLL(str(lib))
    if hasattr(lib, "amx_tiles"):  # a version with AMX batches uses them as decoderlm's kernels here do (DECODERLM_AMX)
        lib.amx_tiles(int(kernels.amx()))
    return lib


def measure(libs: dict[str, ctypes.CDLL], n: int, k: int, bits: int, rows: int, copies: int, repeats: int) -> dict:
    """Median µs a call per version, for `rows` rows through `copies` layers of one shape, and whether the
    versions' products are the same bits."""
    layers = [BlockLinear.from_weight(torch.randn(n, k) * 0.05, bits) for _ in range(copies)]
    calls = [(lay.blocks.data_ptr(), lay.block_scales.data_ptr(), None if lay.block_offsets is None else lay.block_offsets.data_ptr())
             for lay in layers]
    x = torch.randn(rows, k)
    out = {name: torch.empty(rows, n) for name in libs}
    fns = {}
    for name, lib in libs.items():
        fns[name] = getattr(lib, f"q{bits}x16_matmul_{name}")
        fns[name].argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int64, ctypes.c_void_p]
    times: dict[str, list[float]] = {name: [] for name in libs}
    order = list(libs)
    for rep in range(repeats):
        for name in order if rep % 2 else order[::-1]:  # alternate which goes first
            t0 = time.perf_counter()
            for q, d, m in calls:
                fns[name](x.data_ptr(), rows, k, q, d, m, n, out[name].data_ptr())
            times[name].append((time.perf_counter() - t0) / copies * 1e6)
    a, b = (statistics.median(times[name]) for name in order)
    return {"us": dict(zip(order, (a, b))), "speedup": a / b, "same_bits": torch.equal(*out.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the git revision to compare against (A)")
    ap.add_argument("new", nargs="?", default=None, help="the git revision to measure (B; default: the working tree)")
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=30, help="copies of each layer the calls cycle through (the LM head: 3)")
    ap.add_argument("--shapes", type=lambda s: s.split(","), default=[name.split()[0] for name in SHAPES],
                    help="which of block_kernels.py's shapes, by first word: qkv,gate_up,down,o,LM")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if kernels.level() is None:
        raise SystemExit("decoderlm's kernels do not run on this CPU (not x86-64 with SSE4.1)")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)  # the kernels' OpenMP pool is torch's (loaded first)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"a": build(args.base, "a", Path(tmp)), "b": build(args.new, "b", Path(tmp))}
        print("| layer | rows | A µs | B µs | A / B | same bits |\n|---|---:|---:|---:|---:|---|")
        for name in (name for name in SHAPES if name.split()[0] in args.shapes):
            n, k, bits = SHAPES[name]
            for rows in args.rows:
                r = measure(libs, n, k, bits, rows, 3 if bits == 8 else args.layers, args.repeats)
                results[f"{name}, {rows} rows"] = r
                print(f"| {name} | {rows} | {r['us']['a']:.1f} | {r['us']['b']:.1f} | {r['speedup']:.2f} | {r['same_bits']} |", flush=True)
    meta = {"machine": isa.describe(), "isa": isa.current(), "kernels_level": kernels.level(), "threads": args.threads,
            "repeats": args.repeats, "layers": args.layers, "base": args.base, "new": args.new or "working tree", "torch": torch.__version__}
    args.out.write_text(json.dumps(meta | {"results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
