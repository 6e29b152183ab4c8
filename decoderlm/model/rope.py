"""Rotary position embedding (RoPE): rotate pairs of query/key channels by position-dependent angles.

Channel i is paired with channel i + rot_dim/2 (the "rotate half" layout HF checkpoints use) and
rotated by angle pos · θ^(-2i/rot_dim). Scaling variants stretch the low frequencies so a model
reaches beyond its training context: linear (all of them), Llama 3 (long wavelengths only, blended),
YaRN (interpolate the frequencies that turn less than beta_slow times in the original context, keep
those that turn more than beta_fast times, ramp in between; and scale cos/sin by its attention factor,
0.1·ln(factor) + 1, which sharpens the softmax the longer context flattens). Two variants depend on how
far a forward reaches (`frequencies_at`): LongRoPE (Phi-3) divides each frequency by its short_factor,
or by its long_factor once the sequence passes the original context; dynamic NTK raises the base once
the sequence passes max_position_embeddings. With a cache, as in transformers, keys cached before the
switch keep their rotation.
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
    if kind == "yarn":
        return _yarn(inv_freq, rot_dim, theta, scaling).float()
    if kind == "longrope":  # the short factors; `frequencies_at` gives the long ones
        return _divide(inv_freq, scaling["short_factor"], "short_factor").float()
    if kind == "dynamic":  # the plain frequencies up to max_position_embeddings; `frequencies_at` gives the later ones
        return inv_freq.float()
    if kind == "freq_factors":  # one divisor per frequency, as GGUF's rope_freqs tensor stores any scaling
        return _divide(inv_freq, scaling["factors"], "freq_factors").float()
    raise DecoderLMError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, yarn, longrope, dynamic, "
                         "freq_factors")


def _divide(inv_freq: torch.Tensor, factors: list[float], name: str) -> torch.Tensor:
    divisors = torch.tensor(factors, dtype=torch.float64)
    if divisors.shape != inv_freq.shape:
        raise DecoderLMError(f"rope_scaling {name} has {divisors.numel()} factors, expected {inv_freq.numel()} (rot_dim/2); fix the config")
    return inv_freq / divisors


def frequencies_at(rot_dim: int, theta: float, scaling: dict[str, Any] | None, seq_len: int, max_seq_len: int) -> torch.Tensor | None:
    """The inverse frequencies of a forward whose last position is seq_len − 1, where they differ from
    `inverse_frequencies` (LongRoPE past the original context, dynamic NTK past max_seq_len); else None."""
    kind = (scaling or {}).get("rope_type")
    if kind == "longrope" and seq_len > scaling["original_max_position_embeddings"]:
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
        return _divide(inv_freq, scaling["long_factor"], "long_factor").float()
    if kind == "dynamic" and seq_len > max_seq_len:
        factor = scaling["factor"]
        base = theta * ((factor * seq_len / max_seq_len) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
        return (1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))).float()
    return None


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


def _yarn(inv_freq: torch.Tensor, rot_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: each frequency blends its interpolated (÷ factor) and original value by how many turns it
    makes over the original context: under beta_slow turns fully interpolated, over beta_fast kept."""
    factor, old_ctx = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def channel(turns: float) -> float:  # the channel pair that turns `turns` times over old_ctx
        return rot_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(fast), channel(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)  # 0: keep, 1: interpolate
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(scaling: dict[str, Any] | None, max_seq_len: int | None = None) -> float:
    """What cos and sin are multiplied by (so every q·k score by its square): YaRN's 0.1·ln(factor) + 1
    (or the ratio of two such with mscale / mscale_all_dim), LongRoPE's sqrt(1 + ln(factor) / ln(original
    context)) with factor max_seq_len / original context unless given; the config's attention_factor
    first; 1 otherwise."""
    kind = (scaling or {}).get("rope_type")
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":
        old_ctx = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or (max_seq_len or old_ctx) / old_ctx
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables for the given positions, times `attention_factor`. positions (B, T) → cos, sin (B, T, 1, rot_dim).

    sin's first half is negated: rotating the pair (x1, x2) gives (x1·cos − x2·sin, x2·cos + x1·sin),
    which is x·cos + (x2, x1)·(−sin, sin), so `apply_rope_` needs one roll instead of chunk, neg and cat."""
    angles = positions.float().unsqueeze(-1) * inv_freq.float()  # (B, T, rot_dim/2), fp32 even in a bf16 model
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
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
