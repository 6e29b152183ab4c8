"""The server's decode step alone: `decoderlm serve`'s engine in one process, no HTTP, per batch size.

serve_throughput.py measures a server through HTTP, where the server's HTTP thread and the benchmark's own
client share the CPU with the decode step. This measures the step itself, so the two side by side say what
serving costs on top of the model. For each --activations (fp32, serve's on a CPU without AVX2, and int16, `chat`'s and serve's from AVX2) a
child process builds the engine as `decoderlm serve` does (its own flags and parser, the model loaded in a
passing thread, the compiled step built before the measurement where missing), warms it up, then for each
batch size B queues B greedy requests of --new-tokens tokens at once, waits for every stream's first token
(all prompts read), and takes the median gap between one stream's next tokens as the step time (its first
gaps left out). --context N gives every request a prompt of N tokens (its question, then the others'
repeated), so the step attends over N tokens and more: attention's cost grows with the context, the
matmuls' does not. Children
alternate per repeat (A, B, A, B, ...), one engine per process (two OpenMP pools in one process would
oversubscribe the cores); the median over the repeats is reported, with tokens/s = B / step.

    python benchmarks/serve_step.py [--activations fp32,int16] [--batches 1,4,8,16] [--repeats 3]
        [--new-tokens 128] [--context N] [--threads N] [--model NAME_OR_PATH] [--isa native|avx2|avx512|default]
        [--no-compile] [--out JSON]

Writes benchmarks/results/serve_step.json (serve_step_avx2.json for --isa avx2; or --out) and prints a
table. The JSON records the CPU and the level decoderlm ran at.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from decoderlm import isa
from decoderlm.names import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).parent))
from serve_throughput import TOPICS  # a sibling file: the same questions as the served benchmark

RESULTS = Path(__file__).parent / "results" / "serve_step.json"
SKIP = 4  # gaps left out at a stream's start: the prompts' reading and the first steps


def child(args: argparse.Namespace) -> dict:
    """In this process: the engine `decoderlm serve` would build with these flags; per batch size, the median
    ms between two tokens of the first stream (`steps`), the arithmetic its block layers were given and the
    prompts' lengths."""
    from decoderlm.cli import build_parser
    from decoderlm.cli.common import load_model
    from decoderlm.cli.serve import in_passing_thread
    from decoderlm.quantize import BlockLinear
    from decoderlm.sampling import SamplingParams
    from decoderlm.serve import Engine

    flags = ["serve", "--model", args.model, "--activations", args.child, "--max-batch", str(max(args.batches))]
    flags += ["--compile" if args.compile else "--no-compile"] + (["--threads", str(args.threads)] if args.threads else [])
    serve_args = build_parser().parse_args(flags)

    def build() -> tuple[Engine, object]:
        model, tokenizer = load_model(serve_args)
        return Engine(model, max_batch=serve_args.max_batch, compile=serve_args.compile), tokenizer

    engine, tokenizer = in_passing_thread(build)
    if args.compile and not engine.compiled.ready():
        raise SystemExit(f"the compiled server step is unavailable: {engine.compiled.reason}")
    engine.start()
    try:
        filler = tokenizer.encode(" ".join(f"Write a long story about {t}." for t in TOPICS))

        def prompt(i: int) -> list[int]:
            """Row i's question; with --context, the others' after it, repeated to --context tokens."""
            ids = tokenizer.encode(f"Write a long story about {TOPICS[i % len(TOPICS)]}.")
            return (ids + filler * (args.context // len(filler) + 1))[: args.context] if args.context else ids

        def step_ms(batch: int, tokens: int) -> float:
            streams = [engine.add_request(prompt(i), SamplingParams(temperature=0, max_new_tokens=tokens)) for i in range(batch)]
            for s in streams:  # every prompt read: the steps below decode every row
                next(s)
            arrivals = [time.perf_counter() for _ in streams[0]]
            for s in streams[1:]:
                for _ in s:
                    pass
            return 1e3 * statistics.median(b - a for a, b in zip(arrivals[SKIP:], arrivals[SKIP + 1:]))

        step_ms(max(args.batches), SKIP + 8)  # warm-up: the step's first calls, at the largest batch
        layers = sorted({m.activations for m in engine.model.modules() if isinstance(m, BlockLinear)})
        return {"steps": {b: step_ms(b, args.new_tokens) for b in args.batches}, "layers": layers,
                "prompt_tokens": sorted({len(prompt(i)) for i in range(max(args.batches))})}
    finally:
        engine.shutdown()


def run_child(args: argparse.Namespace, activations: str) -> dict:
    """child() in a fresh process at --isa's level: {"steps": {rows: ms}, "layers": [arithmetic], "prompt_tokens": [n]}."""
    cmd = [sys.executable, __file__, "--child", activations, "--model", args.model, "--batches", ",".join(map(str, args.batches)),
           "--new-tokens", str(args.new_tokens), "--context", str(args.context), "--compile" if args.compile else "--no-compile"]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    env = os.environ if args.isa == "native" else isa.env(args.isa)
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(cmd, env=env | {"PYTHONPATH": root}, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"--activations {activations}: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out | {"steps": {int(b): ms for b, ms in out["steps"].items()}}


def table(results: dict[str, list[dict]]) -> str:
    """Per batch size, each arithmetic's median step (the repeats' min–max) and its tokens/s."""
    names = list(results)
    lines = ["| rows | " + " | ".join(f"{a}: step ms (min–max), tok/s" for a in names) + " |", "|---:|" + "---:|" * len(names)]
    for i, level in enumerate(results[names[0]]):
        cells = [f"{r['step_ms']:.2f} ({min(r['repeats']):.2f}–{max(r['repeats']):.2f}), {r['tok_s']:.1f}"
                 for r in (results[a][i] for a in names)]
        lines.append(f"| {level['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--activations", type=lambda s: [a for a in s.split(",") if a], default=["fp32", "int16"],
                   help="the arithmetics to measure (serve's --activations; default: fp32,int16)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--context", type=int, default=0, help="each prompt's tokens (default: its question alone, ~10 tokens)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="steps through the compiled server step, built first where missing (default; what a server runs "
                        "once its step is built); --no-compile: eager steps")
    p.add_argument("--isa", choices=("native", *isa.LEVELS), default="native", help="the CPU level the engines run at")
    p.add_argument("--out", type=Path, default=None, help="the JSON to write (default: results/serve_step[_ISA].json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: measure this --activations here
    args = p.parse_args()
    if args.new_tokens <= SKIP + 1:
        raise SystemExit(f"--new-tokens must be more than {SKIP + 1}: the first {SKIP} gaps are left out")
    if args.context < 0:
        raise SystemExit(f"--context must be a number of tokens >= 0 (0: each question alone), got {args.context}")
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.isa != "native" and args.isa not in isa.supported():
        raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")
    args.out = args.out or (RESULTS if args.isa == "native" else RESULTS.with_stem(f"{RESULTS.stem}_{args.isa}"))
    runs: dict[str, list[dict[int, float]]] = {a: [] for a in args.activations}
    layers: dict[str, list[str]] = {}
    prompts: set[int] = set()
    for repeat in range(args.repeats):
        for a in args.activations:
            out = run_child(args, a)
            runs[a].append(out["steps"])
            layers[a] = out["layers"]
            prompts.update(out["prompt_tokens"])
            print(f"--activations {a}, repeat {repeat}: " + ", ".join(f"{b} rows {ms:.2f} ms" for b, ms in runs[a][-1].items()), flush=True)
    results = {a: [{"rows": b, "step_ms": statistics.median(r[b] for r in rs), "repeats": [r[b] for r in rs]} for b in args.batches]
               for a, rs in runs.items()}
    for levels in results.values():
        for level in levels:
            level["tok_s"] = level["rows"] * 1e3 / level["step_ms"]
    meta = {"machine": isa.describe(), "decoderlm_isa": isa.native() if args.isa == "native" else args.isa, "threads": args.threads,
            "step": "compiled" if args.compile else "eager", "new_tokens": args.new_tokens, "prompt_tokens": sorted(prompts), "repeats": args.repeats, "model": args.model,
            "schedule": "one engine per child process; per repeat every --activations in turn",
            "layers_activations": layers}  # what each engine's block layers computed with, as it reported
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(meta | {"results": results}, indent=2) + "\n")
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
