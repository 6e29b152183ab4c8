"""benchmarks/exposure_bias.py: the spliced context scores the right tokens, own tokens are the model's
greedy choice or a draw from its distribution, and the benchmark runs end to end (--quick)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from conftest import corpus_text, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm.formats import runs
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("exposure_bias", ROOT / "benchmarks" / "exposure_bias.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
P, OWN, SCORE = bench.PREFIX, bench.OWN, bench.SCORE
L = P + OWN + SCORE
MODEL = tiny_model()


def nll_of_suffix(model, sequence: list[int]) -> list[float]:
    """-log p of each of the sequence's last SCORE tokens given everything before it, one window alone."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([sequence[:-1]])).logits[0], -1)  # (L-1, V)
    return [-logp[t - 1, sequence[t]].item() for t in range(L - SCORE, L)]


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 36), min_size=2 * L, max_size=2 * L), st.lists(st.integers(0, 36), min_size=2 * OWN, max_size=2 * OWN))
def test_the_true_tokens_after_the_splice_are_scored_after_the_own_tokens(tokens, own_tokens):
    win = torch.tensor(tokens).view(2, L)
    own = torch.tensor(own_tokens).view(2, OWN)
    true, spliced = bench.continuation_losses(MODEL, win), bench.continuation_losses(MODEL, win, own)
    for i in range(2):
        expected_true = nll_of_suffix(MODEL, tokens[i * L : (i + 1) * L])
        expected_own = nll_of_suffix(MODEL, tokens[i * L : i * L + P] + own_tokens[i * OWN : (i + 1) * OWN] + tokens[i * L + P + OWN : (i + 1) * L])
        torch.testing.assert_close(true[i], torch.tensor(expected_true), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(spliced[i], torch.tensor(expected_own), atol=1e-5, rtol=1e-5)
    # own tokens equal to the true ones change nothing: the gap of a model that never errs is 0
    torch.testing.assert_close(bench.continuation_losses(MODEL, win, win[:, P : P + OWN]), true, atol=0, rtol=0)


def test_greedy_own_tokens_are_what_generate_gives():
    prefixes = torch.randint(0, 37, (3, P), generator=torch.Generator().manual_seed(1))
    own = bench.generate_own(MODEL, prefixes, OWN, 0.0, torch.Generator())
    for row, prefix in zip(own, prefixes):
        assert row.tolist() == generate(MODEL, prefix.tolist(), SamplingParams(temperature=0.0, max_new_tokens=OWN))


def test_sampled_own_tokens_follow_the_model_distribution():
    model = tiny_model(seed=3, vocab_size=5)
    prefix = torch.randint(0, 5, (1, 8), generator=torch.Generator().manual_seed(0))
    n = 20_000
    with torch.no_grad():
        probs = torch.softmax(model(prefix).logits[0, -1], -1)
    own = bench.generate_own(model, prefix.expand(n, -1), 1, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(own[:, 0], minlength=5).float() / n
    assert (freq - probs).abs().max() < 4 * (0.25 / n) ** 0.5  # 4 standard deviations at worst


def test_quick_run_measures_both_models_and_reuses_finished_runs(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(corpus_text(30_000), encoding="utf-8")
    argv = ["--quick", "--data", str(data), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "runs"), "--p", "0.5"]
    threads = torch.get_num_threads()
    try:
        result = bench.main(argv)
        ckpt = tmp_path / "runs" / "seed1337-p0.5" / runs.CKPT_NAME
        stamp = ckpt.stat().st_mtime_ns
        again = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert ckpt.stat().st_mtime_ns == stamp  # reused, not retrained
    assert json.loads((tmp_path / "out" / "exposure_bias.json").read_text())["rows"] == again["rows"]
    assert [(r["p"], r["seed"]) for r in result["rows"]] == [(0.0, 1337), (0.5, 1337)]
    assert runs.read(tmp_path / "runs" / "seed1337-p0.5")["train_config"]["scheduled_sampling"] == 0.5
    for row, other in zip(result["rows"], again["rows"]):
        assert row["windows"] == 32 and len(row["true_context_curve"]) == SCORE
        for kind in ("greedy", "sampled"):
            assert abs(row[kind]["gap"] - (row[kind]["own_context_loss"] - row["true_context_loss"])) < 1e-9
            assert 0 <= row[kind]["own_equals_true"] <= 1
        assert row["val_loss"] == other["val_loss"]
    assert set(result["mean"]) == {"0", "0.5"}
