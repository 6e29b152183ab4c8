"""Writing training-run checkpoints: one `ckpt.pt` per run folder, written atomically (the format and
its one reader: `decoderlm.formats.runs`).

A kill during `save` leaves the previous file intact, because the new one is written beside it and
then renamed over it in one step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.formats.runs import BEST_NAME, CKPT_NAME, SHARDED_NAME

__all__ = ["BEST_NAME", "CKPT_NAME", "SHARDED_NAME", "drop_old_shards", "full_state_dict", "save", "save_sharded"]


def save(run_dir: Path, state: dict[str, Any], name: str = CKPT_NAME) -> Path:
    """Write `state` as run_dir/name (ckpt.pt: the last state; best.pt: the best val loss so far)."""
    path = run_dir / name
    tmp = run_dir / (name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format_version": runs.FORMAT_VERSION} | state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:
        raise DecoderLMError(f"cannot write checkpoint {path} ({e.strerror or e}); free disk space or fix the folder's "
                             f"permissions, then --resume (the previous checkpoint, if any, is intact)") from None
    finally:
        tmp.unlink(missing_ok=True)  # after a failure or Ctrl-C; gone already after the rename
    return path


# --- FSDP runs: sharded states (torch.distributed.checkpoint) -------------------------------------


def save_sharded(run_dir: Path, name: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: Any) -> str:
    """Each process writes its own shards of the model and optimizer into a new folder; returns its
    path relative to run_dir. A new folder per save, so the one ckpt.pt names stays whole until the new
    ckpt.pt replaces it (then `drop_old_shards` removes the old folders)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    folder = f"{SHARDED_NAME}/{Path(name).stem}-{step}"
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=run_dir / folder)
    return folder


def drop_old_shards(run_dir: Path, name: str) -> None:
    """Remove the shard folders of `name` (ckpt or best) that its checkpoint no longer points to."""
    import shutil

    keep = runs.read_path(run_dir / name).get("sharded")
    for folder in (run_dir / SHARDED_NAME).glob(f"{Path(name).stem}-*"):
        if f"{SHARDED_NAME}/{folder.name}" != keep:
            shutil.rmtree(folder, ignore_errors=True)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's whole state dict on the CPU (every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
