"""Exposure bias on the char model, with and without scheduled sampling (issue 12): does training on
its own predictions help a model continue from its own generated text?

Two seed-char runs per seed on tiny Shakespeare, alike (steps, recipe, seed) except `--scheduled-sampling
P` (probability ramping from 0 to P over the run). Each trained model is measured on its val split:

- val loss: the teacher-forced next-token loss over the whole val split (what `train` reports).
- the exposure-bias gap. The val split is cut into non-overlapping windows of L = PREFIX + OWN + SCORE
  (32 + 16 + 16) tokens x_0 .. x_{L-1}. The model continues the true prefix x_{<PREFIX} by OWN tokens of its own
  (greedy, or sampled at temperature 1), which replace x_PREFIX .. x_{PREFIX+OWN-1}. Then the SCORE
  true tokens that follow, x_{PREFIX+OWN} .. x_{L-1}, are scored teacher-forced twice: after the true
  context (true-context loss) and after the spliced one, true prefix + own tokens (own-context loss).
  gap = own-context loss - true-context loss, in nats per token, over the same target tokens (the JSON
  also has both losses at each of the SCORE positions: how fast the model recovers from its own text).

The gap is not all exposure bias: the true text after a different OWN-token stretch is less likely even
for a perfect model, since it continues other words. What the gap does measure is how well the model
predicts the truth once its context holds its own output, which is exactly what scheduled sampling
trains for (own predictions as inputs, true targets); so it is the fair test of whether P > 0 helps.
The share of own tokens equal to the true ones is reported beside it (an own token equal to the truth
changes nothing).

Writes benchmarks/results/exposure_bias.json (or into --out) and prints a table.

    nice python benchmarks/exposure_bias.py --data ../shared/data/tinyshakespeare.txt [--seeds 1337 0] [--p 0.25] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decoderlm import isa
from decoderlm.formats import runs
from decoderlm.generate import decode_step, prefill
from decoderlm.kv_cache import KVCache
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.model.transformer import lm_loss
from decoderlm.train import TrainConfig, train
from decoderlm.train.data import eval_windows, load_splits, token_dtype

PREFIX, OWN, SCORE = 32, 16, 16  # a window fills seed-char's 64-token context (63 inputs)
BATCH = 256  # windows per forward


def train_run(data: str, out: Path, steps: int, seed: int, p: float, threads: int | None, quick: bool) -> Path:
    """One seed-char run in `out`, unless `out` already holds this very run finished (same data, steps,
    seed and P): then it is reused, so an interrupted benchmark need not retrain."""
    if (out / runs.CKPT_NAME).is_file():
        state = runs.read(out)
        saved = state["train_config"]
        same = (saved["data"], saved["max_steps"], saved["seed"], saved["scheduled_sampling"], saved["preset"]) == (
            str(Path(data).resolve()), steps, seed, p, "seed-char")
        if same and state["step"] == steps:
            return out
        sys.exit(f"{out} holds another run; remove it or choose another --work")
    quick_flags = {"eval_interval": steps, "eval_batches": 1, "log_interval": 1} if quick else {}
    train(TrainConfig(data=data, out=str(out), preset="seed-char", max_steps=steps, seed=seed, scheduled_sampling=p,
                      threads=threads, sample_chars=0, **quick_flags))
    return out


@torch.no_grad()
def teacher_forced_loss(model: Transformer, val: torch.Tensor, context: int) -> float:
    """Mean next-token loss over the whole split (non-overlapping windows), as training's evaluation."""
    total, count = 0.0, 0
    for x, y in eval_windows(val.numpy(), context, BATCH):
        total, count = total + lm_loss(model(x).logits, y).item() * y.numel(), count + y.numel()
    return total / count


