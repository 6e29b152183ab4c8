"""Parameters, FLOPs and memory of an `ArchSpec`, counted part by part from the shapes alone.

Counts follow the checkpoint's tensors (a tied lm_head owns no parameters of its own). FLOPs use
the usual estimate for one token's forward pass: 2 × the weights it is multiplied by (a
multiply-add per weight: embedding lookups, norms and biases are negligible and left out; a MoE
token meets only its k experts; the lm_head is included even when tied), plus attention's own
matmuls, which grow with the context: q·k and p·v cost 2 × n_ctx × n_heads × (qk_dim + v_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoderlm.inspect.arch import ArchSpec

BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}  # int formats: without quantization scales
GROUPS = ("attention", "FFN", "norms", "embedding", "lm_head", "final norm", "vision tower")


@dataclass
class Part:
    name: str  # the tensor family, e.g. "q_proj", "experts", "embedding"
    group: str  # one of GROUPS
    per_layer: list[int] = field(default_factory=list)  # one count per layer; empty outside the blocks
    total: int = 0
    active: int = 0  # parameters one token passes through (MoE: k of the E experts)
    matmul: int = 0  # weights one token is multiplied by (counts the tied lm_head again)


def _add(parts: dict[str, Part], name: str, group: str, layer: int, n_layers: int, params: int, active: int | None = None, matmul: int = 0) -> None:
    part = parts.setdefault(name, Part(name, group, [0] * n_layers))
    part.per_layer[layer] += params
    part.total += params
    part.active += params if active is None else active
    part.matmul += matmul


def _linear(parts: dict[str, Part], name: str, group: str, layer: int, spec: ArchSpec, n_in: int, n_out: int, bias: bool) -> None:
    _add(parts, name, group, layer, spec.n_layers, n_in * n_out + (n_out if bias else 0), matmul=n_in * n_out)


def _norm_params(spec: ArchSpec, dim: int) -> int:
    return dim * (2 if spec.norm == "layernorm" and spec.norm_bias else 1)


def _expert_params(spec: ArchSpec, hidden: int) -> tuple[int, int]:
    """(parameters, matmul weights) of one gated or plain MLP of this hidden size."""
    mats = 3 if spec.gated_mlp else 2
    weights = mats * spec.d_model * hidden
    biases = ((mats - 1) * hidden + spec.d_model) if spec.mlp_bias else 0
    return weights + biases, weights


def _attention(parts: dict[str, Part], spec: ArchSpec, i: int) -> None:
    d, H = spec.d_model, spec.n_heads
    if spec.mla:
        qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            _linear(parts, "q_a_proj", "attention", i, spec, d, spec.q_lora_rank, spec.qkv_bias)
            _add(parts, "q_a/kv_a norms", "norms", i, spec.n_layers, _norm_params(spec, spec.q_lora_rank))
            _linear(parts, "q_b_proj", "attention", i, spec, spec.q_lora_rank, H * qk_dim, False)
        else:
            _linear(parts, "q_proj", "attention", i, spec, d, H * qk_dim, False)
        _linear(parts, "kv_a_proj", "attention", i, spec, d, spec.kv_lora_rank + spec.qk_rope_head_dim, spec.qkv_bias)
        _add(parts, "q_a/kv_a norms", "norms", i, spec.n_layers, _norm_params(spec, spec.kv_lora_rank))
        _linear(parts, "kv_b_proj", "attention", i, spec, spec.kv_lora_rank, H * (spec.qk_nope_head_dim + spec.v_head_dim), False)
        _linear(parts, "o_proj", "attention", i, spec, H * spec.v_head_dim, d, spec.o_bias)
        return
    q, kv = H * spec.head_dim, spec.n_kv_heads * spec.head_dim
    _linear(parts, "q_proj", "attention", i, spec, d, q, spec.qkv_bias)
    _linear(parts, "k_proj", "attention", i, spec, d, kv, spec.qkv_bias)
    _linear(parts, "v_proj", "attention", i, spec, d, kv, spec.qkv_bias)
    _linear(parts, "o_proj", "attention", i, spec, q, d, spec.o_bias)
    if spec.attn_sinks:
        _add(parts, "sinks", "attention", i, spec.n_layers, H)
    if spec.qk_norm:  # an RMSNorm over one head (shared by all heads), or over all heads at once
        width = (H + spec.n_kv_heads) * spec.head_dim if spec.qk_norm_all_heads else 2 * spec.head_dim
        _add(parts, "q_norm/k_norm", "norms", i, spec.n_layers, width)


def _ffn(parts: dict[str, Part], spec: ArchSpec, i: int) -> None:
    d = spec.d_model
    if not spec.is_moe(i):
        h = spec.ffn_hidden
        if spec.gated_mlp:
            _linear(parts, "gate_proj", "FFN", i, spec, d, h, spec.mlp_bias)
        _linear(parts, "up_proj", "FFN", i, spec, d, h, spec.mlp_bias)
        _linear(parts, "down_proj", "FFN", i, spec, h, d, spec.mlp_bias)
        return
    _linear(parts, "router", "FFN", i, spec, d, spec.n_experts, spec.router_bias)
    one, one_mm = _expert_params(spec, spec.moe_hidden)
    k = spec.n_experts_per_tok
    _add(parts, "experts", "FFN", i, spec.n_layers, spec.n_experts * one, active=k * one, matmul=k * one_mm)
    if spec.n_shared_experts:
        shared, shared_mm = _expert_params(spec, spec.moe_hidden * spec.n_shared_experts)
        _add(parts, "shared experts", "FFN", i, spec.n_layers, shared, matmul=shared_mm)


def count(spec: ArchSpec) -> list[Part]:
    """Every parameter of the model, by part, in the order a forward pass meets them."""
    parts: dict[str, Part] = {}
    n_embed = spec.vocab_size * spec.d_model
    parts["embedding"] = Part("embedding", "embedding", total=n_embed, active=n_embed)
    if spec.learned_positions:
        n_pos = spec.learned_positions * spec.d_model
        parts["position embedding"] = Part("position embedding", "embedding", total=n_pos, active=n_pos)
    for i in range(spec.n_layers):
        _attention(parts, spec, i)
        _ffn(parts, spec, i)
        _add(parts, "layer norms", "norms", i, spec.n_layers, spec.norms_per_layer * _norm_params(spec, spec.d_model))
    final = _norm_params(spec, spec.d_model)
    parts["final norm"] = Part("final norm", "final norm", total=final, active=final)
    head = 0 if spec.tie_embeddings else n_embed
    parts["lm_head"] = Part("lm_head", "lm_head", total=head, active=head, matmul=n_embed)
    if spec.vision:  # runs once per image, not per token: no share of the per-token FLOPs
        n_vision = vision_params(spec.vision, spec.d_model)
        parts["vision tower"] = Part("vision tower", "vision tower", total=n_vision, active=n_vision)
    return list(parts.values())


def vision_params(v: dict, d_model: int) -> int:
    """Qwen2-VL's vision tower: patch embedding, blocks (norms, qkv, proj, MLP) and the merger to d_model."""
    w, f, merged = v["width"], v["ffn_hidden"], v["width"] * v["merge_size"] ** 2
    norm = w if v["kind"] == "qwen2_5_vl" else 2 * w  # RMSNorm or LayerNorm
    mlp = 3 * w * f + 2 * f + w if v["kind"] == "qwen2_5_vl" else 2 * w * f + f + w  # gate/up/down or fc1/fc2, with biases
    block = 2 * norm + (3 * w * w + 3 * w) + (w * w + w) + mlp
    patches = w * v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    return patches + v["depth"] * block + norm + (merged * merged + merged) + (merged * d_model + d_model)


