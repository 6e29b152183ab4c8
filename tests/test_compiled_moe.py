"""The compiled decode step of mixture-of-experts models: each expert under torch.cond, the same tokens and
logits as the eager path. Not re-run at the other CPU levels (test_cpu_levels): what depends on the level,
the generated vector code and the kernels inside the step, is tests/test_compiled.py's, and each compile
here costs ~20 s a level."""

from __future__ import annotations

import pytest

import decoderlm
from decoderlm import compiled
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams
from tests.hf_models import make_hf_model
from tests.test_compiled import assert_steps_match_eager


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
    assert_steps_match_eager(decoder, model, prompt=3, end=10, atol=1e-4)
