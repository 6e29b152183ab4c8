"""The training loop: AdamW or Muon (decoderlm.train.optim), warmup + cosine schedule, gradient accumulation,
clipping, periodic eval and checkpoints; one process or many under torchrun (DDP, or FSDP2 with --fsdp).

What a batch is and how its loss is computed is an `Objective` (decoderlm.train.objective) passed to
`fit`: `LMObjective` (random windows, next-token loss) for pretraining; fine-tuning passes its own
(SFT, DPO) to the same loop.

A killed run resumed from its last checkpoint equals an uninterrupted one step for step: the
checkpoint carries the optimizer, the loss window being averaged and every RNG stream training draws from.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.model import Transformer
from decoderlm.tokenizer import CharTokenizer
from decoderlm.tokenizer.bpe import HFTokenizer
from decoderlm.train import checkpoint, distributed
from decoderlm.train.config import FIELDS, TrainConfig, parse_sets, resolve_new, resolve_resume, run_folder
from decoderlm.train.data import (
    Split,
    check_sizes,
    is_data_dir,
    load_splits,
    open_data_dir,
    read_corpus,
    split_sizes,
    token_dtype,
    write_splits,
)
from decoderlm.train.distributed import World
from decoderlm.train.objective import LMObjective, Objective
from decoderlm.train.optim import make_optimizer
from decoderlm.train.schedule import lr_at

COMPILE_CACHE = Path.home() / ".cache" / "decoderlm" / "inductor"
RESUME_KEYS = ("optimizer", "rng", "train_config", "history", "window")
# What a run writes into its folder; a new run may start over these (a run killed before its first
# checkpoint), never over anything else.
RUN_FILES = {checkpoint.CKPT_NAME, checkpoint.BEST_NAME, "train.bin", "val.bin", "log.csv", "log.json", "loss.png", "run.json"}
RUN_FILES |= {name + ".tmp" for name in RUN_FILES} | {checkpoint.SHARDED_NAME}
Tokenizer = CharTokenizer | HFTokenizer


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, objective: Objective, cfg: TrainConfig, device: torch.device, world: World) -> float:
    """Mean loss over the val batches (the whole split unless eval_batches is set), summed over processes."""
    model.eval()
    total, count = 0.0, 0
    for batch in objective.val_batches():
        with autocast(cfg, device):
            loss, n = objective.loss(model, batch)
        if n:
            total, count = total + loss.item() * n, count + n
    model.train()
    total, count = distributed.all_sum([total, count], world)
    return total / count if count else float("nan")  # fine-tuning may hold out nothing


@torch.no_grad()
def objective_metrics(model: nn.Module, objective: Objective, cfg: TrainConfig, device: torch.device) -> dict[str, float]:
    """The objective's own held-out numbers (DPO: rewards, margin, accuracy), logged beside val_loss;
    none for an objective without a `metrics` method (pretraining)."""
    if not hasattr(objective, "metrics"):
        return {}
    model.eval()
    with autocast(cfg, device):
        values = objective.metrics(model)
    model.train()
    return values


def flops_per_token(model: Transformer, context: int) -> int:
    """Training FLOPs per token, forward + backward: 6 per weight a token meets in a matmul (every linear
    layer, the head included) plus 12·layers·heads·head_dim·context for attention (PaLM's estimate)."""
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    c = model.config
    return 6 * matmul + 12 * c.n_layers * c.n_heads * c.head_dim * context


PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    """One device's peak FLOP/s for MFU: --peak-flops, else a known GPU's dense bf16 peak, else unknown."""
    if cfg.peak_flops is not None:
        return cfg.peak_flops
    if device.type == "cuda" and cfg.precision == "bf16":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_BF16.items() if k in name), None)
    return None


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) a model in cfg.out; return a summary with the final val loss and speed.

    Every setting, the data's size and the run folder are checked before the first step; see
    `decoderlm.train.config` for what --resume keeps and what it lets change. Under torchrun each
    process runs this same function (see `decoderlm.train.distributed`)."""
    out = Path(run_folder(cfg))
    default = {name: FIELDS[name].metadata["default"] for name in ("device", "dist_timeout")}
    world = distributed.setup(cfg.device or default["device"], cfg.dist_timeout or default["dist_timeout"])
    try:
        cfg, state, tokenizer, (train_data, val_data) = open_run(cfg, out, world) if cfg.resume else start_run(cfg, out, world)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        device = distributed.device_for(cfg.device, world)
        torch.manual_seed(cfg.seed)
        model = Transformer(ModelConfig.from_dict(state["config"]))
        if "init" in state:
            model.load_state_dict(state.pop("init"))
        if world.rank:
            torch.manual_seed(cfg.seed + world.rank)  # dropout differs per process; the weights above do not
        objective = LMObjective(train_data, val_data, cfg, world, device)
        result = fit(model.to(device), objective, cfg, out, state, tokenizer, world, device)
        distributed.barrier(world)  # leave together: a process that tears down while a peer still saves aborts
        return result
    except RuntimeError as e:  # gloo reports a timeout or a closed peer as a plain RuntimeError
        if not (world.distributed and lost_contact(e)):
            raise
        step = runs.last_step(out)
        where = (f"the last checkpoint in {out} (step {step}) is intact; --resume continues from it" if step is not None
                 else "no checkpoint was saved yet")
        raise DecoderLMError(f"rank {world.rank}: lost contact with the other processes ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}); {where}") from None
    finally:
        distributed.teardown(world)


def lost_contact(error: RuntimeError) -> bool:
    """Whether a collective failed because another process died, hung or became unreachable."""
    text = str(error)
    return isinstance(error, torch.distributed.DistError) or any(
        word in text for word in ("Timed out", "timed out", "Connection closed", "Connection reset", "gloo", "NCCL"))


def wrap(model: Transformer, cfg: TrainConfig, world: World, device: torch.device) -> nn.Module:
    """The module the loop runs: DDP (gradients averaged across processes), FSDP2 (each process holds a
    shard of every block; `model` itself becomes sharded), or the model itself; compiled if asked."""
    net: nn.Module = model
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        if world.distributed:
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
    elif world.distributed:
        # No buffer broadcast: the only buffer (RoPE's frequencies) is computed alike on every process.
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                  forward_sync_buffers=False)
    if not cfg.compile:
        return net
    # Inductor's FX-graph and AOTAutograd caches live here, so only a machine's first compiled run pays
    # for code generation; later runs load the compiled step (TORCHINDUCTOR_CACHE_DIR still overrides).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE))
    return torch.compile(net)


def fit(model: Transformer, objective: Objective, cfg: TrainConfig, out: Path, state: dict[str, Any], tokenizer: Tokenizer,
        world: World = World(), device: torch.device = torch.device("cpu"),
        export: Callable[[Transformer, Path, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The loop: `objective` says what a step trains on; `state` is a checkpoint to continue from (it has
    "optimizer") or a new run's {"config", ...}. Rank 0 alone writes the checkpoint and logs.

    `export`, if given, writes the model into `out` wherever a checkpoint would be saved, in place of
    ckpt.pt and best.pt: fine-tuning's run folder is the model itself (an HF folder or a LoRA adapter),
    which every command loads. It also gets the loop's progress (optimizer, RNG states, step, logs): the
    rest of what resuming needs, which the caller saves and passes back in `state` to continue."""
    sharded = cfg.fsdp and world.distributed
    if "optimizer" in state and not state.get("sharded"):
        model.load_state_dict(state["model"])
    net = wrap(model, cfg, world, device)
    optimizer = make_optimizer(model, cfg, device)
    history: list[dict[str, Any]] = []
    step, window_loss, window_steps, tokens_seen, best = 0, 0.0, 0, 0, float("inf")
    if "optimizer" in state:
        if state.get("sharded"):
            runs.load_sharded(out / state["sharded"], model, optimizer)
        else:
            optimizer.load_state_dict(state["optimizer"])
        set_rng_states(state["rng"], objective, device, world)
        history, step = state["history"], state["step"]
        window_loss, window_steps = state["window"]
        tokens_seen, best = state.get("tokens_seen", 0), state.get("best_val", float("inf"))
    n_params = model.num_parameters()  # FSDP's sharded parameters report their whole size
    flops = flops_per_token(model, cfg.context)
    peak = peak_flops(cfg, device)
    run_info = {"parameters": n_params, "flops_per_token": flops, "processes": world.size,
                "global_batch": cfg.batch_size * cfg.grad_accum * world.size, "peak_flops_per_device": peak}

    def save_state(name: str = checkpoint.CKPT_NAME) -> None:
        if export is not None:
            rng = rng_states(objective, device, world)
            if world.main and name == checkpoint.CKPT_NAME:
                export(model, out, {"optimizer": optimizer.state_dict(), "rng": rng, "step": step, "history": history,
                                    "window": (window_loss, window_steps), "tokens_seen": tokens_seen, "best_val": best})
                save_logs(out, history, run_info)
            distributed.barrier(world)
            return
        rng = rng_states(objective, device, world)  # every process takes part: the RNG states are gathered
        weights: dict[str, Any] = {"sharded": checkpoint.save_sharded(out, name, step, model, optimizer, world)} if sharded else {
            "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if world.main:
            checkpoint.save(out, {
                "model": {}, "optimizer": {}, **weights, "step": step, "rng": rng, "config": model.config.to_dict(),
                "tokenizer": runs.tokenizer_to_dict(tokenizer), "train_config": dataclasses.asdict(cfg),
                "history": history, "window": (window_loss, window_steps), "tokens_seen": tokens_seen, "best_val": best,
                "world_size": world.size,
            }, name)
            if sharded:
                checkpoint.drop_old_shards(out, name)
            save_logs(out, history, run_info)
        distributed.barrier(world)

    net.train()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True, disable=not world.main)
    t0 = started = time.perf_counter()
    window_tokens = 0
    while step < cfg.max_steps:
        lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = objective.batches()
        loss_sum, count = 0.0, 0
        for i, batch in enumerate(micro):
            last_micro = i == len(micro) - 1
            sync = contextlib.nullcontext() if last_micro or not isinstance(net, nn.parallel.DistributedDataParallel) else net.no_sync()
            with sync:
                with autocast(cfg, device):
                    loss, n = objective.loss(net, batch)
                (loss / len(micro)).backward()
            loss_sum, count = loss_sum + loss.item(), count + n
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=not sharded or None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum, count = distributed.all_sum([loss_sum / len(micro), count], world)
        step += 1
        tokens_seen, window_tokens = tokens_seen + int(count), window_tokens + int(count)
        window_loss, window_steps = window_loss + loss_sum / world.size, window_steps + 1
        bar.update(1)
        last = step == cfg.max_steps
        evaluating = step % cfg.eval_interval == 0 or last  # on its own interval, whatever the log interval
        saved = False
        if step % cfg.log_interval == 0 or evaluating:
            elapsed = time.perf_counter() - t0
            tok_s = window_tokens / elapsed
            row = {"step": step, "train_loss": window_loss / window_steps, "val_loss": None, "lr": lr, "tokens_seen": tokens_seen,
                   "tokens_per_s": tok_s, "mfu": None if peak is None else flops * tok_s / (peak * world.size)}
            if evaluating:
                # The model itself, not `net`: a compiled net would compile again for eval mode and each val batch size.
                row["val_loss"] = evaluate(model, objective, cfg, device, world)
                row |= objective_metrics(model, objective, cfg, device)
            history.append(row)
            # No forced redraw: the bar shows the figures at its own pace (10 times a second), not at every logged step.
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", val=f"{row['val_loss']:.3f}" if evaluating else "-", tok_s=f"{tok_s:,.0f}",
                            refresh=False)
            window_loss, window_steps, window_tokens = 0.0, 0, 0
            if evaluating:
                if row["val_loss"] < best:
                    best = row["val_loss"]
                    save_state(checkpoint.BEST_NAME)
                save_state()
                saved = True
            t0 = time.perf_counter()
        if cfg.save_interval is not None and step % cfg.save_interval == 0 and not saved:
            save_state()
            saved = True
        if step == cfg.stop_after:
            if not saved:
                save_state()
            break
    bar.close()
    vals = [r["val_loss"] for r in history if r["val_loss"] is not None]
    speeds = [r["tokens_per_s"] for r in history]
    return {"step": step, "val_loss": vals[-1] if vals else None, "seconds": time.perf_counter() - started, "config": cfg,
            "tokens_per_s": float(np.median(speeds)) if speeds else None, "out": str(out), "world": world,
            "model": plain_model(model, sharded, world), "tokenizer": tokenizer}


