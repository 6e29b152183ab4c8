"""Read any model description into an `ArchSpec`: the shapes that decide parameters, FLOPs and memory.

`ModelConfig` describes the families decoderlm can run; `ArchSpec` also describes ones it only
accounts for (DeepSeek-V3's latent attention, gpt-oss's attention sinks, Gemma's sandwich norms,
shared experts). A config.json of a family decoderlm runs, and every GGUF header, is read by the
same code that loads the model (`formats.hf.config_from_hf`, `formats.gguf.gguf_fields`), so
`inspect` and `load` cannot describe one checkpoint differently; only the other families are read
here. A source is a config.json, an HF folder, a .gguf (metadata only), a run folder, a preset name
or a known name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decoderlm import names
from decoderlm.config import GATED_MLPS, PRESETS, ModelConfig, fits_annotation
from decoderlm.errors import DecoderLMError
from decoderlm.formats import detect, runs
from decoderlm.formats.families import FAMILIES, qwen_layer_types, read_rope
from decoderlm.formats.gguf import Metadata, gguf_fields, open_gguf
from decoderlm.formats.hf import config_from_hf, loadable_config
from decoderlm.jsonio import read_json

SLIDING, FULL = "sliding_attention", "full_attention"
# Families whose HF config leaves tie_word_embeddings to the class default of True.
TIED_BY_DEFAULT = {"gpt2", "gemma", "gemma2", "gemma3", "gemma3_text"}
# Families with a plain (ungated) MLP, LayerNorm and learned positions.
GPT2_LIKE = {"gpt2"}
SANDWICH_NORMS = {"gemma2", "gemma3", "gemma3_text"}  # norms before and after each sublayer
QK_NORM = {"qwen3", "qwen3_moe", "gemma3", "gemma3_text"}
QKV_BIAS = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"}  # biased q/k/v, unbiased o_proj regardless of attention_bias


@dataclass
class ArchSpec:
    family: str
    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    gated_mlp: bool = True  # gate/up/down (SwiGLU, GeGLU) or up/down
    norm: str = "rmsnorm"
    norm_bias: bool = True  # LayerNorm only: a bias beside the weight
    norms_per_layer: int = 2  # 4 with sandwich norms (Gemma-2/3)
    qk_norm: bool = False  # a head_dim norm on q and on k (Qwen3, Gemma-3)
    qk_norm_all_heads: bool = False  # the q/k norms span all heads' features instead (OLMo-2)
    post_norm: bool = False  # sublayer outputs are normed before the residual add, inputs are not (OLMo-2)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    attn_sinks: bool = False  # one learned logit per head that soaks up attention (gpt-oss)
    learned_positions: int = 0  # size of the learned position table (GPT-2), 0 with RoPE
    tie_embeddings: bool = False
    max_seq_len: int = 0
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_local_theta: float | None = None  # the sliding layers' own RoPE base (Gemma-3)
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer SLIDING / FULL; None → all sliding if sliding_window else all full
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_hidden: int = 0
    n_shared_experts: int = 0
    router_bias: bool = False
    dense_layers: list[int] = dataclasses.field(default_factory=list)  # layers keeping a dense FFN in a MoE model
    q_lora_rank: int = 0  # MLA (DeepSeek): 0 → a full q_proj
    kv_lora_rank: int = 0  # MLA: > 0 → K/V come from a compressed latent of this width
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    vision: dict[str, Any] | None = None  # a vision-language model's vision tower: decoderlm.model.vision.VisionConfig's fields
    source: str = ""
    refused: str | None = None  # why `load` refuses this model (None: decoderlm runs it)
    unloaded: str = ""  # what `load` leaves out of a model it runs (Gemma-3's vision tower)
    uncounted: list[str] = dataclasses.field(default_factory=list)  # towers outside the counts (a multimodal model's vision_config)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def window(self, layer: int) -> int | None:
        """How many recent keys this layer attends to (None = all)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

    def attention_kind(self) -> str:
        """MHA / GQA / MQA / MLA with the query:key-value head ratio."""
        if self.mla:
            return f"MLA {self.n_heads} heads, latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
        kind = "MHA" if self.n_kv_heads == self.n_heads else "MQA" if self.n_kv_heads == 1 else "GQA"
        return f"{kind} {self.n_heads}:{self.n_kv_heads}"

    def runs(self) -> str:
        """Whether decoderlm runs this model, in one line: "yes", "yes, <what it leaves out>" or "no: <the loader's reason>"."""
        if self.refused is not None:
            return f"no: {self.refused}"
        return f"yes, {self.unloaded}" if self.unloaded else "yes"

    def features(self) -> list[str]:
        """One line per thing that sets this family apart."""
        shared = not self.mla and 1 < self.n_kv_heads < self.n_heads
        lines = [f"attention: {self.attention_kind()}" + (f" ({self.n_heads // self.n_kv_heads} query heads share each K/V head)" if shared else "")]
        if self.mla:
            q = f"q_lora_rank {self.q_lora_rank:,}" if self.q_lora_rank else "full q_proj"
            lines.append(f"MLA: {q}, kv_lora_rank {self.kv_lora_rank:,}; caches the latent + a shared {self.qk_rope_head_dim}-dim RoPE key instead of per-head K/V")
        if self.learned_positions:
            lines.append(f"positions: learned table of {self.learned_positions:,}")
        else:
            scaling = ""
            if self.rope_scaling:
                kind = self.rope_scaling.get("rope_type") or self.rope_scaling.get("type")
                orig = self.rope_scaling.get("original_max_position_embeddings")
                if kind == "freq_factors":  # GGUF's rope_freqs: one divisor per frequency
                    scaling = f", per-frequency scaling (divisors {min(self.rope_scaling['factors']):g}..{max(self.rope_scaling['factors']):g})"
                else:
                    factor = self.rope_scaling.get("factor") or (self.max_seq_len / orig if orig else 1)  # LongRoPE may leave it implicit
                    scaling = f", {kind} scaling ×{factor:g}" + (f" from {orig:,} to {int(orig * factor):,} tokens" if orig else "")
            local = f"; sliding layers θ={self.rope_local_theta:,.0f}" if self.rope_local_theta is not None else ""
            lines.append(f"positions: RoPE θ={self.rope_theta:,.0f}{scaling}{local}")
        if self.sliding_window is not None:
            n_sliding = sum(self.window(i) is not None for i in range(self.n_layers))
            if n_sliding == self.n_layers:
                lines.append(f"sliding window: {self.sliding_window:,} tokens in every layer")
            else:
                lines.append(f"mixed layer_types: {n_sliding} sliding_attention (window {self.sliding_window:,}) + {self.n_layers - n_sliding} full_attention")
        if self.n_experts:
            shared = f" + {self.n_shared_experts} shared" if self.n_shared_experts else ""
            dense = f"; dense FFN in {len(self.dense_layers)} layer(s)" if self.dense_layers else ""
            lines.append(f"MoE: {self.n_experts} experts, {self.n_experts_per_tok} per token{shared}, expert hidden {self.moe_hidden:,}{dense}")
        lines.append("embeddings: tied (lm_head reuses embed_tokens)" if self.tie_embeddings else "embeddings: untied (separate lm_head)")
        qk = "q/k norm" + (" over all heads" if self.qk_norm_all_heads else "")
        extras = [name for name, on in ((qk, self.qk_norm), ("sandwich norms", self.norms_per_layer == 4), ("post-norm", self.post_norm),
                                        ("attention sinks", self.attn_sinks), ("q/k/v bias", self.qkv_bias)) if on]
        lines.append(f"norm: {self.norm}" + (f"; {', '.join(extras)}" if extras else ""))
        if self.vision:
            v = self.vision
            windows = f", windows of {v['window_size']} px but blocks {v['full_attention_blocks']}" if v.get("window_size") else ""
            lines.append(f"vision tower ({v['kind']}): {v['depth']} blocks, width {v['width']:,}, {v['patch_size']} px patches, "
                         f"{v['merge_size']}×{v['merge_size']} merged into one token{windows}; M-RoPE over (time, height, width)")
        return lines


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def spec_from_hf(cfg: dict[str, Any], source: str = "") -> ArchSpec:
    """An HF config.json dict (any family, runnable by decoderlm or not)."""
    try:
        loadable_config(cfg, source or "this checkpoint")
        refused = None
    except DecoderLMError as e:  # the loader's own reason
        refused = str(e)
    family = FAMILIES.get(cfg.get("model_type"))
    whole = family is not None and not family.unloaded  # a vision-language family decoderlm runs whole counts its tower
    towers = [] if whole else [key for key in cfg if key.endswith("_config") and any(m in key for m in ("vision", "audio", "speech"))]
    if "text_config" in cfg and family is None:  # other multimodal wrappers: the counts are the language model's
        cfg = {"model_type": cfg.get("model_type"), **cfg["text_config"]}
    spec = _spec_from_text_hf(cfg, source)
    spec.refused, spec.uncounted = refused, towers
    spec.unloaded = family.unloaded if family is not None and refused is None else ""
    return spec


