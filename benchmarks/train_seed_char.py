"""nanoGPT's CPU recipe on tiny Shakespeare, through the real command line: is val loss <= 1.88 at step 2000?

For each seed, runs `decoderlm train --preset seed-char --max-steps 2000` in a fresh run folder and reports
the final val loss (over the whole val split), the wall time and the median training tokens/s; then the
mean and spread over seeds. Writes benchmarks/results/train_seed_char.json and copies the first seed's
loss curve to docs/loss_seed_char.png.

    python benchmarks/train_seed_char.py [--data ../shared/data/tinyshakespeare.txt] [--seeds 1337 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from decoderlm import isa

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_seed_char.json"
PLOT = ROOT / "docs" / "loss_seed_char.png"
TARGET = 1.88  # nanoGPT README: the same recipe on CPU, 2000 iterations


def run_seed(data: str, max_steps: int, seed: int, keep_plot: bool) -> dict:
    """One training run through the CLI; its final val loss, curve, timing and sample."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "decoderlm", "train", "--data", data, "--preset", "seed-char",
               "--max-steps", str(max_steps), "--seed", str(seed), "--out", str(run)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress bar stays on stderr
        seconds = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"training with seed {seed} failed (exit {proc.returncode})")
        history = json.loads((run / "log.json").read_text())
        if keep_plot:
            PLOT.parent.mkdir(exist_ok=True)
            shutil.copyfile(run / "loss.png", PLOT)
    val = [r for r in history if r["val_loss"] is not None]
    return {
        "seed": seed,
        "steps": history[-1]["step"],
        "val_loss": round(val[-1]["val_loss"], 4),
        "val_curve": {r["step"]: round(r["val_loss"], 4) for r in val},
        "wall_seconds": round(seconds, 1),  # includes start-up, data preparation, evals and the sample
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in history)),
        "sample": proc.stdout.split("--- sample ---\n", 1)[1].rstrip("\n"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--seeds", type=int, nargs="+", default=[1337, 0, 1, 2])
    args = p.parse_args()

    runs = []
    for i, seed in enumerate(args.seeds):
        runs.append(run_seed(args.data, args.max_steps, seed, keep_plot=i == 0))
        r = runs[-1]
        print(f"seed {seed:>5}: val loss {r['val_loss']:.4f}  {r['wall_seconds']:.0f} s  {r['median_tokens_per_s']:,} tokens/s", flush=True)
    losses = [r["val_loss"] for r in runs]
    result = {
        "command": f"decoderlm train --preset seed-char --max-steps {args.max_steps} --seed SEED",
        "target_val_loss": TARGET,
        "mean_val_loss": round(statistics.mean(losses), 4),
        "stdev_val_loss": round(statistics.stdev(losses), 4) if len(losses) > 1 else None,
        "seeds_at_or_below_target": sum(v <= TARGET for v in losses),
        "runs": runs,
        "machine": isa.describe() | {"platform": platform.platform(),
                    "torch_threads": int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    spread = f" ± {result['stdev_val_loss']:.4f}" if result["stdev_val_loss"] is not None else ""
    print(f"\nmean val loss (whole val split) over {len(runs)} seeds: {result['mean_val_loss']:.4f}{spread}"
          f"   (nanoGPT publishes {TARGET}; {result['seeds_at_or_below_target']}/{len(runs)} seeds at or below it)")
    print(f"\n--- sample (seed {runs[0]['seed']}) ---\n{runs[0]['sample']}\n\nwrote {RESULTS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