def plain_model(model: Transformer, sharded: bool, world: World) -> Transformer | None:
    """The trained model in eval mode, whole, on rank 0 (None on the others): FSDP's shards gathered first."""
    if not sharded:
        return model.eval() if world.main else None
    full = checkpoint.full_state_dict(model)  # collective
    if not world.main:
        return None
    plain = Transformer(model.config)
    plain.load_state_dict(full)
    return plain.eval()


def open_run(cfg: TrainConfig, out: Path, world: World = World()) -> tuple[TrainConfig, dict[str, Any], Tokenizer, tuple[Split, Split]]:
    """The run in `out` to resume: its checkpoint, its settings with this invocation's applied, its data."""
    state = runs.read(out)
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise DecoderLMError(f"{out / checkpoint.CKPT_NAME} holds a model but not the training state --resume needs "
                             f"({', '.join(missing)}); start a new run with --data and another --out")
    unknown = sorted(set(state["train_config"]) - FIELDS.keys())
    if unknown:
        raise DecoderLMError(f"{out / checkpoint.CKPT_NAME} has training settings this decoderlm does not know ({', '.join(unknown)}); "
                             "upgrade decoderlm to resume it")
    if state.get("world_size", 1) != world.size:
        raise DecoderLMError(f"{out} was trained by {state.get('world_size', 1)} process(es), and this is {world.size}; "
                             "resume with the same number (the global batch and data order depend on it)")
    saved = {name: f.metadata["default"] for name, f in FIELDS.items() if name not in state["train_config"]} | state["train_config"]
    cfg, notes = resolve_resume(cfg, TrainConfig(**saved), state["step"])
    tokenizer = runs.tokenizer_from_dict(state["tokenizer"])
    splits = read_data(cfg, out, tokenizer)
    check_sizes(max(map(len, splits[0])), sum(map(len, splits[1])), cfg.context, cfg.eval_batches, f"run folder {out}")
    if world.main:
        for note in notes:
            print(note, file=sys.stderr)
    return cfg, state, tokenizer, splits


