"""Gemma-2/3 and gpt-oss beyond the family parity of test_hf_families: their mixed sliding/full layers,
soft-capping and sinks through every cache and entry point (the paged engine, the static cache, the
CLI), quantized and fused; YaRN's attention factor; what `inspect` says of them."""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import make_hf_model, prompt_ids
from tokenizers import Tokenizer

import decoderlm.cli as cli
from decoderlm.generate import generate
from decoderlm.inspect.accounting import Accounting
from decoderlm.inspect.arch import read_spec
from decoderlm.kv_cache import HybridKVCache, KVCache, StaticKVCache, cache_for
from decoderlm.loader import load
from decoderlm.model.rope import attention_factor
from decoderlm.sampling import SamplingParams
from decoderlm.serve import Engine

CASES = ["gemma2", "gemma3", "gpt_oss"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model, case) with a window of 6, shorter than every prompt below."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, make_hf_model(request.param, folder), request.param


def test_paged_engine_batch_gives_transformers_greedy_tokens(checkpoint):
    folder, hf, _ = checkpoint
    model, _ = load(folder)
    prompts = [prompt_ids(n, seed=n)[0].tolist() for n in (3, 9, 14)]
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10)[0, len(p):].tolist() for p in prompts]
    engine = Engine(model, max_batch=3, num_blocks=1 + 24, block_size=4, prefill_chunk=8)  # chunked prefill over blocks
    streams = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    assert [[o.token_id for o in s if o.token_id is not None] for s in streams] == want


def test_paged_engine_gives_back_the_sliding_layers_blocks_over_a_long_generation(checkpoint):
    """The sliding layers' block tables hold their window while the full layer's holds everything, and
    the tokens stay transformers' and `generate`'s."""
    folder, hf, _ = checkpoint
    model, _ = load(folder)
    prompt, params = prompt_ids(14, seed=7)[0].tolist(), SamplingParams(temperature=0, max_new_tokens=24)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)[0, 14:].tolist()
    engine = Engine(model, num_blocks=1 + 3 * 10, block_size=4, prefill_chunk=8)  # 3 groups of one layer
    assert sorted(engine.pool.windows, key=str) == [6, 6, None]
    stream = engine.add_request(prompt, params)
    held = []
    while engine.has_work():
        engine.step()
        held += [[sum(b != 0 for b in t) for t in seq.block_tables] for seq in engine.scheduler.running]
    # Before the last step 36 tokens are computed: the full layer holds 9 blocks, a sliding one the 2 that the
    # next query (at 36, window 6: 31..35) sees.
    assert held[-1] == [2 if w else 9 for w in engine.pool.windows]
    assert [o.token_id for o in stream if o.token_id is not None] == want == generate(model, prompt, params)
    assert engine.stats()["kv_blocks_used"] == 0


