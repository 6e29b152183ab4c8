"""Causal self-attention: one module for multi-head (MHA), grouped-query (GQA) and multi-query (MQA).

With n_kv_heads < n_heads each K/V head serves a group of n_heads / n_kv_heads query heads. Scores
are masked so a token sees only itself and earlier tokens (and, with a sliding window, only the last
`window` of them); `decoderlm.model.cache.build_mask` makes that mask once per forward, from token positions.

Two options SDPA has no switch for are written out in `attention_math`: Gemma-2's soft-capping of the
scores (c·tanh(s / c), which bounds every logit to ±c) and gpt-oss's attention sinks (one learned logit
per head joins each softmax: it takes probability mass and gives no value, so a head can attend to
nothing).

A decode step in inference on the CPU (one new query per row, fp32) runs on decoderlm's own kernel
(`kernels.attend_one`) instead of SDPA: one call for the whole batch, each row's sums in one fixed
order, reading a paged cache's blocks in place. From a fused projection (`rope_attend_one` of KVCache and
of the server's PagedCache) the same call also rotates q and k and writes k and v: an eager step spends
more time in Python's calls around the kernels than in attention itself.

`kv_dtype` (set by `decoderlm.kv_cache.store_keys_in`): the precision keys and values are kept in. With
float16 (the default mode of a quantized model, as llama.cpp's cache) every path rounds k and v to it before
attending, the plain forward too, so a cache that stores them in fp16 (half the bytes to read in every decode
step) gives the same numbers as no cache at all.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm import kernels
from decoderlm.config import ModelConfig
from decoderlm.model.cache import Cache
from decoderlm.model.norm import RMSNorm
from decoderlm.model.rope import apply_rope_


class Attention(nn.Module):
    kv_dtype: torch.dtype | None = None  # keys and values rounded to this before attention (None: the computing dtype)

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        d, qd, kvd = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        self.register_module("qkv_proj", None)  # q, k, v rows in one matrix: set by decoderlm.model.fuse for inference
        self.q_proj = nn.Linear(d, qd, bias=config.attn_bias)
        self.k_proj = nn.Linear(d, kvd, bias=config.attn_bias)
        self.v_proj = nn.Linear(d, kvd, bias=config.attn_bias)
        self.o_proj = nn.Linear(qd, d, bias=config.attn_out_bias)
        self.norm_all_heads = config.qk_norm_scope == "all"  # OLMo-2: one norm over all heads' features
        q_width, k_width = (qd, kvd) if self.norm_all_heads else (config.head_dim, config.head_dim)
        self.q_norm = RMSNorm(q_width, config.norm_eps, config.norm_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.norm_eps, config.norm_offset) if config.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(config.n_heads)) if config.attn_sinks else None  # (H,) logits
        self.scale = config.query_pre_attn_scalar ** -0.5 if config.query_pre_attn_scalar else None  # None: SDPA's 1/sqrt(head_dim)
        self.softcap = config.attn_logit_softcapping
        self.dropout = config.dropout
        self.causal = config.causal

    def project_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of x (B, T, d_model): split into heads, normed and rotated."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None:  # q and k rotated in one go
            return self.rotated_heads(self.qkv_proj(x).view(B, T, H + 2 * Hkv, D), rope)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split((H * D, Hkv * D, Hkv * D), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, H·D), (B, T, Hkv·D) ×2
        if self.q_norm is not None and self.norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
        if self.q_norm is not None and not self.norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            apply_rope_(q, *rope)
            apply_rope_(k, *rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotated_heads(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of the fused projection's heads (B, T, H + 2·Hkv, D)."""
        H, Hkv = self.n_heads, self.n_kv_heads
        if rope is not None:
            apply_rope_(qkv.narrow(2, 0, H + Hkv), *rope)
        q, k, v = qkv.split((H, Hkv, Hkv), dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        B, T, _ = x.shape
        if (T == 1 and rope is not None and self.qkv_proj is not None and self.q_norm is None and hasattr(cache, "rope_attend_one")
                and cache.dtype == (self.kv_dtype or x.dtype)):  # the kernel rounds k and v as the cache stores them
            qkv = self.qkv_proj(x).view(B, T, -1, self.head_dim)  # (B, 1, H + 2·Hkv, D): q, k and v heads
            if self.one_query_kernel(qkv, qkv, mask, cache):  # a decode step: RoPE, the cache write and attention in one call
                y = cache.rope_attend_one(self.layer, qkv.view(B, -1, self.head_dim), rope, mask, self.scale or self.head_dim ** -0.5)
                return self.o_proj(y.view(B, T, -1))  # (B, H, D) → (B, 1, H·D)
            q, k, v = self.rotated_heads(qkv, rope)
        else:
            q, k, v = self.project_qkv(x, rope)
        if self.kv_dtype is not None and self.kv_dtype != k.dtype:
            k, v = k.to(self.kv_dtype).to(k.dtype), v.to(self.kv_dtype).to(v.dtype)
        if T == 1 and self.one_query_kernel(q, k, mask, cache):  # a decode step on the CPU
            scale = self.scale or self.head_dim ** -0.5
            if (paged := getattr(cache, "attend_one", None)) is not None:  # the cache's buffers or blocks, where they are
                y = paged(self.layer, q, k, v, mask, scale)
            else:
                if cache is not None:
                    k, v = cache.update(self.layer, k, v)
                y = kernels.attend_one(q, k, v, mask, scale)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, Hkv, L, D): every token so far
        # Under CPU bf16 autocast (training with --dtype bfloat16) attention runs in fp32: the CPU's bf16
        # flash-attention backward is ~7x slower than fp32's at small head sizes, while the projections
        # around it keep bf16's speed. Without autocast, or on a GPU, nothing changes.
        upcast = q.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        is_causal = self.causal and mask is None and T > 1  # no mask at all: plain causal attention over a fresh sequence (or none)
        dropout = self.dropout if self.training else 0.0
        attend = getattr(cache, "attend", None)  # a cache of rows of different lengths attends row by row
        if self.softcap is not None or self.sinks is not None:
            if attend is not None:
                y = attend(q, k, v, mask, self.n_kv_heads != self.n_heads, attention=self.attention_math)
            else:
                y = self.attention_math(q, k, v, mask, is_causal)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        if upcast and torch.compiler.is_compiling():
            # Compiled (--compile): the math kernel, which computes bf16 inputs in fp32 on the CPU, decomposed
            # into matmuls and a softmax that inductor fuses (faster here than the flash kernel), and with no
            # autocast region in the graph, so the compiled step is loaded whole from the cache.
            y = torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, dropout, is_causal, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)[0]  # (B, H, T, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        with torch.autocast("cpu", enabled=False) if upcast else contextlib.nullcontext():
            if upcast:
                q, k, v = q.float(), k.float(), v.float()
            y = attend(q, k, v, mask, self.n_kv_heads != self.n_heads, scale=self.scale) if attend is not None else F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads,
            )  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def extra_repr(self) -> str:
        return f"kv_dtype={self.kv_dtype}" if self.kv_dtype is not None else ""

    def one_query_kernel(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None = None) -> bool:
        """Whether this one-query step runs on decoderlm's attention kernel (`kernels.attend_one`): in fp32
        on the CPU, outside autograd, with SDPA's own options, and outside compiled graphs unless the cache
        calls the kernel as an operator (the server's compiled step). Its sums run in one order per row, so
        a sequence gets the same bits alone, in a batch, from any cache."""
        return (q.dtype == k.dtype == torch.float32 and q.device.type == "cpu" and self.softcap is None and self.sinks is None
                and not (torch.is_grad_enabled() and q.requires_grad)
                and (not torch.compiler.is_compiling() or getattr(cache, "traceable", False))
                and (mask is None or (mask.dtype == torch.float32 and mask.shape[1] == mask.shape[2] == 1)) and kernels.available())

    def probabilities(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool = False) -> torch.Tensor:
        """softmax(cap(q·kᵀ · scale) + mask) in fp32 for queries (B, H, T, D) over keys (B, Hkv, L, D):
        (B, H, T, L), and with sinks one more column (B, H, T, L + 1), the sink's share of each row."""
        T, L = q.shape[2], k.shape[2]
        k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, L, D)
        scores = (q.float() @ k.float().transpose(-1, -2)) * (self.scale or q.shape[-1] ** -0.5)  # (B, H, T, L)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if mask is not None:
            scores = scores + mask
        elif is_causal:
            scores = scores.masked_fill(~torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T), float("-inf"))
        if self.sinks is not None:
            scores = torch.cat((scores, self.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), dim=-1)  # (B, H, T, L + 1)
        return scores.softmax(dim=-1)

    def attention_math(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = True) -> torch.Tensor:
        """Attention (B, H, T, D) from `probabilities`; the sink's share is dropped: it has no value to add.
        SDPA's signature, for the paged cache's `attend`; the layer's own scale and head grouping apply."""
        probs = self.probabilities(q, k, attn_mask, is_causal)[..., : k.shape[2]]  # (B, H, T, L)
        if self.training and self.dropout:
            probs = F.dropout(probs, self.dropout)
        v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, L, D)
        return (probs @ v.float()).to(q.dtype)
