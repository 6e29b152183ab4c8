"""The GGUF architectures of the families with layer kinds, sinks and latent attention: `gemma2`,
`gemma3`, `gpt-oss`, `qwen3moe` and `deepseek2` (DeepSeek-V2/V3), as llama.cpp's
convert_hf_to_gguf.py writes them and llama.cpp runs them. Quirks undone (or kept) here:
- Gemma's RMSNorm weights are stored with the 1 already added (w + 1), so no norm offset;
- Gemma scales queries by 1/sqrt(head_dim) (1/sqrt(d_model / n_heads) for the 27B models), whatever
  query_pre_attn_scalar the checkpoint had: the file does not keep it;
- sliding layers come from `attention.sliding_window_pattern` (a flag per layer, or every n-th layer
  full) or llama.cpp's defaults (Gemma-2, gpt-oss: 2; Gemma-3: 6);
- gpt-oss's `post_attention_norm` is the FFN's input norm (Gemma's is the attention output's);
  its gate/up experts are stored apart (the converter undoes HF's interleaving);
- DeepSeek's kv_b_proj is stored split, per head, as attn_k_b (transposed: (H, rank, nope)) and
  attn_v_b ((H, v, rank)); they are joined back. Its RoPE rotates adjacent pairs (rope_interleave);
  the router is sigmoid (V3) when `expert_gating_func` says 2, else softmax (V2). (llama.cpp ranks
  expert groups by their best two scores' sum for V2 too; decoderlm keeps V2's best score, as
  transformers does, so a grouped V2 file can choose other experts than llama.cpp does);
- Qwen3-MoE: llama.cpp always renormalizes the chosen experts' weights;
- YaRN: llama.cpp rounds the corrected dimension range to whole dims (truncate).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from decoderlm.errors import DecoderLMError

FAMILIES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2"}
SLIDING, FULL = "sliding_attention", "full_attention"
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

# llama.cpp tensor name → ours, for these architectures ({i} is the layer); the rest is gguf.TENSOR_NAMES.
TENSOR_NAMES = {
    "blk.{i}.post_attention_norm": "layers.{i}.attn_out_norm",
    "blk.{i}.post_ffw_norm": "layers.{i}.ffn_out_norm",
    "blk.{i}.attn_sinks": "layers.{i}.self_attn.sinks",
    "blk.{i}.attn_q_a": "layers.{i}.self_attn.q_a_proj",
    "blk.{i}.attn_q_a_norm": "layers.{i}.self_attn.q_a_layernorm",
    "blk.{i}.attn_q_b": "layers.{i}.self_attn.q_b_proj",
    "blk.{i}.attn_kv_a_mqa": "layers.{i}.self_attn.kv_a_proj_with_mqa",
    "blk.{i}.attn_kv_a_norm": "layers.{i}.self_attn.kv_a_layernorm",
    "blk.{i}.attn_kv_b": "layers.{i}.self_attn.kv_b_proj",
    "blk.{i}.exp_probs_b": "layers.{i}.mlp.gate.e_score_correction_bias",
    **{f"blk.{{i}}.ffn_{x}_shexp": f"layers.{{i}}.mlp.shared_experts.{x}_proj" for x in ("gate", "up", "down")},
}
GPT_OSS_NAMES = {"blk.{i}.post_attention_norm": "layers.{i}.post_attention_layernorm"}
NO_SUFFIX = ("blk.{i}.attn_sinks", "blk.{i}.exp_probs_b")  # our parameter is the module's own tensor, not .weight / .bias


def arch_fields(meta: Any, tensors: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields these architectures add to (or change in) gguf.gguf_fields' common ones."""
    arch, n = meta.arch, fields["n_layers"]
    out: dict[str, Any] = {"family": FAMILIES[arch]}
    if arch in ("gemma2", "gemma3"):
        big = n == (46 if arch == "gemma2" else 62)  # the 27B models: llama.cpp scales by d_model / n_heads
        out.update(mlp="geglu", embed_scale=math.sqrt(fields["d_model"]), norm_offset=0.0, sandwich_norm=True,
                   query_pre_attn_scalar=fields["d_model"] // fields["n_heads"] if big else fields["head_dim"],
                   final_logit_softcapping=_float(meta.get("{arch}.final_logit_softcapping")))
        if arch == "gemma2":
            out["attn_logit_softcapping"] = _float(meta.get("{arch}.attn_logit_softcapping"))
    if arch in ("gemma2", "gemma3", "gpt-oss") and fields.get("sliding_window"):
        out.update(_layer_types(meta, n, 6 if arch == "gemma3" else 2))
        local_theta = meta.get("{arch}.rope.freq_base_swa")
        if arch == "gemma3":  # the local layers: their own base, no scaling
            out.update(rope_local_theta=float(local_theta or 10000.0), rope_local_scaling=None)
        elif local_theta is not None and float(local_theta) != fields["rope_theta"]:
            out.update(rope_local_theta=float(local_theta), rope_local_scaling=fields.get("rope_scaling"))
    if arch == "gpt-oss":
        out.update(mlp="swiglu_clamped", mlp_bias=True, attn_sinks=True, router_bias=True, moe_renormalize=True,
                   moe_hidden=int(meta.require("{arch}.expert_feed_forward_length")))
    if arch == "qwen3moe":
        out.update(moe_renormalize=True)
    if arch == "deepseek2":
        out.update(_deepseek_fields(meta, tensors, fields))
    return out