@dataclass
class Accounting:
    spec: ArchSpec
    parts: list[Part]

    @classmethod
    def of(cls, spec: ArchSpec) -> "Accounting":
        return cls(spec, count(spec))

    @property
    def total(self) -> int:
        return sum(p.total for p in self.parts)

    @property
    def active(self) -> int:
        """Parameters one token passes through: the total for dense models."""
        return sum(p.active for p in self.parts)

    @property
    def non_embedding(self) -> int:
        """Without the embedding tables (token, position): what grows with depth and width."""
        return self.total - self.group("embedding")

    def group(self, name: str) -> int:
        return sum(p.total for p in self.parts if p.group == name)

    def group_per_layer(self, name: str) -> list[int]:
        layer_parts = [p.per_layer for p in self.parts if p.group == name and p.per_layer]
        return [sum(col) for col in zip(*layer_parts)] if layer_parts else []

    def flops_per_token(self) -> int:
        """Forward FLOPs of one token from the weight matmuls alone (no attention over the context)."""
        return 2 * sum(p.matmul for p in self.parts)

    def lm_head_flops(self) -> int:
        return 2 * sum(p.matmul for p in self.parts if p.group == "lm_head")

    def attention_flops(self, context: int) -> int:
        """q·k and p·v of one token attending to `context` earlier tokens (capped by sliding windows)."""
        s = self.spec
        qk, v = (s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim) if s.mla else (s.head_dim, s.head_dim)
        return sum(2 * min(context, s.window(i) or context) * s.n_heads * (qk + v) for i in range(s.n_layers))

    def kv_elements_per_token(self) -> int:
        """Cached numbers per token over all layers: K and V per K/V head, or MLA's latent + RoPE key."""
        s = self.spec
        per_layer = s.kv_lora_rank + s.qk_rope_head_dim if s.mla else 2 * s.n_kv_heads * s.head_dim
        return s.n_layers * per_layer

    def kv_bytes(self, context: int, batch: int = 1, dtype: str = "bf16") -> float:
        """KV cache for `batch` sequences of `context` tokens; a sliding layer keeps only its window."""
        s = self.spec
        per_layer = self.kv_elements_per_token() // s.n_layers
        tokens = sum(min(context, s.window(i) or context) for i in range(s.n_layers))
        return tokens * per_layer * batch * BYTES[dtype]

    def weight_bytes(self, dtype: str) -> float:
        return self.total * BYTES[dtype]
