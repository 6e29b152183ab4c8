"""`decoderlm prepare`: a corpus → a DATA_DIR of token shards that `train --data DATA_DIR` reads.

    DATA_DIR/
      manifest.json        format, tokenizer, dtype, token counts per split and shard, source hashes
      tokenizer.json (+ tokenizer_config.json)   for BPE or a model's tokenizer; a char vocabulary
                           lives in the manifest itself
      train_0000.bin ...   uint16 (vocab < 65536) or uint32 token ids, memmapped by training
      val_0000.bin ...

A JSONL of (image, prompt, answer) records is prepared as image+text data instead (decoderlm.train.image_text).

Sources are text files, folders of them (*.txt, *.md, *.jsonl, recursively, in name order) and JSONL
files whose lines carry a `text` field; each file or JSONL record is one document, and documents are
joined by the tokenizer's end-of-text token (a newline for a char vocabulary). The corpus is
streamed in chunks of about CHUNK_BYTES and never held whole in memory; the last `val_fraction` of
its bytes become the val split. Chunks are tokenized by a pool of worker processes, in order.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from decoderlm.errors import DecoderLMError
from decoderlm.formats.runs import tokenizer_from_dict, tokenizer_to_dict
from decoderlm.tokenizer import CharTokenizer
from decoderlm.tokenizer.bpe import HFTokenizer
from decoderlm.train.data import MANIFEST, VAL_FRACTION, read_manifest, token_dtype
from decoderlm.train.image_text import is_image_text, is_image_text_dir, prepare_image_text

CHUNK_BYTES = 1 << 20
SHARD_TOKENS = 100_000_000
TEXT_SUFFIXES = (".txt", ".md", ".text")
END_OF_TEXT = "<|endoftext|>"


@dataclass
class Chunk:
    text: str
    split: str  # "train" or "val"
    end_of_document: bool  # append the document separator after it


# --- reading the corpus ---------------------------------------------------------------------------


def source_files(paths: list[str]) -> list[Path]:
    """Every file the given paths name, folders expanded; refused if none is readable text."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + (".jsonl",))
            if not found:
                raise DecoderLMError(f"folder {path} holds no .txt, .md or .jsonl files; give text files or JSONL")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise DecoderLMError(f"data path {path} does not exist; give text files, folders of them or JSONL files")
    return files


def read_chunks(files: list[Path], val_fraction: float, hashes: dict[str, str] | None = None) -> Iterator[Chunk]:
    """The corpus as chunks of whole lines (or JSONL records), split at `val_fraction` of its bytes from the end.
    `hashes`, if given, receives each file's sha256."""
    total = sum(f.stat().st_size for f in files)
    boundary = total * (1 - val_fraction)
    seen = 0
    for file in files:
        digest = hashlib.sha256()
        jsonl = file.suffix == ".jsonl"
        lines: list[str] = []
        size = 0
        chunk_split = "train" if seen < boundary else "val"
        try:
            with open(file, "rb") as f:
                for number, raw in enumerate(f, 1):
                    digest.update(raw)
                    split = "train" if seen < boundary else "val"
                    seen += len(raw)
                    text = decode_line(raw, file, number, jsonl)
                    if text is None:
                        continue
                    if jsonl:
                        yield Chunk(text, split, True)
                        continue
                    if lines and split != chunk_split:
                        yield Chunk("".join(lines), chunk_split, False)
                        lines, size = [], 0
                    chunk_split = split
                    lines.append(text)
                    size += len(raw)
                    if size >= CHUNK_BYTES:
                        yield Chunk("".join(lines), split, False)
                        lines, size = [], 0
        except OSError as e:
            raise DecoderLMError(f"cannot read {file} ({e.strerror or e}); check its permissions") from None
        if not jsonl and lines:
            yield Chunk("".join(lines), chunk_split, True)
        if hashes is not None:
            hashes[str(file)] = digest.hexdigest()


def decode_line(raw: bytes, file: Path, number: int, jsonl: bool) -> str | None:
    """One line as text (a JSONL record: its `text` field; None for a blank line)."""
    where = f"{file} line {number}"
    if b"\0" in raw:
        raise DecoderLMError(f"{where} holds NUL bytes: {file} looks binary; give UTF-8 text or JSONL")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecoderLMError(f"{where} is not UTF-8 (bad byte at column {e.start}); convert the file to UTF-8") from None
    if not jsonl:
        return text
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise DecoderLMError(f"{where} is not valid JSON ({e.msg}); fix the line or remove it") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DecoderLMError(f"{where} has no string `text` field; each JSONL line must be {{\"text\": \"...\"}}")
    return record["text"]


# --- tokenizers ---------------------------------------------------------------------------------


def make_tokenizer(spec: str, files: list[Path], val_fraction: float) -> CharTokenizer | HFTokenizer:
    """`char`, `bpe:VOCAB` (trained here on the train split) or any model decoderlm.load reads (its tokenizer)."""
    if spec == "char":
        chars: set[str] = set("\n")  # the document separator
        for chunk in tqdm(read_chunks(files, val_fraction), desc="vocabulary", unit="chunk", leave=False):
            chars.update(chunk.text)
        return CharTokenizer(sorted(chars))
    if spec.startswith("bpe:"):
        vocab = spec[4:]
        if not vocab.isdigit() or not 256 < int(vocab) < 2**32:
            raise DecoderLMError(f"--tokenizer {spec}: give the vocabulary size as bpe:N with N above 256 (e.g. bpe:2048)")
        return train_bpe(files, val_fraction, int(vocab))
    from decoderlm.loader import load

    _, tokenizer = load(spec)
    return tokenizer


