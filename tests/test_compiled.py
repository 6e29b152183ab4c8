"""The static-shape cache and the compiled decode step: the same numbers as the eager path, for dense and
quantized models, at every CPU level (test_cpu_levels). Mixture-of-experts models are
tests/test_compiled_moe.py's; how processes build, find and release the packages is
tests/test_compiled_packages.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import decoderlm
from decoderlm import compiled, kernels
from decoderlm.generate import decode_step, generate, prefill
from decoderlm.kv_cache import KVCache, StaticKVCache, cache_dtype, store_keys_in
from decoderlm.quantize import BlockLinear, quantize
from decoderlm.sampling import SamplingParams
from tests.conftest import configs, tiny_model
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)


@given(cfg=configs(), prompt_len=st.integers(1, 6), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_static_cache_matches_kv_cache_step_by_step(cfg, prompt_len, steps, seed):
    model = tiny_model(seed, **cfg)
    max_len = prompt_len + steps + 3  # spare slots: they must stay invisible
    static, plain = StaticKVCache(model.config, 1, max_len), KVCache(model.config, 1, max_len)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + steps), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(prefill(model, ids[:, :prompt_len], static), prefill(model, ids[:, :prompt_len], plain), atol=1e-5, rtol=1e-5)
        for t in range(prompt_len, prompt_len + steps):
            torch.testing.assert_close(decode_step(model, ids[:, t], static), decode_step(model, ids[:, t], plain), atol=1e-5, rtol=1e-5)
            assert static.length == plain.length == t + 1
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(static.k[layer][:, :, : plain.length], plain.k[layer][:, :, : plain.length])
        torch.testing.assert_close(static.v[layer][:, :, : plain.length], plain.v[layer][:, :, : plain.length])


def test_a_prompt_into_an_empty_static_cache_attends_over_its_own_slots():
    """From slot 0 an eager prompt needs no mask over the cache's spare slots: SDPA's causal attention over its
    T keys (4x fewer scores at 512 of 1,024 slots, the masked half skipped); with a window, a (T, T) mask.
    Later forwards get every slot from `update` (a one-row step then reads only the filled ones: the next test).
    Equal values: the hypothesis test above."""
    model = tiny_model()
    cache, (B, T) = StaticKVCache(model.config, 1, 16), (1, 5)
    k = torch.randn(B, model.config.n_kv_heads, T, model.config.head_dim)
    assert cache.mask(T, None, None, torch.float32, "cpu") is None
    assert cache.mask(T, None, 3, torch.float32, "cpu").shape == (1, 1, T, T)
    assert cache.update(0, k, k)[0].shape[2] == T
    cache.advance(T)
    assert cache.mask(1, None, None, torch.float32, "cpu").shape == (1, 1, 1, 16)
    assert cache.update(0, k[:, :, :1], k[:, :, :1])[0].shape[2] == 16


def test_a_step_attends_over_the_filled_slots_alone():
    """A decode step on a static cache without windows reads the pos + 1 filled slots only (the kernel's operator,
    which the compiled step calls too): spare slots full of NaN change nothing. With a window it reads every slot
    under the mask, as before; the hypothesis test above checks both against the plain cache."""
    model = tiny_model()
    static, plain = StaticKVCache(model.config, 1, 32), KVCache(model.config, 1, 32)
    assert static.traceable and not StaticKVCache(model.config, 2, 32).traceable
    ids = torch.tensor([[5, 17, 3, 8]])
    with torch.no_grad():
        prefill(model, ids, static), prefill(model, ids, plain)
        for layer in range(model.config.n_layers):
            static.k[layer][:, :, 4:] = float("nan")
            static.v[layer][:, :, 4:] = float("nan")
        torch.testing.assert_close(decode_step(model, torch.tensor([9]), static), decode_step(model, torch.tensor([9]), plain), atol=1e-5, rtol=1e-5)


def test_static_cache_refuses_to_overflow():
    model = tiny_model()
    cache = StaticKVCache(model.config, 1, 4)
    with torch.no_grad(), pytest.raises(decoderlm.DecoderLMError, match="holds 4 tokens"):
        prefill(model, torch.zeros(1, 5, dtype=torch.long), cache)


def test_cache_key_follows_weights_and_dtype():
    model = tiny_model()
    key = compiled.cache_key(model, 256)
    assert compiled.cache_key(tiny_model(), 256) == key  # the same weights: the same package
    assert compiled.cache_key(tiny_model(seed=1), 256) != key
    assert compiled.cache_key(model, 512) != key
    assert compiled.cache_key(tiny_model().to(torch.bfloat16), 256) != key
    assert compiled.cache_key(quantize(tiny_model(), "int8"), 256) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert compiled.cache_key(model, 256) != key
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", folder)
    return folder


def assert_steps_match_eager(decoder: compiled.CompiledDecoder, model, prompt: int, end: int, atol: float) -> None:
    """Tokens 10, 11, ...: the first `prompt` prefilled into the compiled step's static cache and into an eager
    KVCache, then one step at a time up to `end` tokens, each compiled step's logits within `atol` of eager's."""
    static, plain = decoder.new_cache(end + 10), KVCache(model.config, 1, end + 10, dtype=cache_dtype(model))
    assert static is not None
    ids = torch.arange(10, 10 + end)[None]
    with torch.inference_mode():
        prefill(model, ids[:, :prompt], static)
        prefill(model, ids[:, :prompt], plain)
        for t in range(prompt, end):
            torch.testing.assert_close(decoder.step(ids[:, t], static), decode_step(model, ids[:, t], plain), atol=atol, rtol=0)


def test_compiled_greedy_generation_and_logits_equal_eager(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    model, _ = decoderlm.load(checkpoint)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    prompts = [[5, 17, 3], list(range(40, 90)), [7] * 9]
    eager = [generate(model, p, params) for p in prompts]
    decoder = compiled.CompiledDecoder(model)
    assert [generate(model, p, params, step=decoder) for p in prompts] == eager
    assert decoder.compiles <= 1  # all three prompts share one cache size: one package
    assert_steps_match_eager(decoder, model, prompt=5, end=20, atol=1e-4)


def test_quantized_layers_run_inside_the_compiled_step(tmp_path, monkeypatch):
    """torch's int4 layers (where decoderlm's kernels cannot be built), and int8 ones where the shape does
    not fit int4 (the 37-token head, the 48-wide down_proj)."""
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "available", lambda: False)
    model = quantize(tiny_model(), "int4")
    params = SamplingParams(temperature=0, max_new_tokens=16)
    eager = generate(model, [3, 1, 4, 1, 5], params)
    step = compiled.CompiledDecoder(model)
    assert generate(model, [3, 1, 4, 1, 5], params, step=step) == eager
    assert step.compiles == 1 and step.runners[64] is not None


@pytest.mark.skipif(not kernels.available(), reason="decoderlm's kernels are off or cannot be built here: the quantized layers are torch's")
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_block_layers_compile_with_their_kernels(tmp_path, monkeypatch, capsys, mode):
    """The compiled step calls decoderlm's block kernels as C++ operators: the eager step's logits (the kernels
    are the same; the float ops around them are inductor's: within 1e-6) and its greedy tokens, and no note.
    Keys and values kept in fp16, as the default mode keeps them: the graph rounds them as eager does
    (`emulate_precision_casts`; without it inductor kept them in fp32, 1.7e-5 away)."""
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    model = quantize(tiny_model(), mode)
    store_keys_in(model, torch.float16)
    assert any(isinstance(m, BlockLinear) for m in model.modules())
    decoder = compiled.CompiledDecoder(model)
    assert_steps_match_eager(decoder, model, prompt=3, end=10, atol=1e-6)
    assert decoder.compiles == 1
    params = SamplingParams(temperature=0, max_new_tokens=6)
    assert generate(model, [3, 1, 4], params, step=decoder) == generate(model, [3, 1, 4], params)
    assert "unavailable" not in capsys.readouterr().err
    wrapper = next(tmp_path.rglob("*.pt2"))
    assert b"decoderlm.block_matmul" in wrapper.read_bytes()  # the package calls the kernel, not a float copy of the weights
    assert b"decoderlm.attend_paged" in wrapper.read_bytes()  # and attends over the filled slots on the kernel


def test_quantized_experts_decode_eagerly_with_one_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    model = quantize(tiny_model(n_experts=4, n_experts_per_tok=2, moe_hidden=16), "int8")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    step = compiled.CompiledDecoder(model)
    assert generate(model, [3, 1, 4], params, step=step) == generate(model, [3, 1, 4], params)
    assert step.compiles == 0 and capsys.readouterr().err.splitlines() == [
        "compiled decoding unavailable (quantized MoE experts do not compile yet; --quantize none compiles them); decoding eagerly"]
    assert not list(tmp_path.rglob("*.failed"))  # known before trying: nothing to remember
