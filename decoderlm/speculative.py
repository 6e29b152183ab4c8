"""Speculative decoding's proposers: a cheap proposer guesses the next k tokens; the target model checks
all k in ONE forward over its KV cache, and keeps the longest prefix it agrees with plus one token of
its own. The loop is decoding's one loop, `decoderlm.generate.stream(..., proposer=...)`.

A decode step of a small model is bound by per-step overhead and weight reads, not by the number of
tokens in it, so checking k guesses costs about one step: every accepted guess is a step saved.

- Greedy: a guess is kept while it equals the target's argmax, so the output is exactly plain greedy
  decoding's (the target computes every kept token's logits from the same context).
- Sampling: guess x drawn from the proposer's q is kept with probability min(1, p(x)/q(x)); at the
  first rejection the token comes from normalize(max(0, p − q)); when all k are kept a bonus token
  comes from p. Each emitted token then follows p exactly (`decoderlm.sampling.verify`). p and q are
  the distributions after the same penalties, logits processors and temperature/top-k/top-p/min-p.

Proposers: `DraftModel` (a smaller model with the same tokenizer, with its own KV cache) and
`PromptLookup` (copy what followed the latest earlier occurrence of the text's last n-gram: no model,
pays when the reply repeats the prompt, as in editing or summarising). A deterministic guess is a q
that is one-hot, which the same rule covers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.generate import Proposer, SpeculativeStats, Step, stream
from decoderlm.kv_cache import KVCache, cache_dtype
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams, greedy, scores, warp
from decoderlm.tokenizer import Tokenizer

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
        self.cache = KVCache(self.model.config, 1, length, dtype=cache_dtype(self.model), device=param.device)
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
                tok = int(greedy(s)[0])
            else:
                q = warp(s, [params])[0]
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




class Decoding:
    """A model and how to decode it (`generate.stream` with a proposer, a step, or neither): prompt ids +
    params → token stream. After a speculative stream, `stats` holds its counts and `report` prints
    them on stderr."""

    def __init__(self, model: Transformer, proposer: Proposer | None = None, num_speculative_tokens: int = 5,
                 step: Step | None = None) -> None:
        self.model, self.proposer, self.k, self.step = model, proposer, num_speculative_tokens, step
        self.stats: SpeculativeStats | None = None

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        self.stats = SpeculativeStats() if self.proposer is not None else None
        return stream(self.model, prompt_ids, params, self.proposer, self.step, self.k, self.stats)

    def report(self) -> None:
        if self.stats is not None:
            print(f"speculative decoding: {self.stats.summary()}", file=sys.stderr)