def _spec_from_text_hf(cfg: dict[str, Any], source: str) -> ArchSpec:
    if cfg.get("model_type") in FAMILIES:
        try:
            return spec_from_model_config(config_from_hf(cfg), source)
        except DecoderLMError as refused:  # a variant loading refuses (mixed sliding/full or dense/MoE layers, ...): still report it
            try:
                return _spec_from_other_hf(cfg, source)
            except DecoderLMError:
                raise refused from None  # the loader's message says more
    return _spec_from_other_hf(cfg, source)


def _spec_from_other_hf(cfg: dict[str, Any], source: str) -> ArchSpec:
    """Families decoderlm does not run, and variants of runnable ones that loading refuses, read generically."""
    family = cfg.get("model_type") or "unknown"
    try:
        d = int(_first(cfg, "hidden_size", "n_embd", "d_model"))
        n_layers = int(_first(cfg, "num_hidden_layers", "n_layer"))
        n_heads = int(_first(cfg, "num_attention_heads", "n_head"))
        vocab = int(cfg["vocab_size"])
        rope = read_rope(cfg)
    except (TypeError, KeyError, ValueError):
        raise DecoderLMError(f"{source or 'config'} is not an HF model config (needs hidden_size, num_hidden_layers, num_attention_heads, vocab_size)") from None
    gpt2 = family in GPT2_LIKE
    spec = ArchSpec(
        family=family, vocab_size=vocab, n_layers=n_layers, d_model=d, n_heads=n_heads,
        n_kv_heads=int(_first(cfg, "num_key_value_heads", default=n_heads)),
        head_dim=int(_first(cfg, "head_dim", default=d // n_heads)),
        ffn_hidden=int(_first(cfg, "intermediate_size", "n_inner", default=4 * d)),
        gated_mlp=not gpt2, norm="layernorm" if gpt2 else "rmsnorm",
        norms_per_layer=4 if family in SANDWICH_NORMS else 2, qk_norm=family in QK_NORM,
        qkv_bias=gpt2 or family in QKV_BIAS or bool(cfg.get("attention_bias")),
        o_bias=gpt2 or (family not in QKV_BIAS and bool(cfg.get("attention_bias"))),
        mlp_bias=gpt2 or family == "gpt_oss" or bool(cfg.get("mlp_bias")),
        attn_sinks=family == "gpt_oss", learned_positions=int(cfg.get("n_positions", 0)) if gpt2 else 0,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family in TIED_BY_DEFAULT)),
        max_seq_len=int(_first(cfg, "max_position_embeddings", "n_positions", default=0)),
        rope_theta=None if gpt2 else rope["rope_theta"], rope_scaling=None if gpt2 else rope["rope_scaling"], source=source,
    )
    try:
        _read_windows(cfg, spec)
        _read_moe(cfg, spec)
        _read_mla(cfg, spec)
    except KeyError as e:
        raise DecoderLMError(f"{source or 'config'} lacks {e.args[0]!r}, which its other fields call for; restore the original config.json") from None
    except (TypeError, ValueError) as e:
        raise DecoderLMError(f"{source or 'config'} has a value of the wrong type ({e}); restore the original config.json") from None
    return spec


