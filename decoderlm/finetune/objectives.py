"""SFT and DPO as `Objective`s of the one training loop (`decoderlm.train.trainer.fit`): what a step
trains on and how its loss is computed; the loop, optimizer, schedule and logs are pretraining's.

Rows are drawn from a per-epoch shuffle seeded by (seed, epoch), so which rows a step trains on depends
on nothing but the step; the step count is the objective's whole random state.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
from collections.abc import Iterator

import torch
from torch import nn

from decoderlm.finetune.dpo import DPOStats, Pair, dpo_loss, pair_batch, sequence_logprobs
from decoderlm.finetune.sft import Batch, Example, batch_logits, collate, pack, sft_loss
from decoderlm.model import Transformer
from decoderlm.model.lora import set_lora_enabled
from decoderlm.model.transformer import IGNORE_INDEX
from decoderlm.train.config import TrainConfig
from decoderlm.train.scheduled_sampling import ScheduledSampling


class EpochRows:
    """batch_size rows per draw from a shuffle of all rows redrawn each epoch; an epoch's last batch is
    shorter when the rows do not divide evenly."""

    def __init__(self, n_rows: int, batch_size: int, seed: int) -> None:
        self.n_rows, self.batch_size, self.seed = n_rows, batch_size, seed
        self.per_epoch = math.ceil(n_rows / batch_size)
        self.draws = 0

    def next(self) -> list[int]:
        epoch, k = divmod(self.draws, self.per_epoch)
        order = torch.randperm(self.n_rows, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)).tolist()
        self.draws += 1
        return order[k * self.batch_size : (k + 1) * self.batch_size]

    def state(self) -> dict[str, torch.Tensor]:
        return {"draws": torch.tensor(self.draws)}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.draws = int(state["draws"])


class SFTObjective:
    """Next-token loss on the tokens of assistant replies (labels are -100 everywhere else), over padded
    rows of one conversation each or, with packing, rows of several that do not attend to each other.
    With scheduled sampling, reply tokens are partly the model's own predictions while training."""

    def __init__(self, train: list[Example], held_out: list[Example], cfg: TrainConfig, pad_id: int, packing: bool,
                 device: torch.device) -> None:
        self.train, self.held_out, self.cfg, self.pad_id, self.device = train, held_out, cfg, pad_id, device
        self.rows = pack([len(ex.ids) for ex in train], cfg.context) if packing else [[i] for i in range(len(train))]
        self.sampler = EpochRows(len(self.rows), cfg.batch_size, cfg.seed)
        self.sampling = ScheduledSampling(cfg.scheduled_sampling, cfg.decay_steps, cfg.seed + 1) if cfg.scheduled_sampling else None

    def batches(self) -> list[Batch]:
        if self.sampling is not None:
            self.sampling.start_step()
        return [collate(self.train, [self.rows[r] for r in self.sampler.next()], self.pad_id) for _ in range(self.cfg.grad_accum)]

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        batch = batch.to(self.device)
        if self.sampling is not None and model.training:
            mixed = self.sampling.mix(batch.input_ids, batch.targets,
                                      lambda ids: batch_logits(model, dataclasses.replace(batch, input_ids=ids)))
            batch = dataclasses.replace(batch, input_ids=mixed)
        return sft_loss(model, batch), int((batch.targets != IGNORE_INDEX).sum())

    def val_batches(self) -> Iterator[Batch]:
        B = self.cfg.batch_size
        for i in range(0, len(self.held_out), B):
            yield collate(self.held_out, [[j] for j in range(i, min(i + B, len(self.held_out)))], self.pad_id)

    def rng_state(self) -> dict[str, torch.Tensor]:
        return self.sampler.state() | (self.sampling.state() if self.sampling is not None else {})

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.sampler.set_state(state)
        if self.sampling is not None:
            self.sampling.set_state(state)


def frozen_copy(model: Transformer) -> Transformer:
    """DPO's reference for full fine-tuning: the starting model, frozen. (With LoRA the reference is the
    policy itself with its adapters switched off, so no second copy is held.)"""
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


class DPOObjective:
    """DPO's loss on preference pairs against a frozen reference: `reference`, or (None) the policy with
    its LoRA adapters disabled. A micro-batch is B pairs; its loss averages over pairs, so n counts pairs."""

    def __init__(self, train: list[Pair], held_out: list[Pair], cfg: TrainConfig, pad_id: int, beta: float,
                 reference: Transformer | None, device: torch.device) -> None:
        self.train, self.held_out, self.cfg, self.pad_id, self.device = train, held_out, cfg, pad_id, device
        self.beta, self.reference = beta, reference
        self.evaluations: list[dict[str, float]] = []  # each `metrics` call's row, the loss included
        self.sampler = EpochRows(len(train), cfg.batch_size, cfg.seed)

    def batches(self) -> list[Batch]:
        return [pair_batch([self.train[i] for i in self.sampler.next()], self.pad_id) for _ in range(self.cfg.grad_accum)]

    def stats(self, model: nn.Module, batch: Batch) -> DPOStats:
        batch = batch.to(self.device)
        with torch.no_grad():
            if self.reference is None:
                set_lora_enabled(model, False)
            reference_logps = sequence_logprobs(self.reference if self.reference is not None else model, batch)
            set_lora_enabled(model, True)
        return dpo_loss(sequence_logprobs(model, batch), reference_logps, self.beta)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        return self.stats(model, batch).loss, batch.input_ids.shape[0] // 2

    def val_batches(self) -> Iterator[Batch]:
        for i in range(0, len(self.held_out), self.cfg.batch_size):
            yield pair_batch(self.held_out[i : i + self.cfg.batch_size], self.pad_id)

    def metrics(self, model: nn.Module) -> dict[str, float]:
        """Held-out rewards, margin and accuracy (means over pairs), printed with the held-out loss."""
        if not self.held_out:
            return {}
        sums = dict.fromkeys(("loss", "chosen_reward", "rejected_reward", "margin", "accuracy"), 0.0)
        for batch in self.val_batches():
            stats, n = self.stats(model, batch), batch.input_ids.shape[0] // 2
            for key in sums:
                value = getattr(stats, key)
                sums[key] += (value.item() if key == "loss" else value) * n
        row = {k: v / len(self.held_out) for k, v in sums.items()}
        print("eval: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()), file=sys.stderr)
        self.evaluations.append(row)
        return {k: v for k, v in row.items() if k != "loss"}  # the loop logs the loss as val_loss

    def rng_state(self) -> dict[str, torch.Tensor]:
        return self.sampler.state()

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.sampler.set_state(state)
