"""What one training step trains on and how its loss is computed: the seam between pretraining and
fine-tuning. The loop in `decoderlm.train.trainer.fit` takes any `Objective`; `LMObjective` is
pretraining's (random windows of a token split, next-token loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from decoderlm.model.transformer import IGNORE_INDEX, lm_loss
from decoderlm.train.config import TrainConfig
from decoderlm.train.data import EVAL_BATCH, Split, eval_windows, read_windows, window_starts
from decoderlm.train.distributed import World
from decoderlm.train.scheduled_sampling import ScheduledSampling

Batch = Any


class Objective(Protocol):
    """What one optimizer step trains on and how its loss is computed: the seam between pretraining and
    fine-tuning. The loop calls `batches` once per step, `loss` on each micro-batch (under autocast),
    and `val_batches` to evaluate; its RNG state is checkpointed so resume stays exact.

    An objective may also define `metrics(model) -> dict[str, float]`: numbers of its own on the
    held-out data (DPO's rewards and margin), computed after each evaluation and logged beside val_loss."""

    def batches(self) -> list[Batch]:
        """This process's micro-batches (grad_accum of them) for the next optimizer step."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        """(mean loss over the batch, how many targets it averages over)."""
        ...

    def val_batches(self) -> Iterator[Batch]:
        """This process's share of the val batches."""
        ...

    def rng_state(self) -> dict[str, torch.Tensor]: ...

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None: ...


class LMObjective:
    """Next-token prediction on random windows. Every process draws the same global batch of window
    starts (one generator, seeded alike) and reads only its own slice: micro-batch m of rank r is
    windows [(m·world + r)·B, +B), so N processes train on exactly what one process with batch N·B would.
    With --scheduled-sampling, training inputs are partly the model's own predictions (see
    decoderlm.train.scheduled_sampling); evaluation stays teacher-forced."""

    def __init__(self, train: Split, val: Split, cfg: TrainConfig, world: World, device: torch.device) -> None:
        self.train, self.val, self.cfg, self.world, self.device = train, val, cfg, world, device
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.sampling = ScheduledSampling(cfg.scheduled_sampling, cfg.decay_steps, cfg.seed + 1) if cfg.scheduled_sampling else None

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        B, world = self.cfg.batch_size, self.world
        if self.sampling is not None:
            self.sampling.start_step()
        starts = window_starts(self.train, B * self.cfg.grad_accum * world.size, self.cfg.context, self.generator)
        mine = [starts[(m * world.size + world.rank) * B :][:B] for m in range(self.cfg.grad_accum)]
        return [read_windows(self.train, part, self.cfg.context) for part in mine]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch[0].to(self.device), batch[1].to(self.device)
        if self.sampling is not None and model.training:
            x = self.sampling.mix(x, y, lambda ids: model(ids).logits)
        return lm_loss(model(x).logits, y), int((y != IGNORE_INDEX).sum())

    def val_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each val batch's rows dealt out over the processes, so every process runs the same number of
        forwards (FSDP gathers weights in each); a process left without rows runs one row that counts for nothing."""
        rank, size = self.world.rank, self.world.size
        for i, (x, y) in enumerate(eval_windows(self.val, self.cfg.context, EVAL_BATCH)):
            if self.cfg.eval_batches is not None and i >= self.cfg.eval_batches:
                break
            if len(x) <= rank:
                yield x[:1], torch.full_like(y[:1], IGNORE_INDEX)
            else:
                yield x[rank::size], y[rank::size]

    def rng_state(self) -> dict[str, torch.Tensor]:
        return {"batch": self.generator.get_state()} | (self.sampling.state() if self.sampling is not None else {})

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["batch"])
        if self.sampling is not None:
            self.sampling.set_state(state)
