"""Incremental detokenization that never prints half a character.

A multi-byte UTF-8 character (Chinese, emoji) can span several byte-level BPE tokens; decoding a
prefix of them yields U+FFFD. We hold text back until it decodes cleanly, and decode a short window
of recent ids (not the whole output) so each step stays cheap — and so tokenizers that add a space
depending on the previous token still decode in context.
"""

from __future__ import annotations

from decoderlm.tokenizer.char import CharTokenizer


class StreamDecoder:
    def __init__(self, tokenizer: "CharTokenizer | object") -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are printed and no longer needed as context
        self.read = 0  # ids up to here have been printed

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        printed = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(printed) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(printed) :]

    def flush(self) -> str:
        """Whatever is still held back at the end (a trailing incomplete character is dropped)."""
        printed = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(printed) :].rstrip("\ufffd")