def read_data(cfg: TrainConfig, out: Path, tokenizer: Tokenizer) -> tuple[Split, Split]:
    """A run's splits: the prepared folder's shards, or the train.bin / val.bin the run wrote."""
    if cfg.data is not None and is_data_dir(cfg.data):
        return open_data_dir(cfg.data)
    return load_splits(out, token_dtype(tokenizer.vocab_size))


def start_run(cfg: TrainConfig, out: Path, world: World = World()) -> tuple[TrainConfig, dict[str, Any], Tokenizer, tuple[Split, Split]]:
    """A new run: settings, model source and corpus checked, then (from a text file) the tokenized splits
    written into `out` by rank 0. The state holds the model config, and the initial weights with --init-from."""
    cfg = resolve_new(cfg)
    check_new_run_folder(out)
    state: dict[str, Any] = {}
    init = None
    if cfg.init_from is not None:
        from decoderlm.loader import load

        init, tokenizer = load(cfg.init_from)
        if cfg.context > init.config.max_seq_len:
            raise DecoderLMError(f"--context {cfg.context} is longer than {cfg.init_from}'s max_seq_len "
                                 f"{init.config.max_seq_len}; lower --context")
    if is_data_dir(cfg.data):
        data_tokenizer = load_data_tokenizer(cfg.data)
        if init is not None and not same_vocabulary(tokenizer, data_tokenizer):
            raise DecoderLMError(f"{cfg.data} was tokenized with another tokenizer than {cfg.init_from}'s; "
                                 f"run decoderlm prepare --tokenizer {cfg.init_from} for it")
        tokenizer = data_tokenizer
        splits = open_data_dir(cfg.data)
        check_sizes(max(map(len, splits[0]), default=0), sum(map(len, splits[1])), cfg.context, cfg.eval_batches,
                    f"data folder {cfg.data}")
    else:
        text = read_corpus(cfg.data)
        if init is None:
            tokenizer = CharTokenizer.from_text(text)
        ids = np.array(encode_text(tokenizer, text), dtype=token_dtype(tokenizer.vocab_size))
        check_sizes(*split_sizes(len(ids)), cfg.context, cfg.eval_batches, f"data file {cfg.data} ({len(ids)} tokens)")
        try:
            if world.main:
                out.mkdir(parents=True, exist_ok=True)
                write_splits(ids, out)
        except OSError as e:
            raise DecoderLMError(f"cannot write the run folder {out} ({e.strerror or e}); choose a writable --out") from None
        distributed.barrier(world)
        splits = load_splits(out, ids.dtype)
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
    if init is not None:
        config = dataclasses.replace(init.config, dropout=cfg.dropout)
        state["init"] = {k: v.float() for k, v in init.state_dict().items()}
    else:
        config = model_config(cfg, tokenizer.vocab_size)
    return cfg, {**state, "config": config.to_dict()}, tokenizer, splits


