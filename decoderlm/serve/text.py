"""From an engine's token stream to the text a client sees: detokenize, cut at stop strings.

A stop string can arrive split across tokens ("Obs" + "erver:"), so text that could still be the
start of one is held back until the next token settles it; the stop string itself is never emitted.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from decoderlm.tokenizer import StreamDecoder


class StopMatcher:
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


@dataclass
class Delta:
    """What one engine output adds to a choice: new text, the token's logprobs, maybe the end."""

    text: str = ""
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    stop_string: bool = False  # finished by a stop string: the engine request is still running


@dataclass
class Timing:
    """Token arrival times of one sequence, for the TTFT / inter-token latency histograms."""

    start: float = field(default_factory=time.perf_counter)  # when the HTTP request arrived
    last: float | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)

    def token(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.gaps.append(now - self.last)
        self.last = now


async def text_deltas(outputs: AsyncIterator, tokenizer, stops: list[str], timing: Timing) -> AsyncIterator[Delta]:
    """An engine stream of TokenOutputs as Deltas of text. Ends at the engine's final output, or
    earlier at a stop string (`Delta.stop_string`), when the caller must abort the engine request."""
    decoder, matcher = StreamDecoder(tokenizer), StopMatcher(stops)
    async for out in outputs:
        delta = Delta(finish_reason=out.finish_reason)
        if out.token_id is not None:
            timing.token()
            delta.token_id, delta.logprob, delta.top_logprobs = out.token_id, out.logprob, out.top_logprobs
            delta.text = matcher.push(decoder.push(out.token_id))
        if out.finish_reason is not None and not matcher.stopped:
            delta.text += matcher.push(decoder.flush()) + matcher.flush()
        if matcher.stopped:
            delta.finish_reason, delta.stop_string = "stop", True
        yield delta
        if delta.finish_reason is not None:
            return
