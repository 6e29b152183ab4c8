"""`finetune(cfg)`: SFT or DPO of a pretrained model on the training loop (`decoderlm.train.trainer.fit`).

The data are read and checked, then tokenized once; an eval split is held out. The method is an
`Objective` (decoderlm.finetune.objectives) run by pretraining's loop, which writes the model out
(`fit`'s export) wherever pretraining would save a checkpoint.
The run folder is a model any command loads: an HF folder after full fine-tuning, or a PEFT adapter
(adapter_config.json names the base) after LoRA, which `load` merges into the base.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decoderlm.device import resolve_device
from decoderlm.errors import DecoderLMError
from decoderlm.finetune.data import as_messages, check_chat, check_pair, read_jsonl
from decoderlm.finetune.dpo import encode_pair
from decoderlm.finetune.lora import apply_lora, save_adapter, trainable_summary
from decoderlm.finetune.objectives import DPOObjective, SFTObjective, frozen_copy
from decoderlm.finetune.sft import check_chat_tokenizer, encode_chat, pack
from decoderlm.formats.hf import save_hf
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.model.transformer import IGNORE_INDEX
from decoderlm.names import KNOWN
from decoderlm.train.config import FIELDS, TRAIN_SEED, TrainConfig, validate
from decoderlm.train.distributed import World
from decoderlm.train.trainer import evaluate, fit, objective_metrics

METHODS = ("sft", "dpo")


@dataclass
class FinetuneConfig:
    model: str
    data: str
    out: str
    method: str = "sft"
    epochs: int = 1
    max_steps: int | None = None  # default: epochs × batches per epoch
    lr: float | None = None  # default: 2e-5 full, 2e-4 LoRA (DPO: a tenth of these)
    batch_size: int = 8
    max_length: int = 512
    packing: bool = False
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float | None = None  # default: 2 × rank
    lora_targets: str = "q_proj,v_proj"
    lora_dropout: float = 0.0
    beta: float = 0.1  # DPO's β
    scheduled_sampling: float = 0.0  # SFT: the largest share of reply tokens replaced by the model's predictions
    warmup: int | None = None  # default: a tenth of the steps, at most 100
    eval_fraction: float = 0.1
    eval_interval: int | None = None  # default: once per epoch
    log_interval: int = 10
    skip_bad_lines: bool = False
    seed: int = TRAIN_SEED
    device: str = "cpu"
    threads: int | None = None


def check(cfg: FinetuneConfig) -> None:
    """Settings refused before any data or model is read."""
    if cfg.method not in METHODS:
        raise DecoderLMError(f"method {cfg.method!r} is not one of {', '.join(METHODS)}")
    for name in ("epochs", "batch_size", "max_length", "log_interval", "max_steps", "eval_interval", "threads"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise DecoderLMError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not isinstance(cfg.lora_rank, int) or cfg.lora_rank < 0:
        raise DecoderLMError(f"--lora-rank must be an integer >= 0 (0 = full fine-tuning), got {cfg.lora_rank}")
    if not 0 <= cfg.lora_dropout < 1:
        raise DecoderLMError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise DecoderLMError(f"--lora-alpha must be positive, got {cfg.lora_alpha}")
    if not 0 <= cfg.eval_fraction < 1:
        raise DecoderLMError(f"--eval-fraction must be in [0, 1), got {cfg.eval_fraction}")
    if not 0 <= cfg.scheduled_sampling <= 1:
        raise DecoderLMError(f"--scheduled-sampling must be in [0, 1], got {cfg.scheduled_sampling}")
    if cfg.method == "dpo" and cfg.scheduled_sampling:
        raise DecoderLMError("--scheduled-sampling applies to sft (and train), not dpo; drop it")
    if not cfg.beta > 0:
        raise DecoderLMError(f"--beta must be positive, got {cfg.beta}")
    resolve_device(cfg.device)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise DecoderLMError(f"--out {out} is a file; give a folder for the run")
    if out.is_dir() and any(out.iterdir()):
        raise DecoderLMError(f"--out {out} is not empty; choose a new or empty folder")


def loop_config(cfg: FinetuneConfig, max_steps: int, eval_interval: int) -> TrainConfig:
    """The loop's settings: the optimizer, schedule and intervals fine-tuning chooses; the rest are the fields' defaults."""
    lr = cfg.lr if cfg.lr is not None else (2e-4 if cfg.lora_rank else 2e-5) / (10 if cfg.method == "dpo" else 1)
    warmup = cfg.warmup if cfg.warmup is not None else min(100, max_steps // 10)
    defaults = {name: f.metadata["default"] for name, f in FIELDS.items()} | {"preset": None}
    chosen = {
        "data": cfg.data, "out": cfg.out, "max_steps": max_steps, "decay_steps": max_steps, "batch_size": cfg.batch_size,
        "context": cfg.max_length, "lr": lr, "min_lr": lr / 10, "warmup": warmup, "weight_decay": 0.0, "beta2": 0.999,
        "dropout": 0.0, "seed": cfg.seed, "eval_interval": eval_interval, "log_interval": cfg.log_interval,
        "device": cfg.device, "threads": cfg.threads, "scheduled_sampling": cfg.scheduled_sampling,
    }
    return validate(TrainConfig(**defaults | chosen))


def split(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded shuffle, then the eval share (at least one item when fraction > 0)."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(len(items) * fraction)) if fraction > 0 and len(items) > 1 else 0
    return [items[i] for i in order[n_eval:]], [items[i] for i in order[:n_eval]]


def base_name(source: str) -> str:
    """How adapter_config.json names the base: a known name as is, a path made absolute."""
    return source if source in KNOWN and not Path(source).exists() else str(Path(source).resolve())


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run SFT or DPO as `cfg` says; return the fit summary plus the held-out metrics."""
    check(cfg)
    records = [r for _, r in read_jsonl(cfg.data, check_chat if cfg.method == "sft" else check_pair, cfg.skip_bad_lines)]
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, tokenizer = load(cfg.model, fuse=False)  # LoRA wraps q_proj, v_proj, ... by name
    check_chat_tokenizer(tokenizer)
    pad_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
    if cfg.method == "sft":
        items: list = [encode_chat(tokenizer, as_messages(r), cfg.max_length) for r in records]
        usable = [ex for ex in items if any(t != IGNORE_INDEX for t in ex.labels)]
    else:
        items = [encode_pair(tokenizer, r, cfg.max_length) for r in records]
        usable = [p for p in items if all(any(t != IGNORE_INDEX for t in ex.labels) for ex in (p.chosen, p.rejected))]
    if len(usable) < len(items):
        print(f"warning: {len(items) - len(usable)} record(s) have no reply tokens within --max-length {cfg.max_length}; "
              "they are left out", file=sys.stderr)
    train_items, eval_items = split(usable, cfg.eval_fraction, cfg.seed)
    if not train_items:
        raise DecoderLMError(f"{cfg.data}: no records left to train on; give more data or a smaller --eval-fraction")
    torch.manual_seed(cfg.seed)
    if cfg.lora_rank:
        targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank, targets, cfg.lora_dropout)
    print(trainable_summary(model))
    device = resolve_device(cfg.device)
    model.to(device)

    n_rows = len(pack([len(ex.ids) for ex in train_items], cfg.max_length)) if cfg.method == "sft" and cfg.packing else len(train_items)
    per_epoch = math.ceil(n_rows / cfg.batch_size)
    max_steps = cfg.max_steps or cfg.epochs * per_epoch
    loop = loop_config(cfg, max_steps, cfg.eval_interval or per_epoch)
    if cfg.method == "sft":
        objective: SFTObjective | DPOObjective = SFTObjective(train_items, eval_items, loop, pad_id, cfg.packing, device)
    else:
        objective = DPOObjective(train_items, eval_items, loop, pad_id, cfg.beta, None if cfg.lora_rank else frozen_copy(model), device)

    before = evaluate(model, objective, loop, device, World())
    objective_metrics(model, objective, loop, device)  # DPO: the rewards before training, its first `evaluations` row
    print(f"{len(train_items)} train / {len(eval_items)} eval records; {per_epoch} steps per epoch, {max_steps} steps"
          + (f"; eval loss before: {before:.4f}" if eval_items else ""))

    out = Path(cfg.out)

    def export(model: Transformer, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.lora_rank:
            save_adapter(model, out, base_name(cfg.model))
            tokenizer.save(out)
        else:
            save_hf(model, tokenizer, out)

    result = fit(model, objective, loop, out, {}, tokenizer, device=device, export=export)
    summary = {"settings": dataclasses.asdict(cfg), "step": result["step"], "eval_loss_before": before}
    if isinstance(objective, DPOObjective):
        summary["eval"] = objective.evaluations  # before training, then at each evaluation
    (out / "finetune.json").write_text(json.dumps(summary, indent=1) + "\n")
    return result | summary | {"out": str(out)}
