"""The training loop: AdamW, warmup + cosine schedule, gradient clipping, periodic eval and checkpoints.

A killed run resumed from its last checkpoint equals an uninterrupted one step for step: the
checkpoint carries the optimizer, the loss window being averaged and every RNG stream training draws from.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer
from decoderlm.model.transformer import lm_loss
from decoderlm.tokenizer import CharTokenizer
from decoderlm.train import checkpoint
from decoderlm.train.config import FIELDS, TrainConfig, resolve_new, resolve_resume, run_folder
from decoderlm.train.data import (EVAL_BATCH, check_sizes, encode, eval_windows, get_batch, load_splits, read_corpus,
                                  split_sizes, token_dtype, write_splits)
from decoderlm.train.schedule import lr_at

RESUME_KEYS = ("optimizer", "rng", "train_config", "history", "window")
# What a run writes into its folder; a new run may start over these (a run killed before its first
# checkpoint), never over anything else.
RUN_FILES = {checkpoint.CKPT_NAME, "train.bin", "val.bin", "log.csv", "log.json", "loss.png"}
RUN_FILES |= {name + ".tmp" for name in RUN_FILES}


def make_optimizer(model: Transformer, cfg: TrainConfig) -> torch.optim.AdamW:
    """Decay matrices only; biases, norm weights (1-D) are not decayed (as nanoGPT and GPT-2)."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False)


@torch.no_grad()
def evaluate(model: Transformer, data: np.ndarray, cfg: TrainConfig) -> float:
    """Mean next-token loss over val windows (the whole split unless eval_batches is set)."""
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(eval_windows(data, cfg.context, EVAL_BATCH)):
        if cfg.eval_batches is not None and i >= cfg.eval_batches:
            break
        loss = lm_loss(model(x.to(cfg.device)).logits, y.to(cfg.device))
        total, count = total + loss.item() * y.numel(), count + y.numel()
    model.train()
    return total / count


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) a model in cfg.out; return a summary with the final val loss and speed.

    Every setting, the data's size and the run folder are checked before the first step; see
    `decoderlm.train.config` for what --resume keeps and what it lets change."""
    out = Path(run_folder(cfg))
    cfg, state, tokenizer, (train_data, val_data) = open_run(cfg, out) if cfg.resume else start_run(cfg, out)
    config = ModelConfig.from_dict(state["config"])
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = Transformer(config).to(device)

    def window_loss(step: int, batch_rng: torch.Generator) -> torch.Tensor:
        x, y = get_batch(train_data, cfg.batch_size, cfg.context, batch_rng)
        return lm_loss(model(x.to(device)).logits, y.to(device))

    def save(loop_state: dict[str, Any]) -> None:
        checkpoint.save(out, loop_state | {"config": config.to_dict(), "tokenizer": tokenizer.to_dict(), "train_config": dataclasses.asdict(cfg)})
        try:
            write_logs(out, loop_state["history"])
        except OSError as e:
            raise DecoderLMError(f"cannot write the logs in {out} ({e.strerror or e}); the checkpoint is saved: "
                                 "free space, then --resume") from None

    summary = fit(model, cfg, window_loss, lambda: evaluate(model, val_data, cfg), save, cfg.batch_size * cfg.context, state)
    return summary | {"config": cfg, "out": str(out), "tokenizer": tokenizer}


# What a batch is and how its loss is computed: (step, batch_rng) -> loss. Pretraining draws random
# windows; fine-tuning (decoderlm.finetune) passes conversations or preference pairs.
StepLoss = Callable[[int, torch.Generator], torch.Tensor]


def fit(model: Transformer, cfg: TrainConfig, step_loss: StepLoss, evaluate: Callable[[], float],
        save: Callable[[dict[str, Any]], None], tokens_per_step: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loop: schedule, `step_loss`, clip, step, log; `evaluate` and `save` on the eval interval.

    `save` gets the loop's state (model, optimizer, step, rng, history, window); a `state` holding
    "optimizer" resumes from it. Only parameters with requires_grad train (LoRA freezes the rest)."""
    device = torch.device(cfg.device)
    optimizer = make_optimizer(model, cfg)
    batch_rng = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, Any]] = []
    step, window_loss, window_steps = 0, 0.0, 0  # the window: train losses since the last log row
    if state is not None and "optimizer" in state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_states(state["rng"], batch_rng, device)
        history, step = state["history"], state["step"]
        window_loss, window_steps = state["window"]

    def save_state() -> None:
        save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
              "rng": rng_states(batch_rng, device), "history": history, "window": (window_loss, window_steps)})

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    t0 = started = time.perf_counter()
    while step < cfg.max_steps:
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = step_loss(step, batch_rng)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        optimizer.step()
        step += 1
        window_loss, window_steps = window_loss + loss.item(), window_steps + 1
        bar.update(1)
        last = step == cfg.max_steps
        evaluating = step % cfg.eval_interval == 0 or last  # on its own interval, whatever the log interval
        if step % cfg.log_interval == 0 or evaluating:
            elapsed = time.perf_counter() - t0
            tok_s = window_steps * tokens_per_step / elapsed
            row = {"step": step, "train_loss": window_loss / window_steps, "lr": lr, "tokens_per_s": tok_s, "val_loss": None}
            if evaluating:
                row["val_loss"] = evaluate()
                model.train()
            history.append(row)
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", val=f"{row['val_loss']:.3f}" if evaluating else "-", tok_s=f"{tok_s:,.0f}")
            window_loss, window_steps = 0.0, 0
            if evaluating:
                save_state()
            t0 = time.perf_counter()
        if step == cfg.stop_after:
            if not evaluating:
                save_state()
            break
    bar.close()
    vals = [r["val_loss"] for r in history if r["val_loss"] is not None]
    speeds = [r["tokens_per_s"] for r in history]
    return {"step": step, "val_loss": vals[-1] if vals else None, "seconds": time.perf_counter() - started,
            "tokens_per_s": float(np.median(speeds)) if speeds else None, "model": model.eval(), "history": history}


