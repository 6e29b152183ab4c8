"""nanoGPT's CPU recipe on tiny Shakespeare, through the real command line: is val loss <= 1.88 at step 2000?

Runs `decoderlm train --preset seed-char --max-steps 2000` in a fresh run folder, then reports the
final val loss (over the whole val split), the wall time and the median training tokens/s, writes
benchmarks/results/train_seed_char.json and copies the run's loss curve to docs/loss_seed_char.png.

    python benchmarks/train_seed_char.py [--data ../shared/data/tinyshakespeare.txt] [--max-steps 2000]
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_seed_char.json"
PLOT = ROOT / "docs" / "loss_seed_char.png"
TARGET = 1.88  # nanoGPT README: the same recipe on CPU, 2000 iterations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--max-steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "decoderlm", "train", "--data", args.data, "--preset", "seed-char",
               "--max-steps", str(args.max_steps), "--seed", str(args.seed), "--out", str(run)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress bar stays on stderr
        seconds = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"training failed (exit {proc.returncode})")
        history = json.loads((run / "log.json").read_text())
        PLOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(run / "loss.png", PLOT)

    sample = proc.stdout.split("--- sample ---\n", 1)[1].rstrip("\n")
    val = [r for r in history if r["val_loss"] is not None]
    result = {
        "command": "decoderlm train --preset seed-char " + " ".join(cmd[cmd.index("--max-steps"):cmd.index("--out")]),
        "steps": history[-1]["step"],
        "val_loss": round(val[-1]["val_loss"], 4),
        "target_val_loss": TARGET,
        "reached_target": val[-1]["val_loss"] <= TARGET,
        "val_curve": {r["step"]: round(r["val_loss"], 4) for r in val},
        "wall_seconds": round(seconds, 1),  # includes start-up, data preparation, evals and the sample
        "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in history)),
        "sample": sample,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print(f"\n{'val loss (whole val split)':<28}{result['val_loss']:.4f}   (nanoGPT: {TARGET})")
    print(f"{'wall time':<28}{result['wall_seconds']:.0f} s")
    print(f"{'median tokens/s':<28}{result['median_tokens_per_s']:,}")
    print(f"\n--- sample ---\n{sample}\n\nwrote {RESULTS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
