"""`finetune(cfg)`: SFT or DPO of a pretrained model on the training loop (`decoderlm.train.trainer.fit`).

The data are read and checked, then tokenized once; an eval split is held out. The method is an
`Objective` (decoderlm.finetune.objectives) run by pretraining's loop, which writes the model out
(an `ExportSaver`) wherever pretraining would save a checkpoint.
The run folder is a model any command loads: an HF folder after full fine-tuning, or a PEFT adapter
(adapter_config.json names the base) after LoRA, which `load` merges into the base; beside it,
finetune_state.pt lets a stopped run continue (`--resume`, see decoderlm.finetune.resume).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from decoderlm.device import resolve_device
from decoderlm.errors import DecoderLMError
from decoderlm.finetune import resume
from decoderlm.finetune.data import as_messages, check_chat, check_pair, read_jsonl
from decoderlm.finetune.dpo import encode_pair
from decoderlm.finetune.objectives import DPOObjective, SFTObjective, frozen_copy
from decoderlm.finetune.sft import check_chat_tokenizer, encode_chat, pack
from decoderlm.formats.hf import save_hf
from decoderlm.formats.peft import save_adapter
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.model.lora import apply_lora
from decoderlm.model.transformer import IGNORE_INDEX
from decoderlm.names import KNOWN
from decoderlm.train.config import FIELDS, TRAIN_SEED, TrainConfig, validate
from decoderlm.train.distributed import World
from decoderlm.train.saver import ExportSaver
from decoderlm.train.trainer import evaluate, fit, objective_metrics

METHODS = ("sft", "dpo")


@dataclass
class FinetuneConfig:
    """Fine-tuning settings. A field left None was not given: a new run takes DEFAULTS or derives it from
    the data (max_steps, lr, warmup, lora_alpha, eval_interval); --resume keeps the run's (see `resume`)."""

    model: str | None = None
    data: str | None = None
    out: str | None = None
    method: str = "sft"
    resume: bool = False
    epochs: int | None = None
    max_steps: int | None = None  # default: epochs × batches per epoch
    stop_after: int | None = None  # stop after this step, to --resume later
    lr: float | None = None  # default: 2e-5 full, 2e-4 LoRA (DPO: a tenth of these)
    batch_size: int | None = None
    max_length: int | None = None
    packing: bool = False
    lora_rank: int | None = None  # 0: full fine-tuning
    lora_alpha: float | None = None  # default: 2 × rank
    lora_targets: str | None = None
    lora_dropout: float | None = None
    beta: float | None = None  # DPO's β
    scheduled_sampling: float | None = None  # SFT: the largest share of reply tokens replaced by the model's predictions
    warmup: int | None = None  # default: a tenth of the steps, at most 100
    eval_fraction: float | None = None
    eval_interval: int | None = None  # default: once per epoch
    log_interval: int | None = None
    skip_bad_lines: bool = False
    seed: int | None = None
    device: str | None = None
    threads: int | None = None


DEFAULTS = {"epochs": 1, "batch_size": 8, "max_length": 512, "lora_rank": 0, "lora_targets": "q_proj,v_proj", "lora_dropout": 0.0,
            "beta": 0.1, "scheduled_sampling": 0.0, "eval_fraction": 0.1, "log_interval": 10, "seed": TRAIN_SEED, "device": "cpu"}


def check(cfg: FinetuneConfig) -> None:
    """Settings refused before any data or model is read."""
    if cfg.method not in METHODS:
        raise DecoderLMError(f"method {cfg.method!r} is not one of {', '.join(METHODS)}")
    for name in ("epochs", "batch_size", "max_length", "log_interval", "max_steps", "stop_after", "eval_interval", "threads"):
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


def resolve_new(cfg: FinetuneConfig) -> FinetuneConfig:
    """A new run's settings: given, else DEFAULTS; the model and data named as resume will compare them."""
    if cfg.model is None or cfg.data is None:
        raise DecoderLMError("--model and --data are required to start a run (or --resume to continue the one in --out)")
    given = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None}
    cfg = FinetuneConfig(**DEFAULTS | given)
    out = Path(cfg.out)
    if out.is_dir() and any(out.iterdir()):
        raise DecoderLMError(f"--out {out} is not empty; choose a new or empty folder, or pass --resume to continue its run")
    return dataclasses.replace(cfg, model=base_name(cfg.model), data=str(Path(cfg.data).resolve()) if Path(cfg.data).exists() else cfg.data)