def model_config(cfg: TrainConfig, vocab_size: int) -> ModelConfig:
    """--preset or --config, with --set applied; the vocabulary from the tokenizer, the length from --context."""
    base = ModelConfig.from_json(cfg.config).to_dict() if cfg.config else ModelConfig.from_preset(cfg.preset).to_dict()
    fields = base | parse_sets(cfg.set) | {"vocab_size": vocab_size, "max_seq_len": cfg.context, "dropout": cfg.dropout}
    return ModelConfig.from_dict(fields)


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def load_data_tokenizer(data_dir: str) -> Tokenizer:
    from decoderlm.train.prepare import load_tokenizer

    return load_tokenizer(data_dir)


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    if isinstance(a, CharTokenizer) or isinstance(b, CharTokenizer):
        return isinstance(a, CharTokenizer) and isinstance(b, CharTokenizer) and a.chars == b.chars
    return a.tokenizer.get_vocab(with_added_tokens=True) == b.tokenizer.get_vocab(with_added_tokens=True)


def check_new_run_folder(out: Path) -> None:
    """A new run writes only into a new folder, an empty one or an unfinished run's: never over the user's files."""
    if out.exists() and not out.is_dir():
        raise DecoderLMError(f"--out {out} is a file; give a folder for the run")
    if (out / checkpoint.CKPT_NAME).exists():
        raise DecoderLMError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES) if out.is_dir() else []
    if foreign:
        raise DecoderLMError(f"--out {out} holds files that are not a decoderlm run's ({', '.join(foreign[:3])}); "
                             "choose a new or empty folder")


