"""The KV cache: per layer, the keys and values of every token seen so far.

Only the K/V heads are stored (n_kv_heads, not n_heads), so GQA/MQA shrink the cache by the group
factor. Buffers are allocated once for the longest sequence and written in place, so a decode step
costs no allocation. The model calls `update` from each attention layer and `advance` once per
forward; a paged cache would implement the same two methods.
"""

from __future__ import annotations

import torch

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)  # (B, Hkv, L, D)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.max_len = max_len
        self.length = 0  # slots already filled, the same for every layer

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
