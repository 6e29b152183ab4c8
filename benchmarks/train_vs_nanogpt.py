"""Training throughput of `decoderlm train` against nanoGPT's own train.py, side by side on nanoGPT's CPU recipe.

Both train the same model (4 layers x 4 heads x d 128, vocab 65, context 64, batch 12, lr 1e-3 with
warmup 100 and cosine decay over 2000 steps) on tiny Shakespeare, with the same number of CPU threads.
nanoGPT runs its README command (`--device=cpu --compile=False ...`: fp32, eager) from a temporary copy
of its source; decoderlm runs `decoderlm train --preset seed-char` twice over: at equal precision (fp32,
eager: `decoderlm_fp32_eager`) and in its best mode, the preset plus FLAGS (default: bf16 autocast and a
compiled step, whose artifacts are cached on disk by an untimed warm-up run: `decoderlm_best_mode`).
Each is compared with nanoGPT, and each reports its own loss.

How tokens/s is measured: each engine is run as a whole process for SHORT and for LONG steps; the
difference of the two runs' times divided by LONG - SHORT steps is the time of one training step,
with start-up, data preparation, compilation (or loading it from the cache) and evaluation cancelled
out (each run evaluates once and identically: nanoGPT at step 0, decoderlm at its last step). Both
wall-clock and CPU time (user + system of the process and its children) are reported; on a shared
machine CPU time at one thread is the steadier figure. The three engines are interleaved (nanoGPT,
fp32, best mode, then the reverse order in the next repeat, ...) and the median over repeats is
reported, with each repeat's ratios. The training loss of each engine's last 50 steps of the long runs
is reported too, and with --full one 2000-step run of each engine gives the val loss at the recipe's
end. Writes benchmarks/results/train_vs_nanogpt.json (or --out).

    python benchmarks/train_vs_nanogpt.py --nanogpt PATH [--data tinyshakespeare.txt] [--threads 1] [--full]
        [--flags "--dtype bfloat16 --compile"] [--short 20 --long 220 --repeats 3] [--isa native|avx2|avx512|default]

`--isa avx2` runs every engine (nanoGPT included) as an AVX2 CPU would (`decoderlm.isa.env`) and writes
train_vs_nanogpt_avx2.json. There bf16 has no instructions: decoderlm's best mode computes in fp32 (with
a note), so it is the compiled fp32 step.

PATH is a nanoGPT work tree or a bare git directory of it (its HEAD is extracted); nothing of it is
copied into this repository.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from decoderlm import isa

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_vs_nanogpt.json"
BATCH, CONTEXT, DECAY = 12, 64, 2000
TOKENS_PER_STEP = BATCH * CONTEXT
LAST = 50  # training-loss steps averaged at the end of a run
KINDS = ("step", "wall", "cpu")
SKIP = 5  # first steps of a run left out of the per-step median (warm-up; nanoGPT's step 0 holds its evaluation)
NANOGPT_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
                  f"--block_size={CONTEXT}", f"--batch_size={BATCH}", "--n_layer=4", "--n_head=4", "--n_embd=128",
                  f"--lr_decay_iters={DECAY}", "--dropout=0.0"]


def setup_nanogpt(source: Path, data: Path, tmp: Path) -> Path:
    """A runnable nanoGPT in tmp: its source (from a work tree or a bare git dir) and tiny Shakespeare prepared."""
    tree = tmp / "nanogpt"
    if (source / "train.py").is_file():
        shutil.copytree(source, tree, ignore=shutil.ignore_patterns(".git"))
    else:
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(source), "archive", "HEAD"], stdout=subprocess.PIPE, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    char_dir = tree / "data" / "shakespeare_char"
    shutil.copyfile(data, char_dir / "input.txt")  # prepare.py downloads it only when missing
    subprocess.run([sys.executable, "prepare.py"], cwd=char_dir, stdout=subprocess.DEVNULL, check=True)
    return tree


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, float, float]:
    """Run cmd to completion; its stdout, wall seconds and CPU seconds (the process and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.stdout, wall, cpu


def run_nanogpt(tree: Path, steps: int, env: dict[str, str], out: Path, eval_at_end: bool = False) -> dict:
    """nanoGPT for `steps` optimizer steps: its max_iters N runs iterations 0..N, so N = steps - 1, or N = steps
    with eval_at_end (it evaluates at the top of iteration N, after `steps` updates, then runs one more step)."""
    last_iter, interval = (steps, steps) if eval_at_end else (steps - 1, 10 * DECAY)
    cmd = [sys.executable, "train.py", *NANOGPT_RECIPE, f"--max_iters={last_iter}", f"--eval_interval={interval}", f"--out_dir={out}"]
    stdout, wall, cpu = timed(cmd, tree, env)
    lines = re.findall(r"^iter \d+: loss ([0-9.]+), time ([0-9.]+)ms", stdout, re.MULTILINE)[:steps]
    losses = [float(loss) for loss, _ in lines]
    step_tok_s = statistics.median(TOKENS_PER_STEP / (float(ms) / 1000) for _, ms in lines[SKIP:])
    val = [float(m) for m in re.findall(r"^step \d+: train loss [0-9.]+, val loss ([0-9.]+)", stdout, re.MULTILINE)]
    assert len(losses) == steps, f"nanoGPT logged {len(losses)} steps, expected {steps}"
    return {"wall": wall, "cpu": cpu, "step": step_tok_s, "train_loss_last": statistics.mean(losses[-LAST:]),
            "val_loss": val[-1] if eval_at_end else None}


def run_decoderlm(data: Path, steps: int, threads: int, flags: list[str], env: dict[str, str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "decoderlm", "train", "--data", str(data), "--preset", "seed-char", "--max-steps", str(steps),
           "--decay-steps", str(DECAY), "--eval-interval", str(10 * DECAY), "--log-interval", "1", "--sample-chars", "0",
           "--threads", str(threads), "--out", str(out), *flags]
    _, wall, cpu = timed(cmd, ROOT, env)
    history = json.loads((out / "log.json").read_text())
    shutil.rmtree(out)
    losses = [r["train_loss"] for r in history]
    assert len(losses) == steps, f"decoderlm logged {len(losses)} steps, expected {steps}"
    step_tok_s = statistics.median(r["tokens_per_s"] for r in history[SKIP:])
    return {"wall": wall, "cpu": cpu, "step": step_tok_s, "train_loss_last": statistics.mean(losses[-LAST:]),
            "val_loss": history[-1]["val_loss"]}


def per_step(short: dict, long: dict, steps: int) -> dict:
    """tokens/s of training steps alone: the extra time of the long run over the short one (wall, CPU), and
    the median over the long run's steps of the engine's own per-step timing (wall, evaluation excluded)."""
    return {k: TOKENS_PER_STEP * steps / (long[k] - short[k]) for k in ("wall", "cpu")} | {"step": long["step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, required=True, help="nanoGPT work tree or bare git directory")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "tinyshakespeare.txt")
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--long", type=int, default=220)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flags", default="--dtype bfloat16 --compile", help="decoderlm train options of its best mode")
    p.add_argument("--full", action="store_true", help="also one 2000-step run of each engine, for the loss at the recipe's end")
    p.add_argument("--out", type=Path, default=None, help="the JSON to write (default: results/train_vs_nanogpt[_ISA].json)")
    p.add_argument("--isa", choices=("native", *isa.LEVELS), default="native",
                   help="the CPU level every engine's torch runs at, nanoGPT's too (as on a CPU that has no more)")
    args = p.parse_args()
    if args.isa != "native" and args.isa != isa.current():  # torch reads its level once: run again under it
        if args.isa not in isa.supported():
            raise SystemExit(f"this CPU runs only the levels {', '.join(isa.supported())}")
        os.execve(sys.executable, [sys.executable, *sys.argv], isa.env(args.isa))
    args.out = args.out or (RESULTS if args.isa == "native" else RESULTS.with_stem(f"{RESULTS.stem}_{args.isa}"))
    data = args.data.resolve()
    configs = {"decoderlm_fp32_eager": [], "decoderlm_best_mode": args.flags.split()}
    engines = ["nanogpt", *configs]
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    steps = args.long - args.short

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tree = setup_nanogpt(args.nanogpt, data, tmp)

        def run(engine: str, n: int, out: Path, eval_at_end: bool = False) -> dict:
            if engine == "nanogpt":
                return run_nanogpt(tree, n, env, out, eval_at_end)
            return run_decoderlm(data, n, args.threads, configs[engine], env, out)

        warm = {e: run(e, args.short, tmp / f"warm-{e}")["wall"] for e, flags in configs.items() if "--compile" in flags}
        for e, wall in warm.items():
            print(f"{e} warm-up run ({args.short} steps, fills the compile cache): {wall:.1f} s wall", flush=True)
        speeds: dict[str, list[dict]] = {e: [] for e in engines}
        finals: dict[str, list[dict]] = {e: [] for e in engines}
        order = [engines if r % 2 == 0 else engines[::-1] for r in range(args.repeats)]
        for r, engines_in_order in enumerate(order):
            for engine in engines_in_order:
                runs = {n: run(engine, n, tmp / f"{engine}-{r}-{n}") for n in (args.short, args.long)}
                speeds[engine].append(per_step(runs[args.short], runs[args.long], steps))
                finals[engine].append(runs[args.long])
                s = speeds[engine][-1]
                print(f"repeat {r}: {engine:20s} tokens/s: per-step median {s['step']:8,.0f}, runs' difference {s['wall']:8,.0f} wall "
                      f"{s['cpu']:8,.0f} CPU; train loss (last {LAST} of {args.long} steps) {runs[args.long]['train_loss_last']:.4f}",
                      flush=True)
        full = {e: run(e, DECAY, tmp / f"{e}-full", eval_at_end=True) for e in engines} if args.full else None

    median = {e: {k: statistics.median(s[k] for s in v) for k in KINDS} for e, v in speeds.items()}
    ratio = {e: {k: round(median[e][k] / median["nanogpt"][k], 2) for k in KINDS} for e in configs}
    ratio_repeats = {e: [{k: round(a[k] / b[k], 2) for k in KINDS} for a, b in zip(speeds[e], speeds["nanogpt"])] for e in configs}
    result = {
        "recipe": "nanoGPT CPU recipe: " + " ".join(NANOGPT_RECIPE),
        "commands": {"nanogpt": "python train.py " + " ".join(NANOGPT_RECIPE) + " (fp32, eager)"}
        | {e: " ".join(["decoderlm train --preset seed-char", *flags]) + " (same recipe: the seed-char preset's)" for e, flags in configs.items()},
        "measurement": (f"tokens/s of training steps, two ways: 'step' = median over steps {SKIP}.. of a {args.long}-step run of "
                        f"the engine's own per-step wall time (nanoGPT's 'iter N: ... time Xms', decoderlm's log.json at "
                        f"--log-interval 1; evaluation excluded from both); 'wall'/'cpu' = {TOKENS_PER_STEP} x {steps} / "
                        f"(time of a {args.long}-step run - time of a {args.short}-step run), so start-up, compile-cache load "
                        f"and the one evaluation per run cancel out. Median of {args.repeats} interleaved repeats (the engines' "
                        f"order reversed every other repeat); {args.threads} thread(s) each. ratio: decoderlm / nanogpt."),
        "run_order": order,
        "tokens_per_s": {e: {k: round(v) for k, v in m.items()} for e, m in median.items()},
        "ratio": ratio,
        "ratio_repeats": ratio_repeats,
        "repeats": {e: [{k: round(x) for k, x in s.items()} for s in v] for e, v in speeds.items()},
        "train_loss_last_steps": {e: [round(f["train_loss_last"], 4) for f in v] for e, v in finals.items()},
        "warm_up_wall_s": {e: round(wall, 1) for e, wall in warm.items()},
        "full_2000_steps": None if full is None else {e: {
            "wall_s": round(f["wall"], 1), f"train_loss_last_{LAST}": round(f["train_loss_last"], 4),
            "val_loss": f["val_loss"] and round(f["val_loss"], 4)} for e, f in full.items()},
        "machine": isa.describe() | {"platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\ntokens/s               {'per-step median':>16s} {'difference, wall':>17s} {'difference, CPU':>16s}   train loss (last {LAST})")
    for e, m in median.items():
        print(f"{e:22s} {m['step']:16,.0f} {m['wall']:17,.0f} {m['cpu']:16,.0f}   {statistics.median(result['train_loss_last_steps'][e]):.4f}")
    for e, r in ratio.items():
        print(f"{e} / nanogpt: {r['step']:.2f}x per-step median, {r['wall']:.2f}x wall, {r['cpu']:.2f}x CPU")
    for e, f in (full or {}).items():
        print(f"2000 steps, {e}: train loss (last {LAST}) {f['train_loss_last']:.4f}, val loss {f['val_loss']}, {f['wall']:.0f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
