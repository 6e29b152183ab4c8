"""Generation speed on this machine: decoderlm vs HF transformers vs llama.cpp, same model, same run.

The model is the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF). decoderlm runs it in fp32 (the
default), bf16, and with int8 / int4 weights (`--quantize`); transformers dequantizes it to fp32;
llama.cpp (llama-cpp-python, optional) runs the Q4_1 weights as they are. Each engine streams greedy
tokens for the same prompt ids; time to the first token measures prefill, the rest measures decode.
Engines are interleaved within each repeat and the median over repeats is reported, so a slow moment
of the machine hits every engine alike.

    python benchmarks/generate_speed.py [--repeats 5] [--new-tokens 64] [--prompt-tokens 128] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from decoderlm import SamplingParams, load, stream
from decoderlm.names import DEFAULT_MODEL, locate

RESULTS = Path(__file__).parent / "results" / "generate_speed.json"
TEXT = ("The history of the decoder-only Transformer begins with language modelling: predict the next token "
        "from the tokens before it. Stacking causal self-attention and feed-forward blocks, ") * 20
Engine = Callable[[list[int], int], Iterable[int]]
DECODERLM = {"decoderlm fp32": ("float32", None), "decoderlm bf16": ("bfloat16", None),
             "decoderlm int8": ("float32", "int8"), "decoderlm int4": ("float32", "int4")}


def timed(tokens: Iterable[int]) -> tuple[float, float, list[int]]:
    """Consume a token stream; return (seconds to first token, seconds for the rest, ids)."""
    t0 = time.perf_counter()
    out, t_first = [], 0.0
    for tok in tokens:
        if not out:
            t_first = time.perf_counter() - t0
        out.append(int(tok))
    return t_first, time.perf_counter() - t0 - t_first, out


def decoderlm_engine(gguf: Path, dtype: str, quantize: str | None) -> Engine:
    model, _ = load(gguf, dtype=dtype, quantize=quantize)
    return lambda ids, n: stream(model, ids, SamplingParams(temperature=0, max_new_tokens=n))


def transformers_engine(gguf: Path) -> Engine:
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' own GGUF reader and dequantizer; from_pretrained(gguf_file=) would also need accelerate.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"], strict=False)
    model.eval()

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


def llamacpp_engine(gguf: Path, threads: int) -> Engine | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_batch=512, n_threads=threads, verbose=False)

    def run(ids: list[int], n: int) -> Iterable[int]:
        llm.reset()  # no prompt reuse between runs
        for i, tok in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            if i >= n:
                break
            yield tok

    return run


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for every engine (default: torch's)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    ap.add_argument("--engines", nargs="*", default=None, help=f"subset of: {', '.join(DECODERLM)}, transformers, llama.cpp")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gguf = locate(DEFAULT_MODEL)
    _, tokenizer = load(gguf)
    ids = tokenizer.encode(TEXT)[: args.prompt_tokens]
    builders: dict[str, Callable[[], Engine | None]] = {
        **{name: (lambda d=d, q=q: decoderlm_engine(gguf, d, q)) for name, (d, q) in DECODERLM.items()},
        "transformers": lambda: transformers_engine(gguf),
        "llama.cpp": lambda: llamacpp_engine(gguf, args.threads),
    }
    engines: dict[str, Engine] = {}
    load_s: dict[str, float] = {}
    for name in args.engines or builders:
        t0 = time.perf_counter()
        engine = builders[name]()
        load_s[name] = time.perf_counter() - t0
        if engine is None:
            print(f"{name}: not installed (pip install llama-cpp-python) — skipped")
        else:
            engines[name] = engine

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
        rows[name] = {"prefill_tok_s": statistics.median(p for p, _ in s), "decode_tok_s": statistics.median(d for _, d in s),
                      "load_s": load_s[name]}
    reference = outputs.get("transformers", outputs.get("decoderlm fp32"))
    print(f"\nSmolLM2-135M-Instruct, {len(ids)} prompt tokens, {args.new_tokens} greedy tokens, "
          f"{args.threads} threads, median of {args.repeats}; ratios are this engine's speed ÷ the other's")
    bases = [b for b in ("transformers", "llama.cpp") if b in rows]
    header = "".join(f"{'÷ ' + b + ' (pre/dec)':>28}" for b in bases)
    print(f"{'engine':<16}{'load s':>7}{'prefill tok/s':>15}{'decode tok/s':>14}{header}{'same greedy tokens':>20}")
    for name, r in rows.items():
        for b in bases:
            r[f"vs_{b}_prefill"] = r["prefill_tok_s"] / rows[b]["prefill_tok_s"]
            r[f"vs_{b}_decode"] = r["decode_tok_s"] / rows[b]["decode_tok_s"]
        r["greedy_tokens_matching_reference"] = common_prefix(outputs[name], reference) if reference else None
        ratios = "".join(f"{r[f'vs_{b}_prefill']:>19.2f} / {r[f'vs_{b}_decode']:<6.2f}" for b in bases)
        print(f"{name:<16}{r['load_s']:>7.1f}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}{ratios}"
              f"{str(r['greedy_tokens_matching_reference']) + '/' + str(len(reference or [])):>20}")
    print("same greedy tokens: leading tokens identical to " + ("transformers'" if "transformers" in outputs else "decoderlm fp32's"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": DEFAULT_MODEL, "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "repeats": args.repeats,
        "threads": args.threads, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "greedy_reference": "transformers" if "transformers" in outputs else "decoderlm fp32", "engines": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
