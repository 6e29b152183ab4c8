"""The KV cache: per layer, the keys and values of every token seen so far.

Only the K/V heads are stored (n_kv_heads, not n_heads), so GQA/MQA shrink the cache by the group
factor. The model talks to any cache through the four methods of `Cache`: where the new tokens sit
(`positions`), which cached keys each of them may see (`mask`), `update` from each attention layer,
and `advance` once per forward. `KVCache` is the contiguous cache of one batch of equal-length rows;
the serving engine's paged cache implements the same contract for rows of different lengths.
"""

from __future__ import annotations

from typing import Protocol

import torch

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model.attention import causal_mask, default_positions


class Cache(Protocol):
    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Positions (B or 1, T) of the T tokens this forward adds."""

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Additive mask (B, 1, T, L) over the L keys `update` returns, or None for plain causal attention."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k, v (B, Hkv, T, D); return the keys/values the new queries attend over (B, Hkv, L, D)."""

    def advance(self, n: int) -> None:
        """The forward is done: the n new tokens are now part of the cached context."""


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)  # (B, Hkv, L, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.max_len = max_len
        self.length = 0  # slots already filled, the same for every layer

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return default_positions(self.length, T, attention_mask, device)

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return causal_mask(self.length, T, attention_mask, window, dtype, device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k, v (B, Hkv, T, D) after the filled slots; return all keys/values so far (B, Hkv, L, D)."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise DecoderLMError(f"KV cache holds {self.max_len} tokens; this step needs {end}")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached tokens (speculative decoding drops rejected guesses this
        way); the slots after them are overwritten by the next `update`."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length
