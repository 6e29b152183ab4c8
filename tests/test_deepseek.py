"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek's MoE) against transformers on tiny random
checkpoints: logits, cached decoding (the absorbed form) and greedy tokens; the caches hold the latent
and the RoPE key only; `inspect` counts what `load` builds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_models import VOCAB, prompt_ids, write_tokenizer
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import decoderlm.cli as cli
from decoderlm import compiled
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import config_from_hf, save_hf
from decoderlm.generate import decode_step, generate, prefill, stream
from decoderlm.inspect.accounting import Accounting
from decoderlm.inspect.arch import read_spec
from decoderlm.kv_cache import KVCache, StaticKVCache
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.model.lora import apply_lora, lora_layers
from decoderlm.model.mla import MLA, softmax_scale
from decoderlm.quantize import BlockLinear, Int8Linear
from decoderlm.sampling import SamplingParams
from decoderlm.serve import Engine
from decoderlm.serve.paged_cache import BlockPool
from decoderlm.speculative import DraftModel, PromptLookup
from decoderlm.train import TrainConfig, train

TOL = 1e-4
BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=3,
            kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=1, pad_token_id=0)
CASES = {
    # q through its latent; 8 experts in 4 groups, 2 groups kept, 3 experts per token; sigmoid + bias; scaled sum.
    "deepseek_v3": ("deepseek_v3", BASE | dict(q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                                               n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # one q_proj; softmax routing limited to the best group of 2; two shared experts; no renormalization.
    "deepseek_v2": ("deepseek_v2", BASE | dict(q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, topk_method="group_limited_greedy",
                                               n_group=2, topk_group=1, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5)),
    # V3 with RoPE in halves (rope_interleave false), biased projections, every layer dense.
    "deepseek_v3-halves-dense": ("deepseek_v3", BASE | dict(q_lora_rank=16, rope_interleave=False, attention_bias=True, n_routed_experts=4,
                                                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=3)),
}


def make_model(case: str, folder, seed: int = 0, **overrides):
    """A random transformers model for `case`, every parameter and the router bias perturbed, saved with a tokenizer."""
    model_type, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(kwargs | overrides)), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)  # large enough to change which experts are chosen
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_model(request.param, folder)
    ours, _ = load(folder)
    return hf, ours, request.param, folder


def test_logits_match_transformers(pair):
    hf, ours, _, _ = pair
    ids = prompt_ids(24)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() < TOL


def test_cached_decoding_matches_transformers(pair):
    """Prefill (expanded form) then one token at a time (absorbed form) over the latent cache."""
    hf, ours, _, _ = pair
    ids = prompt_ids(24, seed=1)
    with torch.no_grad():
        want = hf(ids).logits
        cache = KVCache(ours.config, batch_size=2, max_len=24)
        got = [prefill(ours, ids[:, :10], cache)] + [decode_step(ours, ids[:, t], cache) for t in range(10, 24)]
    assert (torch.stack(got, dim=1) - want[:, 9:]).abs().max().item() < TOL


def test_greedy_generation_matches_transformers(pair):
    hf, ours, _, _ = pair
    ids = prompt_ids(12, seed=2)[:1]
    with torch.no_grad():
        want = hf.generate(ids, do_sample=False, max_new_tokens=32)[0, 12:].tolist()
    assert generate(ours, ids[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=32)) == want


def test_inspect_counts_what_load_builds(pair):
    hf, ours, _, folder = pair
    acc = Accounting.of(read_spec(folder))
    assert acc.total == ours.num_parameters() == hf.num_parameters()
    c = ours.config
    assert acc.kv_elements_per_token() == c.n_layers * (c.kv_lora_rank + c.qk_rope_head_dim)