def derive(cfg: FinetuneConfig, per_epoch: int) -> FinetuneConfig:
    """A new run's settings that depend on the data and on each other, made explicit so --resume keeps them."""
    max_steps = cfg.max_steps or cfg.epochs * per_epoch
    return dataclasses.replace(
        cfg, max_steps=max_steps, eval_interval=cfg.eval_interval or per_epoch,
        lr=cfg.lr if cfg.lr is not None else (2e-4 if cfg.lora_rank else 2e-5) / (10 if cfg.method == "dpo" else 1),
        warmup=cfg.warmup if cfg.warmup is not None else min(100, max_steps // 10),
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None or not cfg.lora_rank else 2 * cfg.lora_rank)


def loop_config(cfg: FinetuneConfig, decay_steps: int) -> TrainConfig:
    """The loop's settings: the optimizer, schedule and intervals fine-tuning chose; the rest are the fields' defaults."""
    defaults = {name: f.metadata["default"] for name, f in FIELDS.items()} | {"preset": None}
    chosen = {
        "data": cfg.data, "out": cfg.out, "max_steps": cfg.max_steps, "decay_steps": decay_steps, "stop_after": cfg.stop_after,
        "batch_size": cfg.batch_size, "context": cfg.max_length, "lr": cfg.lr, "min_lr": cfg.lr / 10, "warmup": cfg.warmup,
        "weight_decay": 0.0, "beta2": 0.999, "dropout": 0.0, "seed": cfg.seed, "eval_interval": cfg.eval_interval,
        "log_interval": cfg.log_interval, "device": cfg.device, "threads": cfg.threads, "scheduled_sampling": cfg.scheduled_sampling,
    }
    return validate(TrainConfig(**defaults | chosen))


def split(items: list, fraction: float, seed: int, key: Callable[[Any], Hashable] | None = None) -> tuple[list, list]:
    """(train, eval): a seeded shuffle, then the eval share (at least one item when fraction > 0). Items with
    the same `key` (DPO: one prompt's pairs) fall on one side, so no held-out item repeats a trained one's key."""
    groups: dict[Hashable, list] = {}
    for i, item in enumerate(items):
        groups.setdefault(i if key is None else key(item), []).append(item)
    grouped = list(groups.values())
    order = torch.randperm(len(grouped), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = max(1, round(len(items) * fraction)) if fraction > 0 and len(grouped) > 1 else 0
    train, held_out = [], []
    for i in order:
        (held_out if len(held_out) < n_eval else train).extend(grouped[i])
    return train, held_out


def base_name(source: str) -> str:
    """How adapter_config.json names the base: a known name as is, a path made absolute."""
    return source if source in KNOWN and not Path(source).exists() else str(Path(source).resolve())


def trainable_summary(model: Transformer) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)"


def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    """Run SFT or DPO as `cfg` says, or continue the run in cfg.out (cfg.resume); return the fit summary
    plus the held-out metrics."""
    if cfg.out is None:
        raise DecoderLMError("--out is required: the run folder to write (or, with --resume, to continue)")
    state, notes = None, []
    if cfg.resume:
        state = resume.read_state(cfg.out)
        cfg, notes = resume.resolve_resume(cfg, FinetuneConfig(**state["settings"]), state["step"])
    else:
        cfg = resolve_new(cfg)
    check(cfg)
    records = [r for _, r in read_jsonl(cfg.data, check_chat if cfg.method == "sft" else check_pair, cfg.skip_bad_lines)]
    digest = resume.file_digest(cfg.data)
    if state is not None and digest != state["data_sha256"]:
        raise DecoderLMError(f"{cfg.data} changed since the run started, and --resume continues on the same data; "
                             "restore it, or start a new run with another --out")
    for note in notes:
        print(note, file=sys.stderr)
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
    train_items, eval_items = split(usable, cfg.eval_fraction, cfg.seed, None if cfg.method == "sft" else lambda pair: pair.prompt)
    if not train_items:
        raise DecoderLMError(f"{cfg.data}: no records left to train on; give more data or a smaller --eval-fraction")
    n_rows = len(pack([len(ex.ids) for ex in train_items], cfg.max_length)) if cfg.method == "sft" and cfg.packing else len(train_items)
    per_epoch = math.ceil(n_rows / cfg.batch_size)
    if state is None:
        cfg = derive(cfg, per_epoch)
    torch.manual_seed(cfg.seed)
    if cfg.lora_rank:
        targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha, targets, cfg.lora_dropout)
    print(trainable_summary(model))
    device = resolve_device(cfg.device)
    model.to(device)

    loop = loop_config(cfg, state["decay_steps"] if state is not None else cfg.max_steps)
    if cfg.method == "sft":
        objective: SFTObjective | DPOObjective = SFTObjective(train_items, eval_items, loop, pad_id, cfg.packing, device)
    else:  # the reference is the starting model, taken before a resumed run's weights are loaded
        objective = DPOObjective(train_items, eval_items, loop, pad_id, cfg.beta, None if cfg.lora_rank else frozen_copy(model), device)

    if state is None:
        before = evaluate(model, objective, loop, device, World())
        objective_metrics(model, objective, loop, device)  # DPO: the rewards before training, its first `evaluations` row
    else:
        resume.load_trainable(model, {k: v.to(device) for k, v in state["trainable"].items()}, Path(cfg.out))
        before = state["eval_loss_before"]
        if isinstance(objective, DPOObjective):
            objective.evaluations = state["evaluations"]
    print(f"{len(train_items)} train / {len(eval_items)} eval records; {per_epoch} steps per epoch, {cfg.max_steps} steps"
          + (f"; eval loss before: {before:.4f}" if eval_items else "")
          + (f"; resuming at step {state['step']}" if state is not None else ""))

    out = Path(cfg.out)

    def export(model: Transformer, out: Path, progress: dict[str, Any]) -> None:
        """The model any command loads, then what --resume needs besides it."""
        out.mkdir(parents=True, exist_ok=True)
        if cfg.lora_rank:
            save_adapter(model, out, cfg.model)
            tokenizer.save(out)
        else:
            save_hf(model, tokenizer, out)
        resume.save_state(out, progress | {
            "trainable": {k: v.cpu() for k, v in resume.trainable_state(model).items()}, "settings": dataclasses.asdict(cfg),
            "decay_steps": loop.decay_steps, "data_sha256": digest, "eval_loss_before": before,
            "evaluations": objective.evaluations if isinstance(objective, DPOObjective) else []})

    continued = {**state, "model": model.state_dict()} if state is not None else {}
    result = fit(model, objective, loop, out, continued, tokenizer, device=device, saver=ExportSaver(export, out))
    summary = {"settings": dataclasses.asdict(cfg), "step": result["step"], "eval_loss_before": before}
    if isinstance(objective, DPOObjective):
        summary["eval"] = objective.evaluations  # before training, then at each evaluation
    (out / "finetune.json").write_text(json.dumps(summary, indent=1) + "\n")
    return result | summary | {"out": str(out)}
