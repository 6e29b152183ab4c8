"""Logits → next token: penalties, logits processors, temperature, top-k, top-p (nucleus), min-p.

Filters run in that order on the last position's logits (B, V); temperature 0 means greedy. A logits
processor is a request's own function of the ids so far and the scores (a grammar's mask, a bias): each
row runs its request's processors, so the same request is processed alike alone, in a batch, or as
speculative decoding's check of several positions. A seeded
`torch.Generator` makes sampling reproducible. `sample` serves rows that share one set of params;
`sample_batch` serves a serving batch, where every row has its own params and its own generator.
Each filter takes one value for all rows or a list with one value per row, so both paths run the
same arithmetic and a request sampled in a batch draws what it would draw alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decoderlm.errors import DecoderLMError


class LogitsProcessor(Protocol):
    """A processor with `stateful = True` (a grammar's parse state, `decoderlm.tools.grammar`) follows
    one sequence: one per request, and speculative decoding refuses it."""

    def __call__(self, ids: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
        """The fp32 scores (V,) of the token after `ids` (the prompt and the tokens generated so far),
        after the penalties: return them changed (e.g. -inf where a grammar forbids a token)."""


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
    frequency_penalty: float = 0.0  # OpenAI: minus penalty × count of the token among the generated ones
    presence_penalty: float = 0.0  # OpenAI: minus penalty once the token has been generated at all
    logits_processors: list[LogitsProcessor] = field(default_factory=list)  # run in order, after the penalties

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
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2] (0 = off), got {self.frequency_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2] (0 = off), got {self.presence_penalty}"),
        ]
        for ok, message in checks:
            if not ok:
                raise DecoderLMError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the ids so far (a penalty or a logits processor)."""
        return self.penalized or bool(self.logits_processors)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        return torch.Generator(device).manual_seed(self.seed) if self.seed is not None else None


def finish_reason(token: int, generated: int, params: SamplingParams, context_full: bool = False) -> str | None:
    """Why a sequence ends at the token it just sampled, the one rule of every decode loop (`generate`,
    speculative decoding, the server's engine): "stop" for a stop token (which is not emitted),
    "length" when it is the `generated`-th token of a budget of max_new_tokens or the context is full,
    None when decoding goes on. A full context ends a sequence only where the cache cannot slide
    (`context_full`: the server's paged cache); `generate` and speculative decoding slide a window of
    the last max_seq_len tokens instead, so they never pass it."""
    if token in params.stop_token_ids:
        return "stop"
    if generated >= params.max_new_tokens or context_full:
        return "length"
    return None


def per_row(value: float | Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """One value for all rows, or a list with one per row, as a (1 or B, 1) tensor next to `like`."""
    values = [value] if isinstance(value, (int, float)) else list(value)
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, 1)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """CTRL-style: divide positive / multiply negative logits of tokens already in `seen` (B, S).
    penalty: a float, or one per row (B, 1)."""
    scores = logits.gather(-1, seen)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.scatter(-1, seen, scores)


def apply_frequency_presence(logits: torch.Tensor, generated: torch.Tensor, real: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties: logit − frequency·count − presence·[count > 0], counted over the generated
    ids (B, S) where `real` (B, S) is 1 (0 marks padding). frequency, presence: (1 or B, 1)."""
    counts = torch.zeros_like(logits).scatter_add_(-1, generated, real.to(logits.dtype))  # (B, V)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def penalize(logits: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[Sequence[int]],
             prompt_lens: Sequence[int]) -> torch.Tensor:
    """Apply each row's penalties: repetition over its whole history `seen` (prompt + generated),
    frequency/presence over the generated part, seen[i][prompt_lens[i]:]. Rows are padded to one
    width with ids that change nothing (the row's own first id; zero weight for the counts)."""
    device = logits.device
    if any(p.repetition_penalty != 1.0 for p in params):
        width = max(1, *map(len, seen))
        ids = [list(s) + [s[0]] * (width - len(s)) if len(s) else [0] * width for s in seen]
        penalty = [p.repetition_penalty if len(s) else 1.0 for p, s in zip(params, seen)]
        logits = apply_repetition_penalty(logits, torch.tensor(ids, device=device), per_row(penalty, logits))
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        generated = [list(s[n:]) for s, n in zip(seen, prompt_lens)]
        width = max(1, *map(len, generated))
        ids = torch.tensor([g + [0] * (width - len(g)) for g in generated], device=device)  # (B, S)
        real = torch.tensor([[1] * len(g) + [0] * (width - len(g)) for g in generated], device=device)
        frequency = per_row([p.frequency_penalty for p in params], logits)
        presence = per_row([p.presence_penalty for p in params], logits)
        logits = apply_frequency_presence(logits, ids, real, frequency, presence)
    return logits


def process(logits: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[Sequence[int]]) -> torch.Tensor:
    """Run each row's logits processors on its scores (B, V), in order; seen[i]: row i's ids so far."""
    if not any(p.logits_processors for p in params):
        return logits
    rows = list(logits.unbind(0))
    for i, (p, ids) in enumerate(zip(params, seen)):
        for processor in p.logits_processors:
            rows[i] = processor(ids, rows[i])
    return torch.stack(rows)


def adjust(logits: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[Sequence[int]],
           prompt_lens: Sequence[int]) -> torch.Tensor:
    """fp32 scores (B, V): each row's penalties (`penalize`), then its logits processors (`process`)."""
    logits = logits.float()
    if any(p.penalized for p in params):
        logits = penalize(logits, params, seen, prompt_lens)
    return process(logits, params, seen)


def scores(logits: torch.Tensor, params: SamplingParams, seen: list[int], first: int, prompt_len: int = 0) -> torch.Tensor:
    """`adjust` for N consecutive positions of one sequence (speculative decoding checks several at
    once): row i of logits (N, V) predicts the token after seen[:first + i], whose tokens from
    prompt_len on count as generated."""
    if not params.needs_history:
        return logits.float()
    n = logits.shape[0]
    return adjust(logits, [params] * n, [seen[: first + i] for i in range(n)], [prompt_len] * n)


def verify(p: torch.Tensor, q: torch.Tensor | None, guesses: list[int], generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling's rule (Leviathan et al., 2023; Chen et al., 2023). p (n+1, V): the target's
    distributions at each guess and after the last; q (n, V): the proposer's (None: one-hot at the
    guesses). Guess x is kept with probability min(1, p(x)/q(x)); at the first rejection the token
    comes from normalize(max(0, p − q)); when all are kept, from p after the last. Every token then
    follows p exactly. Returns (guesses kept, the next token); with no guesses, a draw from p[0]."""
    for i, x in enumerate(guesses):
        q_x = float(q[i, x]) if q is not None else 1.0
        if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[i, x]):  # P = min(1, p/q)
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp(min=0)
        else:
            residual = p[i].clone()
            residual[x] = 0
        if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(guesses), int(torch.multinomial(p[-1], 1, generator=generator))


def filter_top_k(logits: torch.Tensor, k: int | Sequence[int]) -> torch.Tensor:
    """Keep the k largest logits per row; the rest become -inf. k: one for all rows or one per row; 0 = off."""
    V = logits.shape[-1]
    ks = [k if 0 < k < V else 0 for k in ([k] if isinstance(k, int) else k)]
    if not max(ks):
        return logits
    best = logits.topk(max(ks), dim=-1).values  # (B, max k), sorted
    index = torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device).view(-1, 1)
    kth = best.gather(-1, index.expand(logits.shape[0], 1))  # (B, 1)
    on = torch.tensor([k > 0 for k in ks], device=logits.device).view(-1, 1)
    return logits.masked_fill(on & (logits < kth), float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float | Sequence[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (one or per row; 1 = off)."""
    ps = [p] if isinstance(p, (int, float)) else list(p)
    if min(ps) >= 1.0:
        return logits
    top_p = per_row(ps, logits)  # (1 or B, 1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)  # mass before this token already reaches p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float | Sequence[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability (one or per row; 0 = off)."""
    ms = [min_p] if isinstance(min_p, (int, float)) else list(min_p)
    if max(ms) <= 0:
        return logits
    probs = logits.softmax(-1)
    threshold = probs.max(dim=-1, keepdim=True).values * per_row(ms, logits)
    return logits.masked_fill(probs < threshold, float("-inf"))


def warp(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities (B, V) to draw from: temperature, then top-k, top-p, min-p (params: one or per row)."""
    logits = logits / per_row([p.temperature for p in params], logits)
    logits = filter_top_k(logits, [p.top_k for p in params])
    logits = filter_top_p(logits, [p.top_p for p in params])
    logits = filter_min_p(logits, [p.min_p for p in params])
    return logits.softmax(dim=-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely id (B, V) → (B,): the first of equal maxima, a NaN before any number, as
    argmax; torch's max over a row is vectorized where argmax is a scalar loop (~70 µs a 49k-token row)."""
    return logits.max(dim=-1).indices


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           seen: torch.Tensor | None = None, prompt_len: int = 0) -> torch.Tensor:
    """Choose the next token for each row of logits (B, V) → (B,). seen (B, S): each row's prompt
    followed by its generated ids (the first prompt_len are the prompt), for the penalties and processors."""
    if params.needs_history and seen is not None and seen.numel():
        logits = adjust(logits, [params] * seen.shape[0], seen.tolist(), [prompt_len] * seen.shape[0])
    logits = logits.float()
    if params.greedy:
        return greedy(logits)
    return torch.multinomial(warp(logits, [params]), 1, generator=generator).squeeze(-1)


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 seen: Sequence[Sequence[int]] | None = None, prompt_lens: Sequence[int] | None = None) -> torch.Tensor:
    """Next token (B,) for logits (B, V) where row i has its own params[i] and generators[i], so a
    seeded request draws the same tokens whatever else shares the batch. seen/prompt_lens as in
    `penalize` (an empty history for rows that need none: `SamplingParams.needs_history`)."""
    logits = logits.float()
    if seen is not None and any(p.needs_history for p in params):
        logits = adjust(logits, params, seen, prompt_lens or [0] * len(params))
    tokens = greedy(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = warp(logits[index], [params[i] for i in rows])  # (S, V)
        draws = [torch.multinomial(probs[j : j + 1], 1, generator=generators[i]) for j, i in enumerate(rows)]
        tokens[index] = torch.cat(draws).view(-1)
    return tokens
