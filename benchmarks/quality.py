"""Quality guard: how far each way of running the model moves its predictions, and its answers, from the float32 path.

The model is the embedded SmolLM2-135M-Instruct (Q4_1 GGUF); its float32 path is the exact
dequantization of the file's weights, so it is the reference every faster mode is measured against.

Perplexity: two real texts are scored teacher-forced (every position predicts the next token from the
true tokens before it, in one forward): a fixed slice of tiny Shakespeare and a multi-turn chat
(benchmarks/fixtures/chat.json) rendered with the model's own chat template. Per mode and text:
perplexity, its change against float32, and top-1 agreement (the share of positions whose most
likely next token is float32's). A mode whose decode steps compute differently from a prompt's
forward (auto: 16-bit activations in decode steps; int8-act) is scored step by step, one token at a time through
the KV cache, as it decodes. llama.cpp (llama-cpp-python, optional) runs the same GGUF's
blocks as they are, on the same token ids, as a peer. A mode is "faithful" when its perplexity is
within 1 % of float32's on every text.

Answers (benchmarks/answers.py): greedy chat replies to the prompts of benchmarks/fixtures/answers.json
at every CPU dispatch level this machine runs, each level in a child process: agreement with float32
at that level, correct answers to the questions among them, llama.cpp beside them, and a verdict per
level on the default mode.

    python benchmarks/quality.py [--positions 512] [--modes fp32 bf16 ...] [--threads N] [--quick]
                                 [--levels default avx2 avx512] [--per-kind N] [--answers-only | --skip-answers]

--answers-only / --skip-answers run one part and keep the other's earlier results in --out.
--quick runs a tiny random model written on the spot in the embedded model's layout (Q8_0
embeddings, Q4_1 matrices, a byte-level tokenizer with a chat template), to test this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tqdm import tqdm

from decoderlm import Transformer, isa, load
from decoderlm.generate import decode_step
from decoderlm.kv_cache import cache_for
from decoderlm.names import DEFAULT_MODEL, locate

sys.path.insert(0, str(Path(__file__).parent))
import answers  # sibling files: benchmarks/ is not a package
from modes import MODES, REFERENCE

HERE = Path(__file__).parent
RESULTS = HERE / "results" / "quality.json"
SHAKESPEARE = HERE.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
SHAKESPEARE_CHARS = slice(0, 8000)  # the play's opening scene: plenty for 512+ tokens
CHAT = HERE / "fixtures" / "chat.json"
FAITHFUL = 0.01  # largest relative perplexity change a "faithful" mode may show, on every text
LLAMA_CPP = "llama.cpp"


@dataclass
class Predictions:
    """Per scored position: the true next token's negative log-likelihood and the top-1 token."""
    nll: torch.Tensor  # (N,) float64
    top1: torch.Tensor  # (N,) int64


def from_logits(logits: torch.Tensor, ids: list[int]) -> Predictions:
    """logits (T, V) over ids (T,): position t predicts ids[t + 1]; the last position predicts nothing."""
    logp = F.log_softmax(logits[:-1].double(), dim=-1)  # (N, V), N = T - 1
    targets = torch.tensor(ids[1:])
    return Predictions(-logp.gather(1, targets[:, None])[:, 0], logp.argmax(-1))


def texts(tokenizer, shakespeare: Path, positions: int) -> dict[str, list[int]]:
    """The token ids of each text, positions + 1 long (the first token is context only)."""
    if not shakespeare.is_file():
        raise SystemExit(f"{shakespeare} not found; give --shakespeare PATH to tiny Shakespeare's input.txt")
    chat = json.loads(CHAT.read_text(encoding="utf-8"))["messages"]
    out = {
        "shakespeare": tokenizer.encode(shakespeare.read_text(encoding="utf-8")[SHAKESPEARE_CHARS]),
        "chat": tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=False), add_special_tokens=False),
    }
    for name, ids in out.items():
        if len(ids) < positions + 1:
            raise SystemExit(f"the {name} text is {len(ids)} tokens, fewer than --positions {positions} + 1; lower --positions")
    return {name: ids[: positions + 1] for name, ids in out.items()}


@torch.inference_mode()
def predictions(model: Transformer, inputs: dict[str, list[int]]) -> dict[str, Predictions]:
    if model.config.max_seq_len < max(map(len, inputs.values())):
        raise SystemExit(f"the model's context ({model.config.max_seq_len}) is shorter than --positions + 1; lower --positions")
    return {name: from_logits(model(torch.tensor([ids])).logits[0].float(), ids) for name, ids in inputs.items()}


