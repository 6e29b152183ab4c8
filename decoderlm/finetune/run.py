"""`finetune(cfg)`: SFT or DPO of a pretrained model on the training loop (`decoderlm.train.trainer.fit`).

The data are read and checked, then tokenized once; an eval split is held out. Each step's batch is
drawn from a per-epoch shuffle seeded by (seed, epoch), so the order depends on nothing but the step.
The run folder is a model any command loads: an HF folder after full fine-tuning, or a PEFT adapter
(adapter_config.json names the base) after LoRA, which `load` merges into the base.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.finetune.data import as_messages, check_chat, check_pair, read_jsonl
from decoderlm.finetune.dpo import Pair, dpo_loss, encode_pair, pair_batch, sequence_logprobs
from decoderlm.finetune.lora import apply_lora, save_adapter, set_lora_enabled, trainable_summary
from decoderlm.finetune.sft import Batch, Example, check_chat_tokenizer, collate, encode_chat, pack, sft_loss
from decoderlm.formats.hf import save_hf
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.model.transformer import IGNORE_INDEX
from decoderlm.names import KNOWN
from decoderlm.train.config import TrainConfig, check_device, validate
from decoderlm.train.trainer import fit, write_logs

METHODS = ("sft", "dpo")
LOG_FILES = ("log.csv", "log.json", "loss.png", "finetune.json")


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
    warmup: int | None = None  # default: a tenth of the steps, at most 100
    eval_fraction: float = 0.1
    eval_interval: int | None = None  # default: once per epoch
    log_interval: int = 10
    skip_bad_lines: bool = False
    seed: int = 0
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
    if not cfg.beta > 0:
        raise DecoderLMError(f"--beta must be positive, got {cfg.beta}")
    check_device(cfg.device)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise DecoderLMError(f"--out {out} is a file; give a folder for the run")
    if out.is_dir() and any(out.iterdir()):
        raise DecoderLMError(f"--out {out} is not empty; choose a new or empty folder")


def loop_config(cfg: FinetuneConfig, max_steps: int, eval_interval: int) -> TrainConfig:
    """The loop's settings. fit reads only optimizer, schedule and interval fields (preset is unused)."""
    lr = cfg.lr if cfg.lr is not None else (2e-4 if cfg.lora_rank else 2e-5) / (10 if cfg.method == "dpo" else 1)
    warmup = cfg.warmup if cfg.warmup is not None else min(100, max_steps // 10)
    return validate(TrainConfig(
        data=cfg.data, out=cfg.out, preset="seed-char", max_steps=max_steps, decay_steps=max_steps, batch_size=cfg.batch_size,
        context=cfg.max_length, lr=lr, min_lr=lr / 10, warmup=warmup, weight_decay=0.0, beta1=0.9, beta2=0.999, grad_clip=1.0,
        dropout=0.0, seed=cfg.seed, eval_interval=eval_interval, log_interval=cfg.log_interval, device=cfg.device, threads=cfg.threads,
    ))


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
    model, tokenizer = load(cfg.model)
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
    device = torch.device(cfg.device)
    model.to(device)

    task = (sft_task if cfg.method == "sft" else dpo_task)(model, train_items, eval_items, cfg, pad_id)
    rows = task.rows
    per_epoch = math.ceil(len(rows) / cfg.batch_size)
    max_steps = cfg.max_steps or cfg.epochs * per_epoch
    loop = loop_config(cfg, max_steps, cfg.eval_interval or per_epoch)

    def step_loss(step: int, _rng: torch.Generator) -> torch.Tensor:
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)).tolist()
        return task.batch_loss([rows[r] for r in order[k * cfg.batch_size : (k + 1) * cfg.batch_size]])

    out = Path(cfg.out)
    evaluate = task.evaluate if eval_items else (lambda: float("nan"))
    before = evaluate()
    print(f"{len(train_items)} train / {len(eval_items)} eval records; {per_epoch} steps per epoch, {max_steps} steps"
          + (f"; eval loss before: {before:.4f}" if eval_items else ""))

    def save(loop_state: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.lora_rank:
            save_adapter(model, out, base_name(cfg.model))
            tokenizer.save(out)
        else:
            save_hf(model, tokenizer, out)
        write_logs(out, loop_state["history"])
        summary = {"settings": dataclasses.asdict(cfg), "step": loop_state["step"], "eval_loss_before": before}
        if cfg.method == "dpo":
            summary["eval"] = task.eval_history
        (out / "finetune.json").write_text(json.dumps(summary, indent=1) + "\n")

    result = fit(model, loop, step_loss, evaluate, save, int(task.tokens / len(rows) * cfg.batch_size))
    result |= {"eval_loss_before": before, "out": str(out)}
    if cfg.method == "dpo":
        result["eval"] = task.eval_history
    return result


@dataclass
class Task:
    """What SFT or DPO makes of the loop: rows of items, a batch's loss, the held-out evaluation."""

    rows: list[list[int]]  # indices into the train items; one row of a batch each
    batch_loss: Callable[[list[list[int]]], torch.Tensor]  # the rows of one batch -> loss
    evaluate: Callable[[], float]
    tokens: int  # in all rows, for the tokens/s figure
    eval_history: list[dict[str, float]] = dataclasses.field(default_factory=list)


def sft_task(model: Transformer, train: list[Example], held_out: list[Example], cfg: FinetuneConfig, pad_id: int) -> Task:
    device = torch.device(cfg.device)
    rows = pack([len(ex.ids) for ex in train], cfg.max_length) if cfg.packing else [[i] for i in range(len(train))]
    return Task(rows, lambda picked: sft_loss(model, collate(train, picked, pad_id).to(device)),
                lambda: sft_eval_loss(model, held_out, cfg.batch_size, pad_id, device), sum(len(ex.ids) for ex in train))


def dpo_task(model: Transformer, train: list[Pair], held_out: list[Pair], cfg: FinetuneConfig, pad_id: int) -> Task:
    device, lora = torch.device(cfg.device), cfg.lora_rank > 0
    reference = reference_model(model, lora)
    history: list[dict[str, float]] = []
    return Task([[i] for i in range(len(train))],
                lambda picked: dpo_step(model, reference, pair_batch([train[i] for (i,) in picked], pad_id).to(device),
                                        cfg.beta, lora).loss,
                lambda: dpo_eval(model, reference, held_out, cfg, pad_id, history),
                sum(len(p.chosen.ids) + len(p.rejected.ids) for p in train), history)


@torch.no_grad()
def sft_eval_loss(model: Transformer, examples: list[Example], batch_size: int, pad_id: int, device: torch.device) -> float:
    """Mean loss per reply token over the held-out conversations."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples, [[j] for j in range(i, min(i + batch_size, len(examples)))], pad_id).to(device)
        n = int((batch.targets != IGNORE_INDEX).sum())
        total, count = total + sft_loss(model, batch).item() * n, count + n
    return total / count


def reference_model(model: Transformer, lora: bool) -> Transformer | None:
    """DPO's frozen reference: the base itself with adapters switched off (LoRA), else a frozen copy."""
    if lora:
        return None
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def dpo_step(model: Transformer, reference: Transformer | None, batch: Batch, beta: float, lora: bool):
    with torch.no_grad():
        if lora:
            set_lora_enabled(model, False)
        ref = sequence_logprobs(reference if reference is not None else model, batch)
        set_lora_enabled(model, True)
    return dpo_loss(sequence_logprobs(model, batch), ref, beta)


@torch.no_grad()
def dpo_eval(model: Transformer, reference: Transformer | None, pairs: list[Pair], cfg: FinetuneConfig, pad_id: int,
             history: list[dict[str, float]]) -> float:
    """Held-out DPO loss; rewards, margin and accuracy are appended to `history` and printed."""
    model.eval()
    device = torch.device(cfg.device)
    stats = [dpo_step(model, reference, pair_batch(pairs[i : i + cfg.batch_size], pad_id).to(device), cfg.beta, cfg.lora_rank > 0)
             for i in range(0, len(pairs), cfg.batch_size)]
    sizes = [len(pairs[i : i + cfg.batch_size]) for i in range(0, len(pairs), cfg.batch_size)]
    mean = lambda f: sum(f(s) * n for s, n in zip(stats, sizes)) / len(pairs)
    row = {"loss": mean(lambda s: s.loss.item()), "chosen_reward": mean(lambda s: s.chosen_reward),
           "rejected_reward": mean(lambda s: s.rejected_reward), "margin": mean(lambda s: s.margin), "accuracy": mean(lambda s: s.accuracy)}
    history.append(row)
    print("eval: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()), file=sys.stderr)
    return row["loss"]
