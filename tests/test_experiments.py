"""The causal-mask experiment switch (ModelConfig.causal) and benchmarks/experiments.py end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import config_to_hf
from decoderlm.kv_cache import KVCache
from decoderlm.model import Transformer
from tests.conftest import corpus_text, tiny_config

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {  # GPT-2's parts (learned positions, LayerNorm) and Llama's (RoPE, RMSNorm, SwiGLU)
    "gpt2": dict(norm="layernorm", position="learned", mlp="gelu", family="gpt2"),
    "llama": dict(family="llama"),
}


def logits(causal: bool, family: str, ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    model = Transformer(tiny_config(causal=causal, **FAMILIES[family])).eval()
    with torch.no_grad():
        return model(ids).logits  # (1, T, V)


@given(family=st.sampled_from(sorted(FAMILIES)), T=st.integers(3, 12), data=st.data())
def test_a_later_token_changes_earlier_logits_only_without_the_causal_mask(family: str, T: int, data: st.DataObject) -> None:
    j = data.draw(st.integers(1, T - 1), label="changed position")
    ids = torch.tensor([data.draw(st.lists(st.integers(0, 36), min_size=T, max_size=T), label="ids")])
    changed = ids.clone()
    changed[0, j] = (ids[0, j] + 1) % 37
    for causal in (True, False):
        before, after = logits(causal, family, ids)[0, :j], logits(causal, family, changed)[0, :j]  # (j, V)
        if causal:
            torch.testing.assert_close(before, after, rtol=0, atol=1e-6)
        else:
            assert (before - after).abs().amax(-1).min() > 1e-4  # every earlier position sees the change


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_without_the_causal_mask_a_cached_prefill_attends_both_ways_like_the_plain_forward(family: str) -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config(causal=False, **FAMILIES[family])).eval()
    ids = torch.randint(0, 37, (2, 7))
    with torch.no_grad():
        plain = model(ids).logits
        cached = model(ids, cache=KVCache(model.config, 2, 16)).logits
    torch.testing.assert_close(cached, plain, rtol=0, atol=1e-5)


def test_a_model_without_the_causal_mask_is_not_exported_as_an_hf_checkpoint() -> None:
    with pytest.raises(DecoderLMError, match="causal"):
        config_to_hf(tiny_config(causal=False, **FAMILIES["llama"]))


def test_experiments_benchmark_runs_end_to_end_in_quick_mode(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text(corpus_text(30_000), encoding="utf-8")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "benchmarks/experiments.py", "--quick", "--skip-changes", "--data", str(data), "--out", str(out)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "experiments.json").read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert set(runs) == {"seed-char", "seed-char-llama", "seed-char masked", "seed-char causal=false", "seed-char-llama bpe:2048"}
    assert "causal=false" in runs["seed-char causal=false"]["command"]
    assert runs["seed-char"]["tokens"] == runs["seed-char-llama"]["tokens"] == result["steps"] * 12 * 64
    assert abs(runs["seed-char-llama"]["parameters"] / runs["seed-char"]["parameters"] - 1) <= 0.05
    bpe = runs["seed-char-llama bpe:2048"]
    assert bpe["val_chars_per_token"] > 1 and bpe["val_bits_per_char"] < bpe["val_loss"]
    for png in ("experiments_llama_vs_gpt.png", "experiments_causal_mask.png"):
        assert (out / png).stat().st_size > 0
    assert "--- sample: seed-char causal=false" in proc.stdout
    assert result["seed"] == 1337 and all("--seed 1337" in r["command"] for r in result["runs"])


def test_each_improvement_runs_its_own_seeds_and_its_row_records_them() -> None:
    spec = importlib.util.spec_from_file_location("experiments", ROOT / "benchmarks" / "experiments.py")
    experiments = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiments)
    calls = []

    def run(name: str, *args: str) -> dict:
        calls.append((name, args))
        seed = int(args[args.index("--seed") + 1])
        muon = "muon" in " ".join(args) or "seed-char-plus" in args
        return {"name": name, "val_loss": 1.6 - 0.05 * muon + (seed - 1337) / 100, "parameters": 800_000, "tokens": 1_536_000,
                "wall_seconds": 200.0, "step_seconds": 0.13 if muon else 0.1}

    rows = experiments.summarise_improvements(experiments.run_improvements(run))
    assert [name for name, _ in calls] == [f"{change} s{seed}" for change, _, seeds in experiments.IMPROVEMENTS for seed in seeds]
    assert [row["change"] for row in rows] == [change for change, _, _ in experiments.IMPROVEMENTS]
    for row, (_, args, seeds) in zip(rows, experiments.IMPROVEMENTS):
        assert row["seeds"] == list(seeds) and list(row["val_loss"]) == [str(seed) for seed in seeds]
        assert row["arguments"] == " ".join(args)
        assert row["mean_val_bits_per_char"] == round(row["mean_val_loss"] / math.log(2), 4)
    baseline, plus = rows[0], next(row for row in rows if row["change"].startswith("seed-char-plus ("))
    assert baseline["seeds"] == [1337, 1338] and baseline["mean_val_loss"] == 1.605 and baseline["step_vs_baseline"] == 1.0
    assert plus["delta_vs_baseline"] == -0.05 and plus["step_vs_baseline"] == 1.3


def test_explain_shows_attention_to_later_tokens_only_without_the_causal_mask() -> None:
    from decoderlm.inspect.explain import attention_weights

    ids = torch.randint(0, 37, (1, 6))
    for causal in (True, False):
        torch.manual_seed(0)
        model = Transformer(tiny_config(causal=causal, **FAMILIES["llama"])).eval()
        above_diagonal = attention_weights(model, ids, 0)[0].triu(1)  # (H, T, T): weight on later tokens
        assert (above_diagonal.amax() > 1e-3) == (not causal)
