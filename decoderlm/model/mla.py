"""Multi-head latent attention (MLA, DeepSeek-V2/V3): every head's keys and values are up-projected from
one small latent per token, and the cache keeps only that latent and one shared RoPE key.

Per token, x is projected down (`kv_a_proj_with_mqa`) to a latent c of kv_lora_rank numbers (then
normed, `kv_a_layernorm`) and, beside it, to one key k_rope of qk_rope_head_dim numbers that carries
the position (RoPE) and is shared by all heads, as in multi-query attention (hence "with_mqa").
`kv_b_proj` holds, per head, W_UK and W_UV: head h's key is [W_UK_h·c ; k_rope] (qk_nope_head_dim +
qk_rope_head_dim) and its value W_UV_h·c (v_head_dim). Queries are [q_nope ; q_rope] per head, from
`q_proj`, or through a latent of q_lora_rank (`q_a_proj`, `q_a_layernorm`, `q_b_proj`).

The cache holds c and k_rope: kv_lora_rank + qk_rope_head_dim numbers per token and layer. DeepSeek-V3
caches 512 + 64 = 576 where its 128 heads' keys and values would take 128 × (192 + 128) = 40,960 (~71×).

The same attention, computed two ways:
- expanded (prefill): up-project every latent to per-head k_nope and v, then ordinary attention. Many
  queries share each up-projected key, so its cost is spread over them.
- absorbed (decode): q_nope·(W_UK_h c) = (W_UK_hᵀ q_nope)·c, so W_UK is folded into the query and the
  scores are taken against the latents themselves; and Σ p·(W_UV_h c) = W_UV_h (Σ p·c), so attention
  averages the latents and W_UV is applied once after. That is multi-query attention with one key
  [c ; k_rope] and one value c shared by all heads: a step reads the cache and nothing bigger.
Position enters only through the separate rope channels ("decoupled RoPE"): a rotation between W_UK
and c would depend on the key's position and could not be folded into the query.

RoPE layout: DeepSeek rotates adjacent channel pairs (2i, 2i+1) of q_rope and k_rope. transformers'
DeepSeek-V2 multiplies each pair as a complex number and leaves it in place; V3 (`rope_interleave`)
writes the rotated pairs as two halves [x_0, x_2, ... ; x_1, x_3, ...]. The scores only see q·k, which
one permutation applied to both leaves unchanged, so both are computed here by moving the pairs into
halves and rotating with the shared rotate-half code (`rope.apply_rope_`), V3's output exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm.config import ModelConfig
from decoderlm.model.cache import Cache
from decoderlm.model.norm import RMSNorm
from decoderlm.model.rope import apply_rope_

LATENT_NORM_EPS = 1e-6  # transformers and DeepSeek's code build q_a_layernorm / kv_a_layernorm with the default, not rms_norm_eps


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(query/key head width), times YaRN's mscale² when the RoPE scaling sets mscale_all_dim
    (DeepSeek-V2/V3's long-context configs: a stretched context gets sharper attention)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    s = config.rope_scaling or {}
    if s.get("rope_type", "default") != "default" and s.get("mscale_all_dim") and s.get("factor", 1) > 1:
        mscale = 0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MLA(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.n_heads = layer, config.n_heads
        self.nope, self.rope, self.v_dim, self.rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        d, H, qk = config.d_model, config.n_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=config.attn_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
            self.q_proj = None
        else:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=config.attn_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.kv_b_proj.keep_float = True  # the absorbed form reads its weight as W_UK, W_UV: decoderlm.quantize leaves it
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=config.attn_out_bias)
        self.scale = softmax_scale(config)
        self.interleaved = config.rope_interleave
        self.dropout = config.dropout
        self.causal = config.causal

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_rope, latent, k_rope = self.project(x, rope)
        if cache is not None:
            latent, k_rope = cache.update(self.layer, latent, k_rope)  # (B, 1, L, ·): every token so far
        # One new token per row: the absorbed form, which needs kv_b_proj as a matrix (a LoRA-wrapped one decodes expanded).
        attend = self.absorbed if cache is not None and T == 1 and isinstance(self.kv_b_proj, nn.Linear) else self.expanded
        y = attend(q_nope, q_rope, latent, k_rope, mask, cache)  # (B, H, T, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """x (B, T, d_model) → q_nope (B, H, T, nope), q_rope (B, H, T, rope), and what the cache keeps:
        latent (B, 1, T, r) and k_rope (B, 1, T, rope), each a single "head" shared by all."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, self.n_heads, self.nope + self.rope).split((self.nope, self.rope), dim=-1)  # (B, T, H, ·)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)
        q_rope, k_rope = self.rotate(q_rope, rope), self.rotate(k_rope.view(B, T, 1, self.rope), rope)
        return q_nope.transpose(1, 2), q_rope.transpose(1, 2), self.kv_a_layernorm(latent)[:, None], k_rope.transpose(1, 2)

    def queries_and_keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries and keys (B, H, T, nope + rope) of x, the keys up-projected (for showing the scores)."""
        q_nope, q_rope, latent, k_rope = self.project(x, rope)
        B, H, T, _ = q_nope.shape
        k_nope = self.kv_b_proj(latent[:, 0]).view(B, T, H, -1)[..., : self.nope].transpose(1, 2)
        return torch.cat((q_nope, q_rope), dim=-1), torch.cat((k_nope, k_rope.expand(B, H, T, self.rope)), dim=-1)

    def rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on the rope channels x (B, T, heads, rope); DeepSeek's adjacent pairs are moved into halves first."""
        if self.interleaved:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # a copy: (x0, x1, x2, x3, ...) → (x0, x2, ... ; x1, x3, ...)
        else:
            x = x.clone()  # a view from split(), which autograd forbids rotating in place
        return apply_rope_(x, *rope)

    def expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """Attention with per-head keys and values up-projected from the latents.
        q_nope (B, H, T, nope), q_rope (B, H, T, rope), latent (B, 1, L, r), k_rope (B, 1, L, rope) → (B, H, T, v)."""
        B, H, T, _ = q_nope.shape
        L = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(B, L, H, self.nope + self.v_dim).transpose(1, 2)  # (B, H, L, nope + v)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, H, L, self.rope)), dim=-1)  # (B, H, L, nope + rope)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return self.sdpa(q, k, v, mask, cache, gqa=False)

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                 mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """The same attention over the latents themselves: W_UK folded into the query, W_UV applied after."""
        H = self.n_heads
        w_uk, w_uv = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank).split((self.nope, self.v_dim), dim=1)  # (H, nope, r), (H, v, r)
        q = torch.cat((q_nope @ w_uk, q_rope), dim=-1)  # (B, H, T, r + rope): each head's query, in latent coordinates
        k = torch.cat((latent, k_rope), dim=-1)  # (B, 1, L, r + rope): one key head shared by all query heads
        attend = getattr(cache, "attend", None)  # a cache of rows of different lengths attends row by row
        if attend is not None:
            y = attend(q, k, latent, mask, True, scale=self.scale, attention=latent_attention)
        else:
            y = latent_attention(q, k, latent, attn_mask=mask, scale=self.scale)  # (B, H, T, r): each head's average of the latents
        return y @ w_uv.transpose(1, 2)  # (B, H, T, v)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None, gqa: bool) -> torch.Tensor:
        attend = getattr(cache, "attend", None)  # a cache of rows of different lengths attends row by row
        if attend is not None:
            return attend(q, k, v, mask, gqa, scale=self.scale)
        is_causal = self.causal and mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=self.dropout if self.training else 0.0,
                                              scale=self.scale, enable_gqa=gqa)


def latent_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, scale: float = 1.0,
                     enable_gqa: bool = True) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v for queries q (B, H, T, D) over ONE key/value head k (B, 1, L, D), v (B, 1, L, Dv),
    as plain matmuls (SDPA's signature): at the latent's width (DeepSeek's 576) SDPA's CPU kernels are
    ~30× slower than this for a decode step. Scores and softmax in fp32."""
    scores = (q @ k.transpose(-2, -1)).float() * scale  # (B, H, T, L)
    if attn_mask is not None:
        scores = scores + attn_mask
    return scores.softmax(dim=-1).to(v.dtype) @ v  # (B, H, T, Dv)
