"""Training settings: each declared once (type, default, help, what `--resume` may do with it) and all
checked before any work starts, so a bad value is one line at the door rather than a crash minutes in.

A field left `None` was not given: a new run fills it from the preset's recipe (RECIPES), else the
field's own default. On `--resume` the run's saved settings are the starting point, and each field
follows its `on_resume` rule:

- FIXED (model, data, batch, seed, optimizer, schedule): the run was set up with these; a different
  value is refused with an error naming every such flag (the same value is fine).
- RUN (max_steps, eval/log intervals, eval batches): kept from the run unless given; a new value is
  applied with a printed note. A larger `max_steps` extends the run; the schedule keeps its own
  horizon (`decay_steps`), so steps after it run at `min_lr` and the learning rate never jumps back up.
- SESSION (stop_after, device, threads, sample_chars): belong to this invocation only; not restored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from decoderlm.config import PRESETS
from decoderlm.errors import DecoderLMError
from decoderlm.device import DEVICES, resolve_device

FIXED, RUN, SESSION = "fixed", "run", "session"


def setting(help: str, on_resume: str, default: Any = None, choices: tuple[str, ...] | None = None) -> Any:
    """A TrainConfig field: `None` until resolved; `default` applies when neither the user nor the recipe sets it."""
    return field(default=None, metadata=dict(help=help, on_resume=on_resume, default=default, choices=choices))


def switch(help: str) -> Any:
    """A TrainConfig on/off field (a flag without a value): off unless given."""
    return field(default=False, metadata=dict(help=help, on_resume=SESSION, default=False, choices=None))


@dataclass
class TrainConfig:
    """Training settings; see the module docstring for how `None` and `--resume` are read."""

    data: str | None = setting("UTF-8 text file to train on (not needed with --resume)", FIXED)
    out: str | None = setting("run folder: checkpoint, logs, loss.png (default: runs/PRESET)", SESSION)
    preset: str | None = setting(f"model shape: {', '.join(PRESETS)}", FIXED, "seed-char")
    resume: bool = switch("continue the run in --out where it stopped (see below)")
    max_steps: int | None = setting("optimizer steps to train for; with --resume a larger value extends the run", RUN, 2000)
    decay_steps: int | None = setting("steps the warmup + cosine schedule spans (default: --max-steps); "
                                      "after them the lr stays at --min-lr", FIXED)
    stop_after: int | None = setting("stop after this step with a checkpoint, to --resume later; the schedule is unchanged", SESSION)
    batch_size: int | None = setting("windows per step", FIXED)
    context: int | None = setting("tokens per window; also the model's max_seq_len", FIXED)
    lr: float | None = setting("peak learning rate, reached after warmup", FIXED)
    min_lr: float | None = setting("learning rate at the end of the cosine decay", FIXED)
    warmup: int | None = setting("steps of linear warmup", FIXED)
    weight_decay: float | None = setting("AdamW weight decay on matrices (not biases or norms)", FIXED)
    beta1: float | None = setting("AdamW beta1", FIXED, 0.9)
    beta2: float | None = setting("AdamW beta2", FIXED)
    grad_clip: float | None = setting("clip the gradient norm to this (0 = no clipping)", FIXED, 1.0)
    dropout: float | None = setting("dropout probability in [0, 1)", FIXED)
    seed: int | None = setting("seed for the initial weights, batches and dropout", FIXED, 1337)
    eval_interval: int | None = setting("evaluate on the val split and save a checkpoint every this many steps", RUN, 250)
    eval_batches: int | None = setting("evaluate on this many batches of 64 val windows (default: the whole val split)", RUN)
    log_interval: int | None = setting("log the train loss every this many steps", RUN, 10)
    device: str | None = setting("where to train", SESSION, "cpu", DEVICES)
    threads: int | None = setting("CPU threads for torch (default: torch's choice)", SESSION)
    sample_chars: int | None = setting("length of the sample printed at the end", SESSION, 300)


# nanoGPT's CPU recipe for tiny Shakespeare (val loss ≈ 1.88 after 2000 steps).
RECIPES: dict[str, dict[str, Any]] = {
    "seed-char": dict(batch_size=12, context=64, lr=1e-3, min_lr=1e-4, warmup=100, weight_decay=0.1, beta2=0.99, dropout=0.0),
}
DEFAULT_RECIPE = dict(batch_size=8, context=256, lr=6e-4, min_lr=6e-5, warmup=100, weight_decay=0.1, beta2=0.95, dropout=0.0)
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_new(cfg: TrainConfig) -> TrainConfig:
    """A new run's settings: given > the preset's recipe > the field's default."""
    if cfg.data is None:
        raise DecoderLMError("--data is required to start a run; give a UTF-8 text file (or --resume to continue one)")
    preset = cfg.preset or FIELDS["preset"].metadata["default"]
    check_preset(preset)
    values = {name: f.metadata["default"] for name, f in FIELDS.items()} | RECIPES.get(preset, DEFAULT_RECIPE)
    values |= {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None}
    if values["decay_steps"] is None:
        values["decay_steps"] = values["max_steps"]
    values["data"] = str(Path(values["data"]).resolve())  # resume compares it; the cwd may differ then
    values["out"] = run_folder(cfg)
    return validate(TrainConfig(**values))


