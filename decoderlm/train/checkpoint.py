"""Training-run checkpoints: one `ckpt.pt` per run folder, written atomically.

It holds everything needed to resume exactly (model, optimizer, step, RNG states, log history) and
to use the model (config and tokenizer), plus a format version so a file from a newer decoderlm is
refused by name rather than misread. A kill during `save` leaves the previous file intact, because the
new one is written beside it and then renamed over it in one step. Only tensors and plain data are read
back (`weights_only`), so a run folder from elsewhere cannot run code when loaded.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer
from decoderlm.tokenizer import CharTokenizer

CKPT_NAME = "ckpt.pt"
FORMAT_VERSION = 1  # 0: files written before the version was recorded (read and upgraded)
REQUIRED = ("model", "config", "tokenizer", "step")


def save(run_dir: Path, state: dict[str, Any]) -> Path:
    path = run_dir / CKPT_NAME
    tmp = run_dir / (CKPT_NAME + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION} | state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError as e:
        raise DecoderLMError(f"cannot write checkpoint {path} ({e.strerror or e}); free disk space or fix the folder's "
                             f"permissions, then --resume (the previous checkpoint, if any, is intact)") from None
    finally:
        tmp.unlink(missing_ok=True)  # after a failure or Ctrl-C; gone already after the rename
    return path


def read(run_dir: str | Path) -> dict[str, Any]:
    """The checkpoint as a dict; a missing, corrupt, code-carrying or too-new file is each its own error."""
    run_dir = Path(run_dir)
    path = run_dir / CKPT_NAME
    if not run_dir.exists():
        raise DecoderLMError(f"run folder {run_dir} does not exist; train a model there first (decoderlm train --out {run_dir})")
    if not run_dir.is_dir():
        raise DecoderLMError(f"{run_dir} is a file, not a run folder; give the folder a training run wrote (--out)")
    if not path.is_file():
        raise DecoderLMError(f"{run_dir} has no {CKPT_NAME}; train a model there first (decoderlm train --out {run_dir})")
    corrupt = f"checkpoint {path} is truncated or corrupt"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip whose directory is at the end: a cut file has none
        raise DecoderLMError(f"{corrupt} (not a complete torch archive); restore it from a copy or retrain")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" in str(e).lower():
            raise DecoderLMError(f"checkpoint {path} holds pickled objects other than tensors and plain data, and "
                                 "decoderlm never unpickles code; re-save it from code you trust") from None
        raise DecoderLMError(f"{corrupt} ({e}); restore it from a copy or retrain") from None
    except Exception as e:
        raise DecoderLMError(f"{corrupt} ({type(e).__name__}); restore it from a copy or retrain") from None
    if not isinstance(state, dict) or any(k not in state for k in REQUIRED):
        raise DecoderLMError(f"{path} is not a decoderlm run checkpoint (it lacks {', '.join(REQUIRED)}); "
                             "give a folder a decoderlm training run wrote")
    version = state.get("format_version", 0)
    if version not in range(FORMAT_VERSION + 1):
        raise DecoderLMError(f"checkpoint {path} has format version {version!r}, but this decoderlm reads versions up to "
                             f"{FORMAT_VERSION}; upgrade decoderlm to read it")
    return _upgrade(state) if version == 0 else state


def _upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """Version 0 → 1: RNG states gathered under "rng"; the schedule's horizon was always max_steps."""
    state = dict(state, format_version=FORMAT_VERSION)
    if "torch_rng" in state:
        state["rng"] = {"torch": state.pop("torch_rng"), "batch": state.pop("batch_rng")}
    if "train_config" in state:
        state["train_config"] = {"decay_steps": state["train_config"]["max_steps"]} | state["train_config"]
    return state


def load_model(run_dir: str | Path) -> tuple[Transformer, CharTokenizer]:
    """The trained model (eval mode) and its tokenizer from a run folder."""
    state = read(run_dir)
    model = Transformer(ModelConfig.from_dict(state["config"]))
    model.load_state_dict(state["model"])
    return model.eval(), CharTokenizer.from_dict(state["tokenizer"])