def test_static_cache_decoding_equals_recomputation(checkpoint):
    folder, _, _ = checkpoint
    model, _ = load(folder)
    ids = prompt_ids(16, seed=3)
    with torch.no_grad():
        want = model(ids).logits
        cache = StaticKVCache(model.config, 2, 16)
        got = [model(ids[:, :5], cache=cache).logits[:, -1]]
        got += [model(ids[:, t : t + 1], cache=cache).logits[:, -1] for t in range(5, 16)]
    assert (torch.stack(got, dim=1) - want[:, 4:]).abs().max().item() < 1e-4


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_loads_run(checkpoint, quantize):
    """Every projection quantized and fused (q/k/v, each expert's gate/up), the router and the sinks kept
    in float; int8 keeps most greedy choices of this random model (a flipped expert choice moves a
    token's logits a lot, so no logit tolerance)."""
    folder, _, _ = checkpoint
    ids = prompt_ids(12)
    exact = load(folder, fuse=False)[0]
    model = load(folder, quantize=quantize)[0]
    plain = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert all(name.endswith("mlp.gate") for name in plain)  # only the routers stay in float
    assert model.layers[0].self_attn.qkv_proj is not None
    with torch.no_grad():
        want, got = exact(ids).logits, model(ids).logits
    assert torch.isfinite(got).all()
    if quantize == "int8":
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_hybrid_cache_holds_a_window_for_sliding_layers_and_everything_for_full_ones(checkpoint):
    """Decoding through `cache_for`'s cache (a rolling ring for the 2 sliding layers, a contiguous buffer for
    the full one) equals recomputation, a prefill longer than the window included, and its bytes are the ring's
    5 slots per sliding layer plus 64 per full layer."""
    folder, _, _ = checkpoint
    model, _ = load(folder)
    cache = cache_for(model.config, 2, 64)
    assert isinstance(cache, HybridKVCache)
    assert cache.nbytes() == (2 * 5 + 1 * 64) * 2 * 2 * 2 * 16 * 4  # (slots) × K,V × batch × heads × head_dim × fp32
    ids = prompt_ids(24, seed=4)
    with torch.no_grad():
        want = model(ids).logits
        got = [model(ids[:, :9], cache=cache).logits[:, -1]]
        got += [model(ids[:, t : t + 1], cache=cache).logits[:, -1] for t in range(9, 24)]
    assert (torch.stack(got, dim=1) - want[:, 8:]).abs().max().item() < 1e-4
    assert isinstance(cache_for(model.config, 2, 4), KVCache)  # a window past the context: full attention


def test_generate_cli_prints_transformers_greedy_continuation(tmp_path, capsys):
    hf = make_hf_model("gemma3", tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompt = "The quick brown fox"
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)[0].tolist()
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == tok.decode(out) + "\n"


def test_yarn_attention_factor():
    assert attention_factor({"rope_type": "yarn", "factor": 32.0}) == pytest.approx(0.1 * math.log(32) + 1)
    assert attention_factor({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0}) == 1.0  # DeepSeek's ratio
    assert attention_factor({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5}) == 1.5
    assert attention_factor({"rope_type": "linear", "factor": 4.0}) == attention_factor(None) == 1.0


def test_inspect_counts_each_layer_kind(checkpoint):
    folder, hf, _ = checkpoint
    model, _ = load(folder)
    acc = Accounting.of(read_spec(folder))
    assert acc.total == sum(p.numel() for p in hf.parameters()) == model.num_parameters()
    # 2 sliding layers (window 6) and 1 full layer: K and V of 2 heads × 16 per token per layer, bf16
    per_token_layer = 2 * 2 * 16 * 2
    assert acc.kv_bytes(100) == (2 * 6 + 1 * 100) * per_token_layer


def test_inspect_names_the_rope_of_each_kind():
    from pathlib import Path

    configs = Path(__file__).parent / "fixtures" / "configs"
    gemma, oss = read_spec(configs / "gemma-3-1b.json").features(), read_spec(configs / "gpt-oss-20b.json").features()
    assert "positions: RoPE θ=1,000,000; sliding layers θ=10,000" in gemma
    assert "positions: RoPE θ=150,000, yarn scaling ×32 from 4,096 to 131,072 tokens" in oss
    assert "norm: rmsnorm; attention sinks, q/k/v bias" in oss


