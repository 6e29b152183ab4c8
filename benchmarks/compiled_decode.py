"""The compiled decode step (`--compile`) against eager decoding and llama.cpp, same model, same run.

SmolLM2-135M-Instruct, the same prompt as generate_speed.py, greedy. For each mode the model is loaded and
`decoderlm.compiled.CompiledDecoder` builds (first time on this machine: tens of seconds to minutes) or loads
(later: about a second) its package; then each repeat times an eager decode, a compiled one and llama.cpp's,
in turn. Reports the build/load time apart from decode speed.

    python benchmarks/compiled_decode.py [--modes int4 fp32] [--repeats 3] [--new-tokens 128] [--threads 2]
        [--prompt-tokens 128] [--isa native|avx2|avx512|default] [--quick]

A long --prompt-tokens (e.g. 1800) measures decoding late in a long chat, where attention reads thousands of
keys a step (the compiled step's cache size is then 2,048).

int4 and int8 run on decoderlm's block kernels, which the compiled step calls as C++ operators
(decoderlm/kernels/ops.cpp). `--isa avx2` measures as an AVX2 machine would (`decoderlm.isa.env`, as
generate_speed.py) and writes compiled_decode_avx2.json; llama.cpp runs the build LLAMA_CPP_LIB_PATH names
(see generate_speed.py), else llama-cpp-python's own.

--quick runs a tiny random GGUF (quality.py's) for 8 tokens, twice, without llama.cpp: it checks the
script (a tiny model compiles in well under a minute; set DECODERLM_CACHE to keep its package apart).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from generate_speed import TEXT, Engine, llamacpp_build, llamacpp_engine, timed
from modes import MODES
from quality import tiny_gguf

from decoderlm import SamplingParams, compiled, isa, load, stream
from decoderlm.names import DEFAULT_MODEL, locate

RESULTS = Path(__file__).parent / "results" / "compiled_decode.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="*", default=["auto", "fp32-act", "int8-act"], help="modes of benchmarks/modes.py: auto (the default), "
                    "int8-act, fp32, int8, int4, bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: results/compiled_decode[_ISA].json)")
    ap.add_argument("--isa", choices=("native", *isa.LEVELS), default="native",
                    help="the instruction set decoderlm runs at (torch's kernels, inductor's code and decoderlm's kernels)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, 8 tokens, twice, no llama.cpp: checks the script")
    args = ap.parse_args()
    if args.isa != "native" and args.isa != isa.current():  # torch reads its level once: run again under it
        if args.isa not in isa.supported():
            raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")
        os.execve(sys.executable, [sys.executable, *sys.argv], isa.env(args.isa))
    args.out = args.out or (RESULTS if args.isa == "native" else RESULTS.with_stem(f"{RESULTS.stem}_{args.isa}"))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.repeats, args.new_tokens, args.prompt_tokens = 2, 8, 16
            run(args, tiny_gguf(Path(tmp) / "tiny.gguf"), "tiny random (--quick)", None)
        else:
            gguf = locate(DEFAULT_MODEL)
            run(args, gguf, DEFAULT_MODEL, llamacpp_engine(gguf, args.threads, max(1024, args.prompt_tokens + args.new_tokens)))


def run(args: argparse.Namespace, gguf: Path, model_name: str, llama: Engine | None) -> None:
    """Time eager and compiled decoding of `gguf` in each mode (with llama.cpp interleaved, if given)."""
    rows: dict[str, dict] = {}
    for mode in args.modes:
        model, tokenizer = load(gguf, **MODES[mode])
        ids = tokenizer.encode(TEXT * (1 + args.prompt_tokens // 400), add_special_tokens=False)[: args.prompt_tokens]  # TEXT: ~600 tokens

        def decode(step: compiled.CompiledDecoder | None = None) -> tuple[float, list[int]]:
            _, rest, out = timed(stream(model, ids, SamplingParams(temperature=0, max_new_tokens=args.new_tokens), step=step))
            return (len(out) - 1) / rest, out

        t0 = time.perf_counter()
        step = compiled.CompiledDecoder(model)
        decode(step)  # the first compiled decode builds or loads the package
        build_s = time.perf_counter() - t0
        eager, fast, peer, order = [], [], [], []
        for _ in range(args.repeats):  # eager, compiled and llama.cpp interleaved: a slow moment hits all three
            eager.append(decode())
            fast.append(decode(step))
            order += ["eager", "compiled"]
            if llama is not None:
                _, rest, out = timed(llama(ids, args.new_tokens))
                peer.append((len(out) - 1) / rest)
                order.append("llama.cpp")
        row = {"eager_tok_s": statistics.median(r for r, _ in eager), "compiled_tok_s": statistics.median(r for r, _ in fast),
               "build_or_load_s": build_s, "greedy_identical": all(out == eager[0][1] for _, out in fast + eager), "run_order": order}
        if peer:
            row["llama.cpp_tok_s"] = statistics.median(peer)
            row["vs_llama.cpp"] = row["compiled_tok_s"] / row["llama.cpp_tok_s"]
            row["eager_vs_llama.cpp"] = row["eager_tok_s"] / row["llama.cpp_tok_s"]
        rows[mode] = row
    print(f"\n{model_name}, {args.prompt_tokens} prompt tokens, {args.new_tokens} greedy tokens, {args.threads} threads, median of {args.repeats}")
    print(f"{'mode':8} {'eager tok/s':>12} {'compiled tok/s':>15} {'llama.cpp tok/s':>16} {'× llama.cpp (eager / compiled)':>31} "
          f"{'build/load s':>13}  greedy = eager")
    for mode, r in rows.items():
        ratios = f"{r.get('eager_vs_llama.cpp', float('nan')):.2f} / {r.get('vs_llama.cpp', float('nan')):.2f}"
        print(f"{mode:8} {r['eager_tok_s']:12.1f} {r['compiled_tok_s']:15.1f} {r.get('llama.cpp_tok_s', float('nan')):16.1f} "
              f"{ratios:>31} {r['build_or_load_s']:13.1f}  {r['greedy_identical']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model_name, "machine": isa.describe(), "llama.cpp_build": llamacpp_build(), "threads": args.threads, "new_tokens": args.new_tokens,
                                    "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "torch": torch.__version__,
                                    "modes": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