def resolve_resume(cfg: TrainConfig, saved: TrainConfig, step: int) -> tuple[TrainConfig, list[str]]:
    """The run's saved settings with this invocation's applied by the rules above; returns notes to print."""
    given = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None and k not in ("resume", "out")}
    if "data" in given and Path(given["data"]).resolve() == Path(saved.data or "").resolve():
        given["data"] = saved.data
    refused = [f"{flag(k)} {v} (the run's: {getattr(saved, k)})" for k, v in given.items()
               if FIELDS[k].metadata["on_resume"] == FIXED and v != getattr(saved, k)]
    if refused:
        raise DecoderLMError(f"--resume keeps the run's setup, and these differ from it: {'; '.join(refused)}; "
                             "drop them, or start a new run with another --out")
    values = dataclasses.asdict(saved) | {name: f.metadata["default"] for name, f in FIELDS.items() if f.metadata["on_resume"] == SESSION}
    values |= given | {"out": run_folder(cfg), "resume": True}
    notes = [f"note: resuming with {flag(k)} {v} (the run had {getattr(saved, k)})" for k, v in given.items()
             if FIELDS[k].metadata["on_resume"] == RUN and v != getattr(saved, k)]
    resolved = validate(TrainConfig(**values))
    if resolved.max_steps <= step:
        raise DecoderLMError(f"{resolved.out} is already at step {step}; pass a --max-steps larger than {step} to train further")
    if resolved.stop_after is not None and resolved.stop_after <= step:
        raise DecoderLMError(f"--stop-after {resolved.stop_after} is not after the run's step {step}; give a later step or drop it")
    if "max_steps" in given and resolved.max_steps > resolved.decay_steps:
        notes.append(f"note: steps {max(step, resolved.decay_steps) + 1}-{resolved.max_steps} run at --min-lr {resolved.min_lr}, "
                     f"after the schedule's {resolved.decay_steps} steps")
    return resolved, notes


def run_folder(cfg: TrainConfig) -> str:
    return cfg.out or f"runs/{cfg.preset or FIELDS['preset'].metadata['default']}"


def check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise DecoderLMError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and v >= low


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# (field, requirement, test): every numeric setting, checked in this order.
RULES: list[tuple[str, str, Callable[[Any], bool]]] = [
    ("max_steps", "a positive integer", _int_at_least(1)),
    ("decay_steps", "a positive integer", _int_at_least(1)),
    ("stop_after", "a positive integer", _int_at_least(1)),
    ("batch_size", "a positive integer", _int_at_least(1)),
    ("context", "a positive integer", _int_at_least(1)),
    ("lr", "a positive number", lambda v: _finite(v) and v > 0),
    ("min_lr", "a number >= 0", lambda v: _finite(v) and v >= 0),
    ("warmup", "an integer >= 0", _int_at_least(0)),
    ("weight_decay", "a number >= 0", lambda v: _finite(v) and v >= 0),
    ("beta1", "in [0, 1)", lambda v: _finite(v) and 0 <= v < 1),
    ("beta2", "in [0, 1)", lambda v: _finite(v) and 0 <= v < 1),
    ("grad_clip", "a number >= 0 (0 = no clipping)", lambda v: _finite(v) and v >= 0),
    ("dropout", "in [0, 1)", lambda v: _finite(v) and 0 <= v < 1),
    ("seed", "an integer in [0, 2**63)", lambda v: isinstance(v, int) and 0 <= v < 2**63),
    ("eval_interval", "a positive integer", _int_at_least(1)),
    ("eval_batches", "a positive integer", _int_at_least(1)),
    ("log_interval", "a positive integer", _int_at_least(1)),
    ("threads", "a positive integer", _int_at_least(1)),
    ("sample_chars", "an integer >= 0", _int_at_least(0)),
]


def validate(cfg: TrainConfig) -> TrainConfig:
    """Refuse any setting training would trip over later; settings left None (optional ones) pass."""
    check_preset(cfg.preset)
    for name, requirement, ok in RULES:
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not ok(value)):
            raise DecoderLMError(f"{flag(name)} must be {requirement}, got {value}")
    if cfg.min_lr > cfg.lr:
        raise DecoderLMError(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}; the schedule decays from lr down to min_lr")
    resolve_device(cfg.device)
    return cfg
