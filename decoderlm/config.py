"""One `ModelConfig` for every decoder-only family, plus named presets.

A family (GPT-2, Llama, Qwen, Mistral, Mixtral, ...) is a set of values for these fields and a
weight-name table in `decoderlm.formats`; the model code is shared.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoderlm.errors import DecoderLMError
from decoderlm.jsonio import read_json

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
MLPS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu", "swiglu_clamped")
GATED_MLPS = ("swiglu", "geglu", "swiglu_clamped")
LAYER_TYPES = ("full_attention", "sliding_attention")
QK_NORM_SCOPES = ("head", "all")
ROUTERS = ("softmax", "sigmoid")


@dataclass
class ModelConfig:
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int | None = None  # None → n_heads (MHA); 1 → MQA; in between → GQA
    head_dim: int | None = None  # None → d_model // n_heads
    ffn_hidden: int | None = None  # None → 4·d_model (or ≈ 8/3·d_model for gated MLPs)
    max_seq_len: int = 2048
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    position: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3"|"freq_factors", ...}
    partial_rotary_factor: float = 1.0  # fraction of head_dim that is rotated
    mlp: str = "swiglu"
    attn_bias: bool = False  # bias on q/k/v projections
    attn_out_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    norm_bias: bool = True  # LayerNorm only
    tie_embeddings: bool = False
    dropout: float = 0.0
    # Family-specific mechanisms (defaults switch them off).
    sliding_window: int | None = None  # attend to at most this many most recent keys
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention" (Gemma-2/3, gpt-oss); None → the window in every layer
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma-3: 10k); None → rope_theta and rope_scaling
    rope_local_scaling: dict[str, Any] | None = None  # the sliding layers' rope_scaling, with rope_local_theta
    query_pre_attn_scalar: int | None = None  # scores scaled by its 1/sqrt instead of head_dim's (Gemma-2/3)
    attn_logit_softcapping: float | None = None  # scores → c·tanh(scores / c) before the mask (Gemma-2)
    final_logit_softcapping: float | None = None  # logits → c·tanh(logits / c) (Gemma-2)
    sandwich_norm: bool = False  # norm each sublayer's input and its output before the residual add (Gemma-2/3)
    attn_sinks: bool = False  # a learned logit per head in the softmax's denominator, with no value (gpt-oss)
    qk_norm: bool = False  # RMSNorm on queries and keys before RoPE (Qwen3, OLMo-2)
    qk_norm_scope: str = "head"  # "head": one norm per head, shared by all heads (Qwen3); "all": over all heads at once (OLMo-2)
    n_experts: int = 0  # > 0 → sparse MoE FFN (Mixtral)
    n_experts_per_tok: int = 2
    moe_hidden: int | None = None  # per-expert hidden size (None → ffn_hidden)
    moe_renormalize: bool = True  # softmax over the chosen experts only (Mixtral)
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    swiglu_limit: float = 7.0  # swiglu_clamped: gate ≤ limit, |up| ≤ limit (gpt-oss)
    swiglu_alpha: float = 1.702  # swiglu_clamped: gate · sigmoid(alpha · gate)
    embed_scale: float = 1.0  # multiply token embeddings (Gemma: sqrt(d_model))
    norm_offset: float = 0.0  # RMSNorm weight is (offset + w) (Gemma: 1.0)
    post_norm: bool = False  # norm the sublayer output before the residual add (OLMo-2)
    # Multi-head latent attention (DeepSeek-V2/V3, decoderlm.model.mla): kv_lora_rank > 0 switches it on.
    q_lora_rank: int = 0  # queries through a latent of this width (q_a_proj, q_b_proj); 0 → one q_proj
    kv_lora_rank: int = 0  # width of the per-token latent that keys and values are up-projected from
    qk_nope_head_dim: int = 0  # per head: query/key channels without position (from the latent)
    qk_rope_head_dim: int = 0  # per head: query channels with RoPE; the key's are one head shared by all
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE pairs channels (2i, 2i+1) instead of (i, i + rot_dim/2) (DeepSeek)
    # DeepSeek's MoE options (decoderlm.model.moe).
    n_shared_experts: int = 0  # experts every token passes through, as one MLP of n · moe_hidden
    moe_dense_layers: list[int] | None = None  # layers that keep the dense MLP (DeepSeek's first_k_dense_replace)
    moe_router: str = "softmax"  # expert scores: "softmax" (Mixtral, DeepSeek-V2) or "sigmoid" + selection bias (V3)
    moe_groups: int = 1  # experts in this many groups; tokens choose among the best moe_topk_groups groups
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0  # multiplies the routed experts' weights (routed_scaling_factor)
    # Vision-language (Qwen2-VL, decoderlm.model.vision / mrope): a vision tower's fields switch it on.
    vision: dict[str, Any] | None = None  # the tower's shape: decoderlm.model.vision.VisionConfig's fields
    image_token_id: int | None = None  # the placeholder each image token stands at in the text
    mrope_section: list[int] | None = None  # M-RoPE: frequencies turned by (time, height, width) positions
    # Experiment switch, not a family's: False lets every token attend to later ones too (the classic
    # "remove the causal mask" experiment, benchmarks/experiments.py). Such a model cannot generate.
    causal: bool = True
    family: str = "custom"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a hand-written config's "64" or 64.0 fails here, with its name
            if not fits_annotation(getattr(self, f.name), str(f.type)):
                raise DecoderLMError(f"config {f.name}={getattr(self, f.name)!r} is not a valid value; it must be {f.type}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.kv_lora_rank:  # MLA: every head has its own queries/keys of this width; n_kv_heads is not used
            self.head_dim, self.n_kv_heads = self.qk_nope_head_dim + self.qk_rope_head_dim, self.n_heads
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise DecoderLMError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; set head_dim")
            self.head_dim = self.d_model // self.n_heads
        if self.ffn_hidden is None:
            gated = self.mlp in GATED_MLPS
            self.ffn_hidden = llama_hidden(self.d_model) if gated else 4 * self.d_model
        self.validate()

    def validate(self) -> None:
        for name, value, allowed in (("norm", self.norm, NORMS), ("position", self.position, POSITIONS), ("mlp", self.mlp, MLPS),
                                     ("qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES), ("moe_router", self.moe_router, ROUTERS)):
            if value not in allowed:
                raise DecoderLMError(f"config {name}={value!r} is not supported; use one of {', '.join(allowed)}")
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "max_seq_len"):
            if int(getattr(self, name)) <= 0:
                raise DecoderLMError(f"config {name} must be a positive integer, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise DecoderLMError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise DecoderLMError(f"n_experts_per_tok must be in 1..{self.n_experts}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise DecoderLMError(f"config layer_types must list one of {', '.join(LAYER_TYPES)} for each of the {self.n_layers} layers")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise DecoderLMError("config layer_types has sliding_attention layers but no sliding_window; set sliding_window")
        if self.n_experts and (self.n_experts % self.moe_groups or not 0 < self.moe_topk_groups <= self.moe_groups
                               or self.n_experts_per_tok > self.moe_topk_groups * self.n_experts // self.moe_groups):
            raise DecoderLMError(f"{self.n_experts} experts in {self.moe_groups} groups, {self.moe_topk_groups} of them chosen, "
                                 f"cannot give {self.n_experts_per_tok} experts per token; fix moe_groups / moe_topk_groups")
        if any(not 0 <= i < self.n_layers for i in self.moe_dense_layers or []):
            raise DecoderLMError(f"moe_dense_layers {self.moe_dense_layers} must be layer numbers below {self.n_layers}")
        if self.vision and self.image_token_id is None:
            raise DecoderLMError("a config with a vision tower needs image_token_id, the placeholder its image tokens stand at")
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.rope_dim):
            raise DecoderLMError(f"mrope_section {self.mrope_section} must be three counts summing to rot_dim/2 = {self.rope_dim // 2}")
        if self.kv_lora_rank:
            if self.position != "rope" or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.qk_nope_head_dim <= 0 or self.v_head_dim <= 0:
                raise DecoderLMError("multi-head latent attention needs RoPE, an even qk_rope_head_dim > 0, qk_nope_head_dim > 0 and v_head_dim > 0")

    def window(self, layer: int) -> int | None:
        """How many most recent keys this layer's queries see (None: all of them)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windows(self) -> list[int | None]:
        """The distinct windows of the layers, in layer order: one mask per forward for each."""
        return list(dict.fromkeys(self.window(i) for i in range(self.n_layers)))

    @property
    def rope_dim(self) -> int:
        """Channels of each query/key head that RoPE rotates."""
        return self.qk_rope_head_dim if self.kv_lora_rank else int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_cache_widths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the two tensors a KV cache keeps per token and layer: K and V of each K/V
        head or, with MLA, the latent (1, kv_lora_rank) and the shared RoPE key (1, qk_rope_head_dim)."""
        if self.kv_lora_rank:
            return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)
        return (self.n_kv_heads, self.head_dim), (self.n_kv_heads, self.head_dim)

    @property
    def gqa_group(self) -> int:
        """Query heads per K/V head: 1 for MHA, n_heads for MQA."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if data.get("extra") == {}:  # run folders saved before the unused `extra` field was removed
            data = {k: v for k, v in data.items() if k != "extra"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DecoderLMError(f"unknown ModelConfig fields: {', '.join(unknown)}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:  # a missing field, or a value of the wrong type
            raise DecoderLMError(f"not a valid ModelConfig ({e}); compare it with a preset's fields (ModelConfig.from_preset(...).to_dict())") from None

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_json(path, "ModelConfig file", "give a file written by ModelConfig.to_json"))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise DecoderLMError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}, or give a ModelConfig .json file")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_name(cls, name: str | Path) -> "ModelConfig":
        """A preset name, or a ModelConfig .json file: what every --preset flag accepts."""
        if str(name).endswith(".json"):
            return cls.from_json(name)
        return cls.from_preset(str(name))


