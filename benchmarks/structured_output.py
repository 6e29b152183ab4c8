"""Structured output's cost: grammar compile time, the mask's cost per token, and serving throughput
at 8 concurrent streams with a JSON schema vs unconstrained, on the embedded SmolLM2-135M-Instruct.

The engine is driven in-process (no HTTP, so the figure is the grammar's cost alone). Each stream
decodes exactly --tokens tokens: unconstrained with no stop tokens, constrained under a schema whose
one string field is long enough never to close first. The runs alternate (A, B, A, B, ...) so a change
in the machine's load hits both alike; the JSON has every run and the ratio of the medians.

    python benchmarks/structured_output.py [--streams 8] [--tokens 64] [--repeats 3] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import decoderlm
from decoderlm import isa
from decoderlm.names import DEFAULT_MODEL
from decoderlm.sampling import SamplingParams
from decoderlm.serve import Engine
from decoderlm.tools.grammar import Grammars, json_schema_grammar

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "story": {"type": "string"}}, "required": ["city", "story"],
          "additionalProperties": False}
QUESTION = "Tell a long story about a city, as JSON with the fields city and story."


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> float:
    """Generated tokens per second of one batch of concurrent requests."""
    start = time.perf_counter()
    streams = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens = sum(sum(out.token_id is not None for out in s) for s in streams)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/structured_output.json")
    args = ap.parse_args()
    model, tok = decoderlm.load(DEFAULT_MODEL, quantize="auto")
    grammars = Grammars(tok)
    t = time.perf_counter()
    grammars.vocabulary  # noqa: B018 (built once per tokenizer)
    vocab_s = time.perf_counter() - t
    grammar = json_schema_grammar(SCHEMA)
    t = time.perf_counter()
    grammars.processor(grammar)
    compile_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    grammars.processor(grammar)
    cached_ms = (time.perf_counter() - t) * 1000

    # the mask alone, per token, along a valid answer
    answer = tok.encode(json.dumps({"city": "Paris", "story": "Once upon a time " * 6}), add_special_tokens=False)
    p, scores, costs = grammars.processor(grammar), torch.zeros(model.config.vocab_size), []
    for i in range(len(answer)):
        t = time.perf_counter()
        p([0] + answer[:i], scores)
        costs.append(time.perf_counter() - t)

    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]), add_special_tokens=False)
    engine = Engine(model, max_batch=args.streams)
    engine.start()
    runs: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    try:
        for _ in range(args.repeats):
            free = [SamplingParams(temperature=0.0, max_new_tokens=args.tokens) for _ in range(args.streams)]
            runs["unconstrained"].append(run(engine, [prompt] * args.streams, free))
            bound = [SamplingParams(temperature=0.0, max_new_tokens=args.tokens, stop_token_ids=tok.eos_token_ids,
                                    logits_processors=[grammars.processor(grammar)]) for _ in range(args.streams)]
            runs["json_schema"].append(run(engine, [prompt] * args.streams, bound))
    finally:
        engine.shutdown()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    result = {"model": DEFAULT_MODEL, "machine": isa.describe(), "torch": torch.__version__, "engine": "llguidance",
              "streams": args.streams, "tokens_per_stream": args.tokens,
              "vocabulary_build_s": round(vocab_s, 3), "grammar_compile_ms": round(compile_ms, 2), "cached_grammar_ms": round(cached_ms, 3),
              "mask_ms_per_token": {"mean": round(1000 * statistics.mean(costs), 3), "p95": round(1000 * sorted(costs)[int(0.95 * len(costs))], 3)},
              "tokens_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
              "ratio_of_medians": round(medians["json_schema"] / medians["unconstrained"], 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
