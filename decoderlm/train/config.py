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

from decoderlm.config import PRESETS
from decoderlm.device import DEVICE_HELP, resolve_device
from decoderlm.errors import DecoderLMError

FIXED, RUN, SESSION = "fixed", "run", "session"
DTYPES = ("float32", "bfloat16")
OPTIMIZERS = ("adamw", "muon")
TRAIN_SEED = 1337  # every training command (train, sft, dpo) is reproducible by default, as nanoGPT's is


def setting(help: str, on_resume: str, default: Any = None, choices: tuple[str, ...] | None = None) -> Any:
    """A TrainConfig field: `None` until resolved; `default` applies when neither the user nor the recipe sets it."""
    return field(default=None, metadata=dict(help=help, on_resume=on_resume, default=default, choices=choices))


def switch(help: str, on_resume: str = SESSION) -> Any:
    """A TrainConfig on/off field (a flag without a value): off unless given. On --resume a FIXED switch
    keeps the run's value (not giving it does not turn it off)."""
    return field(default=False, metadata=dict(help=help, on_resume=on_resume, default=False, choices=None))


@dataclass
class TrainConfig:
    """Training settings; see the module docstring for how `None` and `--resume` are read."""

    data: str | None = setting("UTF-8 text file (char-level), or a folder `decoderlm prepare` wrote (not needed with --resume)", FIXED)
    out: str | None = setting("run folder: checkpoint, logs, loss.png (default: runs/PRESET)", SESSION)
    preset: str | None = setting(f"model shape: {', '.join(PRESETS)}", FIXED, "seed-char")
    config: str | None = setting("model shape from a JSON file of ModelConfig fields, instead of --preset", FIXED)
    set: list[str] | None = setting("override a model field of the preset or --config: --set n_layers=6 (repeatable; "
                                    "values are JSON, else strings)", FIXED)
    init_from: str | None = setting("start from this model's weights, shape and tokenizer (run folder, HF folder, .gguf "
                                    "dequantized, or known name) instead of random weights", FIXED)
    resume: bool = switch("continue the run in --out where it stopped (see below)")
    max_steps: int | None = setting("optimizer steps to train for; with --resume a larger value extends the run", RUN, 2000)
    decay_steps: int | None = setting("steps the warmup + cosine schedule spans (default: --max-steps); "
                                      "after them the lr stays at --min-lr", FIXED)
    stop_after: int | None = setting("stop after this step with a checkpoint, to --resume later; the schedule is unchanged "
                                    "(default: at --max-steps)", SESSION)
    batch_size: int | None = setting("windows per micro-batch on each process; the global batch is "
                                     "batch_size x grad_accum x processes", FIXED)
    grad_accum: int | None = setting("micro-batches whose gradients are summed before each optimizer step", FIXED, 1)
    context: int | None = setting("tokens per window; also the model's max_seq_len", FIXED)
    optimizer: str | None = setting("adamw, or muon: Muon for the matrices inside the blocks, AdamW for embeddings, "
                                    "head, norms and biases", FIXED, "adamw", OPTIMIZERS)
    lr: float | None = setting("peak learning rate, reached after warmup (AdamW's)", FIXED)
    muon_lr: float | None = setting("Muon's peak learning rate (--optimizer muon); the schedule scales it as it scales --lr",
                                    FIXED, 0.02)
    min_lr: float | None = setting("learning rate at the end of the cosine decay", FIXED)
    warmup: int | None = setting("steps of linear warmup", FIXED)
    weight_decay: float | None = setting("AdamW weight decay on matrices (not biases, norms or embeddings)", FIXED)
    beta1: float | None = setting("AdamW beta1", FIXED, 0.9)
    beta2: float | None = setting("AdamW beta2", FIXED)
    grad_clip: float | None = setting("clip the gradient norm to this (0 = no clipping)", FIXED, 1.0)
    dropout: float | None = setting("dropout probability in [0, 1)", FIXED)
    scheduled_sampling: float | None = setting("scheduled sampling: replace input tokens by the model's own predictions "
                                               "with a probability ramping from 0 to this over --decay-steps", FIXED, 0.0)
    seed: int | None = setting("seed for the initial weights, batches and dropout", FIXED, TRAIN_SEED)
    dtype: str | None = setting("float32, or bfloat16 autocast (matmuls in bfloat16, weights and optimizer in float32)",
                                FIXED, "float32", DTYPES)
    fsdp: bool = switch("shard parameters, gradients and optimizer state across processes (FSDP2) instead of "
                        "replicating them (DDP); checkpoints are then sharded (torch.distributed.checkpoint)", FIXED)
    eval_interval: int | None = setting("evaluate on the val split and save a checkpoint every this many steps", RUN, 250)
    save_interval: int | None = setting("also save the checkpoint every this many steps (default: at evaluations only)", RUN)
    eval_batches: int | None = setting("evaluate on this many batches of 64 val windows (default: the whole val split)", RUN)
    log_interval: int | None = setting("log the train loss every this many steps", RUN, 10)
    device: str | None = setting(f"where to train: {DEVICE_HELP} (under torchrun: cuda, each process its own GPU)",
                                 SESSION, "cpu")
    threads: int | None = setting("CPU threads for torch (default: torch's choice)", SESSION)
    compile: bool = switch("torch.compile the model (faster steps; the compiled code is cached in "
                           "~/.cache/decoderlm/inductor, so only a machine's first run waits for it)")
    peak_flops: float | None = setting("peak FLOP/s of one device, for the MFU column (default: known for some GPUs in bf16)", SESSION)
    dist_timeout: int | None = setting("seconds a process waits for the others (torchrun) before failing", SESSION, 300)
    sample_chars: int | None = setting("length of the sample printed at the end", SESSION, 300)


