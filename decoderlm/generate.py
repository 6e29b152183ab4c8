"""Autoregressive generation: prefill the prompt in one forward, then decode one token per step.

Each decode step feeds only the newest token; keys/values of everything before it come from the
KV cache, so a step costs O(context) attention instead of re-running the whole sequence. A model
with a sliding window gets a rolling cache that never holds more than its window.

`stream` is the one decode loop (the server's engine runs the same rules over a batch). Two things
plug into it:
- a `Step` runs the one-token forward instead of the model's eager forward, over a cache of its own
  (`decoderlm.compiled.CompiledDecoder`; without one, `decoderlm.kernel_step.KernelStep` where the
  model's layers are all on decoderlm's kernels);
- a `Proposer` guesses the next k tokens and the model checks them all in one forward, keeping the
  longest prefix it agrees with plus one token of its own (speculative decoding; the proposers are
  in `decoderlm.speculative`). Without one, every forward checks zero guesses: plain decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.kernel_step import KernelStep
from decoderlm.kv_cache import KVCache, cache_dtype, cache_for
from decoderlm.model import Transformer
from decoderlm.model.cache import Cache
from decoderlm.model.mrope import ShiftedPositions, mrope_positions
from decoderlm.model.vision import Images
from decoderlm.quantize import reading_prompt
from decoderlm.sampling import SamplingParams, finish_reason, greedy, scores, verify, warp


class Step(Protocol):
    def new_cache(self, n_slots: int) -> Cache | None:
        """A cache for n_slots tokens that `step` can run over (None: this step cannot, decode eagerly)."""

    def step(self, token: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Feed one token per row (B,) at the cache's next position; return its logits (B, V)."""


