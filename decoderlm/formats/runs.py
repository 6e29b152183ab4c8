"""decoderlm training run folders: the one reader of `ckpt.pt` (written by `decoderlm.train.checkpoint`).

A checkpoint holds everything needed to resume exactly (model, optimizer, step, RNG states, log
history) and to use the model (config and tokenizer), plus a format version so a file from a newer
decoderlm is refused by name rather than misread. Only tensors and plain data are read back
(`weights_only`), so a run folder from elsewhere cannot run code when loaded. An FSDP run keeps its
weights in torch.distributed.checkpoint shards that ckpt.pt names.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats.build import empty_model
from decoderlm.model import Transformer
from decoderlm.tokenizer import CharTokenizer
from decoderlm.tokenizer.bpe import HFTokenizer

CKPT_NAME = "ckpt.pt"  # the last state
BEST_NAME = "best.pt"  # the state with the lowest val loss so far
SHARDED_NAME = "shards"  # FSDP runs: torch.distributed.checkpoint folders, shards/ckpt-STEP, shards/best-STEP
FORMAT_VERSION = 1  # 0: files written before the version was recorded (read and upgraded)
REQUIRED = ("model", "config", "tokenizer", "step")


def load_run(path: Path, torch_dtype: torch.dtype, device: torch.device) -> tuple[Transformer, CharTokenizer | HFTokenizer]:
    """(model in eval mode, tokenizer) of a run folder: the checkpoint's weights copied into a model built
    on `device` (an FSDP run's shards are gathered whole, in float32, then cast)."""
    state = read(path)
    config = ModelConfig.from_dict(state["config"])
    sharded = state.get("sharded")
    model = empty_model(config, torch.float32 if sharded else torch_dtype, device)
    try:
        if sharded:
            load_sharded(path / sharded, model)
        else:
            model.load_state_dict(state["model"])
    except RuntimeError as e:
        problem = " ".join(str(e).split())[:200]
        raise DecoderLMError(f"checkpoint {path / CKPT_NAME} does not match its own config ({problem}); retrain or restore it") from None
    if sharded:
        model.to(torch_dtype).init_rope()
    return model.eval(), tokenizer_from_dict(state["tokenizer"])


def last_step(run_dir: Path) -> int | None:
    """The step of the run's last checkpoint, or None if it has none (read without a full check)."""
    try:
        return int(read(run_dir)["step"])
    except DecoderLMError:
        return None


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


def read_path(path: Path) -> dict[str, Any]:
    """One state file as written (best.pt, finetune_state.pt), tensors and plain data only."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a sharded state into `model` (and `optimizer`): sharded under FSDP, or whole in a single
    process without any process group (torch.distributed.checkpoint reshards as it reads)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not folder.is_dir():
        raise DecoderLMError(f"the sharded checkpoint {folder} is missing; restore it from a copy or retrain")
    if optimizer is None:
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# --- the tokenizer record: plain data, read and written here ---------------------------------------


def tokenizer_to_dict(tokenizer: CharTokenizer | HFTokenizer) -> dict[str, Any]:
    """Plain data for the checkpoint (no pickled objects): a char vocabulary, or a `tokenizers` JSON
    with the special tokens and chat template around it."""
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.to_dict()
    return {"type": "hf", "json": tokenizer.tokenizer.to_str(), "special_tokens": tokenizer.special_tokens,
            "eos_token_ids": tokenizer.eos_token_ids, "chat_template": tokenizer.chat_template}


def tokenizer_from_dict(data: dict[str, Any]) -> CharTokenizer | HFTokenizer:
    if data.get("type", "char") == "char":
        return CharTokenizer.from_dict(data)
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_str(data["json"]), special_tokens=data["special_tokens"],
                       eos_token_ids=data["eos_token_ids"], chat_template=data["chat_template"])
