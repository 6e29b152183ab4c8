"""Text ↔ token ids. `CharTokenizer` for models trained here; BPE tokenizers of pretrained models
are wrapped in `decoderlm.tokenizer.bpe`. Both satisfy `Tokenizer`."""

from __future__ import annotations

from typing import Protocol

from decoderlm.tokenizer.char import CharTokenizer
from decoderlm.tokenizer.streaming import StreamDecoder


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


__all__ = ["CharTokenizer", "StreamDecoder", "Tokenizer"]
