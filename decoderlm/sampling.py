"""Logits → next token: repetition penalty, temperature, top-k, top-p (nucleus), min-p.

Filters run in that order on the last position's logits (B, V); temperature 0 means greedy. A seeded
`torch.Generator` makes sampling reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoderlm.errors import DecoderLMError


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    max_new_tokens: int = 128
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p < 1, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"),
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DecoderLMError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        return torch.Generator(device).manual_seed(self.seed) if self.seed is not None else None


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive / multiply negative logits of tokens already in `seen` (B, S)."""
    scores = logits.gather(-1, seen)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.scatter(-1, seen, scores)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row; the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum - sorted_logits.softmax(-1) >= p  # mass before this token already reaches p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Choose the next token for each row of logits (B, V) → (B,)."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and seen is not None and seen.numel():
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    logits = filter_top_k(logits, params.top_k)
    logits = filter_top_p(logits, params.top_p)
    logits = filter_min_p(logits, params.min_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