def rng_states(objective: Objective, device: torch.device, world: World) -> dict[str, Any]:
    """Every random stream training draws from: the objective's (batches), and dropout's on the CPU or
    the GPU; under torchrun each process's dropout stream too. (Nothing uses python's or numpy's RNG.)"""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), **objective.rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "mps":
        states["mps"] = torch.mps.get_rng_state()
    if world.distributed:
        states["ranks"] = distributed.all_gather({k: v for k, v in states.items() if k in ("torch", "cuda")}, world)
    return states


def set_rng_states(states: dict[str, Any], objective: Objective, device: torch.device, world: World) -> None:
    """Restore `rng_states`; a GPU stream saved on another device type is left as seeded."""
    objective.set_rng_state(states)
    own = states["ranks"][world.rank] if "ranks" in states else states
    torch.set_rng_state(own["torch"])
    if device.type == "cuda" and "cuda" in own:
        torch.cuda.set_rng_state(own["cuda"], device)
    if device.type == "mps" and "mps" in states:
        torch.mps.set_rng_state(states["mps"])


def save_logs(out: Path, history: list[dict[str, Any]], run_info: dict[str, Any]) -> None:
    try:
        write_logs(out, history, run_info)
    except OSError as e:
        raise DecoderLMError(f"cannot write the logs in {out} ({e.strerror or e}); the checkpoint is saved: "
                             "free space, then --resume") from None


def write_logs(out: Path, history: list[dict[str, Any]], run_info: dict[str, Any]) -> None:
    """log.csv and log.json (every logged step), run.json (parameters, FLOPs per token, processes, global
    batch: what a fair comparison of two runs states besides the loss) and loss.png."""
    fields = ["step", "train_loss", "val_loss", "lr", "tokens_seen", "tokens_per_s", "mfu"]
    fields += list(dict.fromkeys(k for row in history for k in row if k not in fields))  # an objective's metrics
    with open(out / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(history)
    (out / "log.json").write_text(json.dumps(history, indent=1))
    (out / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")
    plot_loss(history, out / "loss.png", run_info)


def plot_loss(history: list[dict[str, Any]], path: Path, run_info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in history], [r["train_loss"] for r in history], label="train", lw=1)
    val = [r for r in history if r["val_loss"] is not None]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)",
           title=f"training loss ({run_info['parameters']:,} parameters, {history[-1]['tokens_seen'] if history else 0:,} tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
