"""The eager decode step as kernel calls (decoderlm.kernel_step): the logits of `Transformer.forward`
bit for bit, for every layer option it takes and every rounding of the activations; `stream` decodes
through it by default; models it does not cover are told apart and decode through the model's forward."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm import kernels
from decoderlm.generate import decode_step, generate, prefill
from decoderlm.kernel_step import KernelStep, unsupported
from decoderlm.kv_cache import KVCache
from decoderlm.model.fuse import fuse_projections
from decoderlm.quantize import quantize, round_activations
from decoderlm.sampling import SamplingParams

pytestmark = [pytest.mark.isa, pytest.mark.skipif(not kernels.available(), reason="no C compiler here: nothing runs on the kernels")]
generate_module = sys.modules["decoderlm.generate"]


def block_model(mode: str = "int4", activations: str = "int16", seed: int = 0, **overrides):
    """A tiny model as `decoderlm.load` gives a quantized GGUF: projections stacked, on BlockLinear."""
    cfg = {"d_model": 64, "ffn_hidden": 96, "n_heads": 4, "n_kv_heads": 2, **overrides}
    model = tiny_model(seed, **cfg)
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # initialised to zeros, which would hide a bias left out
            torch.nn.init.normal_(p, std=0.5)
    model = fuse_projections(quantize(model, mode))
    round_activations(model, activations)
    return model


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(["int4", "int8"]), activations=st.sampled_from(["fp32", "int16", "int8"]),
       heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (2, 1)]), bias=st.booleans(), mlp=st.sampled_from(["swiglu", "geglu"]),
       rotary=st.sampled_from([1.0, 0.5]), rows=st.integers(1, 3), prompt=st.integers(1, 20), seed=st.integers(0, 50))
def test_its_logits_are_the_forwards_bit_for_bit(mode, activations, heads, bias, mlp, rotary, rows, prompt, seed):
    """GQA/MQA/MHA, Qwen2's QKV bias, SwiGLU or GeGLU, partial RoPE, Q4_1 or Q8_0 blocks, fp32/int16/int8
    activations, several rows: each step's logits equal `decode_step`'s exactly (torch.equal), and so does
    the cache they leave."""
    model = block_model(mode, activations, seed, n_heads=heads[0], n_kv_heads=heads[1], attn_bias=bias, mlp=mlp,
                        partial_rotary_factor=rotary)
    assert unsupported(model) is None
    step = KernelStep(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt + 8), generator=g)
    ours, theirs = KVCache(model.config, rows, prompt + 8), KVCache(model.config, rows, prompt + 8)
    with torch.inference_mode():
        prefill(model, ids[:, :prompt], ours)
        prefill(model, ids[:, :prompt], theirs)
        for t in range(prompt, prompt + 8):
            a, b = step.step(ids[:, t], ours), decode_step(model, ids[:, t], theirs)
            assert a.shape == b.shape == (rows, model.config.vocab_size)
            assert torch.equal(a, b), f"step {t}: {(a - b).abs().max()}"
    assert ours.length == theirs.length == prompt + 8
    assert all(torch.equal(x, y) for x, y in zip(ours.k + ours.v, theirs.k + theirs.v))


def test_stream_decodes_through_it_with_the_forwards_tokens(monkeypatch):
    """Plain decoding (no compiled step, no proposer) runs every step after the prompt on the kernel step,
    and greedy and sampled tokens are those of the model's own forward."""
    model = block_model()
    calls = []
    original = KernelStep.step
    monkeypatch.setattr(KernelStep, "step", lambda self, token, cache: calls.append(1) or original(self, token, cache))
    for params in (SamplingParams(temperature=0, max_new_tokens=12), SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_new_tokens=12)):
        ours = generate(model, [3, 1, 4, 1, 5], params)
        assert len(calls) == len(ours) - 1  # every token but the first, which the prompt's forward gives
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(generate_module.KernelStep, "of", classmethod(lambda cls, model: None))
            assert generate(model, [3, 1, 4, 1, 5], params) == ours
        assert not calls


def test_a_context_that_fills_keeps_the_window_rule(monkeypatch):
    """Past max_seq_len the steps run cache-free forwards over the window (the kernel step is not used
    for them): the tokens equal the model's own forward's."""
    model = block_model(max_seq_len=16)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    ours = generate(model, list(range(1, 9)), params)
    monkeypatch.setattr(generate_module.KernelStep, "of", classmethod(lambda cls, model: None))
    assert generate(model, list(range(1, 9)), params) == ours


@pytest.mark.parametrize("change, reason", [
    (lambda: fuse_projections(tiny_model(d_model=64, ffn_hidden=96)), "projections not on decoderlm's block kernels"),
    (lambda: block_model(qk_norm=True), "QK-norm"),
    (lambda: block_model(sliding_window=8), "sliding window"),
    (lambda: block_model(position="learned"), "RoPE"),
    (lambda: block_model(norm="layernorm"), "RMSNorm"),
    (lambda: block_model(mlp="gelu"), "fused gated"),
    (lambda: block_model(post_norm=True), "pre-norm"),
    (lambda: block_model().train(), "eval mode"),
])
def test_what_it_does_not_cover_is_named(change, reason):
    assert reason in (unsupported(change()) or "")


def test_a_hook_keeps_the_model_on_its_forward():
    """A forward hook (the attention pictures use them) is only called by the module's forward."""
    model = block_model()
    seen = []
    handle = model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
    assert "hooks" in unsupported(model)
    generate(model, [3, 1, 4], SamplingParams(temperature=0, max_new_tokens=4))
    assert len(seen) == 4  # the prompt and three steps, every one through the forward
    handle.remove()
    assert unsupported(model) is None