def fits_annotation(value: Any, annotation: str) -> bool:
    """Whether a value read from a file fits a dataclass field's annotation ("int", "float | None",
    "dict[str, Any] | None", ...): a bool is not an int here, an int is a float."""
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str, "None": type(None), "dict": dict, "list": list}
    allowed = tuple(kinds[t.strip().split("[")[0]] for t in annotation.split("|"))
    return isinstance(value, allowed) and (not isinstance(value, bool) or bool in allowed)


def llama_hidden(d_model: int, multiple_of: int = 256) -> int:
    """SwiGLU hidden size: 8/3·d (keeps the parameter count of a 4·d MLP), rounded up."""
    hidden = int(8 * d_model / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


GPT2 = dict(norm="layernorm", position="learned", mlp="gelu_tanh", attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True, family="gpt2")

PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's char-level Shakespeare model for CPUs.
    "seed-char": dict(vocab_size=65, n_layers=4, d_model=128, n_heads=4, max_seq_len=64, norm="layernorm", position="learned", mlp="gelu", attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True, family="gpt2"),
    # seed-char's size and recipe with Llama's parts (RoPE, RMSNorm, SwiGLU): 800,000 parameters against 809,000.
    "seed-char-llama": dict(vocab_size=65, n_layers=4, d_model=128, n_heads=4, max_seq_len=64, ffn_hidden=344, tie_embeddings=True, family="llama"),
    # seed-char-llama with QK-norm; its recipe (decoderlm.train.config.RECIPES) trains with Muon. What each
    # change is worth: benchmarks/experiments.py, improvements.
    "seed-char-plus": dict(vocab_size=65, n_layers=4, d_model=128, n_heads=4, max_seq_len=64, ffn_hidden=344, tie_embeddings=True, qk_norm=True, family="llama"),
    # seed-char-llama's size with the newer architectures' parts: Gemma-3's 3 sliding (window 16) : 1 full
    # layers with their own RoPE bases, sandwich and q/k norms; gpt-oss's sinks and 4 clamped-SwiGLU experts.
    "gemma3-tiny": dict(vocab_size=65, n_layers=4, d_model=128, n_heads=4, n_kv_heads=1, head_dim=32, max_seq_len=64, ffn_hidden=344,
                        mlp="geglu", norm_eps=1e-6, embed_scale=128 ** 0.5, norm_offset=1.0, sandwich_norm=True, qk_norm=True,
                        query_pre_attn_scalar=32, sliding_window=16, layer_types=[*["sliding_attention"] * 3, "full_attention"],
                        rope_theta=1e6, rope_local_theta=1e4, tie_embeddings=True, family="gemma3_text"),
    "gpt-oss-tiny": dict(vocab_size=65, n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=64, ffn_hidden=128,
                         mlp="swiglu_clamped", attn_bias=True, attn_out_bias=True, mlp_bias=True, attn_sinks=True, n_experts=4,
                         n_experts_per_tok=2, moe_hidden=128, router_bias=True, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"] * 2, rope_theta=150000.0, tie_embeddings=True, family="gpt_oss"),
    # seed-char-llama with multi-head latent attention (DeepSeek's MLA): its cache keeps 64 + 16 numbers per token and
    # layer where seed-char-llama's keeps 2 × 128.
    "mla-tiny": dict(vocab_size=65, n_layers=4, d_model=128, n_heads=4, max_seq_len=64, ffn_hidden=344, tie_embeddings=True, kv_lora_rank=64,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, family="deepseek_v3"),
    "gpt2-124m": dict(vocab_size=50257, n_layers=12, d_model=768, n_heads=12, max_seq_len=1024, norm_eps=1e-5, **GPT2),
    "llama-tiny": dict(vocab_size=32000, n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, max_seq_len=1024, family="llama"),
    "llama-3.1-8b": dict(vocab_size=128256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, max_seq_len=131072, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, family="llama"),
    "smollm2-135m": dict(vocab_size=49152, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, ffn_hidden=1536, max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True, family="llama"),
}
