"""Speculative decoding: a cheap proposer guesses the next k tokens; the target model checks all k in
ONE forward over its KV cache, and keeps the longest prefix it agrees with plus one token of its own.

A decode step of a small model is bound by per-step overhead and weight reads, not by the number of
tokens in it, so checking k guesses costs about one step: every accepted guess is a step saved.

- Greedy: a guess is kept while it equals the target's argmax, so the output is exactly plain greedy
  decoding's (the target computes every kept token's logits from the same context).
- Sampling: guess x drawn from the proposer's q is kept with probability min(1, p(x)/q(x)); at the
  first rejection the token comes from normalize(max(0, p − q)); when all k are kept a bonus token
  comes from p. Each emitted token then follows p exactly (Leviathan et al., 2023; Chen et al., 2023).
  p and q are the distributions after the same penalty/temperature/top-k/top-p/min-p filtering.

Proposers: `DraftModel` (a smaller model with the same tokenizer, with its own KV cache) and
`PromptLookup` (copy what followed the latest earlier occurrence of the text's last n-gram: no model,
pays when the reply repeats the prompt, as in editing or summarising). A deterministic guess is a q
that is one-hot, which the same rule covers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.generate import check_request, stream
from decoderlm.kv_cache import KVCache
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams, finish_reason, penalize, warp
from decoderlm.tokenizer import Tokenizer


@dataclass
class SpeculativeStats:
    proposed: int = 0  # guesses checked by the target
    accepted: int = 0  # guesses kept
    target_forwards: int = 0  # verification forwards (the first one also prefills the prompt)
    generated: int = 0  # tokens yielded, including any decoded plainly once the context was nearly full

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def summary(self) -> str:
        return (f"{self.accepted}/{self.proposed} proposed tokens accepted ({self.acceptance_rate:.1%}), "
                f"{self.generated} tokens in {self.target_forwards} target forwards")


class Proposer(Protocol):
    def start(self, max_len: int, vocab_size: int) -> None:
        """A new sequence begins; it will hold at most max_len tokens; the target has vocab_size logits."""

    def propose(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k guesses for the tokens after ids, and the distributions (n, V) they were drawn from
        (None: the guesses are a deterministic function of ids)."""


# --- the target's distributions, shared with the draft so that p and q are filtered alike ----------


def scores(logits: torch.Tensor, params: SamplingParams, seen: list[int], first: int, prompt_len: int = 0) -> torch.Tensor:
    """fp32 logits (N, V) after `decoderlm.sampling.penalize`, as plain decoding penalizes them: row i
    predicts the token after seen[:first + i], whose tokens from prompt_len on count as generated."""
    logits = logits.float()
    if not params.penalized:
        return logits
    n = logits.shape[0]
    return penalize(logits, [params] * n, [seen[: first + i] for i in range(n)], [prompt_len] * n)


