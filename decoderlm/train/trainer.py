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
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decoderlm import isa
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.model import Transformer
from decoderlm.tokenizer import Tokenizer
from decoderlm.train import checkpoint, distributed
from decoderlm.train.config import FIELDS, TrainConfig, run_folder
from decoderlm.train.distributed import World
from decoderlm.train.image_text import ImageTextObjective, ImageTextSplit
from decoderlm.train.logs import ProgressBar, Throughput, log_row, save_logs
from decoderlm.train.objective import LMObjective, Objective
from decoderlm.train.optim import make_optimizer
from decoderlm.train.run_folder import open_run, start_run
from decoderlm.train.saver import CheckpointSaver, RunFolderSaver
from decoderlm.train.schedule import lr_at
from decoderlm.train.state import TrainState, rng_states, set_rng_states

COMPILE_CACHE = Path.home() / ".cache" / "decoderlm" / "inductor"


def emulated_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    """--dtype bfloat16 on a CPU without bf16 instructions: its matmuls would be ~100x slower than fp32's,
    so the run computes in fp32 instead (and says so once)."""
    return cfg.dtype == "bfloat16" and device.type == "cpu" and not isa.native_bf16()


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.dtype == "bfloat16" and not emulated_bf16(cfg, device):
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
    if device.type == "cuda" and cfg.dtype == "bfloat16":
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
        if emulated_bf16(cfg, device) and world.rank == 0:
            print(f"this CPU runs no bf16 instructions at the {isa.current()} level (AVX512-BF16 or AMX): bf16 matmuls would "
                  "be ~100x slower than float32's, so --dtype bfloat16 computes in float32", file=sys.stderr, flush=True)
        torch.manual_seed(cfg.seed)
        model = Transformer(ModelConfig.from_dict(state["config"]))
        if "init" in state:
            model.load_state_dict(state.pop("init"))
        if world.rank:
            torch.manual_seed(cfg.seed + world.rank)  # dropout differs per process; the weights above do not
        kind = ImageTextObjective if isinstance(train_data, ImageTextSplit) else LMObjective
        objective = kind(train_data, val_data, cfg, world, device)
        result = fit(model.to(device), objective, cfg, out, state, tokenizer, world, device)
        if world.distributed:
            # FSDP's modules and their collectives' pending work go while the process group lives: left to the
            # interpreter's exit, gloo's threads can abort a rank as it leaves (pytorch/pytorch#90549).
            del model, objective
            gc.collect()
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
        world: World = World(), device: torch.device = torch.device("cpu"), saver: CheckpointSaver | None = None) -> dict[str, Any]:
    """The loop: `objective` says what a step trains on; `state` is a checkpoint to continue from (it has
    "optimizer") or a new run's {"config", ...}. Rank 0 alone writes the logs.

    `saver` saves the progress at each evaluation (and --save-interval, --stop-after): by default the run
    folder's checkpoints; fine-tuning passes an `ExportSaver`, which writes the model itself."""
    sharded = cfg.fsdp and world.distributed
    if "optimizer" in state and not state.get("sharded"):
        model.load_state_dict(state["model"])
    net = wrap(model, cfg, world, device)
    optimizer = make_optimizer(model, cfg, device)
    progress = TrainState()
    if "optimizer" in state:
        restore(state, model, optimizer, objective, progress, out, world, device)
    saver = saver or RunFolderSaver(out, cfg, tokenizer, world)
    info = run_info(model, cfg, world, device)
    speed = Throughput()
    bar = ProgressBar(cfg.max_steps, progress.step, world.main, speed)

    def save(name: str = checkpoint.CKPT_NAME) -> None:
        saver.save(name, model, optimizer, progress, rng_states(objective, device, world))  # every process: RNG states are gathered
        if world.main and name == checkpoint.CKPT_NAME:
            save_logs(out, progress.history, info)
        distributed.barrier(world)

    net.train()
    started = time.perf_counter()
    while progress.step < cfg.max_steps:
        lr = lr_at(progress.step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.decay_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        speed.start()
        loss, tokens = train_step(net, model, objective, optimizer, cfg, device, world)
        speed.stop(tokens)
        progress.record(loss, tokens)
        bar.step()
        step, saved = progress.step, False
        evaluating = step % cfg.eval_interval == 0 or step == cfg.max_steps  # on its own interval, whatever the log interval
        if step % cfg.log_interval == 0 or evaluating:
            row = log_row(progress, lr, speed.take_window(), info)
            if evaluating:
                # The model itself, not `net`: a compiled net would compile again for eval mode and each val batch size.
                row["val_loss"] = evaluate(model, objective, cfg, device, world)
                row |= objective_metrics(model, objective, cfg, device)
            progress.history.append(row)
            bar.show(row)
            if evaluating:
                if row["val_loss"] < progress.best_val:
                    progress.best_val = row["val_loss"]
                    save(checkpoint.BEST_NAME)
                save()
                saved = True
        if not saved and (cfg.save_interval is not None and step % cfg.save_interval == 0 or step == cfg.stop_after):
            save()
        if step == cfg.stop_after:
            break
    bar.close()
    vals = [r["val_loss"] for r in progress.history if r["val_loss"] is not None]
    return {"step": progress.step, "val_loss": vals[-1] if vals else None, "seconds": time.perf_counter() - started, "config": cfg,
            "tokens_per_s": speed.rate, "out": str(out), "world": world, "model": plain_model(model, sharded, world),
            "tokenizer": tokenizer}


def restore(state: dict[str, Any], model: Transformer, optimizer: torch.optim.Optimizer, objective: Objective, progress: TrainState,
            out: Path, world: World, device: torch.device) -> None:
    """Continue from a checkpoint: the optimizer (FSDP: the model's and the optimizer's shards), every RNG
    stream and the loop's counters."""
    if state.get("sharded"):
        runs.load_sharded(out / state["sharded"], model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_states(state["rng"], objective, device, world)
    progress.load_state_dict(state)


def train_step(net: nn.Module, model: Transformer, objective: Objective, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
               device: torch.device, world: World) -> tuple[float, int]:
    """One optimizer step over the objective's micro-batches (DDP syncs gradients on the last one only);
    returns (mean train loss, targets trained on), over all processes."""
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=not (cfg.fsdp and world.distributed) or None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, count = distributed.all_sum([loss_sum / len(micro), count], world)
    return loss_sum / world.size, int(count)


def run_info(model: Transformer, cfg: TrainConfig, world: World, device: torch.device) -> dict[str, Any]:
    """run.json: what a fair comparison of two runs states besides the loss."""
    return {"parameters": model.num_parameters(),  # FSDP's sharded parameters report their whole size
            "flops_per_token": flops_per_token(model, cfg.context), "processes": world.size,
            "global_batch": cfg.batch_size * cfg.grad_accum * world.size, "peak_flops_per_device": peak_flops(cfg, device)}


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
