"""The KV cache: per layer, the keys and values of the tokens later queries may still attend to.

Only the K/V heads are stored (n_kv_heads, not n_heads), so GQA/MQA shrink the cache by the group
factor; a multi-head latent attention model (DeepSeek) keeps its latent and shared RoPE key in the two
slots instead (`ModelConfig.kv_cache_widths`, `decoderlm.model.mla`). The model talks to any cache
through the four methods of `Cache`: where the new tokens sit (`positions`), which cached keys each
of them may see (`mask`), `update` from each attention layer,
and `advance` once per forward. `KVCache` is the contiguous cache of one batch of equal-length rows;
`RollingKVCache` keeps only a sliding-window model's last window of tokens (Mistral's rolling buffer);
`HybridKVCache` gives a model mixing sliding and full layers (Gemma-2/3, gpt-oss) one of each;
`StaticKVCache` never changes shape, for a compiled decode step (`decoderlm.compiled`); the serving
engine's paged cache implements the same contract for rows of different lengths.
"""

from __future__ import annotations

import dataclasses

import torch

from decoderlm import kernels
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model.attention import Attention
from decoderlm.model.cache import aligned, build_mask, causal_mask, default_positions


class KVCache:
    """Preallocated (B, Hkv, max_len, D) buffers filled left to right. Attention gets the filled slots
    rounded up to a multiple of 16 (`aligned`) under an explicit mask, as the paged cache gives them, so
    a sequence decoded here and one served in a batch compute the same numbers."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        (k_heads, k_width), (v_heads, v_width) = config.kv_cache_widths  # (B, Hkv, L, D) each (MLA: the latent and the RoPE key)
        self.k = [torch.zeros((batch_size, k_heads, aligned(max_len), k_width), dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros((batch_size, v_heads, aligned(max_len), v_width), dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.max_len, self.dtype = max_len, dtype
        self.length = 0  # slots already filled, the same for every layer

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return default_positions(self.length, T, attention_mask, device)

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return causal_mask(self.length, T, attention_mask, window, dtype, device, k_len=aligned(self.length + T))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k, v (B, Hkv, T, D) after the filled slots; return the keys/values of every token so
        far and of the masked slots up to a multiple of 16 (B, Hkv, L, D), in k's dtype."""
        keys, values = self.write(layer, k, v)
        return keys.to(k.dtype), values.to(v.dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` without the conversion: views of the buffers, in the cache's dtype."""
        end = self.room(k.shape[2])
        keys, values = self.k[layer], self.v[layer]
        keys.narrow(2, self.length, end - self.length).copy_(k)
        values.narrow(2, self.length, end - self.length).copy_(v)
        return keys.narrow(2, 0, aligned(end)), values.narrow(2, 0, aligned(end))

    def attend_one(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
        """A decode step's attention (B, H, 1, D) on decoderlm's kernel, over the buffers as they are (fp16 ones
        too): k, v (B, Hkv, 1, D) are written first."""
        keys, values = self.write(layer, k, v)
        return kernels.attend_one(q, keys, values, mask, scale)

    def rope_attend_one(self, layer: int, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
        """A decode step's attention (B, H, D) from the fused projection qkv (B, H + 2·Hkv, D) in one kernel
        call (`kernels.rope_attend_one`): q and k rotated, k and v written after the filled slots, attention
        over them as `update` returns them. The same numbers as apply_rope_, `update` and `kernels.attend_one`."""
        self.room(1)
        return kernels.rope_attend_one(qkv, *rope, self.k[layer], self.v[layer], [self.length] * qkv.shape[0], mask, scale)

    def room(self, T: int) -> int:
        """The filled length once T more tokens are written; a one-line error if the buffers cannot hold it."""
        end = self.length + T
        if end > self.max_len:
            raise DecoderLMError(f"KV cache holds {self.max_len} tokens; this step needs {end}")
        return end

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


class RollingKVCache:
    """A sliding-window model's cache: a ring of the last `window − 1` tokens per layer, so its memory
    stops growing at the window, however long the text.

    A query sees itself and the window − 1 tokens before it; those are exactly what the ring holds
    (token s lives in slot s mod (window − 1), overwriting one that no later query can see). `update`
    returns the ring followed by this forward's own keys, so a prefill longer than the window still
    attends over all of them; the mask is built from the position each slot holds (-1: empty or
    padding), so the ring's order does not matter.
    """

    def __init__(self, config: ModelConfig, batch_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if config.sliding_window is None or None in config.windows:
            raise DecoderLMError("RollingKVCache needs a model with sliding_window in every layer; use KVCache for full attention, "
                                 "HybridKVCache for mixed layer_types")
        self.window = config.sliding_window
        self.size = self.window - 1
        (k_heads, k_width), (v_heads, v_width) = config.kv_cache_widths  # (B, Hkv, W-1, D) each (MLA: the latent and the RoPE key)
        self.k = [torch.zeros((batch_size, k_heads, self.size, k_width), dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros((batch_size, v_heads, self.size, v_width), dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.slot_pos = torch.full((batch_size, self.size), -1, dtype=torch.long, device=device)  # (B, W-1)
        self.length = 0  # tokens fed so far, padding included (token s lives in slot s mod (W-1))
        self._new_pos = self.slot_pos[:, :0]  # (B, T): this forward's positions (-1 for padding), set by `mask`

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return default_positions(self.length, T, attention_mask, device)

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        B = self.slot_pos.shape[0]
        q_pos = self.positions(T, attention_mask, device).expand(B, T)  # (B, T)
        if attention_mask is not None:
            q_pos = q_pos.masked_fill(~attention_mask[:, self.length : self.length + T].bool(), -1)  # padding: no position
        self._new_pos = q_pos
        k_pos = torch.cat((self.slot_pos, self._new_pos), dim=1)  # (B, W-1 + T), in the order `update` returns keys
        return build_mask(q_pos, k_pos, self.window, dtype, key_valid=k_pos >= 0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the ring and the new k, v (B, Hkv, W-1 + T, D); then keep the newest W-1 in the ring."""
        keys, values = torch.cat((self.k[layer].to(k.dtype), k), dim=2), torch.cat((self.v[layer].to(v.dtype), v), dim=2)
        keep, slots = self._slots(k.shape[2], k.device)
        if keep:
            self.k[layer][:, :, slots] = k[:, :, -keep:].to(self.k[layer].dtype)
            self.v[layer][:, :, slots] = v[:, :, -keep:].to(self.v[layer].dtype)
        return keys, values

    def advance(self, n: int) -> None:
        keep, slots = self._slots(n, self.slot_pos.device)
        if keep:
            self.slot_pos[:, slots] = self._new_pos[:, -keep:]
        self.length += n

    def _slots(self, T: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """How many of T new tokens stay in the ring, and their slots."""
        keep = min(T, self.size)
        return keep, torch.arange(self.length + T - keep, self.length + T, device=device) % max(self.size, 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class HybridKVCache:
    """Sliding and full layers in one model (layer_types): the sliding layers' keys in a `RollingKVCache`
    (the last window − 1 tokens), the full layers' in a `KVCache` (every token). Each attention kind asks
    for its mask by its window, each layer stores into its kind's cache."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        sliding = [i for i in range(config.n_layers) if config.window(i) is not None]
        full = [i for i in range(config.n_layers) if config.window(i) is None]
        if not sliding or not full:
            raise DecoderLMError("HybridKVCache needs a model with both sliding and full layers; use cache_for")
        self.full = KVCache(dataclasses.replace(config, n_layers=len(full), layer_types=None), batch_size, max_len, dtype, device)
        self.rolling = RollingKVCache(dataclasses.replace(config, n_layers=len(sliding), layer_types=None), batch_size, dtype, device)
        self.route = {layer: (self.rolling, j) for j, layer in enumerate(sliding)} | {layer: (self.full, j) for j, layer in enumerate(full)}
        self.max_len = max_len

    @property
    def length(self) -> int:
        return self.full.length

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return self.full.positions(T, attention_mask, device)

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        return (self.full if window is None else self.rolling).mask(T, attention_mask, window, dtype, device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache, j = self.route[layer]
        return cache.update(j, k, v)

    def advance(self, n: int) -> None:
        self.full.advance(n)
        self.rolling.advance(n)

    def nbytes(self) -> int:
        return self.full.nbytes() + self.rolling.nbytes()


def store_keys_in(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Keep every attention layer's keys and values in `dtype` (float16: half the cache's bytes; None: the
    model's own dtype): each layer rounds k and v to it in every path (`Attention.kv_dtype`), and caches made
    with `cache_dtype` store them so. Multi-head latent attention keeps its latent as it is."""
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        layer.kv_dtype = dtype


def cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a cache for this model stores keys and values in: its attention layers' `kv_dtype`, else its own."""
    kinds = {m.kv_dtype for m in model.modules() if isinstance(m, Attention)} - {None}
    return kinds.pop() if len(kinds) == 1 else model.norm.weight.dtype


def cache_for(config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> KVCache | RollingKVCache | HybridKVCache:
    """The cache for up to max_len tokens: where a sliding window makes it smaller, a rolling one (every
    layer sliding) or a hybrid one (sliding and full layers mixed)."""
    if config.sliding_window is not None and config.sliding_window <= max_len:
        if None not in config.windows:
            return RollingKVCache(config, batch_size, dtype, device)
        return HybridKVCache(config, batch_size, max_len, dtype, device)
    return KVCache(config, batch_size, max_len, dtype, device)


class StaticKVCache:
    """A cache whose shapes never change, for a compiled decode step: fixed (B, Hkv, max_len, D) buffers,
    written by index at a position tensor, and a mask over all max_len slots built from positions (a one-row
    step without windows attends over the filled slots alone instead: `attend_one`).

    `KVCache` slices its buffers to the filled length, so every step has new shapes and a compiled
    graph would be rebuilt per position. Here the next free slot is a tensor (`pos`), not a Python int:
    a graph reads it like any input, so ONE graph serves every position. Slot s holds position s (one
    batch of equal-length rows, no padding), and the causal rule k ≤ q alone hides the unwritten slots.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        (k_heads, k_width), (v_heads, v_width) = config.kv_cache_widths  # (B, Hkv, L, D) each (MLA: the latent and the RoPE key)
        self.k = [torch.zeros((batch_size, k_heads, max_len, k_width), dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.v = [torch.zeros((batch_size, v_heads, max_len, v_width), dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.max_len = max_len
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # the first free slot
        # One row without windows: a step attends over the filled slots alone through the kernel's operator, which
        # a compiled graph calls too (`attend_one`); otherwise over every slot, the unfilled ones masked.
        self.traceable = batch_size == 1 and config.windows == [None]

    @property
    def length(self) -> int:
        """Slots already filled (a host sync: for the loop around the step, not inside it)."""
        return int(self.pos)

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if attention_mask is not None:
            raise DecoderLMError("StaticKVCache holds rows of equal length; use KVCache for padded batches")
        return (self.pos + torch.arange(T, device=self.pos.device))[None]  # (1, T)

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor | None:
        """(1, 1, T, L) over every slot; for an eager prompt from slot 0, over its own T slots only (None
        without a window: SDPA's causal attention, which skips the masked half), as `update` returns them."""
        positions = self.positions(T, attention_mask, device)
        if self.prompt_from_start():
            return None if window is None else build_mask(positions, positions, window, dtype)  # (1, 1, T, T)
        slots = torch.arange(self.max_len, device=self.pos.device)[None]  # (1, L): slot s holds position s
        return build_mask(positions, slots, window, dtype)  # (1, 1, T, L)

    def prompt_from_start(self) -> bool:
        """An eager forward from slot 0 (a prompt), which needs no slot past its own: not a compiled step."""
        return not torch.compiler.is_compiling() and self.length == 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k, v (B, Hkv, T, D) at slots pos..pos+T-1; return the whole buffers (B, Hkv, L, D), or
        for a prompt from slot 0 its T slots (B, Hkv, T, D)."""
        end = k.shape[2] if self.write(layer, k, v) == 0 else self.max_len  # as prompt_from_start()
        return self.k[layer][:, :, :end].to(k.dtype), self.v[layer][:, :, :end].to(v.dtype)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int | None:
        """Write k, v (B, Hkv, T, D) at slots pos..pos+T-1; return the slots filled before (None in a compiled
        step, which its caller checks)."""
        T = k.shape[2]
        filled = None if torch.compiler.is_compiling() else self.length
        if filled is not None and filled + T > self.max_len:
            raise DecoderLMError(f"KV cache holds {self.max_len} tokens; this step needs {filled + T}")
        slots = self.pos + torch.arange(T, device=self.pos.device)  # (T,)
        self.k[layer].index_copy_(2, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, slots, v.to(self.v[layer].dtype))
        return filled

    def attend_one(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
        """A decode step's attention on decoderlm's kernel (`Attention.one_query_kernel`): k, v (1, Hkv, 1, D)
        written at `pos`, then q (1, H, 1, D) over the pos + 1 filled slots → (1, H, 1, D); with windows or several
        rows, over every slot with the mask. The kernel's sums, as every other cache's, in eager and compiled steps."""
        if not self.traceable:
            return kernels.attend_one(q, *self.update(layer, k, v), mask, scale)  # (B, Hkv, L, D) each
        self.write(layer, k, v)
        pool_k, pool_v = (t[layer][0].transpose(0, 1) for t in (self.k, self.v))  # (L, Hkv, D): one block of L slots
        table = torch.zeros((1, 1), dtype=torch.long, device=q.device)  # made in the graph: a package holds no tensor of its own
        return torch.ops.decoderlm.attend_paged(q, pool_k, pool_v, table, (self.pos + 1).view(1), scale, self.max_len)

    def advance(self, n: int) -> None:
        self.pos.add_(n)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
