"""`--resume` for fine-tuning: a stopped `sft` or `dpo` run continues where its last save left it and
ends exactly as an uninterrupted run would.

The run folder is the model (an HF folder, or a LoRA adapter), so what resuming needs besides it lives in
one more file, finetune_state.pt: the trainable weights (the adapters only, with LoRA), the optimizer,
the RNG states, the step and the logs, plus the settings and what a new run derived from them (steps,
lr, warmup). It is written atomically after the model at every save, so it never lags the run by more
than one save, and the weights resumed from are always those of the state.

The settings follow train's rules (decoderlm.train.config): FIXED ones made the run and are refused if
given with another value; RUN ones apply with a note (a larger --max-steps extends the run at the
schedule's final lr); --stop-after, --device and --threads belong to one invocation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.train import checkpoint
from decoderlm.train.config import flag

STATE_NAME = "finetune_state.pt"
FIXED = ("model", "data", "epochs", "lr", "batch_size", "max_length", "packing", "lora_rank", "lora_alpha", "lora_targets",
         "lora_dropout", "beta", "scheduled_sampling", "warmup", "eval_fraction", "skip_bad_lines", "seed")
RUN = ("max_steps", "eval_interval", "log_interval")
SESSION = ("stop_after", "device", "threads")


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights training changes: every parameter after full fine-tuning, the adapters after LoRA."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: nn.Module, weights: dict[str, torch.Tensor], out: Path) -> None:
    if weights.keys() != trainable_state(model).keys():
        raise DecoderLMError(f"{out / STATE_NAME} holds other trainable weights than this run's model builds; "
                             "the base model changed since the run started: start a new run with another --out")
    model.load_state_dict(weights, strict=False)


def save_state(out: Path, state: dict[str, Any]) -> None:
    checkpoint.save(out, state, STATE_NAME)


def read_state(out: str | Path) -> dict[str, Any]:
    out = Path(out)
    path = out / STATE_NAME
    if not path.is_file():
        what = "a fine-tuned model" if any(out.glob("*.safetensors")) else "no fine-tuning run"
        raise DecoderLMError(f"{out} holds {what} without {STATE_NAME}, so there is nothing to resume; "
                             "start a new run with another --out")
    try:
        return runs.read_path(path)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError) as e:  # a cut or foreign file
        raise DecoderLMError(f"{path} is truncated or corrupt ({type(e).__name__}); start a new run with another --out") from None


def same_source(given: str, saved: str) -> bool:
    """Whether two --model or --data values name the same thing (a path by another spelling, or a known name)."""
    return given == saved or (Path(given).exists() and Path(given).resolve() == Path(saved).resolve())


def resolve_resume(cfg: Any, saved: Any, step: int) -> tuple[Any, list[str]]:
    """The run's saved settings (a resolved FinetuneConfig) with this invocation's applied; notes to print."""
    given = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None and v is not False and k not in ("out", "resume", "method")}
    if cfg.method != saved.method:
        raise DecoderLMError(f"{cfg.out} is a {saved.method} run; resume it with decoderlm {saved.method} --resume")
    for key in ("model", "data"):
        if key in given and same_source(given[key], getattr(saved, key)):
            given[key] = getattr(saved, key)
    refused = [f"{flag(k)} {v} (the run's: {getattr(saved, k)})" for k, v in given.items() if k in FIXED and v != getattr(saved, k)]
    if refused:
        raise DecoderLMError(f"--resume keeps the run's setup, and these differ from it: {'; '.join(refused)}; "
                             "drop them, or start a new run with another --out")
    notes = [f"note: resuming with {flag(k)} {v} (the run had {getattr(saved, k)})" for k, v in given.items()
             if k in RUN and v != getattr(saved, k)]
    session = {k: None for k in SESSION} | {"device": "cpu"}
    resolved = dataclasses.replace(saved, **session | given | {"out": cfg.out, "resume": True})
    if resolved.max_steps <= step:
        raise DecoderLMError(f"{cfg.out} is already at step {step}; pass a --max-steps larger than {step} to train further")
    if resolved.stop_after is not None and resolved.stop_after <= step:
        raise DecoderLMError(f"--stop-after {resolved.stop_after} is not after the run's step {step}; give a later step or drop it")
    return resolved, notes
