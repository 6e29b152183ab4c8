"""Training data: tokens in memmapped shards (a prepared DATA_DIR, or train.bin / val.bin that a run
writes from one text file), from which training draws random windows.

A split is a list of shards; a window never crosses a shard boundary. Under torchrun every rank draws
the same global batch of window starts (one shared generator) and reads only its own slice of them,
so N processes see exactly the windows one process with an N times larger batch would.

Sizes are checked before any of this is written or any step runs: each split needs one window of
`context` + 1 tokens (inputs and their shifted targets), and the val split enough windows for the
requested evaluation, so a small corpus is an error at the door rather than at the first evaluation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer import CharTokenizer

VAL_FRACTION = 0.1  # the last 10% of the corpus
EVAL_BATCH = 64  # val windows per evaluation batch
MANIFEST = "manifest.json"  # marks a folder `decoderlm prepare` wrote

Split = list[np.ndarray]  # shards of token ids


def is_data_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DecoderLMError(f"cannot read {path} ({e}); run `decoderlm prepare` again into a new --out") from None
    if manifest.get("format") != "decoderlm-tokens" or "splits" not in manifest:
        raise DecoderLMError(f"{path} is not a manifest `decoderlm prepare` wrote; prepare the data again")
    return manifest


def open_data_dir(data_dir: str | Path) -> tuple[Split, Split]:
    """The train and val shards of a prepared folder as read-only memmaps, checked against the manifest."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    dtype = np.dtype(manifest["dtype"])
    splits = []
    for name in ("train", "val"):
        shards = []
        for shard in manifest["splits"][name]["shards"]:
            path = data_dir / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise DecoderLMError(f"{path} is missing or not the {shard['tokens']} tokens the manifest lists; "
                                     "run `decoderlm prepare` again")
            if shard["tokens"]:
                shards.append(np.memmap(path, dtype=dtype, mode="r"))
        splits.append(shards)
    return splits[0], splits[1]


def read_corpus(path: str | Path) -> str:
    path = Path(path)
    if path.is_dir():
        raise DecoderLMError(f"data path {path} is a folder; pass --data with a UTF-8 text file")
    if not path.exists():
        raise DecoderLMError(f"data file {path} does not exist; pass --data with a UTF-8 text file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DecoderLMError(f"cannot read data file {path} ({e.strerror or e}); check its permissions") from None
    if not raw:
        raise DecoderLMError(f"data file {path} is empty; give a text file with some content")
    if b"\0" in raw:
        raise DecoderLMError(f"data file {path} looks binary (it holds NUL bytes); pass a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecoderLMError(f"data file {path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from None


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size < 2**16 else np.uint32


def split_sizes(n_tokens: int) -> tuple[int, int]:
    n_train = int(n_tokens * (1 - VAL_FRACTION))
    return n_train, n_tokens - n_train


def min_corpus(train_tokens: int, val_tokens: int) -> int:
    """The fewest tokens whose 90/10 split gives each split at least the tokens asked for."""
    n = max(1, int(max(train_tokens / (1 - VAL_FRACTION), val_tokens / VAL_FRACTION)) - 20)
    while any(have < need for have, need in zip(split_sizes(n), (train_tokens, val_tokens))):
        n += 1
    return n


def check_sizes(n_train: int, n_val: int, context: int, eval_batches: int | None, where: str) -> None:
    """Refuse splits too small for one window, or a val split too small for --eval-batches."""
    if min(n_train, n_val) <= context:
        split, have = ("train", n_train) if n_train <= context else ("val", n_val)
        shorter = f" or a --context of at most {min(n_train, n_val) - 1}" if min(n_train, n_val) > 1 else ""
        raise DecoderLMError(f"{where}: the {split} split has {have} tokens, too few for one window of --context {context} "
                             f"(needs {context + 1}); use a corpus of at least {min_corpus(context + 1, context + 1)} characters{shorter}")
    if eval_batches is not None:
        available = -(-((n_val - 1) // context) // EVAL_BATCH)
        if eval_batches > available:
            need = (EVAL_BATCH * (eval_batches - 1) + 1) * context + 1
            raise DecoderLMError(f"{where}: --eval-batches {eval_batches} needs a val split of at least {need} tokens (a corpus of "
                                 f"{min_corpus(context + 1, need)} characters), but it has {n_val}, enough for {available}; "
                                 "lower --eval-batches, or omit it to use the whole val split")


def encode(text: str, tokenizer: CharTokenizer) -> np.ndarray:
    return np.array(tokenizer.encode(text), dtype=token_dtype(tokenizer.vocab_size))


def write_splits(ids: np.ndarray, out_dir: Path) -> tuple[Split, Split]:
    """Split 90/10, write train.bin/val.bin; return them as read-only memmaps."""
    n_train, _ = split_sizes(len(ids))
    for name, part in (("train.bin", ids[:n_train]), ("val.bin", ids[n_train:])):
        tmp = out_dir / (name + ".tmp")
        part.tofile(tmp)
        tmp.replace(out_dir / name)
    return load_splits(out_dir, ids.dtype)


def load_splits(out_dir: Path, dtype: type) -> tuple[Split, Split]:
    """train.bin / val.bin of a run folder, each a one-shard split."""
    splits = []
    for name in ("train.bin", "val.bin"):
        try:
            splits.append([np.memmap(out_dir / name, dtype=dtype, mode="r")])
        except (OSError, ValueError) as e:
            raise DecoderLMError(f"cannot read {out_dir / name}, the run's tokenized data ({e}); "
                                 "restore it, or start a new run with --data and another --out") from None
    return splits[0], splits[1]


def window_starts(split: Split, n: int, context: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """n random (shard, offset) window starts, uniform over every start that leaves context + 1 tokens."""
    room = [max(len(shard) - context, 0) for shard in split]
    if sum(room) == 0:
        longest = max((len(shard) for shard in split), default=0)
        raise DecoderLMError(f"a data split's longest shard has {longest} tokens, fewer than context {context} + 1; "
                             "use a longer corpus or a shorter --context")
    bounds = np.cumsum(room)
    flat = torch.randint(int(bounds[-1]), (n,), generator=generator).numpy()
    shard = np.searchsorted(bounds, flat, side="right")
    return [(int(k), int(f - (bounds[k - 1] if k else 0))) for k, f in zip(shard, flat)]


def read_windows(split: Split, starts: list[tuple[int, int]], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x (B, T) and targets y (B, T) = x shifted left by one token."""
    rows = np.stack([split[k][s : s + context + 1] for k, s in starts]).astype(np.int64)
    return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])


def get_batch(data: np.ndarray | Split, batch_size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows x (B, T) and targets y (B, T) = x shifted left by one token."""
    split = data if isinstance(data, list) else [data]
    return read_windows(split, window_starts(split, batch_size, context, generator), context)


def eval_windows(data: np.ndarray | Split, context: int, batch_size: int = EVAL_BATCH) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows covering the whole split in order, for an exact val loss. Yields (x, y) batches."""
    split = data if isinstance(data, list) else [data]
    for shard in split:
        n = (len(shard) - 1) // context
        if n <= 0:
            continue
        arr = np.asarray(shard[: n * context + 1]).astype(np.int64)
        x_all = torch.from_numpy(arr[:-1].reshape(n, context))
        y_all = torch.from_numpy(arr[1:].reshape(n, context))
        for i in range(0, n, batch_size):
            yield x_all[i : i + batch_size], y_all[i : i + batch_size]
