"""Generation speed on this machine: decoderlm vs HF transformers vs llama.cpp, same model, same run.

The model is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF). decoderlm and transformers
dequantize it to fp32; llama.cpp (llama-cpp-python, optional) runs the Q4_1 weights as they are.
Each engine streams greedy tokens for the same prompt ids; time to the first token measures prefill,
the rest measures decode. Engines are interleaved within each repeat and the median over repeats is
reported, so a slow moment of the machine hits every engine alike.

    python benchmarks/generate_speed.py [--repeats 5] [--new-tokens 64] [--prompt-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from decoderlm import SamplingParams, load, stream
from decoderlm.names import DEFAULT_MODEL, locate

RESULTS = Path(__file__).parent / "results" / "generate_speed.json"
TEXT = ("The history of the decoder-only Transformer begins with language modelling: predict the next token "
        "from the tokens before it. Stacking causal self-attention and feed-forward blocks, ") * 20


def timed(tokens: Iterable[int]) -> tuple[float, float, list[int]]:
    """Consume a token stream; return (seconds to first token, seconds for the rest, ids)."""
    t0 = time.perf_counter()
    out, t_first = [], 0.0
    for tok in tokens:
        if not out:
            t_first = time.perf_counter() - t0
        out.append(int(tok))
    return t_first, time.perf_counter() - t0 - t_first, out


def decoderlm_engine(gguf: Path) -> Callable[[list[int], int], Iterable[int]]:
    model, _ = load(gguf)
    return lambda ids, n: stream(model, ids, SamplingParams(temperature=0, max_new_tokens=n))


def transformers_engine(gguf: Path) -> Callable[[list[int], int], Iterable[int]]:
    import queue
    import threading

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()

    class Streamer:  # transformers calls put() with the prompt first, then with each new token
        def __init__(self) -> None:
            self.q: queue.Queue = queue.Queue()
            self.first = True

        def put(self, value: torch.Tensor) -> None:
            if self.first:
                self.first = False
                return
            self.q.put(int(value.reshape(-1)[0]))

        def end(self) -> None:
            self.q.put(None)

    def run(ids: list[int], n: int) -> Iterable[int]:
        streamer = Streamer()
        kwargs = dict(input_ids=torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=streamer)
        thread = threading.Thread(target=lambda: model.generate(**kwargs))
        thread.start()
        while (tok := streamer.q.get()) is not None:
            yield tok
        thread.join()

    return run


def llamacpp_engine(gguf: Path) -> Callable[[list[int], int], Iterable[int]] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=torch.get_num_threads(), verbose=False)

    def run(ids: list[int], n: int) -> Iterable[int]:
        llm.reset()  # no prompt reuse between runs
        for i, tok in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            if i >= n:
                break
            yield tok

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()

    gguf = locate(DEFAULT_MODEL)
    _, tokenizer = load(gguf)
    ids = tokenizer.encode(TEXT)[: args.prompt_tokens]
    engines = {"decoderlm": decoderlm_engine(gguf), "transformers": transformers_engine(gguf)}
    llama = llamacpp_engine(gguf)
    if llama is None:
        print("llama.cpp: not installed (pip install llama-cpp-python) — skipped")
    else:
        engines["llama.cpp"] = llama

    for run in engines.values():  # warm-up
        timed(run(ids, 4))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.repeats):
        for name, run in engines.items():
            ttft, rest, out = timed(run(ids, args.new_tokens))
            samples[name].append((len(ids) / ttft, (len(out) - 1) / rest))
            outputs[name] = out

    rows = {}
    for name, s in samples.items():
        rows[name] = {"prefill_tok_s": statistics.median(p for p, _ in s), "decode_tok_s": statistics.median(d for _, d in s)}
    base = rows["decoderlm"]
    print(f"\nSmolLM2-135M-Instruct, {len(ids)} prompt tokens, {args.new_tokens} greedy tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'decoderlm ÷ it (prefill)':>26}{'(decode)':>10}")
    for name, r in rows.items():
        r["decoderlm_speedup_prefill"] = base["prefill_tok_s"] / r["prefill_tok_s"]
        r["decoderlm_speedup_decode"] = base["decode_tok_s"] / r["decode_tok_s"]
        print(f"{name:<14}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}{r['decoderlm_speedup_prefill']:>26.2f}{r['decoderlm_speedup_decode']:>10.2f}")
    same = outputs["decoderlm"] == outputs["transformers"]
    print(f"greedy tokens identical to transformers: {same}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "model": DEFAULT_MODEL, "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "engines": rows, "greedy_identical_to_transformers": same,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