def _read_mla(cfg: dict[str, Any], spec: ArchSpec) -> None:
    """DeepSeek's multi-head latent attention: K/V (and optionally Q) through low-rank latents."""
    if not cfg.get("kv_lora_rank"):
        return
    spec.q_lora_rank = int(cfg.get("q_lora_rank") or 0)
    spec.kv_lora_rank = int(cfg["kv_lora_rank"])
    spec.qk_rope_head_dim, spec.qk_nope_head_dim = int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"])
    spec.v_head_dim = int(cfg["v_head_dim"])
    spec.head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim


def _read_windows(cfg: dict[str, Any], spec: ArchSpec) -> None:
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:  # Qwen ships a window it does not use
        return
    n = spec.n_layers
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
    elif cfg.get("sliding_window_pattern"):  # Gemma-3: every p-th layer is global
        p = int(cfg["sliding_window_pattern"])
        types = [FULL if (i + 1) % p == 0 else SLIDING for i in range(n)]
    elif spec.family == "gemma2":  # alternating, starting with a local layer
        types = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    elif cfg.get("use_sliding_window"):  # Qwen: only the layers from max_window_layers on
        types = qwen_layer_types(cfg)
    else:
        types = None
    if types is not None and SLIDING not in types:
        return
    spec.sliding_window = int(window)
    spec.layer_types = None if types is None or all(t == SLIDING for t in types) else types


def _read_moe(cfg: dict[str, Any], spec: ArchSpec) -> None:
    n_experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0))
    if not n_experts:
        return
    spec.n_experts = n_experts
    spec.n_experts_per_tok = int(_first(cfg, "num_experts_per_tok", "experts_per_token", default=2))
    spec.moe_hidden = int(_first(cfg, "moe_intermediate_size", default=spec.ffn_hidden))
    spec.n_shared_experts = int(cfg.get("n_shared_experts") or 0)
    spec.router_bias = spec.family == "gpt_oss"
    n = spec.n_layers
    if cfg.get("first_k_dense_replace") is not None:  # DeepSeek
        k, freq = int(cfg["first_k_dense_replace"]), int(cfg.get("moe_layer_freq", 1))
        spec.dense_layers = [i for i in range(n) if i < k or i % freq]
    elif "decoder_sparse_step" in cfg:  # Qwen-MoE
        step, only = int(cfg["decoder_sparse_step"]), set(cfg.get("mlp_only_layers") or [])
        spec.dense_layers = [i for i in range(n) if i in only or (i + 1) % step]


