"""Training-run checkpoints: one `ckpt.pt` per run folder, written atomically.

It holds everything needed to resume exactly (model, optimizer, step, RNG states, log history) and
to use the model (config and tokenizer). A kill during `save` leaves the previous file intact,
because the new one is written beside it and then renamed over it in one step. Only tensors and plain
data are read back (`weights_only`), so a run folder from elsewhere cannot run code when loaded.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer
from decoderlm.tokenizer import CharTokenizer

CKPT_NAME = "ckpt.pt"


def save(run_dir: Path, state: dict[str, Any]) -> Path:
    path = run_dir / CKPT_NAME
    tmp = run_dir / (CKPT_NAME + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def read(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CKPT_NAME
    if not path.is_file():
        raise DecoderLMError(f"{run_dir} has no {CKPT_NAME}; train a model there first (decoderlm train --out {run_dir})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {k: state[k] for k in ("model", "config", "tokenizer", "step")} | state
    except pickle.UnpicklingError:
        raise DecoderLMError(f"checkpoint {path} is corrupt or holds pickled objects other than tensors and plain data "
                             "(decoderlm never unpickles code); retrain, or re-save it from code you trust") from None
    except Exception as e:
        raise DecoderLMError(f"checkpoint {path} is corrupt or incomplete ({type(e).__name__}); retrain or restore it") from None


def load_model(run_dir: str | Path) -> tuple[Transformer, CharTokenizer]:
    """The trained model (eval mode) and its tokenizer from a run folder."""
    state = read(run_dir)
    model = Transformer(ModelConfig.from_dict(state["config"]))
    model.load_state_dict(state["model"])
    return model.eval(), CharTokenizer.from_dict(state["tokenizer"])