# nanoGPT's CPU recipe for tiny Shakespeare (val loss ≈ 1.88 after 2000 steps).
CPU_RECIPE = dict(batch_size=12, context=64, lr=1e-3, min_lr=1e-4, warmup=100, weight_decay=0.1, beta2=0.99, dropout=0.0)
# seed-char-plus: the same recipe, with Muon on the block matrices (AdamW keeps lr 1e-3 for the rest).
PLUS_RECIPE = CPU_RECIPE | dict(optimizer="muon", muon_lr=0.02)
RECIPES: dict[str, dict[str, Any]] = {"seed-char": CPU_RECIPE, "seed-char-llama": CPU_RECIPE, "seed-char-plus": PLUS_RECIPE}
DEFAULT_RECIPE = dict(batch_size=8, context=256, lr=6e-4, min_lr=6e-5, warmup=100, weight_decay=0.1, beta2=0.95, dropout=0.0)
FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_new(cfg: TrainConfig) -> TrainConfig:
    """A new run's settings: given > the preset's recipe > the field's default."""
    if cfg.data is None:
        raise DecoderLMError("--data is required to start a run; give a UTF-8 text file or a prepared folder (or --resume to continue one)")
    shapes = [flag(k) for k in ("preset", "config", "init_from") if getattr(cfg, k) is not None]
    if len(shapes) > 1:
        raise DecoderLMError(f"{' and '.join(shapes)} each choose the model; give one of them")
    if cfg.set and cfg.init_from is not None:
        raise DecoderLMError("--set changes a new model's shape; --init-from keeps the loaded model's, so drop --set")
    preset = cfg.preset or ("" if shapes else FIELDS["preset"].metadata["default"])
    values = {name: f.metadata["default"] for name, f in FIELDS.items()} | RECIPES.get(preset, DEFAULT_RECIPE)
    values |= {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None}
    if shapes and cfg.preset is None:
        values["preset"] = None  # the model comes from --config or --init-from
    if values["decay_steps"] is None:
        values["decay_steps"] = values["max_steps"]
    for key in ("data", "config", "init_from"):  # resume compares them; the cwd may differ then
        if values[key] is not None and Path(values[key]).exists():
            values[key] = str(Path(values[key]).resolve())
    values["out"] = run_folder(cfg)
    return validate(TrainConfig(**values))


def resolve_resume(cfg: TrainConfig, saved: TrainConfig, step: int) -> tuple[TrainConfig, list[str]]:
    """The run's saved settings with this invocation's applied by the rules above; returns notes to print."""
    given = {k: v for k, v in dataclasses.asdict(cfg).items() if v is not None and v is not False and k not in ("resume", "out")}
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
    if cfg.out:
        return cfg.out
    if cfg.config or cfg.init_from:
        return f"runs/{Path(cfg.config or cfg.init_from).stem}"
    return f"runs/{cfg.preset or FIELDS['preset'].metadata['default']}"


def parse_sets(sets: list[str] | None) -> dict[str, Any]:
    """--set key=value pairs as {key: value}; a value is read as JSON (6, 0.1, true, "x") or else kept as text."""
    import json

    overrides = {}
    for item in sets or []:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise DecoderLMError(f"--set {item!r} is not key=value; write e.g. --set n_layers=6")
        try:
            overrides[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key.strip()] = text
    for key in ("vocab_size", "max_seq_len"):
        if key in overrides:
            raise DecoderLMError(f"--set {key} is decided by the {'tokenizer' if key == 'vocab_size' else '--context'}; drop it")
    return overrides


def check_preset(preset: str | None) -> None:
    if preset is not None and preset not in PRESETS:
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
    ("muon_lr", "a positive number", lambda v: _finite(v) and v > 0),
    ("warmup", "an integer >= 0", _int_at_least(0)),
    ("weight_decay", "a number >= 0", lambda v: _finite(v) and v >= 0),
    ("beta1", "in [0, 1)", lambda v: _finite(v) and 0 <= v < 1),
    ("beta2", "in [0, 1)", lambda v: _finite(v) and 0 <= v < 1),
    ("grad_accum", "a positive integer", _int_at_least(1)),
    ("save_interval", "a positive integer", _int_at_least(1)),
    ("peak_flops", "a positive number", lambda v: _finite(v) and v > 0),
    ("dist_timeout", "a positive integer", _int_at_least(1)),
    ("grad_clip", "a number >= 0 (0 = no clipping)", lambda v: _finite(v) and v >= 0),
    ("dropout", "in [0, 1)", lambda v: _finite(v) and 0 <= v < 1),
    ("scheduled_sampling", "in [0, 1]", lambda v: _finite(v) and 0 <= v <= 1),
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
    if cfg.optimizer not in OPTIMIZERS:
        raise DecoderLMError(f"--optimizer {cfg.optimizer!r} is not supported; use one of {', '.join(OPTIMIZERS)}")
    if cfg.optimizer == "muon" and cfg.fsdp:
        raise DecoderLMError("--optimizer muon needs each matrix whole, and --fsdp shards them; drop one of the two")
    if cfg.dtype not in DTYPES:
        raise DecoderLMError(f"--dtype {cfg.dtype!r} is not supported for training; use one of {', '.join(DTYPES)}")
    parse_sets(cfg.set)
    resolve_device(cfg.device)
    return cfg