def spec_from_model_config(cfg: ModelConfig, source: str = "") -> ArchSpec:
    """A decoderlm `ModelConfig` (a preset, a run folder's checkpoint, a loaded model, a read checkpoint)."""
    return ArchSpec(
        family=cfg.family, vocab_size=cfg.vocab_size, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, ffn_hidden=cfg.ffn_hidden, gated_mlp=cfg.mlp in GATED_MLPS,
        norm=cfg.norm, norm_bias=cfg.norm_bias, norms_per_layer=4 if cfg.sandwich_norm else 2,
        qk_norm=cfg.qk_norm, qk_norm_all_heads=cfg.qk_norm_scope == "all", post_norm=cfg.post_norm,
        qkv_bias=cfg.attn_bias, o_bias=cfg.attn_out_bias, mlp_bias=cfg.mlp_bias, attn_sinks=cfg.attn_sinks, router_bias=cfg.router_bias,
        learned_positions=cfg.max_seq_len if cfg.position == "learned" else 0, tie_embeddings=cfg.tie_embeddings,
        max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta if cfg.position == "rope" else None,
        rope_scaling=cfg.rope_scaling if cfg.position == "rope" else None, rope_local_theta=cfg.rope_local_theta,
        sliding_window=cfg.sliding_window, layer_types=cfg.layer_types, n_experts=cfg.n_experts, n_experts_per_tok=cfg.n_experts_per_tok if cfg.n_experts else 0,
        moe_hidden=(cfg.moe_hidden or cfg.ffn_hidden) if cfg.n_experts else 0, n_shared_experts=cfg.n_shared_experts if cfg.n_experts else 0,
        dense_layers=list(cfg.moe_dense_layers or []) if cfg.n_experts else [], q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, vision=cfg.vision,
        source=source,
    )


def spec_from_gguf(path: Path) -> ArchSpec:
    """GGUF metadata only (no weights are read), through the loader's own reading of the header."""
    reader = open_gguf(path)
    config = ModelConfig(**gguf_fields(Metadata(reader), {t.name: t for t in reader.tensors}))
    return spec_from_model_config(config, str(path))


def _from_json(path: Path) -> ArchSpec:
    cfg = read_json(path, "config file", "give an HF config.json or a ModelConfig .json")
    if "d_model" in cfg and "n_layers" in cfg:  # a decoderlm ModelConfig
        return spec_from_model_config(ModelConfig.from_dict(cfg), str(path))
    return spec_from_hf(cfg, str(path))


def read_spec(source: str | Path) -> ArchSpec:
    """Any source `inspect` accepts → ArchSpec, reading no weights where the format allows it."""
    if str(source) in PRESETS and not Path(source).exists():
        return spec_from_model_config(ModelConfig.from_preset(str(source)), str(source))
    path = names.resolve(source)
    kind = detect(path)
    if kind == "json":
        return _from_json(path)
    if kind == "gguf":
        return spec_from_gguf(path)
    if kind == "run":
        return spec_from_model_config(ModelConfig.from_dict(runs.read(path)["config"]), str(path))
    if kind == "hf":
        return _from_json(path / "config.json")
    raise DecoderLMError(f"{source} is not something inspect can read: give a config.json, an HF folder, a .gguf, a run folder or a preset ({', '.join(PRESETS)})")


def with_overrides(spec: ArchSpec, overrides: dict[str, str]) -> ArchSpec:
    """A copy with some fields changed (values parsed as JSON: `n_kv_heads=1`, `sliding_window=null`)."""
    fields = {f.name: f for f in dataclasses.fields(ArchSpec)}
    changes: dict[str, Any] = {}
    for key, raw in overrides.items():
        if key not in fields:
            raise DecoderLMError(f"cannot override {key!r}; choose from {', '.join(sorted(fields))}")
        try:
            changes[key] = json.loads(raw)
        except json.JSONDecodeError:
            changes[key] = raw
        if not fits_annotation(changes[key], str(fields[key].type)):
            raise DecoderLMError(f"cannot override {key} with {raw!r}; it must be {fields[key].type}")
    new = dataclasses.replace(spec, **changes)
    for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden"):
        if getattr(new, name) <= 0:
            raise DecoderLMError(f"override {name}={getattr(new, name)} must be a positive number")
    if not new.mla and new.n_heads % new.n_kv_heads:
        raise DecoderLMError(f"n_heads {new.n_heads} must be a multiple of n_kv_heads {new.n_kv_heads}")
    return new

