"""Character-level tokenizer: one id per distinct character of the training corpus."""

from __future__ import annotations

from typing import Any

from decoderlm.errors import DecoderLMError


class CharTokenizer:
    def __init__(self, chars: list[str]) -> None:
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        self.eos_token_ids: list[int] = []

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        if not text:
            raise DecoderLMError("the corpus is empty; give a text file with some content")
        return cls(sorted(set(text)))

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise DecoderLMError(f"character {e.args[0]!r} never appeared in the training corpus; remove it from the prompt") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CharTokenizer":
        return cls(data["chars"])
