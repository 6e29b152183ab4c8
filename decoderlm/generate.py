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


@torch.inference_mode()
def stream(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
    """Yield generated token ids one at a time. Stops at a stop token (not yielded), after
    max_new_tokens, or when the model's context is full."""
    params.validate()
    max_len = model.config.max_seq_len
    if not prompt_ids:
        raise DecoderLMError("the prompt is empty; give at least one token")
    if len(prompt_ids) >= max_len:
        raise DecoderLMError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {max_len}; shorten the prompt")
    total = min(len(prompt_ids) + params.max_new_tokens, max_len)
    param = next(model.parameters())
    cache = KVCache(model.config, 1, total, dtype=param.dtype, device=param.device)
    ids = torch.tensor([prompt_ids], device=param.device)
    seen = ids if params.repetition_penalty != 1.0 else None
    generator = params.generator(param.device)
    stop = set(params.stop_token_ids)
    logits = prefill(model, ids, cache)
    for _ in range(total - len(prompt_ids)):
        token = sample(logits, params, generator, seen)  # (1,)
        tok = int(token)
        if tok in stop:
            return
        yield tok
        if cache.length >= total:
            return
        if seen is not None:
            seen = torch.cat((seen, token[:, None]), dim=1)
        logits = decode_step(model, token, cache)


def generate(model: Transformer, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """All generated ids at once (see `stream`)."""
    return list(stream(model, prompt_ids, params))
