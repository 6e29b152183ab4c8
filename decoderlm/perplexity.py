"""Sliding-window perplexity: how surprised the model is by a text longer than its context.

The text's ids are covered by windows of `context` tokens that start every `stride` tokens. Each
window scores only the tokens the previous window did not, so every token is scored once, with at
least `context - stride` tokens of history (except in the first window). A smaller stride gives each
token more history and costs more forwards; stride == context is the cheap, pessimistic end, where a
window's first token has no history in it and is not scored (as in transformers' perplexity guide).

    perplexity = exp(total negative log-likelihood / tokens scored)

Bits per character / byte divide the same total (in bits) by the length of the scored text, which
compares models with different tokenizers.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed to the model
    end: int  # one past the last token fed
    score_from: int  # tokens score_from..end-1 are scored (each predicted from the ones before it)

    @property
    def scored(self) -> int:
        return self.end - self.score_from


@dataclass
class PerplexityResult:
    perplexity: float
    nll_per_token: float  # nats
    tokens_scored: int
    tokens: int
    windows: int
    context: int
    stride: int
    chars: int | None = None  # of the scored text; None without a tokenizer to decode it
    bytes: int | None = None  # UTF-8
    bits_per_char: float | None = None
    bits_per_byte: float | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows over n_tokens ids; the last one ends at the last token. Windows that would score
    nothing (a one-token tail after stride == context) are left out."""
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        window = Window(begin, end, max(prev_end, begin + 1))
        if window.scored > 0:
            out.append(window)
        prev_end = end
        if end == n_tokens:
            break
    return out


def check_settings(model: Transformer, n_tokens: int, context: int, stride: int, batch_size: int = 1) -> None:
    """Raise a one-line DecoderLMError for settings that cannot give a perplexity."""
    max_len = model.config.max_seq_len
    checks = [
        (n_tokens >= 2, f"the data has {n_tokens} token(s); perplexity needs at least 2 (give a longer text)"),
        (context <= max_len, f"--context {context} is longer than the model's context ({max_len}); use --context {max_len} or less"),
        (context >= 2, f"--context must be at least 2, got {context}"),
        (stride >= 1, f"--stride must be at least 1, got {stride}"),
        (stride <= context, f"--stride {stride} is longer than --context {context}, so tokens between windows would go unscored; use --stride {context} or less"),
        (batch_size >= 1, f"--batch-size must be at least 1, got {batch_size}"),
    ]
    for ok, message in checks:
        if not ok:
            raise DecoderLMError(message)


@torch.inference_mode()
def perplexity(model: Transformer, ids: list[int], context: int, stride: int, batch_size: int = 1,
               tokenizer=None, progress: bool | None = False) -> PerplexityResult:
    """Score `ids` with sliding windows (see the module docstring). Windows of the same shape run
    `batch_size` at a time. With a tokenizer, bits per character and per byte are reported too.
    progress: show a tqdm bar (None: only on a terminal)."""
    check_settings(model, len(ids), context, stride, batch_size)
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    tokens = torch.tensor(ids, device=device)
    plan = windows(len(ids), context, stride)
    nll, scored = 0.0, 0
    with tqdm(total=len(plan), desc="perplexity", unit="window", disable=None if progress is None else not progress, leave=False) as bar:
        for group in _batches(plan, batch_size):
            nll += _score(model, tokens, group)
            scored += sum(w.scored for w in group)
            bar.update(len(group))
            bar.set_postfix(ppl=f"{math.exp(nll / scored):.3f}")
    result = PerplexityResult(math.exp(nll / scored), nll / scored, scored, len(ids), len(plan), context, stride)
    if tokenizer is not None:
        text = "".join(tokenizer.decode(ids[a:b]) for a, b in _scored_spans(plan))
        result.chars, result.bytes = len(text), len(text.encode("utf-8"))
        bits = nll / math.log(2)
        result.bits_per_char = bits / result.chars if result.chars else None
        result.bits_per_byte = bits / result.bytes if result.bytes else None
    result.seconds = time.perf_counter() - t0
    return result


def _batches(plan: list[Window], batch_size: int) -> list[list[Window]]:
    """Consecutive windows of one shape (length, tokens scored), at most batch_size per group."""
    groups: list[list[Window]] = []
    for w in plan:
        last = groups[-1] if groups else None
        if last and len(last) < batch_size and (last[0].end - last[0].begin, last[0].scored) == (w.end - w.begin, w.scored):
            last.append(w)
        else:
            groups.append([w])
    return groups


def _score(model: Transformer, tokens: torch.Tensor, group: list[Window]) -> float:
    """Summed negative log-likelihood (nats) of the scored tokens of windows of one shape."""
    n = group[0].scored
    inputs = torch.stack([tokens[w.begin : w.end] for w in group])  # (B, T)
    targets = torch.stack([tokens[w.score_from : w.end] for w in group])  # (B, n)
    # Logits at positions score_from-1 .. end-2 predict the scored tokens; the last one predicts past the window.
    logits = model(inputs, logits_to_keep=n + 1).logits[:, :-1]  # (B, n, V)
    return float(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"))


def _scored_spans(plan: list[Window]) -> list[tuple[int, int]]:
    """The scored ids as maximal runs [a, b), so text is decoded whole where tokens are contiguous."""
    spans: list[tuple[int, int]] = []
    for w in plan:
        if spans and spans[-1][1] == w.score_from:
            spans[-1] = (spans[-1][0], w.end)
        else:
            spans.append((w.score_from, w.end))
    return spans
