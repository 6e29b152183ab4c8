"""Where `fit` saves a run's progress: a `CheckpointSaver`. Pretraining's `RunFolderSaver` writes ckpt.pt
and best.pt (FSDP: sharded); fine-tuning's `ExportSaver` writes the model itself as the run folder (an HF
folder or a LoRA adapter) with the resume state beside it. The loop calls either the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from torch.optim import Optimizer

from decoderlm.model import Transformer
from decoderlm.formats import runs
from decoderlm.tokenizer import CharTokenizer
from decoderlm.tokenizer.bpe import HFTokenizer
from decoderlm.train import checkpoint
from decoderlm.train.config import TrainConfig
from decoderlm.train.distributed import World
from decoderlm.train.state import TrainState

Export = Callable[[Transformer, Path, dict[str, Any]], None]


class CheckpointSaver(Protocol):
    def save(self, name: str, model: Transformer, optimizer: Optimizer, state: TrainState, rng: dict[str, Any]) -> None:
        """Save as `name` (checkpoint.CKPT_NAME: the last state; BEST_NAME: the best val loss so far).
        Every process calls it; `rng` is every process's RNG states, already gathered."""
        ...


class RunFolderSaver:
    """A pretraining run folder's checkpoints: everything resuming and loading need, in one atomic file
    (under FSDP each process writes its shards first, and the file names their folder)."""

    def __init__(self, out: Path, cfg: TrainConfig, tokenizer: CharTokenizer | HFTokenizer, world: World) -> None:
        self.out, self.cfg, self.tokenizer, self.world = out, cfg, tokenizer, world
        self.sharded = cfg.fsdp and world.distributed

    def save(self, name: str, model: Transformer, optimizer: Optimizer, state: TrainState, rng: dict[str, Any]) -> None:
        weights: dict[str, Any] = (
            {"sharded": checkpoint.save_sharded(self.out, name, state.step, model, optimizer, self.world)} if self.sharded
            else {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        if not self.world.main:
            return
        checkpoint.save(self.out, {
            "model": {}, "optimizer": {}, **weights, "rng": rng, "config": model.config.to_dict(),
            "tokenizer": runs.tokenizer_to_dict(self.tokenizer), "train_config": dataclasses.asdict(self.cfg),
            **state.state_dict(), "world_size": self.world.size,
        }, name)
        if self.sharded:
            checkpoint.drop_old_shards(self.out, name)


class ExportSaver:
    """Fine-tuning's run folder is the model every command loads: `export(model, out, progress)` writes it,
    then the progress (optimizer, RNG states, TrainState) that resuming needs besides it. Only the last
    state is kept; one process."""

    def __init__(self, export: Export, out: Path) -> None:
        self.export, self.out = export, out

    def save(self, name: str, model: Transformer, optimizer: Optimizer, state: TrainState, rng: dict[str, Any]) -> None:
        if name == checkpoint.CKPT_NAME:
            self.export(model, self.out, {"optimizer": optimizer.state_dict(), "rng": rng, **state.state_dict()})