def test_each_case_switches_its_mechanism_on(pair):
    _, ours, case, _ = pair
    c = ours.config
    moe = [type(b.mlp).__name__ for b in ours.layers]
    expected = {
        "deepseek_v3": c.q_lora_rank and c.rope_interleave and c.moe_router == "sigmoid" and c.moe_groups == 4 and c.moe_renormalize
        and c.moe_routed_scale == 2.5 and moe == ["MLP", "MoE", "MoE"] and ours.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0,
        "deepseek_v2": not c.q_lora_rank and c.rope_interleave and c.moe_router == "softmax" and c.moe_groups == 2 and not c.moe_renormalize
        and c.n_shared_experts == 2 and moe == ["MLP", "MoE", "MoE"],
        "deepseek_v3-halves-dense": not c.rope_interleave and c.attn_bias and moe == ["MLP"] * 3,
    }
    assert expected[case]


def test_absorbed_form_equals_expanded_form(pair):
    """The decode path (W_UK folded into the query, attention over the latents, W_UV after) computes what
    the prefill path (keys and values up-projected per head) computes, for several queries at once."""
    _, ours, _, _ = pair
    mla = ours.layers[1].self_attn
    assert isinstance(mla, MLA)
    g = torch.Generator().manual_seed(3)
    B, H, T, L = 2, mla.n_heads, 3, 7
    q_nope, q_rope = torch.randn(B, H, T, mla.nope, generator=g), torch.randn(B, H, T, mla.rope, generator=g)
    latent, k_rope = torch.randn(B, 1, L, mla.rank, generator=g), torch.randn(B, 1, L, mla.rope, generator=g)
    mask = torch.zeros(B, 1, T, L).masked_fill_(torch.rand(B, 1, T, L, generator=g) < 0.3, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expanded = mla.expanded(q_nope, q_rope, latent, k_rope, mask, None)
        absorbed = mla.absorbed(q_nope, q_rope, latent, k_rope, mask, None)
    assert expanded.shape == (B, H, T, mla.v_dim)
    assert (expanded - absorbed).abs().max().item() < 1e-5


def test_caches_hold_the_latent_and_the_rope_key_only(pair):
    _, ours, _, _ = pair
    c = ours.config
    per_token = c.n_layers * (c.kv_lora_rank + c.qk_rope_head_dim)  # 3 × (20 + 8) = 84 numbers
    expanded = c.n_layers * c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)  # 270
    assert KVCache(c, 1, 64).nbytes() == 64 * per_token * 4 < 64 * expanded * 4
    assert StaticKVCache(c, 1, 64).nbytes() == 64 * per_token * 4
    assert BlockPool.bytes_per_token(c, torch.float32) == per_token * 4
    pool = BlockPool(c, num_blocks=3, block_size=4)
    assert sum(t.numel() for t in pool.k + pool.v) == 3 * 4 * per_token


def test_static_cache_decoding_matches_the_plain_cache(pair):
    """The fixed-shape cache of the compiled step, run eagerly: the same logits."""
    _, ours, _, _ = pair
    ids = prompt_ids(16, seed=4)[:1]
    with torch.no_grad():
        caches = KVCache(ours.config, 1, 16), StaticKVCache(ours.config, 1, 16)
        for cache in caches:
            prefill(ours, ids[:, :6], cache)
        for t in range(6, 16):
            plain, static = (decode_step(ours, ids[:, t], cache) for cache in caches)
            assert (plain - static).abs().max().item() < 1e-5


def test_paged_engine_gives_each_request_its_solo_tokens(pair):
    """Served in one batch from the paged pool (prefix sharing, chunked prefill): generate's tokens."""
    _, ours, _, _ = pair
    g = torch.Generator().manual_seed(5)
    shared = list(range(30, 38))
    prompts = [shared + torch.randint(0, VOCAB, (1 + 5 * i,), generator=g).tolist() for i in range(5)]
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    expected = [generate(ours, p, greedy) for p in prompts]
    engine = Engine(ours, max_batch=4, num_blocks=1 + 40, block_size=4, prefill_chunk=12)
    streams = [engine.add_request(p, greedy) for p in prompts]
    while engine.has_work():
        engine.step()
    assert [[o.token_id for o in s if o.token_id is not None] for s in streams] == expected


