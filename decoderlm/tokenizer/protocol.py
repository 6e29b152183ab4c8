"""`Tokenizer`: what decoderlm asks of a tokenizer, whichever kind `load` returns."""

from __future__ import annotations

from typing import Protocol

from decoderlm.tokenizer.chat import Message


class Tokenizer(Protocol):
    """Text ↔ ids, the ids that end a turn, and the chat template (None: the model does not chat).
    `CharTokenizer` and `HFTokenizer` satisfy it."""

    eos_token_ids: list[int]  # EOS first, then end-of-turn ids
    chat_template: str | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str: ...

    def get_vocab(self) -> dict[str, int]:
        """Token → id, every token (two tokenizers map text alike when these are equal)."""
        ...