Splits = tuple[np.ndarray, np.ndarray]


def open_run(cfg: TrainConfig, out: Path) -> tuple[TrainConfig, dict[str, Any], CharTokenizer, Splits]:
    """The run in `out` to resume: its checkpoint, its settings with this invocation's applied, its data."""
    state = checkpoint.read(out)
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise DecoderLMError(f"{out / checkpoint.CKPT_NAME} holds a model but not the training state --resume needs "
                             f"({', '.join(missing)}); start a new run with --data and another --out")
    unknown = sorted(set(state["train_config"]) - FIELDS.keys())
    if unknown:
        raise DecoderLMError(f"{out / checkpoint.CKPT_NAME} has training settings this decoderlm does not know ({', '.join(unknown)}); "
                             "upgrade decoderlm to resume it")
    cfg, notes = resolve_resume(cfg, TrainConfig(**state["train_config"]), state["step"])
    tokenizer = CharTokenizer.from_dict(state["tokenizer"])
    splits = load_splits(out, token_dtype(tokenizer.vocab_size))
    check_sizes(len(splits[0]), len(splits[1]), cfg.context, cfg.eval_batches, f"run folder {out}")
    for note in notes:
        print(note, file=sys.stderr)
    return cfg, state, tokenizer, splits


def start_run(cfg: TrainConfig, out: Path) -> tuple[TrainConfig, dict[str, Any], CharTokenizer, Splits]:
    """A new run: settings and corpus checked, then the tokenized splits written into `out`.
    The state holds only the model config: nothing is restored."""
    cfg = resolve_new(cfg)
    check_new_run_folder(out)
    text = read_corpus(cfg.data)
    tokenizer = CharTokenizer.from_text(text)
    ids = encode(text, tokenizer)
    check_sizes(*split_sizes(len(ids)), cfg.context, cfg.eval_batches, f"data file {cfg.data} ({len(ids)} characters)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        splits = write_splits(ids, out)
    except OSError as e:
        raise DecoderLMError(f"cannot write the run folder {out} ({e.strerror or e}); choose a writable --out") from None
    config = ModelConfig.from_preset(cfg.preset, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.context, dropout=cfg.dropout)
    return cfg, {"config": config.to_dict()}, tokenizer, splits


def check_new_run_folder(out: Path) -> None:
    """A new run writes only into a new folder, an empty one or an unfinished run's: never over the user's files."""
    if out.exists() and not out.is_dir():
        raise DecoderLMError(f"--out {out} is a file; give a folder for the run")
    if (out / checkpoint.CKPT_NAME).exists():
        raise DecoderLMError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES) if out.is_dir() else []
    if foreign:
        raise DecoderLMError(f"--out {out} holds files that are not a decoderlm run's ({', '.join(foreign[:3])}); "
                             "choose a new or empty folder")


def rng_states(batch_rng: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Every random stream training draws from: the batch sampler, and dropout's on the CPU or the GPU.
    (Nothing in training uses python's `random` or numpy's.)"""
    states = {"torch": torch.get_rng_state(), "batch": batch_rng.get_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "mps":
        states["mps"] = torch.mps.get_rng_state()
    return states


def set_rng_states(states: dict[str, torch.Tensor], batch_rng: torch.Generator, device: torch.device) -> None:
    """Restore `rng_states`; a GPU stream saved on another device type is left as seeded."""
    torch.set_rng_state(states["torch"])
    batch_rng.set_state(states["batch"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    if device.type == "mps" and "mps" in states:
        torch.mps.set_rng_state(states["mps"])


def write_logs(out: Path, history: list[dict[str, Any]]) -> None:
    """log.csv and log.json (every logged step) and loss.png (train and val curves)."""
    fields = ["step", "train_loss", "val_loss", "lr", "tokens_per_s"]
    with open(out / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(history)
    (out / "log.json").write_text(json.dumps(history, indent=1))
    plot_loss(history, out / "loss.png")


def plot_loss(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in history], [r["train_loss"] for r in history], label="train", lw=1)
    val = [r for r in history if r["val_loss"] is not None]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