def test_speculative_greedy_decoding_gives_plain_greedy_tokens(pair):
    """Guesses checked several at a time (the expanded form over the latent cache), rejected ones truncated."""
    _, ours, _, _ = pair
    prompt = prompt_ids(10, seed=7)[0].tolist() * 2  # repeats: prompt lookup finds guesses
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    want = generate(ours, prompt, greedy)
    for proposer in (DraftModel(ours), PromptLookup()):
        assert list(stream(ours, prompt, greedy, proposer=proposer, num_speculative_tokens=3)) == want


def test_lora_on_kv_b_proj_decodes_in_the_expanded_form(pair):
    """An adapter on the up-projection: cached decoding still equals recomputation (the absorbed form
    would read the base matrix alone)."""
    _, _, _, folder = pair
    model, _ = load(folder, fuse=False)
    apply_lora(model, rank=2, alpha=4.0, targets=["kv_b_proj"])
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B["default"].weight.normal_()
    ids = prompt_ids(12, seed=8)
    with torch.no_grad():
        want = model(ids).logits
        cache = KVCache(model.config, batch_size=2, max_len=12)
        got = [prefill(model, ids[:, :6], cache)] + [decode_step(model, ids[:, t], cache) for t in range(6, 12)]
    assert (torch.stack(got, dim=1) - want[:, 5:]).abs().max().item() < 1e-5


def test_int8_quantized_load_keeps_kv_b_proj_in_float(pair):
    _, ours, _, folder = pair
    q, _ = load(folder, quantize="int8")
    mla = q.layers[0].self_attn
    assert isinstance(mla.kv_b_proj, torch.nn.Linear) and isinstance(mla.kv_a_proj_with_mqa, (Int8Linear, BlockLinear))
    ids = prompt_ids(12)
    with torch.no_grad():
        assert (q(ids).logits - ours(ids).logits).abs().mean().item() < 0.05  # int8 weights (and bf16 activations in torch's kernels)
    assert len(generate(q, ids[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=4))) == 4


def test_save_hf_round_trips_through_transformers(pair, tmp_path):
    hf, ours, _, folder = pair
    save_hf(ours, load(folder)[1], tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompt_ids(10)
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max().item() < 1e-5


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """DeepSeek-V3 checkpoints carry their MTP module as layer n_layers (model.layers.61.* in V3); it is unused."""
    hf = make_model("deepseek_v3", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(96, 192)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours, _ = load(tmp_path)
    with torch.no_grad():
        assert (hf(prompt_ids()).logits - ours(prompt_ids()).logits).abs().max().item() < TOL


def test_cli_generate_runs_a_deepseek_folder(tmp_path, capsys):
    make_model("deepseek_v3", tmp_path)
    ours, tok = load(tmp_path)
    prompt = "The quick brown fox"
    argv = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]
    assert cli.main(argv) == 0
    ids = tok.encode(prompt)
    new = generate(ours, ids, SamplingParams(temperature=0.0, max_new_tokens=8))  # transformers' tokens: test_greedy_generation_...
    assert len(new) == 8
    out, text = capsys.readouterr().out, tok.decode(ids + new)
    assert out.endswith("\n") and text.startswith(out[:-1]) and out.startswith(prompt)
    assert set(text[len(out) - 1 :]) <= {"\ufffd"}  # all but the bytes of an unfinished character, which the stream holds back


def test_real_deepseek_v3_config_reads_as_published():
    d = json.loads((Path(__file__).parent / "fixtures" / "configs" / "deepseek-v3.json").read_text())
    c = config_from_hf(d)
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (512, 1536, 128, 64, 128)
    assert (c.n_experts, c.n_experts_per_tok, c.n_shared_experts, c.moe_dense_layers) == (256, 8, 1, [0, 1, 2])
    assert (c.moe_router, c.moe_groups, c.moe_topk_groups, c.moe_routed_scale, c.moe_renormalize) == ("sigmoid", 8, 4, 2.5, True)
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_interleave
    assert c.kv_cache_widths == ((1, 512), (1, 64))


def test_yarn_softmax_scale_is_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    rope = {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    c = ModelConfig(vocab_size=8, n_layers=1, d_model=16, n_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                    rope_scaling=rope)
    assert math.isclose(softmax_scale(c), yarn_apply_mscale(rope, 8 ** -0.5), rel_tol=1e-12)
    assert softmax_scale(ModelConfig(**{**c.to_dict(), "rope_scaling": None})) == 8 ** -0.5


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
        "beta_slow": 1, "original_max_position_embeddings": 64}  # DeepSeek-V2's published values, a tiny context


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2"])
def test_yarn_configs_match_transformers(case, tmp_path):
    """DeepSeek's long-context configs: YaRN frequencies (decoderlm.model.rope) and MLA's mscale² softmax scale."""
    hf = make_model(case, tmp_path, rope_parameters=YARN)
    ours, _ = load(tmp_path)
    ids = prompt_ids(24)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids).logits).abs().max().item() < TOL