@torch.inference_mode()
def stepwise_predictions(model: Transformer, inputs: dict[str, list[int]]) -> dict[str, Predictions]:
    """Scores as decoding computes them: each position a one-token decode step through the KV cache. For
    a mode whose decode steps compute differently from a prompt's forward (auto, int8-act: rounded activations), a
    teacher-forced forward would measure the prompt path instead."""
    out = {}
    for name, ids in inputs.items():
        cache = cache_for(model.config, 1, len(ids))
        logits = [decode_step(model, torch.tensor([token]), cache)[0].float() for token in tqdm(ids, desc=f"{name}, step by step", leave=False)]
        out[name] = from_logits(torch.stack(logits), ids)
    return out


def decodes_otherwise(model: Transformer) -> bool:
    """Whether the model's decode steps round activations (`BlockLinear.activations`); its prompts may not
    (`prompt_activations`: fp32 but for `auto` on AVX512-VNNI)."""
    return any(getattr(layer, "activations", "fp32") != "fp32" for layer in model.modules())


def mode_predictions(gguf: Path, load_kwargs: dict, inputs: dict[str, list[int]]) -> dict[str, Predictions]:
    model, _ = load(gguf, **load_kwargs)
    out = (stepwise_predictions if decodes_otherwise(model) else predictions)(model, inputs)
    del model  # one model in memory at a time
    gc.collect()
    return out


def llamacpp_predictions(gguf: Path, inputs: dict[str, list[int]], threads: int) -> dict[str, Predictions] | str:
    """llama.cpp's predictions on the same ids, or why there are none."""
    try:
        from llama_cpp import Llama
    except (ImportError, OSError) as e:
        return f"llama-cpp-python is not installed or does not import ({e}); pip install llama-cpp-python"
    n_ctx = max(map(len, inputs.values()))
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, logits_all=True, verbose=False)
    out = {}
    for name, ids in inputs.items():
        llm.reset()
        llm.eval(ids)
        out[name] = from_logits(torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32)), ids)
    return out


def compare(pred: Predictions, ref: Predictions) -> dict[str, float]:
    ppl, ref_ppl = math.exp(pred.nll.mean()), math.exp(ref.nll.mean())
    return {"perplexity": ppl, "perplexity_change": ppl / ref_ppl - 1, "top1_agreement": float((pred.top1 == ref.top1).double().mean())}


def tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama in the embedded model's layout (tied Q8_0 embeddings, Q4_1 matrices, F32
    norms) with a byte-level tokenizer and a ChatML template: every engine here can load it in a second."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from decoderlm.formats.gguf import byte_alphabet

    d, ff, heads, kv_heads, layers, ctx = 64, 128, 4, 2, 2, 1024
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*byte_alphabet().values(), "Ġt", "he", *specials]
    rng = np.random.default_rng(seed)
    hd = d // heads
    shapes = {"token_embd": (len(tokens), d), "output_norm": (d,)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm": (d,), f"blk.{i}.attn_q": (d, d), f"blk.{i}.attn_k": (kv_heads * hd, d),
                   f"blk.{i}.attn_v": (kv_heads * hd, d), f"blk.{i}.attn_output": (d, d), f"blk.{i}.ffn_norm": (d,),
                   f"blk.{i}.ffn_gate": (ff, d), f"blk.{i}.ffn_up": (ff, d), f"blk.{i}.ffn_down": (d, ff)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")  # the embedded model's word splitting (llama.cpp knows no "gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(specials)) + [3] * len(specials))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name, shape in shapes.items():
        if len(shape) == 1:  # norm weights around 1, not exactly 1, so a misplaced one would show
            w.add_tensor(f"{name}.weight", (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        qtype = Q.Q8_0 if name == "token_embd" else Q.Q4_1
        std = 0.3 if name == "token_embd" else 0.2  # the tied head's logits spread by ~2: a clear top-1
        w.add_tensor(f"{name}.weight", quantize(rng.normal(0, std, shape).astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def print_table(title: str, rows: dict[str, dict], names: list[str]) -> None:
    print(f"\n{title}")
    head = "".join(f"{n + ': ppl':>22}{'Δ vs ' + REFERENCE:>11}{'top-1 agree':>13}" for n in names)
    print(f"{'mode':<12}{head}{'faithful':>10}")
    for mode, row in rows.items():
        cells = "".join(f"{r['perplexity']:>22.3f}{r['perplexity_change']:>+10.2%}{r['top1_agreement']:>13.1%}"
                        for r in (row["texts"][n] for n in names))
        print(f"{mode:<12}{cells}{'yes' if row['faithful'] else 'no':>10}")


def perplexity_part(args: argparse.Namespace, gguf: Path, wanted: list[str], model: str) -> dict:
    """Every mode's teacher-forced scores against fp32's, printed as a table; the results file's part for them."""
    modes = [REFERENCE, *(m for m in MODES if m in wanted and m != REFERENCE)]
    # The reference is its own load and forward, so fp32's row (100 % agreement) checks that runs repeat exactly.
    reference_model, tokenizer = load(gguf, **MODES[REFERENCE])
    inputs = texts(tokenizer, args.shakespeare, args.positions)
    reference = predictions(reference_model, inputs)
    del reference_model
    preds, seconds, rows, skipped = {}, {}, {}, {}
    for mode in modes:
        t0 = time.perf_counter()
        preds[mode] = mode_predictions(gguf, MODES[mode], inputs)
        seconds[mode] = time.perf_counter() - t0
    if LLAMA_CPP in wanted:
        t0 = time.perf_counter()
        result = llamacpp_predictions(gguf, inputs, args.threads)
        if isinstance(result, str):
            skipped[LLAMA_CPP] = result
            print(f"{LLAMA_CPP}: skipped, {result}")
        else:
            preds[LLAMA_CPP], seconds[LLAMA_CPP] = result, time.perf_counter() - t0
    for mode, pred in preds.items():
        per_text = {name: compare(pred[name], reference[name]) for name in inputs}
        rows[mode] = {"engine": LLAMA_CPP if mode == LLAMA_CPP else "decoderlm", "load": MODES.get(mode), "seconds": seconds[mode],
                      "texts": per_text, "faithful": all(abs(r["perplexity_change"]) <= FAITHFUL for r in per_text.values())}
    print_table(f"{model}: {args.positions} teacher-forced positions per text, against decoderlm {REFERENCE}; "
                f"faithful = perplexity within {FAITHFUL:.0%} on every text", rows, list(inputs))
    return {"positions": args.positions, "reference": REFERENCE, "faithful_within": FAITHFUL, "threads": args.threads,
            "texts": {"shakespeare": f"tiny Shakespeare, characters {SHAKESPEARE_CHARS.start}-{SHAKESPEARE_CHARS.stop}",
                      "chat": f"{CHAT.relative_to(HERE.parent)}, rendered with the model's chat template"},
            "modes": rows, "skipped": skipped}


def merged(out: Path, results: dict) -> dict:
    """`results` over the file's earlier ones for the same model: a run of one part keeps the other."""
    try:
        earlier = json.loads(out.read_text())
    except (OSError, ValueError):
        earlier = {}
    return (earlier if earlier.get("model") == results["model"] else {}) | results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=512, help="teacher-forced positions scored per text (≥ 512 for the README)")
    ap.add_argument("--modes", nargs="*", default=None, help=f"subset of: {', '.join(MODES)}, {LLAMA_CPP} (default: all; {REFERENCE} "
                    f"always runs, and {answers.DEFAULT} in the answers part)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="for every engine (default: torch's)")
    ap.add_argument("--shakespeare", type=Path, default=SHAKESPEARE, help="tiny Shakespeare's text")
    ap.add_argument("--levels", nargs="+", choices=isa.LEVELS, default=None, help="CPU dispatch levels of the answers part "
                    f"(default: every one this CPU runs: {', '.join(isa.supported())})")
    ap.add_argument("--per-kind", type=int, default=None, help="answers part: at most N prompts of each kind (default: all)")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--answers-only", action="store_true", help="skip the perplexity part (--out keeps its earlier one)")
    part.add_argument("--skip-answers", action="store_true", help="skip the answers part (--out keeps its earlier one)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    ap.add_argument("--quick", action="store_true", help="a tiny random model instead of the embedded one (tests this script)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    wanted = args.modes if args.modes is not None else [*MODES, LLAMA_CPP]
    unknown = [m for m in wanted if m not in MODES and m != LLAMA_CPP]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}, {LLAMA_CPP}")
    levels = args.levels or isa.supported()
    if set(levels) - set(isa.supported()):
        raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")

    model = "tiny random model (--quick)" if args.quick else DEFAULT_MODEL
    results = {"model": model, "machine": isa.describe(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        gguf = tiny_gguf(Path(tmp) / "tiny.gguf") if args.quick else locate(DEFAULT_MODEL)
        if not args.answers_only:
            results |= perplexity_part(args, gguf, wanted, model)
        if not args.skip_answers:
            results["answers"] = answers.run(gguf, levels, wanted, args.threads, args.per_kind)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged(args.out, results), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