def train_bpe(files: list[Path], val_fraction: float, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's scheme: every byte is a symbol, so any text encodes) trained on the train split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (c.text for c in tqdm(read_chunks(files, val_fraction), desc="train BPE", unit="chunk", leave=False) if c.split == "train")
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer, special_tokens={"eos_token": END_OF_TEXT})


def separator(tokenizer: CharTokenizer | HFTokenizer) -> list[int]:
    """The ids that end a document: the end-of-text token, or for a char vocabulary a newline."""
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.encode("\n")
    return tokenizer.eos_token_ids[:1]


# Worker processes rebuild the tokenizer once from plain data, then encode chunks.
_worker_tokenizer: CharTokenizer | HFTokenizer | None = None


def _init_worker(tokenizer_dict: dict[str, Any]) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer_from_dict(tokenizer_dict)


def _encode(tokenizer: CharTokenizer | HFTokenizer, chunk: Chunk) -> tuple[str, list[int], int]:
    ids = tokenizer.encode(chunk.text, add_special_tokens=False)
    return chunk.split, ids + (separator(tokenizer) if chunk.end_of_document else []), len(chunk.text.encode())


def _encode_in_worker(chunk: Chunk) -> tuple[str, list[int], int]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, chunk)


# --- writing shards -----------------------------------------------------------------------------


class ShardWriter:
    """Appends ids to NAME_0000.bin, NAME_0001.bin, ..., starting a new file every `shard_tokens` tokens."""

    def __init__(self, out: Path, name: str, dtype: type, shard_tokens: int) -> None:
        self.out, self.name, self.dtype, self.shard_tokens = out, name, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.file = None

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self.file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            ids[:room].tofile(self.file)
            self.shards[-1]["tokens"] += len(ids[:room])
            ids = ids[room:]

    def _next(self) -> None:
        self.close()
        name = f"{self.name}_{len(self.shards):04d}.bin"
        self.file = open(self.out / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def prepare(paths: list[str], out: str | Path, tokenizer: str = "char", val_fraction: float = VAL_FRACTION,
            workers: int | None = None, shard_tokens: int = SHARD_TOKENS) -> dict[str, Any]:
    """Tokenize the corpus into `out` (see the module docstring); returns the manifest."""
    out = Path(out)
    if not 0 < val_fraction < 1:
        raise DecoderLMError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if workers is not None and workers < 1:
        raise DecoderLMError(f"--workers must be a positive integer, got {workers}")
    if shard_tokens < 1:
        raise DecoderLMError(f"--shard-tokens must be a positive integer, got {shard_tokens}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DecoderLMError(f"--out {out} exists and is not an empty folder; choose a new folder for the data")
    files = source_files(paths)
    if is_image_text(files):
        return prepare_image_text(files[0], out, tokenizer, val_fraction)
    tok = make_tokenizer(tokenizer, files, val_fraction)
    dtype = token_dtype(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, HFTokenizer):
        tok.save(out)
    writers = {name: ShardWriter(out, name, dtype, shard_tokens) for name in ("train", "val")}
    hashes: dict[str, str] = {}
    chunks = read_chunks(files, val_fraction, hashes)
    workers = workers or os.cpu_count() or 1
    bar = tqdm(total=sum(f.stat().st_size for f in files), desc="tokenize", unit="B", unit_scale=True, dynamic_ncols=True)
    pool = multiprocessing.get_context("fork").Pool(workers, _init_worker, (tokenizer_to_dict(tok),)) if workers > 1 else _nullpool()
    with pool as pool:
        encoded = pool.imap(_encode_in_worker, chunks, chunksize=4) if pool else (_encode(tok, c) for c in chunks)
        for split, ids, size in encoded:
            writers[split].write(np.asarray(ids, dtype=dtype))
            bar.update(size)
    bar.close()
    for writer in writers.values():
        writer.close()
    splits = {name: {"tokens": sum(s["tokens"] for s in w.shards), "shards": w.shards} for name, w in writers.items()}
    manifest = {
        "format": "decoderlm-tokens", "version": 1, "dtype": np.dtype(dtype).name, "tokenizer_spec": tokenizer,
        "tokenizer": tokenizer_to_dict(tok) if isinstance(tok, CharTokenizer) else {"type": "hf", "file": "tokenizer.json"},
        "vocab_size": tok.vocab_size, "val_fraction": val_fraction, "splits": splits,
        "sources": [{"path": str(f), "bytes": f.stat().st_size, "sha256": hashes[str(f)]} for f in files],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class _nullpool:
    """Stands in for the Pool when tokenizing in this process (one worker)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def load_tokenizer(data_dir: str | Path) -> CharTokenizer | HFTokenizer:
    """The tokenizer a prepared folder was written with."""
    if is_image_text_dir(data_dir):
        return HFTokenizer.from_hf_folder(data_dir)
    manifest = read_manifest(data_dir)
    if manifest["tokenizer"]["type"] == "char":
        return tokenizer_from_dict(manifest["tokenizer"])
    return HFTokenizer.from_hf_folder(data_dir)
