"""Every HF family loads to the logit: a tiny random transformers model per family, saved and loaded by
decoderlm, must give the same fp32 logits (full forward and KV-cache decoding) and the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_models import CASES, make_hf_model, prompt_ids
from safetensors.torch import load_file, save_file

from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import config_from_hf, load_hf
from decoderlm.generate import decode_step, generate, prefill
from decoderlm.kv_cache import KVCache
from decoderlm.loader import load
from decoderlm.sampling import SamplingParams

TOL = 1e-4
FIXTURES = Path(__file__).parent / "fixtures" / "configs"


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our model, case name) for one family case."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder)
    ours, _ = load(folder)
    return hf, ours, request.param


def logits_diff(hf, ours, ids: torch.Tensor | None = None) -> float:
    """Max |transformers − decoderlm| over the logits of the same ids."""
    ids = prompt_ids() if ids is None else ids
    with torch.no_grad():
        return (hf(ids).logits - ours(ids).logits.float()).abs().max().item()


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    assert logits_diff(hf, ours, prompt_ids(24)) < TOL


def test_kv_cache_decoding_matches_transformers(pair):
    hf, ours, _ = pair
    ids = prompt_ids(24, seed=1)
    with torch.no_grad():
        want = hf(ids).logits  # (B, T, V)
        cache = KVCache(ours.config, batch_size=2, max_len=24)
        got = [prefill(ours, ids[:, :10], cache)]
        got += [decode_step(ours, ids[:, t], cache) for t in range(10, 24)]
    assert (torch.stack(got, dim=1) - want[:, 9:]).abs().max().item() < TOL


def test_greedy_generation_matches_transformers(pair):
    hf, ours, _ = pair
    ids = prompt_ids(12, seed=2)[:1]
    with torch.no_grad():
        want = hf.generate(ids, do_sample=False, max_new_tokens=32)[0, 12:].tolist()
    got = generate(ours, ids[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=32))
    assert len(want) == 32 and got == want


def test_each_case_switches_its_mechanism_on(pair):
    """Guards the parity tests above against a case that silently exercises nothing new."""
    _, ours, case = pair
    c = ours.config
    expected = {
        "gpt2": c.position == "learned" and c.norm == "layernorm" and c.mlp == "gelu_tanh",
        "llama": c.n_kv_heads < c.n_heads and c.rope_scaling is None,
        "llama-rope-llama3": (c.rope_scaling or {}).get("rope_type") == "llama3",
        "llama-rope-linear": (c.rope_scaling or {}).get("rope_type") == "linear",
        "mistral-window": c.sliding_window == 8,  # shorter than the 24-token test sequences
        "qwen2-bias-tied": c.attn_bias and not c.attn_out_bias and c.tie_embeddings,
        "qwen3-qknorm": c.qk_norm and c.head_dim * c.n_heads != c.d_model,
        "mixtral": c.n_experts == 4 and c.n_experts_per_tok == 2 and c.moe_renormalize,
        "qwen3_moe": c.n_experts == 4 and c.qk_norm and not c.moe_renormalize,
        "phi3-partial-rotary": c.partial_rotary_factor == 0.5,
        "gemma": c.norm_offset == 1.0 and c.embed_scale == 8.0 and c.mlp == "geglu" and c.tie_embeddings,
        "olmo2-postnorm": c.post_norm and c.qk_norm and c.qk_norm_scope == "all" and c.n_kv_heads < c.n_heads,
        "qwen2-mixed-window": c.layer_types == ["full_attention", "sliding_attention", "sliding_attention"] and c.sliding_window == 6,
        "gemma2": (c.layer_types == ["sliding_attention", "full_attention", "sliding_attention"] and c.sliding_window == 6
                   and c.sandwich_norm and c.attn_logit_softcapping == 5.0 and c.final_logit_softcapping == 3.0
                   and c.query_pre_attn_scalar == 24 and c.norm_offset == 1.0 and c.mlp == "geglu"),
        "gemma3": (c.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] and c.qk_norm and c.sandwich_norm
                   and c.rope_local_theta == 1e4 and c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 4.0}
                   and c.attn_logit_softcapping is None),
        "gpt_oss": (c.attn_sinks and c.attn_bias and c.router_bias and c.mlp_bias and c.mlp == "swiglu_clamped" and c.n_experts == 4
                    and c.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
                    and (c.rope_scaling or {}).get("rope_type") == "yarn"),
    }
    assert expected[case]
    assert c.family == CASES[case][0]


def test_sharded_checkpoint_loads(tmp_path):
    hf = make_hf_model("qwen3-qknorm", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours, _ = load(tmp_path)
    assert logits_diff(hf, ours) < TOL


def test_legacy_rope_config_keys(tmp_path):
    """Configs written before transformers 5 say rope_theta + rope_scaling {"type": ...}."""
    hf = make_hf_model("llama-rope-linear", tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "linear", "factor": rope["factor"]})
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours, _ = load(tmp_path)
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert logits_diff(hf, ours) < TOL


def test_gpt2_checkpoint_with_original_names_and_mask_buffers(tmp_path):
    """OpenAI's GPT-2 files name tensors without "transformer." and carry each layer's causal mask."""
    hf = make_hf_model("gpt2", tmp_path)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "model.safetensors").items()}
    tensors |= {f"h.{i}.attn.bias": torch.ones(1, 1, 128, 128).tril() for i in range(2)}
    save_file(tensors, tmp_path / "model.safetensors")
    ours, _ = load(tmp_path)
    assert logits_diff(hf, ours) < TOL


def test_bfloat16_load_casts_weights_and_keeps_rope_in_fp32(tmp_path):
    hf = make_hf_model("llama", tmp_path)
    ours, tok = load_hf(tmp_path, torch.bfloat16)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.inv_freq.dtype == torch.float32
    assert logits_diff(hf, ours) < 0.1
    assert tok.decode(tok.encode("The quick brown fox")) == "The quick brown fox"


def test_generation_config_becomes_sampling_defaults(tmp_path):
    make_hf_model("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    ours, _ = load(tmp_path)
    assert ours.generation_defaults["temperature"] == 0.6 and ours.generation_defaults["top_p"] == 0.9


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


SUPPORTED_FIXTURES = ["gpt2", "llama-3.1-8b", "mistral-7b-v0.1", "mixtral-8x7b-v0.1", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-30b-a3b",
                      "smollm2-135m"]


@pytest.mark.parametrize("name", SUPPORTED_FIXTURES)
def test_real_configs_read_as_published(name):
    d = _fixture(name)
    c = config_from_hf(d)
    assert c.family == d["model_type"]
    assert c.n_layers == d.get("num_hidden_layers", d.get("n_layer"))
    assert c.vocab_size == d["vocab_size"]
    assert c.n_heads == d.get("num_attention_heads", d.get("n_head"))
    if "rope_theta" in d:
        assert c.rope_theta == d["rope_theta"]
    if "head_dim" in d:
        assert c.head_dim == d["head_dim"]
    # Qwen2.5 lists sliding_window but switches it off; Mistral v0.1 uses it in every layer.
    assert c.sliding_window == (d["sliding_window"] if d["model_type"] == "mistral" else None)
    assert c.tie_embeddings == d.get("tie_word_embeddings", d["model_type"] == "gpt2")


def test_real_llama3_config_keeps_its_rope_scaling():
    c = config_from_hf(_fixture("llama-3.1-8b"))
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    assert c.rope_scaling["original_max_position_embeddings"] == 8192


def test_real_moe_config_reads_expert_shape():
    d = _fixture("qwen3-30b-a3b")
    c = config_from_hf(d)
    assert (c.n_experts, c.n_experts_per_tok) == (d["num_experts"], d["num_experts_per_tok"])
    assert (c.moe_hidden, c.moe_renormalize) == (d["moe_intermediate_size"], d["norm_topk_prob"])


def test_unsupported_families_name_the_supported_ones():
    with pytest.raises(DecoderLMError, match="not supported; supported families: gpt2, llama, mistral"):
        config_from_hf(_fixture("llama-3.1-8b") | {"model_type": "falcon"})


def test_mixed_sliding_and_full_layers_read_per_layer():
    c = config_from_hf(_fixture("qwen2.5-0.5b") | {"use_sliding_window": True, "max_window_layers": 12})
    assert [c.window(i) for i in (11, 12)] == [None, c.sliding_window] and c.windows == [None, c.sliding_window]


def test_real_gemma3_and_gpt_oss_configs_read_each_layer_kind():
    gemma = config_from_hf(_fixture("gemma-3-1b"))  # transformers 4's keys: sliding_window_pattern, rope_local_base_freq
    assert [i for i in range(26) if gemma.window(i) is None] == [5, 11, 17, 23] and gemma.sliding_window == 512
    assert (gemma.rope_theta, gemma.rope_local_theta, gemma.query_pre_attn_scalar) == (1e6, 1e4, 256)
    oss = config_from_hf(_fixture("gpt-oss-20b"))
    assert oss.window(0) == 128 and oss.window(1) is None and oss.rope_scaling["rope_type"] == "yarn" and oss.n_experts == 32
