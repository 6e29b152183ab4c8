"""The decoder-only Transformer: embeddings → N blocks (attention + FFN, each with a residual) → norm → lm_head.

Every family runs through this code; `ModelConfig` switches the parts (LayerNorm or RMSNorm, learned
or rotary positions, plain or gated MLP or a mixture of experts, ...). Parameter names follow the HF
checkpoints (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`), so loading weights is a table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.model.attention import Attention
from decoderlm.model.cache import Cache, causal_mask, default_positions
from decoderlm.model.mla import MLA
from decoderlm.model.mlp import MLP
from decoderlm.model.moe import MoE
from decoderlm.model.mrope import mrope_cos_sin, mrope_positions
from decoderlm.model.norm import make_norm
from decoderlm.model.rope import attention_factor, frequencies_at, inverse_frequencies, rope_cos_sin
from decoderlm.model.vision import ImageEmbeds, Images, VisionConfig, VisionTower

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T or logits_to_keep, vocab)
    loss: torch.Tensor | None = None


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, T, V) against aligned targets (B, T); -100 is ignored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + ffn(norm(x)). With post_norm (OLMo-2): x + norm(attn(x)).
    With sandwich_norm (Gemma-2/3) both: x + norm(attn(norm(x))), and the same around the FFN."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.post_norm = config.post_norm
        self.window = config.window(layer)  # this layer's attention kind: the mask it takes
        self.local_rope = self.window is not None and config.rope_local_theta is not None  # Gemma-3's sliding layers
        self.input_layernorm = make_norm(config)
        self.self_attn = MLA(config, layer) if config.kv_lora_rank else Attention(config, layer)
        self.post_attention_layernorm = make_norm(config)
        self.attn_out_norm = make_norm(config) if config.sandwich_norm else None
        self.ffn_out_norm = make_norm(config) if config.sandwich_norm else None
        self.mlp = MoE(config) if config.n_experts and layer not in (config.moe_dense_layers or ()) else MLP(config)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        if self.post_norm:
            x = x + self.input_layernorm(self.self_attn(x, rope, mask, cache))
            return x + self.post_attention_layernorm(self.mlp(x))
        h = self.self_attn(self.input_layernorm(x), rope, mask, cache)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = x + (self.resid_dropout(h) if self.training else h)  # eval: no call at all, a decode step is op-bound
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (self.ffn_out_norm(h) if self.ffn_out_norm is not None else h)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.generation_defaults: dict = {}  # sampling defaults from the checkpoint's generation_config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.max_seq_len, config.d_model) if config.position == "learned" else None
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.windows = config.windows  # the attention kinds: one mask per forward for each
        self.norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.visual = VisionTower(VisionConfig.from_dict(config.vision), config.d_model) if config.vision else None
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope()
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2·n_layers).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    def init_rope(self) -> None:
        """(Re)compute RoPE's inverse frequencies in fp32. Loaders call it after building on the meta
        device (which leaves the buffer empty) or casting to bf16/fp16 (which would round it)."""
        cfg = self.config
        if self.visual is not None:
            self.visual.init_rope()
        if cfg.position != "rope":
            return
        rot_dim = cfg.rope_dim
        device = self.norm.weight.device  # the embedding may be quantized
        self.register_buffer("inv_freq", inverse_frequencies(rot_dim, cfg.rope_theta, cfg.rope_scaling).to(device), persistent=False)
        self.rope_factor = attention_factor(cfg.rope_scaling, cfg.max_seq_len)
        self.rope_by_length = (cfg.rope_scaling or {}).get("rope_type") in ("longrope", "dynamic")  # frequencies depend on the length reached
        if cfg.rope_local_theta is not None:  # the sliding layers' own base and scaling (Gemma-3)
            inv_freq = inverse_frequencies(rot_dim, cfg.rope_local_theta, cfg.rope_local_scaling)
            self.register_buffer("inv_freq_local", inv_freq.to(device), persistent=False)
            self.rope_local_factor = attention_factor(cfg.rope_local_scaling)

    def frequencies_reached(self, positions: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """LongRoPE's and dynamic NTK's inverse frequencies, which depend on the length a sequence has
        reached: the forward's last position + 1, or per row a paged batch's `seq_lens` (rot_dim/2,) or (B, 1, rot_dim/2)."""
        cfg, rot_dim = self.config, 2 * self.inv_freq.shape[0]
        lengths = getattr(cache, "seq_lens", None) or [int(positions.max()) + 1]
        freqs = [frequencies_at(rot_dim, cfg.rope_theta, cfg.rope_scaling, n, cfg.max_seq_len) for n in lengths]
        freqs = [self.inv_freq if f is None else f.to(self.inv_freq.device) for f in freqs]
        return freqs[0] if len(freqs) == 1 else torch.stack(freqs)[:, None]

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # tied weights are counted once
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel() + (self.embed_positions.weight.numel() if self.embed_positions is not None else 0)
        return n

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
        images: Images | ImageEmbeds | None = None,
    ) -> ModelOutput:
        """input_ids (B, T) → logits (B, T, V).

        positions (B, T): token positions (default: after what the cache holds; with attention_mask,
        counted over real tokens only, so left-padded rows start at 0). attention_mask (B, L): 1 for
        real tokens, 0 for padding, over all cache slots including these T. labels (B, T): the loss
        compares logits at t with labels at t+1 (shifted here). logits_to_keep: only the last k rows.
        images: the vision tower's output replaces the embeddings of the image_token_id placeholders;
        with M-RoPE, positions (3, B, T) then default to the images' grid coordinates (from position 0).
        ImageEmbeds: that output computed already, for the marked columns (give M-RoPE's positions too).
        """
        B, T = input_ids.shape
        cfg = self.config
        # A fresh unpadded sequence's last position is T - 1, known without reading a tensor (no graph break under torch.compile).
        last = T - 1 if positions is None and cache is None and attention_mask is None else None
        if isinstance(images, Images) and positions is None and cfg.mrope_section:
            positions = mrope_positions(input_ids, images.grid_thw, cfg.image_token_id, self.visual.config.merge_size)[0]
        if positions is None:
            positions = cache.positions(T, attention_mask, input_ids.device) if cache is not None else default_positions(0, T, attention_mask, input_ids.device)
        x = self.embed_tokens(input_ids)  # (B, T, D)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if images is not None:
            x = self.splice_images(input_ids, x, images)
        rope = local_rope = None
        if self.embed_positions is not None:
            last = int(positions.max()) if last is None else last
            if last >= cfg.max_seq_len:
                raise DecoderLMError(f"sequence reaches position {last}, but this model has learned positions only up to {cfg.max_seq_len - 1}")
            x = x + self.embed_positions(positions)
        elif positions.dim() == 3:  # M-RoPE's (t, h, w) positions
            rope = mrope_cos_sin(positions, self.inv_freq, cfg.mrope_section, x.dtype)
        else:
            inv_freq = self.frequencies_reached(positions, cache) if self.rope_by_length else self.inv_freq
            rope = rope_cos_sin(positions, inv_freq, x.dtype, self.rope_factor)  # (B, T, 1, rot_dim) each
            if cfg.rope_local_theta is not None:
                local_rope = rope_cos_sin(positions, self.inv_freq_local, x.dtype, self.rope_local_factor)
        x = self.dropout(x)
        masks = {}  # one per attention kind (window) the layers use
        for window in self.windows:
            if cache is not None:
                mask = cache.mask(T, attention_mask, window, x.dtype, x.device)
            else:
                mask = causal_mask(0, T, attention_mask, window, x.dtype, x.device)
            if not cfg.causal and mask is not None:  # experiment switch: every query sees what the last one sees
                mask = mask[:, :, -1:].expand_as(mask)  # (B, 1, T, L)
            masks[window] = mask
        for block in self.layers:
            x = block(x, local_rope if block.local_rope else rope, masks[block.window], cache)
        if cache is not None:
            cache.advance(T)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:
            loss = lm_loss(logits[:, :-1], labels[:, 1:])
        return ModelOutput(logits, loss)

    def splice_images(self, input_ids: torch.Tensor, x: torch.Tensor, images: Images | ImageEmbeds) -> torch.Tensor:
        """x (B, T, D) with the image tokens' embeddings (the vision tower's, in order) at the placeholders."""
        if self.visual is None:
            raise DecoderLMError("this model has no vision tower; it reads text only, so give it no images")
        if isinstance(images, ImageEmbeds):
            return x.masked_scatter(images.at[..., None], images.embeds.to(x.dtype))
        at = input_ids == self.config.image_token_id  # (B, T)
        expected = sum(images.tokens(self.visual.config.merge_size))
        if int(at.sum()) != expected:
            raise DecoderLMError(f"the text has {int(at.sum())} image placeholder tokens but the images make {expected} tokens; "
                                 "put each image's placeholder in the prompt once (the chat template does)")
        return x.masked_scatter(at[..., None], self.visual(images).to(x.dtype))
