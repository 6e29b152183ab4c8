"""Training data: tokenize the corpus once into train.bin / val.bin (a memmap), then draw random windows.

Sizes are checked before any of this is written or any step runs: each split needs one window of
`context` + 1 tokens (inputs and their shifted targets), and the val split enough windows for the
requested evaluation, so a small corpus is an error at the door rather than at the first evaluation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer import CharTokenizer

VAL_FRACTION = 0.1  # the last 10% of the corpus
EVAL_BATCH = 64  # val windows per evaluation batch


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


def write_splits(ids: np.ndarray, out_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Split 90/10, write train.bin/val.bin; return them as read-only memmaps."""
    n_train, _ = split_sizes(len(ids))
    for name, part in (("train.bin", ids[:n_train]), ("val.bin", ids[n_train:])):
        tmp = out_dir / (name + ".tmp")
        part.tofile(tmp)
        tmp.replace(out_dir / name)
    return load_splits(out_dir, ids.dtype)


def load_splits(out_dir: Path, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    splits = []
    for name in ("train.bin", "val.bin"):
        try:
            splits.append(np.memmap(out_dir / name, dtype=dtype, mode="r"))
        except (OSError, ValueError) as e:
            raise DecoderLMError(f"cannot read {out_dir / name}, the run's tokenized data ({e}); "
                                 "restore it, or start a new run with --data and another --out") from None
    return splits[0], splits[1]


def get_batch(data: np.ndarray, batch_size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows x (B, T) and targets y (B, T) = x shifted left by one token."""
    if len(data) <= context:
        raise DecoderLMError(f"a data split has {len(data)} tokens, fewer than context {context} + 1; use a longer corpus or a shorter --context")
    starts = torch.randint(len(data) - context, (batch_size,), generator=generator).tolist()
    x = torch.from_numpy(np.stack([data[s : s + context] for s in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[s + 1 : s + 1 + context] for s in starts]).astype(np.int64))
    return x, y


def eval_windows(data: np.ndarray, context: int, batch_size: int = EVAL_BATCH):
    """Non-overlapping windows covering the whole split, for an exact val loss. Yields (x, y) batches."""
    n = (len(data) - 1) // context
    arr = np.asarray(data[: n * context + 1]).astype(np.int64)
    x_all = torch.from_numpy(arr[:-1].reshape(n, context))
    y_all = torch.from_numpy(arr[1:].reshape(n, context))
    for i in range(0, n, batch_size):
        yield x_all[i : i + batch_size], y_all[i : i + batch_size]
