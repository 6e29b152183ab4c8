"""HF checkpoint families: each `model_type` is a reading of config.json into `ModelConfig` fields, the
inverse writing, and a weight-name table. There is no per-family model code.

A table row maps one checkpoint tensor to one or more of our parameters. Several parameters mean the
checkpoint fuses them along dim 0 (Phi-3's qkv_proj, GPT-2's c_attn), split at load and concatenated
at save; `transpose` marks GPT-2's Conv1D, which stores weights as (in, out). Names may hold `{i}`
(layer), `{e}` (expert), `{v}` (vision block) and `{p}` (weight or bias); a row applies where our model has
the parameters. A row whose checkpoint name has no `{e}` but whose parameters do holds every expert in
one tensor (gpt-oss): `layout` says how (see `to_ours`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError


@dataclass(frozen=True)
class Row:
    ckpt: str
    ours: tuple[str, ...]
    transpose: bool = False
    layout: str = ""  # "experts": (E, in, out) weights / (E, out) biases; "experts_interleaved": also gate, up rows alternating
    experts: int = 0  # how many experts a stacked tensor holds


def to_ours(row: Row, tensor: torch.Tensor) -> torch.Tensor:
    """A stacked experts tensor as our parameters' rows, concatenated expert by expert: (E·out, in) or
    (E·out,); with gate and up interleaved, an expert's gate rows come before its up rows."""
    if not row.layout:
        return tensor
    t = tensor.transpose(1, 2) if tensor.dim() == 3 else tensor  # (E, out[, in])
    if row.layout == "experts_interleaved":  # rows g0 u0 g1 u1 ... → g0 g1 ... u0 u1 ...
        E, out = t.shape[:2]
        t = t.reshape(E, out // 2, 2, *t.shape[2:]).transpose(1, 2).reshape(E, out, *t.shape[2:])
    return t.flatten(0, 1)


def to_checkpoint(row: Row, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_ours`."""
    if not row.layout:
        return tensor
    t = tensor.unflatten(0, (row.experts, -1))  # (E, out[, in])
    if row.layout == "experts_interleaved":
        E, out = t.shape[:2]
        t = t.reshape(E, 2, out // 2, *t.shape[2:]).transpose(1, 2).reshape(E, out, *t.shape[2:])
    return t.transpose(1, 2) if t.dim() == 3 else t


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class that loads the checkpoint
    read: Callable[[dict[str, Any]], dict[str, Any]]  # config.json → ModelConfig fields
    write: Callable[[ModelConfig], dict[str, Any]] | None  # ModelConfig → config.json fields; None: read only (Gemma-3's wrapper)
    table: tuple[Row, ...]
    optional_prefix: str = ""  # older checkpoints may omit it (GPT-2: "transformer.")
    mtp_layers: bool = False  # layers numbered from n_layers on are a multi-token-prediction module (DeepSeek-V3), unused here
    aliases: tuple[tuple[str, str], ...] = ()  # (prefix, the table's prefix) for names newer checkpoints spell differently
    skipped: tuple[str, ...] = ()  # prefixes of checkpoint tensors left unread (a multimodal wrapper's vision tower)
    unloaded: str = ""  # what loading leaves out, said on stderr and by `inspect`


def row(ckpt: str, *ours: str, transpose: bool = False, layout: str = "") -> Row:
    return Row(ckpt, ours, transpose, layout)


def expand(family: Family, config: ModelConfig, params: set[str]) -> dict[str, Row]:
    """Concrete rows (checkpoint name → Row) for this config: placeholders filled, rows whose
    parameters our model lacks (absent biases, q/k norms, ...) dropped. A tied lm_head is not a tensor."""
    if config.tie_embeddings:
        params = params - {"lm_head.weight"}
    out: dict[str, Row] = {}
    depth = (config.vision or {}).get("depth", 0)
    for r in family.table:
        for i, v in ((i, v) for i in (range(config.n_layers) if "{i}" in r.ckpt else [0]) for v in (range(depth) if "{v}" in r.ckpt else [0])):
            for e in range(config.n_experts) if "{e}" in r.ckpt else [0]:
                for p in ("weight", "bias") if "{p}" in r.ckpt else ["weight"]:
                    name, ours = r.ckpt.format(i=i, e=e, p=p, v=v), tuple(o.format(i=i, e=e, p=p, v=v) for o in r.ours)
                    if r.layout:  # one tensor for every expert
                        ours = tuple(o.format(i=i, e=x, p=p, v=v) for x in range(config.n_experts) for o in r.ours)
                    if all(o in params for o in ours):
                        out[name] = Row(name, ours, r.transpose, r.layout, config.n_experts if r.layout else 0)
    unnamed = params - {o for r in out.values() for o in r.ours}
    if unnamed:
        raise DecoderLMError(f"a {family.model_type} checkpoint has no tensor for our parameter {sorted(unnamed)[0]}; "
                             f"this model cannot be stored as {family.model_type}")
    return out


# --- tables -------------------------------------------------------------------------------------

ATTN = "layers.{i}.self_attn"
QKV = tuple(row(f"model.{ATTN}.{x}_proj.{{p}}", f"{ATTN}.{x}_proj.{{p}}") for x in "qkv")
MLP = tuple(row(f"model.layers.{{i}}.mlp.{x}_proj.{{p}}", f"layers.{{i}}.mlp.{x}_proj.{{p}}") for x in ("gate", "up", "down"))


NORMS = (row("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight"),
         row("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm.weight"))


def llama_table(qkv: tuple[Row, ...] = QKV, mlp: tuple[Row, ...] = MLP, norms: tuple[Row, ...] = NORMS) -> tuple[Row, ...]:
    """Llama's names, which its descendants keep; they differ in how q/k/v, the FFN and the norms are stored."""
    return (
        row("model.embed_tokens.weight", "embed_tokens.weight"),
        *norms,
        *qkv,
        row(f"model.{ATTN}.o_proj.{{p}}", f"{ATTN}.o_proj.{{p}}"),
        row(f"model.{ATTN}.q_norm.weight", f"{ATTN}.q_norm.weight"),
        row(f"model.{ATTN}.k_norm.weight", f"{ATTN}.k_norm.weight"),
        *mlp,
        row("model.norm.weight", "norm.weight"),
        row("lm_head.weight", "lm_head.weight"),
    )


EXPERT = "layers.{i}.mlp.experts.{e}"
LLAMA_TABLE = llama_table()
# Qwen3-MoE: the router is mlp.gate, each expert a dense MLP.
QWEN3_MOE_TABLE = llama_table(mlp=(
    row("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.gate.weight"),
    *(row(f"model.{EXPERT}.{x}_proj.weight", f"{EXPERT}.{x}_proj.weight") for x in ("gate", "up", "down")),
))
# Mixtral: block_sparse_moe, with w1 = gate, w3 = up, w2 = down.
MIXTRAL_TABLE = llama_table(mlp=(
    row("model.layers.{i}.block_sparse_moe.gate.weight", "layers.{i}.mlp.gate.weight"),
    *(row(f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight", f"{EXPERT}.{x}_proj.weight")
      for w, x in (("w1", "gate"), ("w3", "up"), ("w2", "down"))),
))
# Phi-3 fuses q/k/v into one matrix and gate/up into another.
PHI3_TABLE = llama_table(
    qkv=(row(f"model.{ATTN}.qkv_proj.weight", *(f"{ATTN}.{x}_proj.weight" for x in "qkv")),),
    mlp=(row("model.layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.up_proj.weight"),
         row("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.weight")),
)
# OLMo-2 norms each sublayer's output (post_norm): our block's first norm is its post_attention_layernorm,
# the second its post_feedforward_layernorm.
OLMO2_TABLE = llama_table(norms=(
    row("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.input_layernorm.weight"),
    row("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.post_attention_layernorm.weight"),
))
# Gemma-2/3 norm each sublayer's input and output (sandwich_norm): checkpoint post_attention_layernorm is
# our attn_out_norm, pre_feedforward_layernorm our post_attention_layernorm (the FFN's input norm).
GEMMA2_TABLE = llama_table(norms=(
    row("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight"),
    row("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.attn_out_norm.weight"),
    row("model.layers.{i}.pre_feedforward_layernorm.weight", "layers.{i}.post_attention_layernorm.weight"),
    row("model.layers.{i}.post_feedforward_layernorm.weight", "layers.{i}.ffn_out_norm.weight"),
))
# gpt-oss: a sink logit per head; the router is mlp.router (with a bias); the experts' matrices are stacked
# (E, in, out) tensors, gate and up interleaved column by column in one.
GPT_OSS_TABLE = llama_table(qkv=(*QKV, row(f"model.{ATTN}.sinks", f"{ATTN}.sinks")), mlp=(
    row("model.layers.{i}.mlp.router.{p}", "layers.{i}.mlp.gate.{p}"),
    row("model.layers.{i}.mlp.experts.gate_up_proj", f"{EXPERT}.gate_proj.weight", f"{EXPERT}.up_proj.weight", layout="experts_interleaved"),
    row("model.layers.{i}.mlp.experts.gate_up_proj_bias", f"{EXPERT}.gate_proj.bias", f"{EXPERT}.up_proj.bias", layout="experts_interleaved"),
    row("model.layers.{i}.mlp.experts.down_proj", f"{EXPERT}.down_proj.weight", layout="experts"),
    row("model.layers.{i}.mlp.experts.down_proj_bias", f"{EXPERT}.down_proj.bias", layout="experts"),
))
# DeepSeek-V2/V3: multi-head latent attention (decoderlm.model.mla), and MoE layers with shared experts
# after the first dense ones; the router's selection bias (V3) is a checkpoint tensor too.
MLA_ATTN = tuple(row(f"model.{ATTN}.{x}", f"{ATTN}.{x}") for x in (
    "q_proj.weight", "q_a_proj.{p}", "q_a_layernorm.weight", "q_b_proj.weight",
    "kv_a_proj_with_mqa.{p}", "kv_a_layernorm.weight", "kv_b_proj.weight"))
DEEPSEEK_TABLE = llama_table(qkv=MLA_ATTN, mlp=(
    *MLP,
    row("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.gate.weight"),
    row("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.gate.e_score_correction_bias"),
    *(row(f"model.{EXPERT}.{x}_proj.weight", f"{EXPERT}.{x}_proj.weight") for x in ("gate", "up", "down")),
    *(row(f"model.layers.{{i}}.mlp.shared_experts.{x}_proj.weight", f"layers.{{i}}.mlp.shared_experts.{x}_proj.weight") for x in ("gate", "up", "down")),
))
H = "transformer.h.{i}"
GPT2_TABLE = (
    row("transformer.wte.weight", "embed_tokens.weight"),
    row("transformer.wpe.weight", "embed_positions.weight"),
    row(H + ".ln_1.{p}", "layers.{i}.input_layernorm.{p}"),
    row(H + ".attn.c_attn.weight", *(f"{ATTN}.{x}_proj.weight" for x in "qkv"), transpose=True),
    row(H + ".attn.c_attn.bias", *(f"{ATTN}.{x}_proj.bias" for x in "qkv")),
    row(H + ".attn.c_proj.weight", f"{ATTN}.o_proj.weight", transpose=True),
    row(H + ".attn.c_proj.bias", f"{ATTN}.o_proj.bias"),
    row(H + ".ln_2.{p}", "layers.{i}.post_attention_layernorm.{p}"),
    row(H + ".mlp.c_fc.weight", "layers.{i}.mlp.up_proj.weight", transpose=True),
    row(H + ".mlp.c_fc.bias", "layers.{i}.mlp.up_proj.bias"),
    row(H + ".mlp.c_proj.weight", "layers.{i}.mlp.down_proj.weight", transpose=True),
    row(H + ".mlp.c_proj.bias", "layers.{i}.mlp.down_proj.bias"),
    row("transformer.ln_f.{p}", "norm.{p}"),
    row("lm_head.weight", "lm_head.weight"),
)

# Qwen2-VL's vision tower: our names are the checkpoint's ({p}: rows whose parameter our tower lacks drop out).
VISION_TABLE = (
    row("visual.patch_embed.proj.weight", "visual.patch_embed.proj.weight"),
    *(row(f"visual.blocks.{{v}}.{x}.{{p}}", f"visual.blocks.{{v}}.{x}.{{p}}") for x in (
        "norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    *(row(f"visual.merger.{x}.{{p}}", f"visual.merger.{x}.{{p}}") for x in ("ln_q", "mlp.0", "mlp.2")),
)
QWEN_VL_TABLE = LLAMA_TABLE + VISION_TABLE
QWEN_VL_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))  # transformers 5's own spelling
# Gemma-3's multimodal folder (Gemma3ForConditionalGeneration): its language model's tensors under transformers 5's
# prefix or the older one (the published checkpoints'); the SigLIP tower and the projector are not read.
GEMMA3_ALIASES = (("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
GEMMA3_SKIPPED = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")

# Buffers some checkpoints carry that hold no learned values (GPT-2's causal mask, old Llama's inv_freq).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# --- config.json ↔ ModelConfig ------------------------------------------------------------------

SLIDING, FULL = "sliding_attention", "full_attention"

GATED_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def read_rope(d: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """RoPE fields from transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or d.get("rope_theta") or default_theta
    partial = params.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
    kind = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    scaling = None
    if kind != "default":
        scaling = {"rope_type": kind, **params}
        if kind in ("llama3", "longrope"):  # transformers falls back to the model's context when the file omits it
            context = d.get("original_max_position_embeddings") or d["max_position_embeddings"]
            scaling.setdefault("original_max_position_embeddings", context)
        if kind == "longrope" and d.get("original_max_position_embeddings"):  # Phi-3 keeps it beside: that one counts
            scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    return dict(rope_theta=float(theta), rope_scaling=scaling, partial_rotary_factor=float(partial))


def _windows(d: dict[str, Any], mode: str) -> dict[str, Any]:
    """sliding_window and layer_types. mode "all": config.json's sliding_window applies to every layer
    (Mistral, Mixtral, Phi-3); "qwen": only with use_sliding_window, and only in the layers listed as
    sliding (layer_types, else those from max_window_layers on); "none": the family has none."""
    window = d.get("sliding_window")
    if mode == "none" or window is None or (mode == "qwen" and not d.get("use_sliding_window", False)):
        return dict(sliding_window=None, layer_types=None)
    if mode == "all":
        return dict(sliding_window=window, layer_types=None)
    types = qwen_layer_types(d)
    if SLIDING not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=None if FULL not in types else types)


def qwen_layer_types(d: dict[str, Any]) -> list[str]:
    """Qwen's attention kind per layer when use_sliding_window is on: config.json's layer_types, else
    sliding from layer max_window_layers on (transformers' default for it: 28)."""
    n = d["num_hidden_layers"]
    return list(d.get("layer_types") or ["sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention" for i in range(n)])


def _read_llama_like(d: dict[str, Any], *, theta: float = 10000.0, eps: float = 1e-6, tie: bool = False,
                     head_dim: int | None = None, window: str = "none") -> dict[str, Any]:
    """The fields every Llama descendant shares; the keyword defaults are the family's transformers defaults."""
    act = d.get("hidden_act") or "silu"
    if act not in GATED_ACTS:
        raise DecoderLMError(f"hidden_act {act!r} in config.json is not supported; supported: {', '.join(GATED_ACTS)}")
    bias = bool(d.get("attention_bias", False))
    return dict(
        vocab_size=d["vocab_size"], n_layers=d["num_hidden_layers"], d_model=d["hidden_size"], n_heads=d["num_attention_heads"],
        n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"], head_dim=d.get("head_dim") or head_dim,
        ffn_hidden=d["intermediate_size"], max_seq_len=d.get("max_position_embeddings", 2048),
        norm="rmsnorm", norm_eps=float(d.get("rms_norm_eps", eps)), position="rope", **read_rope(d, theta),
        mlp=GATED_ACTS[act], attn_bias=bias, attn_out_bias=bias,
        tie_embeddings=bool(d.get("tie_word_embeddings", tie)), **_windows(d, window), family=d["model_type"],
    )


NO_BIAS = dict(attn_bias=False, attn_out_bias=False)  # families whose projections never have biases


def _write_llama_like(c: ModelConfig) -> dict[str, Any]:
    if (c.rope_scaling or {}).get("rope_type") == "freq_factors":
        raise DecoderLMError("this model scales RoPE by per-frequency factors (a GGUF rope_freqs tensor that is not Llama 3 scaling), "
                             "which an HF config.json cannot express; run the .gguf file directly instead of converting it")
    out = dict(
        vocab_size=c.vocab_size, num_hidden_layers=c.n_layers, hidden_size=c.d_model, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.ffn_hidden, max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        hidden_act={"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}.get(c.mlp, c.mlp), attention_bias=c.attn_bias, mlp_bias=c.mlp_bias,
        tie_word_embeddings=c.tie_embeddings, sliding_window=c.sliding_window,
    )
    if c.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary_factor
    return out


def _read_llama(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d) | dict(mlp_bias=bool(d.get("mlp_bias", False)))


def _read_mistral(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d, window="all") | NO_BIAS


def _read_mixtral(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d, theta=1e6, eps=1e-5, window="all") | NO_BIAS | dict(
        n_experts=d.get("num_local_experts", 8), n_experts_per_tok=d.get("num_experts_per_tok", 2),
        moe_hidden=d["intermediate_size"], moe_renormalize=True)


def _write_mixtral(c: ModelConfig) -> dict[str, Any]:
    return _write_llama_like(c) | dict(num_local_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_tok,
                                       intermediate_size=c.moe_hidden)


def _read_qwen2(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d, window="qwen") | dict(attn_bias=True, attn_out_bias=False)


def _read_qwen3(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d, head_dim=128, window="qwen") | dict(qk_norm=True)


def _write_qwen(c: ModelConfig) -> dict[str, Any]:
    sliding = c.sliding_window is not None
    return _write_llama_like(c) | dict(use_sliding_window=sliding, max_window_layers=0 if sliding else c.n_layers,
                                       layer_types=[SLIDING if c.window(i) else FULL for i in range(c.n_layers)])


def _read_qwen3_moe(d: dict[str, Any]) -> dict[str, Any]:
    n_experts = d.get("num_experts", d.get("num_local_experts", 128))
    if n_experts and (d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1):
        raise DecoderLMError("this qwen3_moe checkpoint mixes dense and expert layers (mlp_only_layers / decoder_sparse_step), "
                             "which decoderlm does not support yet")
    # Unlike Qwen3's, its sliding window (when switched on) covers every layer.
    return _read_llama_like(d, window="all" if d.get("use_sliding_window") else "none") | dict(
        qk_norm=True, n_experts=n_experts, n_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_hidden=d.get("moe_intermediate_size", 768), moe_renormalize=bool(d.get("norm_topk_prob", False)))


def _write_qwen3_moe(c: ModelConfig) -> dict[str, Any]:
    return _write_llama_like(c) | dict(
        num_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_tok, moe_intermediate_size=c.moe_hidden,
        norm_topk_prob=c.moe_renormalize, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=c.sliding_window is not None)


def _read_phi3(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d, eps=1e-5, window="all") | NO_BIAS


def _read_gemma(d: dict[str, Any]) -> dict[str, Any]:
    # Gemma's official configs say "gelu" but mean the tanh approximation (transformers maps it too).
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    act = "gelu_pytorch_tanh" if act == "gelu" else act
    return _read_llama_like({**d, "hidden_act": act}, head_dim=256, tie=True) | dict(
        embed_scale=math.sqrt(d["hidden_size"]), norm_offset=1.0)


def _layer_types(d: dict[str, Any], every: int) -> dict[str, Any]:
    """sliding_window and layer_types from config.json's layer_types, else every `every`-th layer full
    (Gemma-2, gpt-oss: 2; Gemma-3: sliding_window_pattern). Uniform kinds need no list."""
    window, n = d.get("sliding_window"), d["num_hidden_layers"]
    types = list(d.get("layer_types") or [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)])
    if window is None or SLIDING not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=None if FULL not in types else types)


def _write_layer_types(c: ModelConfig) -> dict[str, Any]:
    return dict(sliding_window=c.sliding_window, layer_types=[SLIDING if c.window(i) else FULL for i in range(c.n_layers)])


def _read_gemma2(d: dict[str, Any], every: int = 2, theta: float = 10000.0) -> dict[str, Any]:
    if d.get("use_bidirectional_attention"):
        raise DecoderLMError(f"this {d['model_type']} checkpoint uses bidirectional attention (an encoder), which decoderlm does not run")
    return _read_gemma({**d, "sliding_window": None, "rope_theta": d.get("rope_theta") or theta}) | _layer_types(d, every) | dict(
        sandwich_norm=True, query_pre_attn_scalar=int(d.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=d.get("attn_logit_softcapping"), final_logit_softcapping=d.get("final_logit_softcapping"))


def _write_gemma2(c: ModelConfig) -> dict[str, Any]:
    return _write_llama_like(c) | _write_layer_types(c) | dict(
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=c.query_pre_attn_scalar,
        attn_logit_softcapping=c.attn_logit_softcapping, final_logit_softcapping=c.final_logit_softcapping)


def _read_gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma-3: q/k norms, no attention soft-capping, and its own RoPE for the sliding layers: transformers
    5's rope_parameters per layer kind, or the older rope_theta + rope_scaling (global) and rope_local_base_freq."""
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        rope = read_rope({"rope_parameters": params.get(FULL) or {}}, 1e6)
        local = read_rope({"rope_parameters": params.get(SLIDING) or {}}, 10000.0)
    else:
        rope = read_rope(d, 1e6)
        local = dict(rope_theta=float(d.get("rope_local_base_freq") or 10000.0), rope_scaling=None)
    fields = _read_gemma2({**d, "rope_parameters": None, "rope_scaling": None}, every=int(d.get("sliding_window_pattern") or 6))
    return fields | dict(rope_theta=rope["rope_theta"], rope_scaling=rope["rope_scaling"], rope_local_theta=local["rope_theta"],
                         rope_local_scaling=local["rope_scaling"], qk_norm=True, attn_logit_softcapping=None)


def _write_gemma3(c: ModelConfig) -> dict[str, Any]:
    out = _write_gemma2(c)
    del out["rope_theta"], out["rope_scaling"], out["attn_logit_softcapping"]
    return out | dict(rope_parameters={FULL: {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})},
                                       SLIDING: {"rope_type": "default", "rope_theta": c.rope_local_theta, **(c.rope_local_scaling or {})}})


# Gemma3TextConfig's defaults for the keys the published multimodal configs leave out of text_config.
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, max_position_embeddings=131072, sliding_window=4096)


def _read_gemma3_wrapper(d: dict[str, Any]) -> dict[str, Any]:
    """A gemma3 folder's language model as the gemma3_text model it is. transformers' wrapper ties lm_head by its
    own tie_word_embeddings and soft-caps no logits (text_config's final_logit_softcapping is unread)."""
    text = GEMMA3_TEXT_DEFAULTS | (d.get("text_config") or {}) | dict(
        model_type="gemma3_text", tie_word_embeddings=d.get("tie_word_embeddings", True), final_logit_softcapping=None)
    return _read_gemma3(text)


# transformers' RoPE for a gpt_oss config.json that names none: YaRN ×32 from 4,096.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


def _read_gpt_oss(d: dict[str, Any]) -> dict[str, Any]:
    if not d.get("rope_scaling") and not d.get("rope_parameters"):
        d = {**d, "rope_parameters": GPT_OSS_ROPE}
    return _read_llama_like({**d, "sliding_window": None}, theta=150000.0, eps=1e-5) | _layer_types(d, 2) | dict(
        mlp="swiglu_clamped", mlp_bias=True, attn_sinks=True, router_bias=True,
        n_experts=d.get("num_local_experts", 128), n_experts_per_tok=d.get("num_experts_per_tok", 4), moe_hidden=d["intermediate_size"],
        moe_renormalize=True, swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


def _write_gpt_oss(c: ModelConfig) -> dict[str, Any]:
    out = _write_llama_like(c) | _write_layer_types(c) | dict(
        num_local_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_tok, intermediate_size=c.moe_hidden,
        swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha)
    del out["hidden_act"], out["mlp_bias"], out["rope_theta"], out["rope_scaling"]
    return out | dict(rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})})


def _read_olmo2(d: dict[str, Any]) -> dict[str, Any]:
    return _read_llama_like(d, eps=1e-5) | dict(qk_norm=True, qk_norm_scope="all", post_norm=True)


def _read_deepseek(d: dict[str, Any], v3: bool) -> dict[str, Any]:
    """DeepSeek-V2 / V3; the defaults are transformers' for a key the file omits."""
    if d.get("moe_layer_freq", 1) != 1:
        raise DecoderLMError(f"this {d['model_type']} checkpoint has expert layers only every {d['moe_layer_freq']} layers (moe_layer_freq), "
                             "which decoderlm (and transformers) do not support")
    fields = _read_llama_like(d, eps=1e-6) | dict(
        q_lora_rank=d.get("q_lora_rank", 1536) or 0, kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
        rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,  # V2's complex-number RoPE pairs adjacent channels
        mlp_bias=False if v3 else bool(d.get("mlp_bias", False)))
    n_experts = d.get("n_routed_experts", 256 if v3 else 64) or 0
    dense = min(d.get("first_k_dense_replace", 3 if v3 else 0) or 0, d["num_hidden_layers"])
    if not n_experts or dense == d["num_hidden_layers"]:  # no expert layer at all
        return fields
    fields |= dict(n_experts=n_experts, n_experts_per_tok=d["num_experts_per_tok"], moe_hidden=d.get("moe_intermediate_size", 2048 if v3 else 1407),
                   n_shared_experts=d.get("n_shared_experts", 1 if v3 else 2) or 0, moe_dense_layers=list(range(dense)) or None,
                   moe_routed_scale=float(d.get("routed_scaling_factor", 2.5 if v3 else 1.0)))
    if v3:  # sigmoid scores, the selection bias, groups ranked by their best two (transformers reads no topk_method / scoring_func)
        return fields | dict(moe_router="sigmoid", moe_groups=d.get("n_group", 8) or 1, moe_topk_groups=d.get("topk_group", 4) or 1,
                             moe_renormalize=bool(d.get("norm_topk_prob", True)))
    method = d.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise DecoderLMError(f"deepseek_v2 topk_method {method!r} is not supported; supported: greedy, group_limited_greedy")
    grouped = method == "group_limited_greedy"
    # transformers' DeepSeek-V2 never renormalizes the chosen weights (norm_topk_prob is not read); nor does this.
    return fields | dict(moe_groups=d["n_group"] if grouped else 1, moe_topk_groups=d["topk_group"] if grouped else 1, moe_renormalize=False)


def _write_deepseek(c: ModelConfig, v3: bool) -> dict[str, Any]:
    out = _write_llama_like(c) | dict(
        head_dim=c.qk_rope_head_dim, q_lora_rank=c.q_lora_rank or None, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, first_k_dense_replace=c.n_layers)
    del out["sliding_window"]
    if not c.n_experts:  # every layer dense
        return out | (dict(rope_interleave=c.rope_interleave) if v3 else {})
    out |= dict(n_routed_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_tok, moe_intermediate_size=c.moe_hidden,
                n_shared_experts=c.n_shared_experts, routed_scaling_factor=c.moe_routed_scale, first_k_dense_replace=len(c.moe_dense_layers or []),
                n_group=c.moe_groups, topk_group=c.moe_topk_groups)
    if v3:
        return out | dict(rope_interleave=c.rope_interleave, norm_topk_prob=c.moe_renormalize)
    return out | dict(topk_method="group_limited_greedy" if c.moe_groups > 1 else "greedy")


VISION_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _read_qwen_vl(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL: the text model's fields (nested in text_config, or flat in older files), M-RoPE's
    sections, and the vision tower's shape."""
    text = {**d, **(d.get("text_config") or {}), "model_type": d["model_type"]}
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if rope.get("rope_type", rope.get("type")) == "mrope":  # transformers reads it as default RoPE, in three sections
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text["rope_parameters"], text["rope_scaling"] = rope, None
    fields = _read_llama_like(text, theta=1e6, eps=1e-5, window="qwen") | dict(attn_bias=True, attn_out_bias=False)
    v = d.get("vision_config") or {}
    act = v.get("hidden_act") or ("silu" if d["model_type"] == "qwen2_5_vl" else "quick_gelu")
    if act not in VISION_ACTS:
        raise DecoderLMError(f"vision_config hidden_act {act!r} is not supported; supported: {', '.join(VISION_ACTS)}")
    shape = dict(depth=v.get("depth", 32), n_heads=v.get("num_heads", 16), act=VISION_ACTS[act], patch_size=v.get("patch_size", 14),
                 temporal_patch_size=v.get("temporal_patch_size", 2), merge_size=v.get("spatial_merge_size", 2),
                 in_channels=v.get("in_channels", v.get("in_chans", 3)),
                 rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    if d["model_type"] == "qwen2_vl":
        width = v.get("embed_dim", 1280)
        vision = dict(kind="qwen2_vl", width=width, ffn_hidden=int(width * v.get("mlp_ratio", 4)), **shape)
        out_width = v.get("hidden_size", 3584)
    else:
        vision = dict(kind="qwen2_5_vl", width=v.get("hidden_size", 3584), ffn_hidden=v.get("intermediate_size", 3420),
                      window_size=v.get("window_size", 112), full_attention_blocks=list(v.get("fullatt_block_indexes", [7, 15, 23, 31])), **shape)
        out_width = v.get("out_hidden_size", 3584)
    if out_width != fields["d_model"]:
        raise DecoderLMError(f"the vision tower's output width ({out_width}) is not the language model's ({fields['d_model']}); "
                             "restore the checkpoint's original config.json")
    return fields | dict(vision=vision, image_token_id=d.get("image_token_id", 151655), mrope_section=section or [16, 24, 24])


def _write_qwen_vl(c: ModelConfig) -> dict[str, Any]:
    text = _write_qwen(c)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"), "mrope_section": c.mrope_section}
    if text.pop("rope_scaling"):
        raise DecoderLMError("this model scales RoPE, which a Qwen2-VL config.json cannot express")
    v = c.vision or {}
    vision = dict(depth=v["depth"], num_heads=v["n_heads"], hidden_act={"gelu_tanh": "gelu_pytorch_tanh"}.get(v["act"], v["act"]),
                  patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"], spatial_merge_size=v["merge_size"],
                  in_channels=v["in_channels"], rope_parameters={"rope_type": "axial", "rope_theta": v["rope_theta"]})
    if v["kind"] == "qwen2_vl":
        ratio = v["ffn_hidden"] / v["width"]
        vision |= dict(embed_dim=v["width"], mlp_ratio=int(ratio) if ratio.is_integer() else ratio, hidden_size=c.d_model)
    else:
        vision |= dict(hidden_size=v["width"], intermediate_size=v["ffn_hidden"], window_size=v["window_size"],
                       fullatt_block_indexes=v["full_attention_blocks"], out_hidden_size=c.d_model)
    return dict(text_config=text, vision_config=vision, image_token_id=c.image_token_id, tie_word_embeddings=c.tie_embeddings)


def _read_gpt2(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("scale_attn_by_inverse_layer_idx") or not d.get("scale_attn_weights", True):
        raise DecoderLMError("this gpt2 checkpoint scales attention differently (scale_attn_by_inverse_layer_idx / scale_attn_weights), "
                             "which decoderlm does not support")
    act = d.get("activation_function", "gelu_new")
    if act not in GPT2_ACTS:
        raise DecoderLMError(f"activation_function {act!r} in config.json is not supported; supported: {', '.join(GPT2_ACTS)}")
    return dict(
        vocab_size=d["vocab_size"], n_layers=d["n_layer"], d_model=d["n_embd"], n_heads=d["n_head"],
        ffn_hidden=d.get("n_inner") or 4 * d["n_embd"], max_seq_len=d.get("n_positions", 1024),
        norm="layernorm", norm_eps=float(d.get("layer_norm_epsilon", 1e-5)), position="learned", mlp=GPT2_ACTS[act],
        attn_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=bool(d.get("tie_word_embeddings", True)), family="gpt2",
    )


def _write_gpt2(c: ModelConfig) -> dict[str, Any]:
    return dict(vocab_size=c.vocab_size, n_layer=c.n_layers, n_embd=c.d_model, n_head=c.n_heads, n_inner=c.ffn_hidden,
                n_positions=c.max_seq_len, layer_norm_epsilon=c.norm_eps, activation_function={"gelu_tanh": "gelu_new"}.get(c.mlp, c.mlp),
                tie_word_embeddings=c.tie_embeddings)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("gpt2", "GPT2LMHeadModel", _read_gpt2, _write_gpt2, GPT2_TABLE, optional_prefix="transformer."),
    Family("llama", "LlamaForCausalLM", _read_llama, _write_llama_like, LLAMA_TABLE),
    Family("mistral", "MistralForCausalLM", _read_mistral, _write_llama_like, LLAMA_TABLE),
    Family("mixtral", "MixtralForCausalLM", _read_mixtral, _write_mixtral, MIXTRAL_TABLE),
    Family("qwen2", "Qwen2ForCausalLM", _read_qwen2, _write_qwen, LLAMA_TABLE),
    Family("qwen3", "Qwen3ForCausalLM", _read_qwen3, _write_qwen, LLAMA_TABLE),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _read_qwen3_moe, _write_qwen3_moe, QWEN3_MOE_TABLE),
    Family("phi3", "Phi3ForCausalLM", _read_phi3, _write_llama_like, PHI3_TABLE),
    Family("gemma", "GemmaForCausalLM", _read_gemma, _write_llama_like, LLAMA_TABLE),
    Family("olmo2", "Olmo2ForCausalLM", _read_olmo2, _write_llama_like, OLMO2_TABLE),
    Family("gemma2", "Gemma2ForCausalLM", _read_gemma2, _write_gemma2, GEMMA2_TABLE),
    Family("gemma3_text", "Gemma3ForCausalLM", _read_gemma3, _write_gemma3, GEMMA2_TABLE),
    Family("gemma3", "Gemma3ForConditionalGeneration", _read_gemma3_wrapper, None, GEMMA2_TABLE, aliases=GEMMA3_ALIASES,
           skipped=GEMMA3_SKIPPED, unloaded="the language model only; the vision tower (SigLIP) is not loaded"),
    Family("gpt_oss", "GptOssForCausalLM", _read_gpt_oss, _write_gpt_oss, GPT_OSS_TABLE),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", partial(_read_deepseek, v3=False), partial(_write_deepseek, v3=False), DEEPSEEK_TABLE),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", partial(_read_deepseek, v3=True), partial(_write_deepseek, v3=True), DEEPSEEK_TABLE,
           mtp_layers=True),
    Family("qwen2_vl", "Qwen2VLForConditionalGeneration", _read_qwen_vl, _write_qwen_vl, QWEN_VL_TABLE, aliases=QWEN_VL_ALIASES),
    Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _read_qwen_vl, _write_qwen_vl, QWEN_VL_TABLE, aliases=QWEN_VL_ALIASES),
)}


def family_of(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise DecoderLMError(f"model_type {model_type!r} is not supported; supported families: {', '.join(FAMILIES)}")
    return FAMILIES[model_type]