def _float(value: Any) -> float | None:
    return float(value) if value else None


def _layer_types(meta: Any, n: int, every: int) -> dict[str, Any]:
    pattern = meta.get("{arch}.attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        types = [SLIDING if p else FULL for p in pattern[:n]]
    else:  # llama.cpp's set_swa_pattern: the last of every `pattern` layers is full
        types = [SLIDING if int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 else FULL for i in range(n)]
    if SLIDING not in types:
        return dict(sliding_window=None, layer_types=None)
    return dict(layer_types=None if FULL not in types else types)


def _deepseek_fields(meta: Any, tensors: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    if meta.get("{arch}.rope.scaling.yarn_log_multiplier"):
        raise DecoderLMError("this deepseek2 GGUF uses YaRN with mscale_all_dim (rope.scaling.yarn_log_multiplier), "
                             "which decoderlm does not read from GGUF yet; load the HF checkpoint instead")
    rope = int(meta.require("{arch}.rope.dimension_count"))
    out = dict(q_lora_rank=int(meta.get("{arch}.attention.q_lora_rank") or 0), kv_lora_rank=int(meta.require("{arch}.attention.kv_lora_rank")),
               qk_rope_head_dim=rope, qk_nope_head_dim=int(meta.require("{arch}.attention.key_length_mla")) - rope,
               v_head_dim=int(meta.require("{arch}.attention.value_length_mla")), rope_interleave=True, head_dim=rope,
               n_kv_heads=fields["n_heads"], partial_rotary_factor=1.0)
    if not fields.get("n_experts"):
        return out
    v3 = int(meta.get("{arch}.expert_gating_func") or 1) == SIGMOID
    if not v3 and any(name.endswith("exp_probs_b.bias") for name in tensors):
        raise DecoderLMError("this deepseek2 GGUF has a router selection bias (exp_probs_b) but softmax routing (no expert_gating_func 2); "
                             "decoderlm runs that bias with sigmoid scores only (DeepSeek-V3): re-convert with scoring_func \"sigmoid\" in config.json")
    dense = int(meta.get("{arch}.leading_dense_block_count") or 0)
    return out | dict(family="deepseek_v3" if v3 else "deepseek_v2", moe_router="sigmoid" if v3 else "softmax",
                      n_shared_experts=int(meta.get("{arch}.expert_shared_count") or 0), moe_dense_layers=list(range(dense)) or None,
                      moe_routed_scale=float(meta.get("{arch}.expert_weights_scale") or 1.0),
                      moe_renormalize=bool(meta.get("{arch}.expert_weights_norm", False)),
                      moe_groups=int(meta.get("{arch}.expert_group_count") or 1), moe_topk_groups=int(meta.get("{arch}.expert_group_used_count") or 1))


def tensor_name(arch: str, key: str) -> str | None:
    """Our name (with {i}) for a llama.cpp key of these architectures, or None."""
    if arch == "gpt-oss" and key in GPT_OSS_NAMES:
        return GPT_OSS_NAMES[key]
    return TENSOR_NAMES.get(key)


class KvB:
    """Joins DeepSeek's attn_k_b (H, rank, nope) and attn_v_b (H, v, rank) back into kv_b_proj
    (H·(nope + v), rank), whichever comes first."""

    def __init__(self) -> None:
        self.parts: dict[tuple[str, str], torch.Tensor] = {}

    def add(self, layer: str, which: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        self.parts[(layer, which)] = value
        k, v = self.parts.get((layer, "k")), self.parts.get((layer, "v"))
        if k is None or v is None:
            return []
        del self.parts[(layer, "k")], self.parts[(layer, "v")]
        joined = torch.cat((k.transpose(1, 2), v), dim=1)  # (H, nope + v, rank)
        return [(f"layers.{layer}.self_attn.kv_b_proj.weight", joined.reshape(-1, joined.shape[-1]))]
