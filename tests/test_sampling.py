"""Sampler properties: each filter keeps exactly the set its definition names; seeds reproduce."""

import pytest
import torch
from conftest import tiny_model
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams, apply_repetition_penalty, filter_min_p, filter_top_k, filter_top_p, sample

VOCAB = 50
seeds = st.integers(0, 2**31 - 1)


def random_logits(seed: int, rows: int = 3, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale  # (B, V)


@given(seeds, st.integers(1, VOCAB))
def test_top_k_keeps_exactly_the_k_best(seed, k):
    logits = random_logits(seed)
    kept = filter_top_k(logits, k).isfinite()
    best = logits.topk(k, dim=-1).indices
    assert (kept.sum(-1) == k).all()
    assert kept.gather(-1, best).all()


@given(seeds, st.integers(1, 10))
@settings(max_examples=30)
def test_sample_with_top_k_never_leaves_the_k_best(seed, k):
    logits = random_logits(seed)
    best = logits.topk(k, dim=-1).indices
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        token = sample(logits, SamplingParams(top_k=k), gen)  # (B,)
        assert (best == token[:, None]).any(-1).all()


@given(seeds, st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_reaching_p(seed, p):
    logits = random_logits(seed)
    kept = filter_top_p(logits, p).isfinite()
    probs = logits.softmax(-1)
    for row in range(logits.shape[0]):
        mass = probs[row][kept[row]]
        assume(abs(float(mass.sum()) - p) > 1e-5)  # skip float ties at the boundary
        assert mass.sum() >= p  # reaches p ...
        assert mass.sum() - mass.min() < p  # ... and dropping its least likely token would not
        dropped = probs[row][~kept[row]]
        if dropped.numel():
            assert dropped.max() <= mass.min()  # the kept set is the most likely tokens


def test_top_p_one_keeps_everything():
    logits = random_logits(0)
    assert filter_top_p(logits, 1.0).isfinite().all()


@given(seeds, st.floats(0.0, 0.99))
def test_min_p_keeps_tokens_above_the_scaled_top_probability(seed, min_p):
    logits = random_logits(seed)
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * min_p
    assume(((probs - threshold).abs() > 1e-7).all())
    kept = filter_min_p(logits, min_p).isfinite()
    assert torch.equal(kept, probs >= threshold)


@given(seeds, st.floats(1.01, 5.0))
def test_repetition_penalty_discourages_seen_tokens_only(seed, penalty):
    logits = random_logits(seed)
    seen = torch.tensor([[0, 3, 7]] * logits.shape[0])  # (B, S)
    out = apply_repetition_penalty(logits, seen, penalty)
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, seen, True)
    assert (out[mask] < logits[mask]).all()  # each seen token became less likely
    assert torch.equal(out[~mask], logits[~mask])
    back = apply_repetition_penalty(logits, seen, 1 / penalty)  # < 1 encourages instead
    assert (back[mask] > logits[mask]).all()


def test_repetition_penalty_applied_by_sample():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert int(sample(logits, params)) == 0
    assert int(sample(logits, params, seen=torch.tensor([[0]]))) == 1  # 5/2 < 4


@given(seeds, st.sampled_from([0.0, 1e-4, 1e-3]))
@settings(max_examples=40)
def test_cold_temperature_is_greedy(seed, temperature):
    logits = random_logits(seed)
    top2 = logits.topk(2, dim=-1).values
    assume(((top2[:, 0] - top2[:, 1]) > 0.05).all())  # a clear winner in every row
    token = sample(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(seed))
    assert torch.equal(token, logits.argmax(-1))


def test_same_seed_same_output_different_seed_differs():
    model = tiny_model(vocab_size=64)
    prompt = [1, 2, 3]

    def run(seed):
        return generate(model, prompt, SamplingParams(temperature=1.5, max_new_tokens=40, seed=seed))

    assert run(7) == run(7)
    assert run(7) != run(8)  # 40 draws over 64 near-uniform tokens: a collision is practically impossible


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.cat([sample(logits, SamplingParams(), gen) for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
    dict(min_p=-0.1), dict(min_p=1.0), dict(repetition_penalty=0.0), dict(repetition_penalty=-2.0),
    dict(max_new_tokens=-1),
])
def test_invalid_params_raise(bad):
    with pytest.raises(DecoderLMError):
        SamplingParams(**bad)


def test_invalid_prompts_raise():
    model = tiny_model(max_seq_len=16)
    with pytest.raises(DecoderLMError, match="empty"):
        generate(model, [], SamplingParams())
    with pytest.raises(DecoderLMError, match="context"):
        generate(model, [1] * 16, SamplingParams())
