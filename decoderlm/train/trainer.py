"""The training loop: AdamW, warmup + cosine schedule, gradient clipping, periodic eval and checkpoints."""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from decoderlm.config import PRESETS, ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer
from decoderlm.model.transformer import lm_loss
from decoderlm.tokenizer import CharTokenizer
from decoderlm.train import checkpoint
from decoderlm.train.data import eval_windows, get_batch, load_split, prepare, read_corpus
from decoderlm.train.schedule import lr_at


@dataclass
class TrainConfig:
    """Training knobs. `None` means: take the preset's recipe (see RECIPES), else DEFAULT_RECIPE."""

    data: str | None  # not needed to resume
    out: str = "runs/seed-char"
    preset: str = "seed-char"
    max_steps: int | None = None  # None: 2000, or on resume the run's own
    batch_size: int | None = None
    context: int | None = None
    lr: float | None = None
    min_lr: float | None = None
    warmup: int | None = None
    weight_decay: float | None = None
    beta1: float = 0.9
    beta2: float | None = None
    grad_clip: float = 1.0
    dropout: float | None = None
    eval_interval: int = 250
    eval_batches: int | None = None  # None: the whole val split
    log_interval: int = 10
    seed: int = 1337
    device: str = "cpu"
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after this step; the schedule still spans max_steps
    sample_chars: int = 300


# nanoGPT's CPU recipe for tiny Shakespeare (val loss ≈ 1.88 after 2000 steps).
RECIPES: dict[str, dict[str, Any]] = {
    "seed-char": dict(batch_size=12, context=64, lr=1e-3, min_lr=1e-4, warmup=100, weight_decay=0.1, beta2=0.99, dropout=0.0),
}
DEFAULT_RECIPE = dict(batch_size=8, context=256, lr=6e-4, min_lr=6e-5, warmup=100, weight_decay=0.1, beta2=0.95, dropout=0.0)


def resolve(cfg: TrainConfig) -> TrainConfig:
    if cfg.preset not in PRESETS:
        raise DecoderLMError(f"unknown preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}")
    recipe = RECIPES.get(cfg.preset, DEFAULT_RECIPE)
    filled = {k: v for k, v in recipe.items() if getattr(cfg, k) is None}
    if cfg.max_steps is None and not cfg.resume:
        filled["max_steps"] = 2000
    if cfg.data is None and not cfg.resume:
        raise DecoderLMError("--data is required to start a run; give a UTF-8 text file")
    cfg = dataclasses.replace(cfg, **filled)
    for name in ("max_steps", "batch_size", "context", "eval_interval", "log_interval", "stop_after"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise DecoderLMError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    if cfg.lr <= 0 or cfg.min_lr < 0 or cfg.min_lr > cfg.lr:
        raise DecoderLMError(f"need 0 <= --min-lr <= --lr and --lr > 0, got lr={cfg.lr} min_lr={cfg.min_lr}")
    if not 0 <= cfg.dropout < 1:
        raise DecoderLMError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    return cfg


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
    for i, (x, y) in enumerate(eval_windows(data, cfg.context, 64)):
        if cfg.eval_batches is not None and i >= cfg.eval_batches:
            break
        loss = lm_loss(model(x.to(cfg.device)).logits, y.to(cfg.device))
        total, count = total + loss.item() * y.numel(), count + y.numel()
    model.train()
    return total / count


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) a model in cfg.out; return a summary with the final val loss and speed."""
    cfg = resolve(cfg)
    out = Path(cfg.out)
    if cfg.resume:
        state = checkpoint.read(out)
        saved = TrainConfig(**state["train_config"])
        max_steps = cfg.max_steps or saved.max_steps  # the same total keeps the lr schedule, so resuming is exact
        cfg = dataclasses.replace(saved, max_steps=max_steps, stop_after=cfg.stop_after, resume=True, device=cfg.device)
        tokenizer = CharTokenizer.from_dict(state["tokenizer"])
        dtype = np.uint16 if tokenizer.vocab_size < 2**16 else np.uint32
        train_data, val_data = load_split(out, "train", dtype), load_split(out, "val", dtype)
        config = ModelConfig.from_dict(state["config"])
    else:
        if (out / checkpoint.CKPT_NAME).exists():
            raise DecoderLMError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
        text = read_corpus(cfg.data)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = CharTokenizer.from_text(text)
        train_data, val_data = prepare(text, tokenizer, out)
        config = ModelConfig.from_preset(cfg.preset, vocab_size=tokenizer.vocab_size, max_seq_len=max(cfg.context, 1), dropout=cfg.dropout)
        state = None

    torch.manual_seed(cfg.seed)
    model = Transformer(config).to(cfg.device)
    optimizer = make_optimizer(model, cfg)
    batch_rng = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, Any]] = []
    step, window_loss, window_steps = 0, 0.0, 0  # the window: train losses since the last log row
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batch_rng.set_state(state["batch_rng"])
        torch.set_rng_state(state["torch_rng"])
        history, step = state["history"], state["step"]
        window_loss, window_steps = state.get("window", (0.0, 0))
    if step >= cfg.max_steps:
        raise DecoderLMError(f"{out} is already at step {step}; pass a larger --max-steps to train further")

    def save_state() -> None:
        checkpoint.save(out, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "batch_rng": batch_rng.get_state(), "torch_rng": torch.get_rng_state(),
            "config": config.to_dict(), "tokenizer": tokenizer.to_dict(),
            "train_config": dataclasses.asdict(cfg), "history": history, "window": (window_loss, window_steps),
        })
        write_logs(out, history)

    model.train()
    tokens_per_step = cfg.batch_size * cfg.context
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    t0 = started = time.perf_counter()
    while step < cfg.max_steps:
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, cfg.batch_size, cfg.context, batch_rng)
        loss = lm_loss(model(x.to(cfg.device)).logits, y.to(cfg.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        window_loss, window_steps = window_loss + loss.item(), window_steps + 1
        bar.update(1)
        last = step == cfg.max_steps
        if step % cfg.log_interval == 0 or last:
            elapsed = time.perf_counter() - t0
            tok_s = window_steps * tokens_per_step / elapsed
            row = {"step": step, "train_loss": window_loss / window_steps, "lr": lr, "tokens_per_s": tok_s, "val_loss": None}
            if step % cfg.eval_interval == 0 or last:
                row["val_loss"] = evaluate(model, val_data, cfg)
            history.append(row)
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", val=f"{row['val_loss']:.3f}" if row["val_loss"] else "-", tok_s=f"{tok_s:,.0f}")
            window_loss, window_steps = 0.0, 0
            if row["val_loss"] is not None:
                save_state()
            t0 = time.perf_counter()
        if step == cfg.stop_after and not last:
            save_state()
            break
    bar.close()
    vals = [r["val_loss"] for r in history if r["val_loss"] is not None]
    speeds = [r["tokens_per_s"] for r in history]
    return {"step": step, "val_loss": vals[-1] if vals else None, "seconds": time.perf_counter() - started,
            "tokens_per_s": float(np.median(speeds)) if speeds else None, "out": str(out), "model": model.eval(), "tokenizer": tokenizer}


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
