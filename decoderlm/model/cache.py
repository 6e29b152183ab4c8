"""The contract between the model and any KV cache, and the masks and positions every cache builds on.

A cache tells a forward where its new tokens sit (`positions`), which keys each of them may see
(`mask`), stores each layer's new keys and values (`update`) and counts the tokens once the forward is
done (`advance`). Masks are built from token positions, not slot indices (`build_mask`), so one rule
serves the contiguous, rolling, static and paged caches alike.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Cache(Protocol):
    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Positions (B or 1, T) of the T tokens this forward adds."""

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Additive mask (B, 1, T, L) over the L keys `update` returns, or None for plain causal attention."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k, v (B, Hkv, T, D); return the keys/values the new queries attend over (B, Hkv, L, D).
        Multi-head latent attention stores its latent and shared RoPE key (B, 1, T, ·) in these two slots."""

    def advance(self, n: int) -> None:
        """The forward is done: the n new tokens are now part of the cached context."""


def build_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, dtype: torch.dtype, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask (B, 1, Tq, Tk): 0 where a query may attend to a key, the dtype's minimum where not.

    q_pos (B or 1, Tq) and k_pos (B or 1, Tk) are the tokens' positions in their sequence: a query sees
    keys at its own position or earlier (and, with a sliding window, fewer than `window` back).
    key_valid (B or 1, Tk) marks slots that hold a real token (False: padding, or a cache slot not yet
    written). Positions rather than slot indices make one rule serve a plain, rolling or paged cache.
    A large finite negative instead of -inf keeps a row whose every key is masked (a padding row)
    finite: softmax turns it into a harmless uniform row, not NaN.
    """
    q, k = q_pos[:, :, None], k_pos[:, None, :]  # (B, Tq, 1), (B, 1, Tk)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :].bool()  # (B, Tq, Tk)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


KEY_ALIGN = 16  # caches hand attention a multiple of this many keys, the slots past the last token masked


def aligned(n_keys: int) -> int:
    """n_keys rounded up to a multiple of KEY_ALIGN. SDPA's CPU kernels sum a row's keys in vector-wide
    groups: with the real keys in the same groups and whole groups of masked ones after them, a sequence
    gets bit-identical attention from every cache and in any batch (an odd key count regroups the tail)."""
    return -(-n_keys // KEY_ALIGN) * KEY_ALIGN


def causal_mask(start: int, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype,
                device: torch.device, k_len: int | None = None) -> torch.Tensor | None:
    """The mask for T new tokens at slots start..start+T-1 over keys at slots 0..start+T-1 of one
    contiguous sequence. attention_mask (B, >= start+T): 1 for real tokens, 0 for padding.
    k_len: the keys a cache returns (>= start+T, see `aligned`): always an explicit mask over them.
    Without it, None when plain causal attention is exact (SDPA's is_causal, or one query over all keys)."""
    n = start + T
    window = window if window is not None and n > window else None
    padded = attention_mask is not None and not bool(attention_mask[:, :n].all())
    if k_len is None and not padded and window is None and (start == 0 or T == 1):
        return None
    slots = torch.arange(k_len or n, device=device)[None]  # (1, L): slot j holds position j; causality hides j >= n
    valid = F.pad(attention_mask[:, :n], (0, (k_len or n) - n)) if padded else None
    return build_mask(slots[:, start:n], slots, window, dtype, valid)


def default_positions(start: int, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Positions (B or 1, T) of T new tokens after `start` cached ones; with attention_mask (B, L), counted
    over real tokens only, so left-padded rows start at 0."""
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start : start + T]
    return torch.arange(start, start + T, device=device)[None]
