"""The compiled decode step of mixture-of-experts models: each expert under torch.cond, the same tokens and
logits as the eager path. Not re-run at the other CPU levels (test_cpu_levels): what depends on the level,
the generated vector code and the kernels inside the step, is tests/test_compiled.py's, and each compile
here costs ~20 s a level."""

from __future__ import annotations

import pytest
import torch

import decoderlm
from decoderlm import compiled
from decoderlm.generate import decode_step, generate, prefill
from decoderlm.kv_cache import KVCache
from decoderlm.sampling import SamplingParams
from tests.hf_models import make_hf_model


@pytest.mark.parametrize("case", ["gpt_oss", pytest.param("deepseek_v3", marks=pytest.mark.slow), pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_decodes_compiled_with_eager_tokens(tmp_path, monkeypatch, case):
    """The experts run under torch.cond, each only when the token chose it: gpt-oss (sinks, router bias, the
    clamped SwiGLU), DeepSeek-V3 (MLA, grouped sigmoid routing, shared experts) and Mixtral compile and give
    eager's greedy tokens and logits."""
    from tests.test_deepseek import make_model

    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    (make_model if case.startswith("deepseek") else make_hf_model)(case, tmp_path / "model")
    model, _ = decoderlm.load(tmp_path / "model")
    params, prompts = SamplingParams(temperature=0, max_new_tokens=12), [[5, 17, 3], list(range(40, 60))]
    decoder = compiled.CompiledDecoder(model)
    assert [generate(model, p, params, step=decoder) for p in prompts] == [generate(model, p, params) for p in prompts]
    assert decoder.compiles == 1 and None not in decoder.runners.values()
    static, plain = decoder.new_cache(20), KVCache(model.config, 1, 20)
    ids = torch.tensor([list(range(10, 20))])
    with torch.inference_mode():
        prefill(model, ids[:, :3], static)
        prefill(model, ids[:, :3], plain)
        for t in range(3, 10):
            torch.testing.assert_close(decoder.step(ids[:, t], static), decode_step(model, ids[:, t], plain), atol=1e-4, rtol=0)
