"""Setting up a run folder: a new run (settings resolved, model source and corpus checked, a text
corpus tokenized into train.bin / val.bin) or the run in it to resume (its checkpoint, its settings with
this invocation's applied, its data). Everything is checked before the first step."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.jsonio import read_json
from decoderlm.formats import runs
from decoderlm.tokenizer import CharTokenizer, Tokenizer
from decoderlm.train import checkpoint, distributed
from decoderlm.train.config import FIELDS, TrainConfig, parse_sets, resolve_new, resolve_resume
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
from decoderlm.train.image_text import ImageTextSplit, check_model, is_image_text_dir, open_image_text

RESUME_KEYS = ("optimizer", "rng", "train_config", "history", "window")
# What a run writes into its folder; a new run may start over these (a run killed before its first
# checkpoint), never over anything else.
RUN_FILES = {checkpoint.CKPT_NAME, checkpoint.BEST_NAME, "train.bin", "val.bin", "log.csv", "log.json", "loss.png", "run.json"}
RUN_FILES |= {name + ".tmp" for name in RUN_FILES} | {checkpoint.SHARDED_NAME}


def open_run(cfg: TrainConfig, out: Path, world: World = World()) -> tuple[TrainConfig, dict[str, Any], Tokenizer, tuple[Split, Split]]:
    """The run in `out` to resume: its checkpoint, its settings with this invocation's applied, its data."""
    state = runs.read(out)
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise DecoderLMError(f"{out / checkpoint.CKPT_NAME} holds a model but not the training state --resume needs "
                             f"({', '.join(missing)}); start a new run with --data and another --out")
    settings = renamed_settings(state["train_config"])
    unknown = sorted(set(settings) - FIELDS.keys())
    if unknown:
        raise DecoderLMError(f"{out / checkpoint.CKPT_NAME} has training settings this decoderlm does not know ({', '.join(unknown)}); "
                             "upgrade decoderlm to resume it")
    if state.get("world_size", 1) != world.size:
        raise DecoderLMError(f"{out} was trained by {state.get('world_size', 1)} process(es), and this is {world.size}; "
                             "resume with the same number (the global batch and data order depend on it)")
    saved = {name: f.metadata["default"] for name, f in FIELDS.items() if name not in settings} | settings
    cfg, notes = resolve_resume(cfg, TrainConfig(**saved), state["step"])
    tokenizer = runs.tokenizer_from_dict(state["tokenizer"])
    splits = read_data(cfg, out, tokenizer)
    if not isinstance(splits[0], ImageTextSplit):
        check_sizes(max(map(len, splits[0])), sum(map(len, splits[1])), cfg.context, cfg.eval_batches, f"run folder {out}")
    if world.main:
        for note in notes:
            print(note, file=sys.stderr)
    return cfg, state, tokenizer, splits


def renamed_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A run's saved settings under today's names: a run trained before --precision fp32|bf16 became
    --dtype float32|bfloat16 (the spelling of every other command) resumes with the same setting."""
    if "precision" not in settings:
        return settings
    old = {k: v for k, v in settings.items() if k != "precision"}
    return old | {"dtype": {"fp32": "float32", "bf16": "bfloat16"}.get(settings["precision"], settings["precision"])}


def read_data(cfg: TrainConfig, out: Path, tokenizer: Tokenizer) -> tuple[Split, Split] | tuple[ImageTextSplit, ImageTextSplit]:
    """A run's splits: the prepared folder's shards or image+text examples, or the train.bin / val.bin the run wrote."""
    if is_image_text_dir(cfg.data):
        return open_image_text(cfg.data)[1:]
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
        if init is not None and tokenizer.get_vocab() != data_tokenizer.get_vocab():
            raise DecoderLMError(f"{cfg.data} was tokenized with another tokenizer than {cfg.init_from}'s; "
                                 f"run decoderlm prepare --tokenizer {cfg.init_from} for it")
        tokenizer = data_tokenizer
        if is_image_text_dir(cfg.data):
            manifest, *splits = open_image_text(cfg.data)
        else:
            splits = open_data_dir(cfg.data)
            check_sizes(max(map(len, splits[0]), default=0), sum(map(len, splits[1])), cfg.context, cfg.eval_batches,
                        f"data folder {cfg.data}")
    else:
        text = read_corpus(cfg.data)
        if init is None:
            tokenizer = CharTokenizer.from_text(text)
        ids = np.array(tokenizer.encode(text, add_special_tokens=False), dtype=token_dtype(tokenizer.vocab_size))
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
        images = is_image_text_dir(cfg.data)
        config = model_config(cfg, tokenizer.vocab_size, **({"image_token_id": manifest["image_token_id"]} if images else {}))
    if is_image_text_dir(cfg.data):
        check_model(config, manifest, cfg.context, f"data folder {cfg.data}")
    return cfg, {**state, "config": config.to_dict()}, tokenizer, tuple(splits)


def model_config(cfg: TrainConfig, vocab_size: int, **from_data: Any) -> ModelConfig:
    """--preset or --config, with --set applied; the vocabulary from the tokenizer, the length from --context,
    and what the data fixes (image+text data: the image token); a --config file may leave these out."""
    base = read_json(cfg.config, "ModelConfig file", "give a file of ModelConfig fields") if cfg.config else ModelConfig.from_preset(cfg.preset).to_dict()
    fields = base | parse_sets(cfg.set) | {"vocab_size": vocab_size, "max_seq_len": cfg.context, "dropout": cfg.dropout} | from_data
    return ModelConfig.from_dict(fields)


def load_data_tokenizer(data_dir: str) -> Tokenizer:
    from decoderlm.train.prepare import load_tokenizer

    return load_tokenizer(data_dir)


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