class Proposer(Protocol):
    def start(self, max_len: int, vocab_size: int) -> None:
        """A new sequence begins; it will hold at most max_len tokens; the target has vocab_size logits."""

    def propose(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k guesses for the tokens after ids, and the distributions (n, V) they were drawn from
        (None: the guesses are a deterministic function of ids)."""


@dataclass
class SpeculativeStats:
    proposed: int = 0  # guesses checked by the target
    accepted: int = 0  # guesses kept
    target_forwards: int = 0  # forwards of the target (the first one also prefills the prompt)
    generated: int = 0  # tokens yielded

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def summary(self) -> str:
        return (f"{self.accepted}/{self.proposed} proposed tokens accepted ({self.acceptance_rate:.1%}), "
                f"{self.generated} tokens in {self.target_forwards} target forwards")


def prefill(model: Transformer, ids: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Run the whole prompt (B, T) through the model, filling the cache; return last logits (B, V)."""
    with reading_prompt():
        return model(ids, cache=cache, logits_to_keep=1).logits[:, -1]


def decode_step(model: Transformer, token: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Feed one new token per row (B,) at the next position; return its logits (B, V)."""
    return model(token[:, None], cache=cache).logits[:, -1]


def stream(model: Transformer, prompt_ids: list[int], params: SamplingParams, proposer: Proposer | None = None,
           step: Step | None = None, num_speculative_tokens: int = 5, stats: SpeculativeStats | None = None,
           images: Images | None = None) -> Iterator[int]:
    """Yield generated token ids one at a time, until a stop token (not yielded) or max_new_tokens.

    The model sees a sliding window of the last `max_seq_len` tokens: every token is chosen from the
    logits of model(ids[-max_seq_len:]), as if the text so far were cropped and run afresh. With a
    `proposer`, up to num_speculative_tokens guesses are checked per forward: greedy, the tokens are
    plain decoding's; sampled, they follow the same distribution (see `sampling.verify`). A `step`
    serves the one-token forwards of plain decoding (a proposer's checks are multi-token, eager).
    Counts go into `stats`. Bad params or prompts raise here, at the call, not at the first token
    (so a caller can report them before printing anything). `images` stand at the prompt's image
    placeholders (a vision-language model's); the prompt and its answer must then fit the context."""
    check_request(model, prompt_ids, params)
    if proposer is not None and num_speculative_tokens < 1:
        raise DecoderLMError(f"the number of speculative tokens must be at least 1, got {num_speculative_tokens}")
    if images is not None:
        if proposer is not None:
            raise DecoderLMError("speculative decoding does not take images yet; run without a draft model")
        if len(prompt_ids) + params.max_new_tokens > model.config.max_seq_len:
            raise DecoderLMError(f"a prompt with images and its answer must fit the context ({model.config.max_seq_len} tokens); "
                                 "lower max_new_tokens")
    if proposer is not None and any(getattr(p, "stateful", False) for p in params.logits_processors):
        raise DecoderLMError("speculative decoding cannot follow a grammar (its state would have to roll back rejected guesses); "
                             "decode without a draft or n-gram proposer, or without the grammar")
    return _decode(model, list(prompt_ids), params, proposer, step, num_speculative_tokens, stats or SpeculativeStats(), images)


def check_request(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> None:
    """Raise a one-line error for params or a prompt this model cannot continue: empty, an id outside
    its vocabulary, or a prompt that fills the whole context. Every decoding path checks this first."""
    params.validate()
    vocab, context = model.config.vocab_size, model.config.max_seq_len
    if not prompt_ids:
        raise DecoderLMError("the prompt is empty; give at least one token")
    if not all(0 <= t < vocab for t in prompt_ids):
        raise DecoderLMError(f"prompt token ids must be in [0, {vocab}); check the tokenizer matches the model")
    if len(prompt_ids) >= context:
        raise DecoderLMError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}; shorten the prompt")


@torch.inference_mode()
def _decode(model: Transformer, ids: list[int], params: SamplingParams, proposer: Proposer | None, step: Step | None,
            k: int, stats: SpeculativeStats, images: Images | None = None) -> Iterator[int]:
    """Each round: guesses (none without a proposer), one forward over the tokens the cache lacks and the
    guesses, then the kept guesses and one token of the model's own.

    A full context (more than max_seq_len tokens) slides the window by one token per step. That moves
    every token to a new position and drops the oldest token from every later token's context, so no
    cached key or value stays exact: each further step runs one cache-free forward over the window, as
    recomputation would, and checks no guesses.
    """
    device = next(model.parameters()).device
    max_len, prompt_len, budget = model.config.max_seq_len, len(ids), params.max_new_tokens
    generator = params.generator(device)
    if not budget:
        return
    # Slots: the prompt, plus one per sampled token but the last (it is never fed); guesses past the
    # budget are never made, so they need no room of their own.
    n_slots = min(prompt_len + budget - 1, max_len)

    def fresh_cache():  # the compiled step's static cache (loaded once: the same again), else an eager one
        if step is not None:
            return step.new_cache(n_slots)
        kv = cache_dtype(model)  # fp16 where the model keeps its keys so (`kv_cache.store_keys_in`)
        return KVCache(model.config, 1, n_slots, dtype=kv, device=device) if proposer else cache_for(model.config, 1, n_slots, dtype=kv, device=device)

    if proposer is not None or images is not None:
        step = None  # a proposer's multi-token checks and an image prompt run eagerly
    cache = fresh_cache()
    if cache is None:  # the compiled step is unavailable: eager
        step = None
        cache = fresh_cache()
    if step is None and proposer is None and images is None and type(cache) is KVCache:
        step = KernelStep.of(model)  # eager steps as the kernels' calls alone, where the model's layers allow
    scaling = model.config.rope_scaling or {}
    switch = scaling["original_max_position_embeddings"] if scaling.get("rope_type") == "longrope" else None
    if proposer is not None:
        proposer.start(n_slots, model.config.vocab_size)
    if images is not None and model.config.mrope_section:  # decoding continues from the images' M-RoPE offset
        cache = ShiftedPositions(cache, mrope_positions(torch.tensor([ids]), images.grid_thw, model.config.image_token_id,
                                                        model.visual.config.merge_size)[1].to(device))
    emitted = 0
    while True:
        if len(ids) > max_len:
            cache = None
        elif switch is not None and cache is not None and 0 < cache.length <= switch < len(ids):
            # LongRoPE turns to its long factors past the original context: the keys cached under the
            # short ones are computed again (a fresh prefill), as transformers' generate does
            cache = fresh_cache()
        n = min(k, budget - emitted - 1, max_len - len(ids)) if proposer is not None and cache is not None else 0
        guesses, q = proposer.propose(ids, n, params, generator) if n > 0 else ([], None)
        guesses, q = guesses[:n], (q[:n] if q is not None else None)
        if cache is None:  # the context is full: the window's last logits, recomputed (read as a prompt)
            with reading_prompt():
                logits = model(torch.tensor([ids[-max_len:]], device=device), logits_to_keep=1).logits[0]  # (1, V)
        elif step is not None and 0 < cache.length == len(ids) - 1:  # the prompt is prefilled eagerly
            logits = step.step(torch.tensor(ids[-1:], device=device), cache)  # (1, V)
        elif cache.length == 0:  # the first forward prefills the prompt, then checks the first guesses as a decode would
            with reading_prompt():
                logits = model(torch.tensor([ids], device=device), cache=cache, logits_to_keep=1, images=images).logits[0]  # (1, V)
            if guesses:
                checked = model(torch.tensor([guesses], device=device), cache=cache, logits_to_keep=len(guesses)).logits[0]
                logits = torch.cat([logits, checked])  # (n+1, V)
        else:  # the last token and the guesses
            feed = torch.tensor([ids[cache.length :] + guesses], device=device)
            logits = model(feed, cache=cache, logits_to_keep=len(guesses) + 1).logits[0]  # (n+1, V)
        stats.target_forwards += 1
        seen = ids + guesses if guesses else ids  # no copy of the history on a plain step
        s = scores(logits, params, seen, len(ids), prompt_len)  # (n+1, V)
        if params.greedy:
            choice = greedy(s).tolist()
            kept = next((i for i, x in enumerate(guesses) if x != choice[i]), len(guesses))
            nxt = choice[kept]
        else:
            kept, nxt = verify(warp(s, [params]), q, guesses, generator)
        if guesses:
            stats.proposed += len(guesses)
            stats.accepted += kept
            cache.truncate(len(ids) + kept)  # ids and the kept guesses; the new token is fed next round
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


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams, proposer: Proposer | None = None,
             step: Step | None = None, num_speculative_tokens: int = 5, images: Images | None = None) -> list[int]:
    """All generated ids at once (see `stream`)."""
    return list(stream(model, prompt_ids, params, proposer, step, num_speculative_tokens, images=images))