def test_shrunk_model_keeps_both_layer_kinds_and_its_cache_check_passes(checkpoint):
    from decoderlm.config import ModelConfig
    from decoderlm.inspect.checks import check_kv_cache, shrink
    from decoderlm.model import Transformer

    folder, _, _ = checkpoint
    config = load(folder)[0].config
    small = shrink(ModelConfig(**{**config.to_dict(), "n_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}))
    assert small.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    assert check_kv_cache(Transformer(small)).passed


def test_explained_attention_weights_reproduce_the_layer_and_show_the_sink(checkpoint):
    """weights @ V through o_proj gives the layer's output: the scale, soft-cap and window are the layer's,
    and with sinks the rows sum to 1 only with the sink's column, which takes a share and adds nothing."""
    from decoderlm.inspect.explain import attention_weights

    folder, _, case = checkpoint
    model, _ = load(folder, fuse=False)
    ids = prompt_ids(12)[:1]
    attn = model.layers[0].self_attn  # a sliding layer
    seen = {}
    handle = attn.register_forward_hook(lambda module, args, output: seen.update(x=args[0], out=output))
    full = attention_weights(model, ids, layer=0, sink=True)  # (1, H, T, T [+ 1])
    handle.remove()
    B, T, _ = seen["x"].shape
    torch.testing.assert_close(full.sum(-1), torch.ones(1, attn.n_heads, T))
    weights = full[..., :T]
    assert weights[..., torch.arange(T)[:, None] - torch.arange(T)[None, :] >= 6].abs().max() == 0  # the window
    if case == "gpt_oss":
        assert full.shape[-1] == T + 1 and full[..., T].min() > 0
    with torch.inference_mode():
        v = attn.v_proj(seen["x"]).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # (B, H, T, D)
        rebuilt = attn.o_proj((weights @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(rebuilt, seen["out"], atol=1e-5, rtol=1e-5)


def test_explain_attention_png_names_the_sink_share(tmp_path):
    from decoderlm.inspect.explain import plot_attention

    make_hf_model("gpt_oss", tmp_path / "m")
    model, tok = load(tmp_path / "m")
    assert plot_attention(model, tok, "The quick brown fox", 1, tmp_path / "a.png").stat().st_size > 0


@pytest.mark.parametrize("preset", ["gemma3-tiny", "gpt-oss-tiny"])
def test_presets_train_and_convert_to_transformers(preset, corpus, tmp_path):
    """A few steps lower the loss (soft-capping, sinks and experts all take gradients); the run converts to
    an HF folder transformers loads to the same logits."""
    from transformers import AutoModelForCausalLM

    from decoderlm.formats import runs
    from decoderlm.formats.hf import save_hf
    from decoderlm.train import TrainConfig, train

    train(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), preset=preset, batch_size=4, context=32, max_steps=30,
                      eval_interval=30, log_interval=10, sample_chars=0, lr=3e-3))
    history = runs.read(tmp_path / "run")["history"]
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.3
    model, tok = load(tmp_path / "run")
    save_hf(model, tok, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))  # longer than the window
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < 1e-4


def test_gpt_oss_config_without_rope_reads_transformers_default_yarn():
    import json
    from pathlib import Path

    from decoderlm.formats.hf import config_from_hf

    d = json.loads((Path(__file__).parent / "fixtures" / "configs" / "gpt-oss-20b.json").read_text())
    del d["rope_scaling"]
    scaling = config_from_hf(d).rope_scaling
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 32.0 and scaling["original_max_position_embeddings"] == 4096


def test_a_pre_quantized_checkpoint_is_refused_in_one_line(tmp_path):
    """Pre-quantized layouts other than gpt-oss's MXFP4 experts (tests/test_mxfp4.py), here FP8."""
    import json

    from decoderlm.errors import DecoderLMError

    make_hf_model("gpt_oss", tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(d | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(DecoderLMError, match="holds fp8 weights .* dequantize it with transformers and save_pretrained"):
        load(tmp_path)


def test_left_padded_batch_through_the_hybrid_cache_equals_each_row_alone(checkpoint):
    folder, _, _ = checkpoint
    model, _ = load(folder)
    ids = prompt_ids(20, seed=5)
    pad = 3  # row 0 starts 3 tokens late
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :pad] = 0
    with torch.no_grad():
        alone = [model(ids[:1, pad:]).logits[0, -9:-1], model(ids[1:]).logits[0, -9:-1]]  # after tokens 11..18
        cache = cache_for(model.config, 2, 20)
        got = [model(ids[:, :12], cache=cache, attention_mask=mask[:, :12]).logits[:, -1]]
        got += [model(ids[:, t : t + 1], cache=cache, attention_mask=mask[:, : t + 1]).logits[:, -1] for t in range(12, 19)]
    got = torch.stack(got, dim=1)  # (2, 8, V): the logits after tokens 11..18
    assert isinstance(cache, HybridKVCache)
    assert max((got[i] - alone[i]).abs().max().item() for i in range(2)) < 1e-4
