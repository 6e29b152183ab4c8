"""Speculative decoding on the embedded SmolLM2-135M-Instruct (fp32 target): plain greedy decoding vs
prompt lookup and two draft models, on a prompt where guessing should pay (correct a paragraph: the
reply repeats the prompt) and one where it should not (a free story).

Drafts, made locally (no smaller SmolLM2 ships with decoderlm):
- "int8 / int4 self-draft": the same GGUF loaded with int8 / int4 weights — same tokenizer, cheaper
  steps, logits close to the target's (int8 closer, int4 cheaper).
- "first-N-layers draft": the target's first N blocks with its own norm and head, sharing its weights.
  An early-exit model of this size was never trained to stop there; expect few accepted guesses.

Engines are interleaved within each repeat and medians are reported. Time covers the whole call
(prefill included), since speculation folds the prefill into its first verification. Wall time and
the process's CPU time are both reported: on shared cores wall time swings by tens of percent, while
one thread's CPU time stays close to what an idle machine would take. Greedy output
of every speculative engine is compared with plain decoding's.

    python benchmarks/speculative.py [--repeats 3] [--new-tokens 48] [--k 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from decoderlm import isa
from decoderlm import SamplingParams, Transformer, load, stream
from decoderlm.generate import SpeculativeStats
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.speculative import DraftModel, PromptLookup

RESULTS = Path(__file__).parent / "results" / "speculative.json"
PARAGRAPH = ("The Transformer architecture was introduced in 2017 in the paper Attention Is All You Need. It replaced recurrence "
             "with self-attention, so that every token can look at every earlier token in one step. Training became much faster "
             "on parallel hardware, and models grew from millions to billions of parameters within a few years. Today most "
             "large language models are decoder-only Transformers that predict the next token from the ones before it.")
PROMPTS = {
    "edit (should pay)": "Rewrite the following paragraph exactly, but replace every occurrence of the word \"token\" with \"word\":\n\n" + PARAGRAPH,
    "story (should not)": "Write a short story about a lighthouse keeper who finds a map in a bottle.",
}
Engine = Callable[[list[int], int], tuple[Iterator[int], SpeculativeStats | None]]


def truncated_copy(model: Transformer, n_layers: int) -> Transformer:
    """The first n_layers blocks of `model` with its final norm and head, sharing its tensors."""
    with torch.device("meta"):
        small = Transformer(replace(model.config, n_layers=n_layers))
    keep = {name: t for name, t in model.state_dict().items() if not name.startswith("layers.") or int(name.split(".")[1]) < n_layers}
    small.load_state_dict(keep, assign=True)
    if model.config.tie_embeddings:
        small.lm_head.weight = small.embed_tokens.weight
    small.init_rope()
    return small.eval()


def engines(target: Transformer, gguf: Path, k: int, draft_layers: int) -> dict[str, Engine]:
    def plain(ids: list[int], n: int):
        return stream(target, ids, SamplingParams(temperature=0, max_new_tokens=n)), None

    def speculative(proposer) -> Engine:
        def run(ids: list[int], n: int):
            stats = SpeculativeStats()
            return stream(target, ids, SamplingParams(temperature=0, max_new_tokens=n), proposer, num_speculative_tokens=k, stats=stats), stats
        return run

    return {
        "plain": plain,
        "prompt lookup (n<=3)": speculative(PromptLookup(3)),
        "int8 self-draft": speculative(DraftModel(load(gguf, quantize="int8")[0])),
        "int4 self-draft": speculative(DraftModel(load(gguf, quantize="int4")[0])),
        f"first-{draft_layers}-layers draft": speculative(DraftModel(truncated_copy(target, draft_layers))),
    }


def timed(run: Engine, ids: list[int], n: int) -> tuple[float, float, list[int], SpeculativeStats | None]:
    """(wall seconds, this process's CPU seconds, ids, stats). With one thread, CPU time is what the
    run would take on an idle machine, and is far steadier than wall time on shared cores."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens, stats = run(ids, n)
    out = list(tokens)
    return time.perf_counter() - t0, time.process_time() - c0, out, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=5, help="tokens guessed per step")
    ap.add_argument("--draft-layers", type=int, default=6, help="blocks kept in the truncated draft")
    ap.add_argument("--threads", type=int, default=1, help="1: on shared cores a second thread mostly waits")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gguf = locate(DEFAULT_MODEL)
    target, tok = load(gguf)
    runs = engines(target, gguf, args.k, args.draft_layers)
    prompts = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
               for name, text in PROMPTS.items()}
    for run in runs.values():  # warm-up
        timed(run, prompts["story (should not)"], 4)

    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    result: dict[tuple[str, str], tuple[list[int], SpeculativeStats | None]] = {}
    for _ in range(args.repeats):
        for prompt, ids in prompts.items():
            for name, run in runs.items():
                w, c, out, stats = timed(run, ids, args.new_tokens)
                wall.setdefault((prompt, name), []).append(w)
                cpu.setdefault((prompt, name), []).append(c)
                result[(prompt, name)] = (out, stats)

    rows = []
    print(f"\nSmolLM2-135M-Instruct fp32 target, greedy, {args.new_tokens} new tokens, k={args.k}, {args.threads} threads, "
          f"median of {args.repeats} interleaved repeats")
    print(f"{'prompt':<20}{'engine':<24}{'tok/s':>7}{'speedup':>9}{'CPU tok/s':>11}{'CPU speedup':>13}{'accepted':>10}"
          f"{'tokens/forward':>16}{'same output':>13}")
    for prompt in prompts:
        plain_wall, plain_cpu = statistics.median(wall[(prompt, "plain")]), statistics.median(cpu[(prompt, "plain")])
        plain_out = result[(prompt, "plain")][0]
        for name in runs:
            out, stats = result[(prompt, name)]
            w, c = statistics.median(wall[(prompt, name)]), statistics.median(cpu[(prompt, name)])
            row = {"prompt": prompt, "engine": name, "prompt_tokens": len(prompts[prompt]), "new_tokens": len(out),
                   "seconds": w, "tok_s": len(out) / w, "speedup": plain_wall / w,
                   "cpu_seconds": c, "cpu_tok_s": len(out) / c, "cpu_speedup": plain_cpu / c, "same_output_as_plain": out == plain_out,
                   "acceptance_rate": stats.acceptance_rate if stats else None, "proposed": stats.proposed if stats else None,
                   "accepted": stats.accepted if stats else None, "target_forwards": stats.target_forwards if stats else len(out)}
            rows.append(row)
            accepted = "" if stats is None else f"{row['acceptance_rate']:.0%}"
            print(f"{prompt:<20}{name:<24}{row['tok_s']:>7.1f}{row['speedup']:>8.2f}x{row['cpu_tok_s']:>11.1f}{row['cpu_speedup']:>12.2f}x{accepted:>10}"
                  f"{len(out) / row['target_forwards']:>16.2f}{str(row['same_output_as_plain']):>13}")
    print("speedup: plain decoding's time ÷ this engine's, same prompt (wall clock, and this process's CPU time);"
          " tokens/forward: generated tokens per target forward")
    for prompt in prompts:
        print(f"{prompt} reply: {tok.decode(result[(prompt, 'plain')][0])[:160]!r}...")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": DEFAULT_MODEL, "target_dtype": "float32", "new_tokens": args.new_tokens, "k": args.k, "repeats": args.repeats,
        "threads": args.threads, "draft_layers": args.draft_layers, "machine": isa.describe(),
        "torch": torch.__version__, "load_average_1m_at_end": os.getloadavg()[0], "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