def probabilities(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution (N, V) of `decoderlm.sampling.sample` for scores (N, V)."""
    return warp(scores, [params])


def verify(p: torch.Tensor, q: torch.Tensor | None, guesses: list[int], generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling. p (n+1, V): the target's distributions at each guess and after the last;
    q (n, V): the proposer's (None: one-hot at the guesses). Returns (guesses kept, the next token)."""
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


# --- proposers --------------------------------------------------------------------------------------


class PromptLookup:
    """Guess the tokens that followed the most recent earlier occurrence of the text's last n tokens,
    trying n = max_ngram down to 1 (prompt-lookup decoding; no model)."""

    def __init__(self, max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise DecoderLMError(f"the prompt-lookup n-gram size must be at least 1, got {max_ngram}")
        self.max_ngram = max_ngram

    def start(self, max_len: int, vocab_size: int) -> None:
        pass

    def propose(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], None]:
        return ngram_lookup(ids, k, self.max_ngram), None


def ngram_lookup(ids: list[int], k: int, max_ngram: int) -> list[int]:
    """k tokens copied from after the latest earlier match of the longest suffix n-gram (n <= max_ngram),
    or none without a match. The copy reads on into its own guesses, so a match d tokens back guesses
    that the last d tokens repeat (a loop guesses that it loops on)."""
    seq = torch.tensor(ids)
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        # n-grams starting at 0 .. len-1-n: every one but the suffix itself, each followed by a token.
        found = (seq[:-1].unfold(0, n, 1) == seq[-n:]).all(-1).nonzero()
        if len(found):
            start, text = int(found[-1]) + n, list(ids)
            for i in range(k):
                text.append(text[start + i])
            return text[len(ids) :]
    return []


class DraftModel:
    """A smaller model with the target's tokenizer guesses k tokens, one forward each, over its own KV
    cache. The cache remembers which ids it holds, so after a rejection it is cut back to the prefix
    it shares with the accepted text and only the new tokens are fed."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the ids whose keys/values the cache holds
        self.vocab_size = model.config.vocab_size

    def start(self, max_len: int, vocab_size: int) -> None:
        param = next(self.model.parameters())
        length = min(max_len, self.model.config.max_seq_len)
        self.cache = KVCache(self.model.config, 1, length, dtype=param.dtype, device=param.device)
        self.cached, self.vocab_size = [], vocab_size

    def propose(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        assert self.cache is not None, "call start() first"
        k = min(k, self.cache.max_len - len(ids) + 1)  # the last guess is never fed
        if k <= 0:
            return [], None
        keep = 0
        for a, b in zip(self.cached, ids[:-1]):  # at least one token is fed, to get logits
            if a != b:
                break
            keep += 1
        self.cache.truncate(keep)
        self.cached = ids[:keep]
        feed, guesses, dists = ids[keep:], [], []
        if max(feed) >= self.model.config.vocab_size:  # an id past a smaller draft vocabulary (padding): no guess
            return [], None
        device = self.cache.k[0].device
        for _ in range(k):
            logits = self.model(torch.tensor([feed], device=device), cache=self.cache, logits_to_keep=1).logits[:, -1]  # (1, V)
            self.cached += feed
            # prompt_len 0: the draft counts the whole context as generated for frequency/presence; q is
            # still exactly the distribution the guess is drawn from, so verification stays exact
            s = scores(self._fit(logits), params, ids + guesses, len(ids) + len(guesses))
            if params.greedy:
                tok = int(s.argmax())
            else:
                q = probabilities(s, params)[0]
                tok = int(torch.multinomial(q, 1, generator=generator))
                dists.append(q)
            guesses.append(tok)
            feed = [tok]
        return guesses, torch.stack(dists) if dists else None

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (1, V_draft) → (1, V_target): vocabularies padded to different sizes share their first ids;
        ids only the draft has get probability 0."""
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.cat((logits, logits.new_full((1, extra), float("-inf"))), dim=-1)
        return logits[:, : self.vocab_size]


def check_vocabularies(target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer) -> None:
    """A draft must map text to the same ids as the target; raise a one-line error if it does not."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target != draft:
        differ = sum(draft.get(token) != i for token, i in target.items())
        raise DecoderLMError(f"the draft model's tokenizer differs from the target's ({len(draft)} vs {len(target)} tokens, "
                             f"{differ} of the target's map to other ids); a draft must share the target's tokenizer")


# --- the loop ------------------------------------------------------------------------------------


def speculative_stream(target: Transformer, prompt_ids: list[int], params: SamplingParams, proposer: Proposer,
                       num_speculative_tokens: int = 5, stats: SpeculativeStats | None = None) -> Iterator[int]:
    """Like `decoderlm.generate.stream` (same stop rules, same greedy output, same distribution when
    sampling), with up to num_speculative_tokens guesses checked per target forward. Counts go into
    `stats`. Bad arguments raise here, at the call."""
    check_request(target, prompt_ids, params)
    if num_speculative_tokens < 1:
        raise DecoderLMError(f"the number of speculative tokens must be at least 1, got {num_speculative_tokens}")
    return _speculate(target, list(prompt_ids), params, proposer, num_speculative_tokens, stats or SpeculativeStats())


@torch.inference_mode()
def _speculate(target: Transformer, ids: list[int], params: SamplingParams, proposer: Proposer, k: int, stats: SpeculativeStats) -> Iterator[int]:
    param = next(target.parameters())
    max_len = target.config.max_seq_len
    generator = params.generator(param.device)
    budget, emitted, prompt_len = params.max_new_tokens, 0, len(ids)
    size = min(max_len, len(ids) + budget + k)
    cache = KVCache(target.config, 1, size, dtype=param.dtype, device=param.device)  # holds ids[:cache.length]
    proposer.start(size, target.config.vocab_size)
    while emitted < budget:
        left = budget - emitted
        if len(ids) >= max_len - 1:
            # The context is (nearly) full: plain decoding takes over, with its own rule for a full context.
            seed = None if generator is None else int(torch.randint(2**31, (1,), generator=generator, device=generator.device))
            for tok in stream(target, ids, replace(params, max_new_tokens=left, seed=seed)):
                stats.generated += 1
                yield tok
            return
        n = min(k, left - 1, max_len - len(ids) - 2)  # leave room for the handover above
        guesses, q = proposer.propose(ids, n, params, generator) if n > 0 else ([], None)
        guesses, q = guesses[:n], (q[:n] if q is not None else None)
        feed = ids[cache.length :] + guesses  # the first forward is also the prompt's prefill
        logits = target(torch.tensor([feed], device=param.device), cache=cache, logits_to_keep=len(guesses) + 1).logits[0]  # (n+1, V)
        stats.target_forwards += 1
        s = scores(logits, params, ids + guesses, len(ids), prompt_len)
        if params.greedy:
            choice = s.argmax(-1).tolist()
            kept = next((i for i, x in enumerate(guesses) if x != choice[i]), len(guesses))
            nxt = choice[kept]
        else:
            kept, nxt = verify(probabilities(s, params), q, guesses, generator)
        stats.proposed += len(guesses)
        stats.accepted += kept
        cache.truncate(len(ids) + kept)  # ids and the kept guesses; the new token is fed next time
        for tok in guesses[:kept] + [nxt]:
            reason = finish_reason(tok, emitted + 1, params)
            if reason == "stop":
                return
            ids.append(tok)
            emitted += 1
            stats.generated += 1
            yield tok
            if reason == "length":
                return


def speculative_generate(target: Transformer, prompt_ids: list[int], params: SamplingParams, proposer: Proposer,
                         num_speculative_tokens: int = 5) -> tuple[list[int], SpeculativeStats]:
    """All generated ids at once, with the counts (see `speculative_stream`)."""
    stats = SpeculativeStats()
    return list(speculative_stream(target, prompt_ids, params, proposer, num_speculative_tokens, stats)), stats


class Decoding:
    """Prompt ids + params → token stream, plain (`generate.stream`) or speculative with `proposer`;
    after a speculative stream, `stats` holds its counts and `report` prints them on stderr."""

    def __init__(self, model: Transformer, proposer: Proposer | None = None, num_speculative_tokens: int = 5) -> None:
        self.model, self.proposer, self.k = model, proposer, num_speculative_tokens
        self.stats: SpeculativeStats | None = None

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        if self.proposer is None:
            return stream(self.model, prompt_ids, params)
        self.stats = SpeculativeStats()
        return speculative_stream(self.model, prompt_ids, params, self.proposer, self.k, self.stats)

    def report(self) -> None:
        if self.stats is not None:
            print(f"speculative decoding: {self.stats.summary()}", file=sys.stderr)
