"""Autoregressive generation: prefill the prompt in one forward, then decode one token per step.

Each decode step feeds only the newest token; keys/values of everything before it come from the
KV cache, so a step costs O(context) attention instead of re-running the whole sequence.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.kv_cache import KVCache
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams, sample


def prefill(model: Transformer, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run the whole prompt (B, T) through the model, filling the cache; return last logits (B, V)."""
    return model(ids, cache=cache, logits_to_keep=1).logits[:, -1]


def decode_step(model: Transformer, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Feed one new token per row (B,) at the next position; return its logits (B, V)."""
    return model(token[:, None], cache=cache).logits[:, -1]


def stream(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one at a time, until a stop token (not yielded) or max_new_tokens.
    Bad params or prompts raise here, at the call, not at the first token (so a caller can report
    them before printing anything)."""
    params.validate()
    max_len = model.config.max_seq_len
    if not prompt_ids:
        raise DecoderLMError("the prompt is empty; give at least one token")
    if len(prompt_ids) >= max_len:
        raise DecoderLMError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {max_len}; shorten the prompt")
    return _decode(model, prompt_ids, params)


@torch.inference_mode()
def _decode(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Prefill, then sample and decode. When the context is full, start again from its last half
    (re-prefilled at positions 0.., as nanoGPT crops its input), so a small model can write on."""
    param = next(model.parameters())
    max_len = model.config.max_seq_len
    ids = list(prompt_ids)
    seen = torch.tensor([ids], device=param.device) if params.penalized else None
    generator = params.generator(param.device)
    stop = set(params.stop_token_ids)

    def start(context: list[int], to_sample: int) -> tuple[KVCache, torch.Tensor]:
        # Slots: the context, plus one per sampled token but the last (it needs no forward pass).
        cache = KVCache(model.config, 1, min(len(context) + to_sample - 1, max_len), dtype=param.dtype, device=param.device)
        return cache, prefill(model, torch.tensor([context], device=param.device), cache)

    if not params.max_new_tokens:
        return
    cache, logits = start(ids, params.max_new_tokens)
    for n in range(params.max_new_tokens):
        token = sample(logits, params, generator, seen, len(prompt_ids))  # (1,)
        tok = int(token)
        if tok in stop:
            return
        yield tok
        ids.append(tok)
        left = params.max_new_tokens - n - 1
        if not left:
            return
        if seen is not None:
            seen = torch.cat((seen, token[:, None]), dim=1)
        if cache.length == cache.max_len:
            cache, logits = start(ids[-max(1, max_len // 2) :], left)
        else:
            logits = decode_step(model, token, cache)


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """All generated ids at once (see `stream`)."""
    return list(stream(model, prompt_ids, params))
