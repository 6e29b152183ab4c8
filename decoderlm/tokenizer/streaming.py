"""Incremental detokenization: text as tokens arrive, never half a character, never a lost space.

Two things make decoding one token at a time wrong. A multi-byte UTF-8 character (Chinese, emoji) can
span several byte-level BPE or byte-fallback tokens; decoding a prefix of them yields U+FFFD. And
SentencePiece decoders (Llama 2, Mistral) drop the leading space of the first word they decode, so
"▁world" alone decodes to "world", but after "▁Hello" to " world". So we decode a short window of
recent ids that starts with ids already printed (the first window: the prompt's last ids) and print
only what the window adds beyond them. Text that still ends in U+FFFD is held back, and a window never
starts inside a character (a byte-fallback decoder turns a whole run of byte pieces into U+FFFD if
the run, cut at the window's start, is not valid UTF-8).

The result: decode(prompt) + streamed text == decode(prompt + generated ids), but for a trailing
incomplete character. (A run of byte pieces with an invalid byte decodes to U+FFFD as a whole; a
stream that already printed the run's valid start keeps it.)

`StopMatcher` then cuts such a stream where a stop string first completes (the server's `stop`,
`generate --stop`).
"""

from __future__ import annotations

from collections.abc import Sequence

from decoderlm.tokenizer.protocol import Tokenizer

CONTEXT = 8  # prompt ids decoded with the first new ones: enough for a 4-byte character and a word before it


class StreamDecoder:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        prompt = list(prompt_ids)
        start = max(0, len(prompt) - CONTEXT)
        while start and self._inside_a_character(prompt[start:]):
            start -= 1
        self.ids: list[int] = prompt[start:]
        self.prefix = 0  # window start: ids before it are printed and no longer needed as context
        self.read = len(self.ids)  # ids before this are printed (or are the prompt's)
        # The text of ids[prefix:read]. A prompt that ends inside a character has printed only what
        # comes before it, so the character comes out whole when the generated ids complete it.
        self.printed = tokenizer.decode(self.ids).rstrip("\ufffd")

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(self.printed) or text.endswith("\ufffd"):
            return ""
        new = text[len(self.printed) :]
        if not self._inside_a_character(self.ids[self.read :]):
            self.prefix = self.read
        self.read = len(self.ids)
        self.printed = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return new

    def flush(self) -> str:
        """Whatever is still held back at the end (a trailing incomplete character is dropped)."""
        text = self.tokenizer.decode(self.ids[self.prefix :])
        new = text[len(self.printed) :].rstrip("\ufffd")
        self.prefix = self.read = len(self.ids)
        self.printed = ""
        return new

    def _inside_a_character(self, ids: list[int]) -> bool:
        return self.tokenizer.decode(ids).startswith("\ufffd")


class StopMatcher:
    """Cuts streamed text where a stop string first completes. A stop string can arrive split across tokens
    ("Obs" + "erver:"), so text that could still be the start of one is held back until the next token
    settles it; the stop string itself is never released."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""  # text received but not yet released
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; return what can be released now. Generation stops where a stop string is first
        completed: `stopped` is set and everything from that stop string on is dropped."""
        if self.stopped:
            return ""
        for ch in text:  # character by character, so where generation stops never depends on how text was split
            self.pending += ch
            starts = [len(self.pending) - len(s) for s in self.stops if self.pending.endswith(s)]
            if starts:  # the first stop string to complete; of those ending here, the longest
                self.stopped = True
                out, self.pending = self.pending[: min(starts)], ""
                return out
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(self.pending) + 1)) if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """At the end of generation the held-back text is not a stop string after all."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
