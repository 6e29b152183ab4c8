"""Rotary position embedding (RoPE): rotate pairs of query/key channels by position-dependent angles.

Channel i is paired with channel i + rot_dim/2 (the "rotate half" layout HF checkpoints use) and
rotated by angle pos · θ^(-2i/rot_dim). Scaling variants stretch the low frequencies so a model
reaches beyond its training context.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from decoderlm.errors import DecoderLMError


def inverse_frequencies(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """θ^(-2i/rot_dim) for i < rot_dim/2, adjusted by the checkpoint's rope_scaling. Shape (rot_dim/2,)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3(inv_freq, scaling).float()
    if kind == "freq_factors":  # one divisor per frequency, as GGUF's rope_freqs tensor stores any scaling
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise DecoderLMError(f"rope_scaling freq_factors has {factors.numel()} factors, expected {inv_freq.numel()} (rot_dim/2); "
                                 "fix the config")
        return (inv_freq / factors).float()
    raise DecoderLMError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, freq_factors")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1: divide long wavelengths by `factor`, keep short ones, blend smoothly in between."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(middle, blended, out)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables for the given positions. positions (B, T) → cos, sin (B, T, 1, rot_dim).

    sin's first half is negated: rotating the pair (x1, x2) gives (x1·cos − x2·sin, x2·cos + x1·sin),
    which is x·cos + (x2, x1)·(−sin, sin), so `apply_rope_` needs one roll instead of chunk, neg and cat."""
    angles = positions.float().unsqueeze(-1) * inv_freq.float()  # (B, T, rot_dim/2), fp32 even in a bf16 model
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # (B, T, rot_dim)
    return cos.unsqueeze(2).to(dtype), sin.unsqueeze(2).to(dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate, in place, the first rot_dim channels of x (B, T, H, D); the rest pass through (partial rotary).
    In place, so a fused projection's q and k are rotated in its own output, with no copy to split or cat.
    Two products, each rounded, then their sum: addcmul_ would save an op but round once less, which
    moves bf16 results off those of the plain formula."""
    rot_dim = cos.shape[-1]
    rot = x if rot_dim == x.shape[-1] else x.narrow(-1, 0, rot_dim)
    swapped = rot.roll(rot_dim // 2, dims=-1)  # (x2, x1)
    rot.mul_(cos).add_(swapped.mul_(sin))
    return x
