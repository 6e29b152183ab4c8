"""Autoregressive generation: prefill the prompt in one forward, then decode one token per step.

Each decode step feeds only the newest token; keys/values of everything before it come from the
KV cache, so a step costs O(context) attention instead of re-running the whole sequence. A model
with a sliding window gets a rolling cache that never holds more than its window.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.kv_cache import cache_for
from decoderlm.model import Transformer
from decoderlm.model.cache import Cache
from decoderlm.sampling import SamplingParams, finish_reason, sample


def prefill(model: Transformer, ids: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Run the whole prompt (B, T) through the model, filling the cache; return last logits (B, V)."""
    return model(ids, cache=cache, logits_to_keep=1).logits[:, -1]


def decode_step(model: Transformer, token: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Feed one new token per row (B,) at the next position; return its logits (B, V)."""
    return model(token[:, None], cache=cache).logits[:, -1]


def stream(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one at a time, until a stop token (not yielded) or max_new_tokens.

    The model sees a sliding window of the last `max_seq_len` tokens: every token is chosen from the
    logits of model(ids[-max_seq_len:]), as if the text so far were cropped and run afresh. Bad params
    or prompts raise here, at the call, not at the first token (so a caller can report them before
    printing anything)."""
    check_request(model, prompt_ids, params)
    return _decode(model, prompt_ids, params)


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
def _decode(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Prefill, then sample and decode through the cache until the context holds max_seq_len tokens.

    From then on the window slides by one token per step. That moves every token to a new position
    and drops the oldest token from every later token's context, so no cached key or value stays
    exact: each further step runs one cache-free forward over the window, as recomputation would.
    """
    param = next(model.parameters())
    max_len = model.config.max_seq_len
    ids = list(prompt_ids)
    seen = torch.tensor([ids], device=param.device) if params.penalized else None
    generator = params.generator(param.device)
    if not params.max_new_tokens:
        return
    # Slots: the prompt, plus one per sampled token but the last (it needs no forward pass).
    n_slots = min(len(ids) + params.max_new_tokens - 1, max_len)
    compiled = getattr(model, "compiled_decoder", None)  # set by decoderlm.compiled.enable (--compile)
    cache: Cache | None = compiled.new_cache(n_slots) if compiled is not None else None
    if cache is None:
        compiled = None
        cache = cache_for(model.config, 1, n_slots, dtype=param.dtype, device=param.device)
    logits = prefill(model, torch.tensor([ids], device=param.device), cache)
    for n in range(params.max_new_tokens):
        token = sample(logits, params, generator, seen, len(prompt_ids))  # (1,)
        tok = int(token)
        reason = finish_reason(tok, n + 1, params)
        if reason == "stop":
            return
        yield tok
        if reason == "length":
            return
        ids.append(tok)
        if seen is not None:
            seen = torch.cat((seen, token[:, None]), dim=1)
        if cache is not None and cache.length < max_len:
            logits = compiled.step(token, cache) if compiled is not None else decode_step(model, token, cache)
        else:  # the context is full: slide the window
            cache = None
            window = torch.tensor([ids[-max_len:]], device=param.device)
            logits = model(window, logits_to_keep=1).logits[:, -1]


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """All generated ids at once (see `stream`)."""
    return list(stream(model, prompt_ids, params))