def windows(val: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows (N, length) of the split, in order; at most `limit` of them."""
    n = len(val) // length if limit is None else min(limit, len(val) // length)
    return val[: n * length].view(n, length)


@torch.no_grad()
def generate_own(model: Transformer, prefixes: torch.Tensor, n: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """The model's own continuation (B, n) of each prefix (B, P): greedy at temperature 0, else sampled.
    Prefill, then one cached decode step per token (decoderlm.generate's split), for all rows at once."""
    cache = KVCache(model.config, len(prefixes), prefixes.shape[1] + n)
    logits = prefill(model, prefixes, cache).float()  # (B, V)
    own = []
    for i in range(n):
        if temperature == 0:
            own.append(logits.argmax(-1))
        else:
            own.append(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0])
        if i < n - 1:
            logits = decode_step(model, own[-1], cache).float()
    return torch.stack(own, 1)


@torch.no_grad()
def continuation_losses(model: Transformer, win: torch.Tensor, own: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token losses (N, SCORE) of each window's (N, L) last SCORE true tokens, teacher-forced after the
    true context (own None) or after the context whose tokens PREFIX .. PREFIX+OWN-1 are `own` (N, OWN)."""
    inputs = win[:, :-1].clone()  # (N, L-1)
    if own is not None:
        inputs[:, PREFIX : PREFIX + OWN] = own
    start = PREFIX + OWN - 1  # the input slot that predicts the first scored token
    out = []
    for i in range(0, len(win), BATCH):
        logits = model(inputs[i : i + BATCH]).logits[:, start:].float()  # (b, SCORE, V)
        targets = win[i : i + BATCH, start + 1 :]  # (b, SCORE)
        out.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
    return torch.cat(out)


def exposure_gap(model: Transformer, val: torch.Tensor, seed: int, limit: int | None = None) -> dict[str, Any]:
    """The true-context loss and, for greedy and T=1 own tokens, the own-context loss and the gap (see the
    module docstring); each also as a curve over the SCORE positions after the splice."""
    win = windows(val, PREFIX + OWN + SCORE, limit)
    true = continuation_losses(model, win)  # (N, SCORE)
    result: dict[str, Any] = {"windows": len(win), "prefix": PREFIX, "own": OWN, "score": SCORE,
                              "true_context_loss": true.mean().item(), "true_context_curve": rounded(true.mean(0))}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        generator = torch.Generator().manual_seed(seed)
        own = torch.cat([generate_own(model, win[i : i + BATCH, :PREFIX], OWN, temperature, generator) for i in range(0, len(win), BATCH)])
        spliced = continuation_losses(model, win, own)
        result[name] = {"own_context_loss": spliced.mean().item(), "gap": (spliced.mean() - true.mean()).item(),
                        "own_equals_true": (own == win[:, PREFIX : PREFIX + OWN]).float().mean().item(),
                        "own_context_curve": rounded(spliced.mean(0))}
    return result


def rounded(t: torch.Tensor) -> list[float]:
    return [round(v, 4) for v in t.tolist()]


def measure(run: Path, seed: int, limit: int | None = None, threads: int | None = None) -> dict[str, Any]:
    """Both numbers for the model in a run folder, on that run's own val split."""
    if threads is not None:
        torch.set_num_threads(threads)
    model, tokenizer = load(run)
    val = torch.from_numpy(load_splits(run, token_dtype(tokenizer.vocab_size))[1][0].astype("int64"))
    return {"val_loss": teacher_forced_loss(model, val, model.config.max_seq_len), **exposure_gap(model, val, seed, limit)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per P: the mean over seeds of each headline number."""
    def value(row: dict[str, Any], key: str) -> float:
        kind, _, name = key.partition(":")
        return row[kind][name] if name else row[kind]

    keys = ("val_loss", "true_context_loss", "greedy:own_context_loss", "greedy:gap", "sampled:own_context_loss", "sampled:gap")
    out = {}
    for p in sorted({r["p"] for r in rows}):
        mine = [r for r in rows if r["p"] == p]
        out[f"{p:g}"] = {"seeds": len(mine)} | {k.replace(":", "_"): round(statistics.mean(value(r, k) for r in mine), 4) for k in keys}
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'P':>5} {'seed':>5} {'val loss':>9} {'true ctx':>9} {'greedy ctx':>11} {'gap':>7} {'T=1 ctx':>8} {'gap':>7}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['p']:>5g} {r['seed']:>5} {r['val_loss']:>9.4f} {r['true_context_loss']:>9.4f} "
                     f"{r['greedy']['own_context_loss']:>11.4f} {r['greedy']['gap']:>7.4f} "
                     f"{r['sampled']['own_context_loss']:>8.4f} {r['sampled']['gap']:>7.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps of every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 0])
    p.add_argument("--p", type=float, default=0.25, help="--scheduled-sampling of the runs that use it")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 is steadiest on a shared machine)")
    p.add_argument("--work", help="keep the run folders here (default: a temporary folder); finished runs are reused")
    p.add_argument("--quick", action="store_true", help="4 steps, one seed, 32 windows: checks the script, not the models")
    p.add_argument("--out", help="folder for exposure_bias.json (default: benchmarks/results/)")
    args = p.parse_args(argv)
    steps, seeds, limit = (4, args.seeds[:1], 32) if args.quick else (args.steps, args.seeds, None)
    results = Path(args.out) if args.out else ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    data = str(Path(args.data).resolve())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        for seed in seeds:
            for prob in (0.0, args.p):
                run = train_run(data, work / f"seed{seed}-p{prob:g}", steps, seed, prob, args.threads, args.quick)
                speed = statistics.median(r["tokens_per_s"] for r in json.loads((run / "log.json").read_text()))
                rows.append({"p": prob, "seed": seed, **measure(run, seed, limit, args.threads), "train_tokens_per_s": round(speed)})
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    result = {
        "command": f"decoderlm train --preset seed-char --max-steps {steps} --seed SEED [--scheduled-sampling {args.p:g}]",
        "data": args.data, "steps": steps, "quick": args.quick, "definition": "\n\n".join(__doc__.split("\n\n")[1:4]), "rows": rows,
        "mean": summarize(rows),
        "machine": isa.describe() | {"platform": platform.platform(), "threads": args.threads},
    }
    (results / "exposure_bias.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    return result


if __name__ == "__main__":
    main()
