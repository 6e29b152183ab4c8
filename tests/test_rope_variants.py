"""RoPE variants whose frequencies depend on how far a forward reaches, against transformers: Phi-3's
LongRoPE (short factors within the original context, long ones past it, and its attention factor) and
dynamic NTK (a larger base past max_position_embeddings). Both switch per forward, as transformers does,
so cached decoding is compared with transformers' own cached decoding (greedy tokens)."""

from __future__ import annotations

import pytest
import torch
from hf_models import LLAMA, prompt_ids
from transformers import AutoConfig, AutoModelForCausalLM

from decoderlm.generate import generate
from decoderlm.inspect.arch import spec_from_model_config
from decoderlm.loader import load
from decoderlm.sampling import SamplingParams
from decoderlm.serve import Engine

LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]  # one divisor per frequency (head_dim 16: 8)
SHORT = [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0]
VARIANTS = {
    "phi3-longrope": ("phi3", LLAMA | dict(max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "long_factor": LONG, "short_factor": SHORT})),
    "llama-dynamic": ("llama", LLAMA | dict(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    from hf_models import write_tokenizer

    model_type, kwargs = VARIANTS[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_tokenizer(folder)
    return hf, load(folder)[0], request.param


@pytest.mark.parametrize("n", [12, 30])  # within the switch point (16) and past it
def test_logits_match_transformers_on_both_sides_of_the_switch(pair, n):
    hf, ours, _ = pair
    ids = prompt_ids(n)
    with torch.no_grad():
        hf_logits = hf(ids).logits
        assert (hf_logits - ours(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("pair", ["phi3-longrope"], indirect=True)
def test_greedy_decoding_across_the_switch_matches_transformers(pair):
    """LongRoPE switches factors inside the context, so `generate` crosses the switch (and rebuilds the cache
    there, as transformers does). Dynamic NTK switches only past max_position_embeddings, where `generate`
    never goes (its window slides at the model's context): the logits test above covers it."""
    hf, ours, _ = pair
    ids = prompt_ids(10, seed=2)[:1]  # 10 + 20 tokens: the switch at 16 falls in the decoding
    with torch.no_grad():
        want = hf.generate(ids, do_sample=False, max_new_tokens=20)[0, 10:].tolist()
    assert generate(ours, ids[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=20)) == want


@pytest.mark.parametrize("pair", ["phi3-longrope"], indirect=True)
def test_paged_engine_across_the_switch_matches_transformers(pair):
    """One batch holds a row that stays within the switch (4 + 12 tokens), one that crosses it while decoding
    (10 + 12: computed again, long, as transformers does) and a prompt past it read in chunks of 8 (long from
    its first chunk); each row with its own factors gives transformers' greedy tokens. Long-computed blocks
    are named apart in the prefix cache: a short prompt sharing their tokens does not reuse them."""
    hf, ours, _ = pair
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    long = prompt_ids(20, seed=20)[0].tolist()
    prompts = [prompt_ids(4, seed=4)[0].tolist(), prompt_ids(10, seed=10)[0].tolist(), long]
    with torch.no_grad():
        want = {tuple(p): hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12)[0, len(p):].tolist()
                for p in prompts}
        want[tuple(long[:12])] = hf.generate(torch.tensor([long[:12]]), do_sample=False, max_new_tokens=4)[0, 12:].tolist()
    engine = Engine(ours, max_batch=3, num_blocks=1 + 24, block_size=4, prefill_chunk=8)
    streams = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    assert [[o.token_id for o in s if o.token_id is not None] for s in streams] == [want[tuple(p)] for p in prompts]
    assert engine.stats()["preemptions"] == 0
    # The long prompt's first 12 tokens, within the switch to the end: no hit; the long prompt again: its 4 full blocks.
    for p, n, hits in ((long[:12], 4, 0), (long, 12, 16)):
        before, params = engine.stats()["prefix_cache_hits"], SamplingParams(temperature=0.0, max_new_tokens=n)
        stream = engine.add_request(p, params)
        while engine.has_work():
            engine.step()
        assert [o.token_id for o in stream if o.token_id is not None] == want[tuple(p)] == generate(ours, p, params)
        assert engine.stats()["prefix_cache_hits"] - before == hits


def test_configs_name_the_variant(pair):
    _, ours, case = pair
    scaling = ours.config.rope_scaling
    assert scaling["rope_type"] == case.split("-")[1]
    features = spec_from_model_config(ours.config).features()
    if case == "phi3-longrope":
        assert scaling["original_max_position_embeddings"] == 16 and ours.rope_factor > 1
        assert "positions: RoPE θ=10,000, longrope scaling ×4 from 16 to 64 tokens" in features
    else:
        assert "positions: RoPE θ=10,000, dynamic scaling ×2" in features
