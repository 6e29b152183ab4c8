"""Attention variants on one tiny-Shakespeare budget, and the KV cache of the real configs that use them.

1. seed-char-llama (4 layers, d_model 128, 4 heads of 32) with its attention changed one way at a time:
   MHA (the preset), GQA (2 K/V heads), MQA (1), MLA (DeepSeek's latent: kv_lora_rank 64 + a 16-dim
   RoPE key), a sliding/full mix (Gemma-3's 3 sliding layers, window 16, : 1 full) and the same mix with
   gpt-oss's attention sinks. Where a change removes parameters, the FFN's hidden width gives them back
   (every variant within ± 5 % of the preset's 800,000). Each is a real `decoderlm train` run (same seed,
   steps, recipe and tokens): its val loss over the whole val split; KV bytes per token (bf16, inspect's
   accounting; a sliding layer keeps only its window, so the mix's figure is taken at 2k tokens of
   context); decode tok/s with the cache prefilled to 2,048 tokens (one thread, greedy, through
   `decoderlm.generate.stream`; random weights of the variant's shape, since speed does not depend on
   the values).
2. DeepSeek-V3, Gemma-3-27B, gpt-oss-120b and Llama-3.1-8B from their published config.json fields
   (tests/fixtures/configs, benchmarks/fixtures/real_configs.json): KV bytes per token and at 128k
   tokens of context, by `decoderlm inspect`'s accounting, and whether decoderlm runs the folder as published.

Writes benchmarks/results/attention_variants.json and .png (val loss against KV bytes per token), prints both tables.

    nice python benchmarks/attention_variants.py [--data ../shared/data/tinyshakespeare.txt] [--steps 2000] [--quick]
        [--real-configs-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from experiments import train  # noqa: E402  (one `decoderlm train` run, as the other experiments)

from decoderlm import isa  # noqa: E402
from decoderlm.config import ModelConfig  # noqa: E402
from decoderlm.formats import runs  # noqa: E402
from decoderlm.generate import stream  # noqa: E402
from decoderlm.inspect.accounting import Accounting  # noqa: E402
from decoderlm.inspect.arch import read_spec, spec_from_hf, spec_from_model_config  # noqa: E402
from decoderlm.inspect.report import fmt_bytes  # noqa: E402
from decoderlm.model import Transformer  # noqa: E402
from decoderlm.sampling import SamplingParams  # noqa: E402

BASE = "seed-char-llama"
SEED = 1337
TOLERANCE = 0.05  # parameters within ± 5 % of the base preset's
MIX = dict(sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"])
VARIANTS: list[tuple[str, dict[str, Any]]] = [  # (name, ModelConfig changes to seed-char-llama)
    ("MHA", {}),
    ("GQA 4:2", dict(n_kv_heads=2, ffn_hidden=387)),
    ("MQA 4:1", dict(n_kv_heads=1, ffn_hidden=408)),
    ("MLA 64+16", dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_hidden=336, family="deepseek_v3")),
    ("sliding 3:1 full", MIX),
    ("sliding 3:1 full + sinks", MIX | dict(attn_sinks=True)),
]
REAL = {  # name → where its published config.json fields are
    "DeepSeek-V3": ROOT / "tests" / "fixtures" / "configs" / "deepseek-v3.json",
    "Gemma-3-27B": "real_configs.json",
    "gpt-oss-120b": "real_configs.json",
    "Llama-3.1-8B": ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json",
}
LONG = 131072  # "128k"


def variant_config(changes: dict[str, Any]) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_preset(BASE), **changes)


def accounting(config: ModelConfig) -> Accounting:
    return Accounting.of(spec_from_model_config(config))


def kv_per_token(acc: Accounting, context: int) -> float:
    """bf16 KV bytes per token with `context` tokens cached (a sliding layer holds only its window)."""
    return acc.kv_bytes(context) / context


def decode_speed(config: ModelConfig, context: int, new_tokens: int, repeats: int) -> float:
    """Median decode tok/s over `repeats`, the cache prefilled with `context` random tokens first."""
    torch.manual_seed(SEED)
    model = Transformer(dataclasses.replace(config, max_seq_len=context + new_tokens + 1)).eval()
    prompt = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(SEED)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    speeds = []
    for _ in range(repeats):
        tokens = stream(model, prompt, params)
        next(tokens)  # the prefill and the first token
        t0 = time.perf_counter()
        n = sum(1 for _ in tokens)
        speeds.append(n / (time.perf_counter() - t0))
    return statistics.median(speeds)


def real_configs() -> list[dict[str, Any]]:
    fixture = json.loads((ROOT / "benchmarks" / "fixtures" / "real_configs.json").read_text())
    rows = []
    for name, where in REAL.items():
        spec = spec_from_hf(fixture[name], name) if where == "real_configs.json" else read_spec(where)
        acc = Accounting.of(spec)
        rows.append({
            "name": name, "attention": spec.attention_kind(), "layers": spec.n_layers,
            "sliding_layers": sum(spec.window(i) is not None for i in range(spec.n_layers)), "sliding_window": spec.sliding_window,
            "parameters": acc.total, "kv_bytes_per_token": acc.kv_elements_per_token() * 2, f"kv_bytes_at_{LONG}": acc.kv_bytes(LONG),
            "runs_in_decoderlm": spec.runs(), "uncounted": spec.uncounted,
        })
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, r in enumerate(rows):  # labels alternately above and below: the two mixes sit on one point
        ax.scatter(r["kv_bytes_per_token_at_context"], r["val_loss"], s=30)
        ax.annotate(r["name"], (r["kv_bytes_per_token_at_context"], r["val_loss"]), fontsize=8, xytext=(4, -10 if i % 2 else 3),
                    textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set(xlabel=f"KV cache bytes per token at {context:,} tokens of context (bf16, all 4 layers)", ylabel="val loss (nats/char)", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(rows: list[dict[str, Any]], real: list[dict[str, Any]], steps: int, context: int) -> str:
    lines = [f"| variant ({steps} steps) | parameters | val loss | KV bytes/token @{context:,} | decode tok/s @{context:,} |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['parameters']:,} | {r['val_loss']:.3f} | {r['kv_bytes_per_token_at_context']:,.0f} | {r['decode_tok_s_at_context']:,.0f} |"
              for r in rows]
    lines += ["", "| model | attention | KV per token (bf16) | KV at 128k | runs in decoderlm |", "|---|---|---:|---:|---|"]
    for r in real:
        sliding = f", {r['sliding_layers']} of {r['layers']} layers sliding ({r['sliding_window']:,})" if r["sliding_layers"] else ""
        runs = r["runs_in_decoderlm"].split(";")[0]  # "yes", "yes, the language model only", "no: <the reason's first clause>"
        lines.append(f"| {r['name']} | {r['attention']}{sliding} | {fmt_bytes(r['kv_bytes_per_token'])} | {fmt_bytes(r[f'kv_bytes_at_{LONG}'])} | {runs} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps of every run (the issue's budget: 2000)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for training and decoding (1 is steadiest on a shared machine)")
    p.add_argument("--context", type=int, default=2048, help="tokens in the cache before decode is timed")
    p.add_argument("--new-tokens", type=int, default=64, help="decoded tokens timed per repeat")
    p.add_argument("--repeats", type=int, default=3, help="decode timings per variant (the median is kept)")
    p.add_argument("--quick", action="store_true", help="4 steps, one val batch, a 64-token context: checks the script, not the variants")
    p.add_argument("--out", help="folder for the JSON and PNG (default: benchmarks/results/)")
    p.add_argument("--real-configs-only", action="store_true",
                   help="recompute part 2 (the published configs) into the JSON already in --out, keeping its trained variants")
    args = p.parse_args()
    steps, context, new_tokens, repeats = (4, 64, 4, 1) if args.quick else (args.steps, args.context, args.new_tokens, args.repeats)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    if args.real_configs_only:
        result = json.loads((out / "attention_variants.json").read_text())
        result["real_configs"] = real_configs()
        result["markdown"] = markdown(result["variants"], result["real_configs"], result["steps"], result["decode_context"])
        (out / "attention_variants.json").write_text(json.dumps(result, indent=1) + "\n")
        print(result["markdown"])
        return
    torch.set_num_threads(args.threads)
    base = accounting(variant_config({})).total
    configs = [(name, changes, variant_config(changes)) for name, changes in VARIANTS]
    for name, _, config in configs:  # before any training: a variant off budget is a bug in VARIANTS
        total = accounting(config).total
        if abs(total / base - 1) > TOLERANCE:
            sys.exit(f"{name}: {total:,} parameters, more than {TOLERANCE:.0%} from {BASE}'s {base:,}; adjust its ffn_hidden")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, changes, config in tqdm(configs, desc="variants", unit="run"):
            sets = [a for key, value in changes.items() for a in ("--set", f"{key}={json.dumps(value)}")]
            folder = name.replace(" ", "_").replace(":", "-").replace("+", "plus")
            run = train(folder, Path(tmp), str(Path(args.data).resolve()), steps, args.threads, args.quick, "--preset", BASE, *sets, "--seed", str(SEED))
            trained = ModelConfig.from_dict(runs.read(Path(tmp) / folder)["config"])
            if any(getattr(trained, key) != value for key, value in changes.items()):
                sys.exit(f"{name}: the trained model is not the variant ({changes}); check the --set flags")
            acc = accounting(config)
            rows.append({
                "name": name, "changes": changes, "parameters": run["parameters"], "vs_base_parameters": round(run["parameters"] / base - 1, 4),
                "val_loss": run["val_loss"], "train_loss": run["train_loss"], "tokens": run["tokens"], "wall_seconds": run["wall_seconds"],
                "kv_bytes_per_token": acc.kv_elements_per_token() * 2, "kv_bytes_per_token_at_context": kv_per_token(acc, context),
                "seconds_per_step": round(run["wall_seconds"] / steps, 3), "decode_tok_s_at_context": round(decode_speed(config, context, new_tokens, repeats), 1), "command": run["command"],
                "curve": run["curve"],
            })
    real = real_configs()
    result = {
        "steps": steps, "issue_steps": 2000, "seed": SEED, "threads": args.threads, "quick": args.quick, "data": args.data,
        "base": BASE, "base_parameters": base, "decode_context": context, "decode_new_tokens": new_tokens, "decode_repeats": repeats,
        "kv_dtype": "bf16 (inspect's accounting; the decode runs in fp32)",
        "note": "decode tok/s come from a single shared, busy 2-core machine (other jobs ran beside it): noisy, compare within this run only; "
                "decode runs random weights of each variant's shape, extended to the context (RoPE, no learned positions)",
        "variants": rows, "real_configs": real, "markdown": markdown(rows, real, steps, context),
        "machine": isa.describe() | {"platform": platform.platform(), "python": platform.python_version()},
    }
    (out / "attention_variants.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, out / "attention_variants.png", f"{BASE} attention variants, {steps} steps, tiny Shakespeare", context)
    print(result["markdown"])


if __name__ == "__main__":
    main()
