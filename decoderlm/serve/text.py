"""From an engine's token stream to the text a client sees: detokenize, cut at stop strings
(`decoderlm.tokenizer.StopMatcher`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from decoderlm.tokenizer import StopMatcher, StreamDecoder


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
