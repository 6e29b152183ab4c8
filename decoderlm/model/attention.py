"""Causal self-attention: one module for multi-head (MHA), grouped-query (GQA) and multi-query (MQA).

With n_kv_heads < n_heads each K/V head serves a group of n_heads / n_kv_heads query heads. Scores
are masked so a token sees only itself and earlier tokens (and, with a sliding window, only the last
`window` of them); `build_mask` makes that mask once per forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm.config import ModelConfig
from decoderlm.kv_cache import KVCache
from decoderlm.model.norm import RMSNorm
from decoderlm.model.rope import apply_rope


def build_mask(q_start: int, q_len: int, k_len: int, key_valid: torch.Tensor | None, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask (B or 1, 1, q_len, k_len): 0 where query may attend, the dtype's minimum where not.

    Queries sit at cache slots q_start .. q_start+q_len-1, keys at slots 0 .. k_len-1. key_valid (B, k_len)
    marks real tokens (False = padding). A large finite negative instead of -inf keeps a row whose
    every key is masked (a padding row) finite: softmax turns it into a harmless uniform row, not NaN.
    """
    q = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)  # (Tq, 1)
    k = torch.arange(k_len, device=device).unsqueeze(0)  # (1, Tk)
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    allowed = allowed.unsqueeze(0)  # (1, Tq, Tk)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :k_len].bool()  # (B, Tq, Tk)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        d, qd, kvd = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(d, qd, bias=config.attn_bias)
        self.k_proj = nn.Linear(d, kvd, bias=config.attn_bias)
        self.v_proj = nn.Linear(d, kvd, bias=config.attn_bias)
        self.o_proj = nn.Linear(qd, d, bias=config.attn_out_bias)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.dropout = config.dropout

    def project_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x (B, T, d_model), split into heads, normed and rotated."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, rope)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, Hkv, L, D): every token so far
        # No mask at all means plain causal attention over a fresh sequence.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.n_kv_heads != self.n_heads,
        )  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
