"""Training data: tokenize the corpus once into train.bin / val.bin (a memmap), then draw random windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer import CharTokenizer


def read_corpus(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise DecoderLMError(f"data file {path} does not exist; pass --data with a UTF-8 text file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecoderLMError(f"data file {path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8") from None
    if not text:
        raise DecoderLMError(f"data file {path} is empty; give a text file with some content")
    return text


def prepare(text: str, tokenizer: CharTokenizer, out_dir: Path, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Encode once, split 90/10, write uint16 train.bin/val.bin; return them as read-only memmaps."""
    ids = np.array(tokenizer.encode(text), dtype=np.uint16 if tokenizer.vocab_size < 2**16 else np.uint32)
    n_train = int(len(ids) * (1 - val_fraction))
    for name, part in (("train.bin", ids[:n_train]), ("val.bin", ids[n_train:])):
        tmp = out_dir / (name + ".tmp")
        part.tofile(tmp)
        tmp.replace(out_dir / name)
    return load_split(out_dir, "train", ids.dtype), load_split(out_dir, "val", ids.dtype)


def load_split(out_dir: Path, split: str, dtype: np.dtype) -> np.ndarray:
    return np.memmap(out_dir / f"{split}.bin", dtype=dtype, mode="r")


def get_batch(data: np.ndarray, batch_size: int, context: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows x (B, T) and targets y (B, T) = x shifted left by one token."""
    if len(data) <= context:
        raise DecoderLMError(f"a data split has {len(data)} tokens, fewer than context {context} + 1; use a longer corpus or a shorter --context")
    starts = torch.randint(len(data) - context, (batch_size,), generator=generator).tolist()
    x = torch.from_numpy(np.stack([data[s : s + context] for s in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([data[s + 1 : s + 1 + context] for s in starts]).astype(np.int64))
    return x, y


def eval_windows(data: np.ndarray, context: int, batch_size: int):
    """Non-overlapping windows covering the whole split, for an exact val loss. Yields (x, y) batches."""
    n = (len(data) - 1) // context
    arr = np.asarray(data[: n * context + 1]).astype(np.int64)
    x_all = torch.from_numpy(arr[:-1].reshape(n, context))
    y_all = torch.from_numpy(arr[1:].reshape(n, context))
    for i in range(0, n, batch_size):
        yield x_all[i : i + batch_size], y_all[i : i + batch_size]