def test_bad_moe_groups_are_refused():
    with pytest.raises(DecoderLMError, match="cannot give 3 experts per token"):
        ModelConfig(vocab_size=8, n_layers=1, d_model=16, n_heads=2, n_experts=8, n_experts_per_tok=3, moe_groups=4, moe_topk_groups=1)


def test_explain_attention_weights_rebuild_the_mla_output(pair):
    """`decoderlm explain attention` on MLA: its weights, applied to the up-projected values, give the layer's output."""
    _, ours, _, _ = pair
    from decoderlm.inspect.explain import attention_weights

    attn, ids, seen = ours.layers[1].self_attn, prompt_ids(12)[:1], {}
    handle = attn.register_forward_hook(lambda module, args, output: seen.update(x=args[0], out=output))
    weights = attention_weights(ours, ids, layer=1)  # (1, H, T, T)
    handle.remove()
    B, T, _ = seen["x"].shape
    assert weights.triu(1).abs().max() == 0
    with torch.inference_mode():
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(seen["x"])[..., : attn.rank])[:, None]  # (B, 1, T, r)
        v = attn.kv_b_proj(latent[:, 0]).view(B, T, attn.n_heads, -1)[..., attn.nope :].transpose(1, 2)  # (B, H, T, v)
        rebuilt = attn.o_proj((weights @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(rebuilt, seen["out"], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_decode_step_over_the_latent_cache(tmp_path, monkeypatch):
    """AOTInductor compiles the absorbed step over the static latent cache (~1 min): eager's tokens.
    (A MoE model's step does not export, its expert loop branching on data, and decodes eagerly, as Mixtral's does.)"""
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path / "cache"))
    make_model("deepseek_v3-halves-dense", tmp_path / "model")
    model, _ = load(tmp_path / "model")
    params, prompts = SamplingParams(temperature=0, max_new_tokens=12), [[5, 17, 3], list(range(40, 70))]
    decoder = compiled.CompiledDecoder(model)
    assert [generate(model, p, params, step=decoder) for p in prompts] == [generate(model, p, params) for p in prompts]
    assert decoder.compiles == 1 and None not in decoder.runners.values()


def test_mla_tiny_preset_trains_and_converts_to_a_deepseek_v3_folder(corpus, tmp_path):
    """The `mla-tiny` preset: seed-char-llama's size (± 5 %), trained a few steps, saved as deepseek_v3 for transformers."""
    mla, llama = (Transformer(ModelConfig.from_preset(name)) for name in ("mla-tiny", "seed-char-llama"))
    assert abs(mla.num_parameters() / llama.num_parameters() - 1) <= 0.05
    train(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), preset="mla-tiny", batch_size=4, context=16, eval_interval=5,
                      log_interval=1, eval_batches=1, sample_chars=0, max_steps=3))
    model, tok = load(tmp_path / "run")
    assert cli.main(["convert", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(corpus.read_text(encoding="utf-8")[:13])])  # characters the corpus has (tiny Shakespeare or the fallback)
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < TOL

