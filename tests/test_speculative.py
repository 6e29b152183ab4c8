"""Speculative decoding: greedy output is plain greedy decoding's, token for token, whatever the
proposer guesses; sampled tokens follow the target's distribution (a chi-square test that a naive
verifier fails); the draft's tokenizer must be the target's; the CLI flags."""

from __future__ import annotations

import importlib
import math
import shutil
from collections import Counter

import pytest
import torch
from conftest import run_cli, tiny_model
from hf_models import make_hf_model
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from decoderlm.errors import DecoderLMError
from decoderlm.generate import SpeculativeStats, generate, stream
from decoderlm.kv_cache import KVCache
from decoderlm.model.transformer import ModelOutput
from decoderlm.sampling import SamplingParams, apply_repetition_penalty, filter_top_k, filter_top_p
from decoderlm.speculative import DraftModel, PromptLookup, check_vocabularies, ngram_lookup
from decoderlm.tokenizer import CharTokenizer

GREEDY = dict(temperature=0.0)
CONFIGS = {"rope-gqa": dict(n_kv_heads=2), "learned": dict(position="learned"), "window": dict(sliding_window=4, n_kv_heads=1)}


def speculative_generate(target, prompt, params, proposer, k) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats()
    return list(stream(target, prompt, params, proposer, num_speculative_tokens=k, stats=stats)), stats


def proposers(target, cfg) -> dict:
    return {"other model": DraftModel(tiny_model(9, n_layers=1, **cfg)),  # different weights: guesses mostly rejected
            "itself": DraftModel(target),  # every guess accepted
            "prompt lookup": PromptLookup(2)}


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("max_seq_len", [64, 12])  # 12: the context fills up and plain decoding takes over
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_plain_greedy_output(cfg, max_seq_len, k):
    target = tiny_model(3, max_seq_len=max_seq_len, **cfg)
    prompt = [5, 1, 7, 5, 1]
    for penalty in (1.0, 1.4):
        params = dict(max_new_tokens=30, repetition_penalty=penalty, **GREEDY)
        want = generate(target, prompt, SamplingParams(**params))
        for name, proposer in proposers(tiny_model(3, max_seq_len=max_seq_len, **cfg), cfg).items():
            got, stats = speculative_generate(target, prompt, SamplingParams(**params), proposer, k)
            assert got == want, (name, penalty)
            assert stats.accepted <= stats.proposed and stats.generated == len(want)
            if name == "itself" and max_seq_len == 64:
                assert stats.acceptance_rate == 1.0 and stats.target_forwards == math.ceil(30 / (k + 1))


@settings(max_examples=25)
@given(prompt=st.lists(st.integers(0, 36), min_size=1, max_size=20), k=st.integers(1, 6), n=st.integers(0, 25),
       which=st.sampled_from(["draft", "lookup"]))
def test_greedy_equality_for_any_prompt_k_and_length(prompt, k, n, which):
    target = tiny_model(4, max_seq_len=24, n_kv_heads=2)
    proposer = DraftModel(tiny_model(5, n_layers=1, max_seq_len=24, n_kv_heads=2)) if which == "draft" else PromptLookup(3)
    params = SamplingParams(max_new_tokens=n, **GREEDY)
    assert speculative_generate(target, prompt, params, proposer, k)[0] == generate(target, prompt, params)


def test_stop_token_ends_generation_as_in_plain_decoding():
    target = tiny_model(3)
    free = generate(target, [2, 3], SamplingParams(max_new_tokens=20, repetition_penalty=1.5, **GREEDY))  # no loop
    stop_at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    params = SamplingParams(max_new_tokens=20, repetition_penalty=1.5, stop_token_ids=[free[stop_at]], **GREEDY)
    assert speculative_generate(target, [2, 3], params, DraftModel(target), 4)[0] == free[:stop_at]


def test_prompt_lookup_pays_on_repeated_text():
    target = tiny_model(3)  # its greedy continuation of [2, 3] is the cycle 28 8 28 8 ...
    params = SamplingParams(max_new_tokens=30, **GREEDY)
    got, stats = speculative_generate(target, [2, 3], params, PromptLookup(2), 5)
    assert got == generate(target, [2, 3], params)
    assert stats.acceptance_rate > 0.8 and stats.target_forwards <= 10


def test_prompt_lookup_guesses_from_the_latest_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 4, 8, 5, 2, 3, 7, 1, 2]
    assert ngram_lookup(ids, 3, max_ngram=3) == [4, 8, 5]  # no earlier "7 1 2"; the latest earlier "1 2" is followed by 4 8 5
    assert ngram_lookup(ids + [3], 2, max_ngram=3) == [9, 1]  # "1 2 3" (at 0) beats the later "2 3" (at 9)
    assert ngram_lookup([1, 2, 3], 4, max_ngram=2) == []
    assert ngram_lookup([4, 4, 4, 4], 5, max_ngram=2) == [4, 4, 4, 4, 4]  # a copy that reaches the end reads its own guesses
    assert ngram_lookup([7, 1, 2, 3, 1, 2], 5, max_ngram=2) == [3, 1, 2, 3, 1]


# --- sampling: the emitted tokens follow the target's distribution ---------------------------------------

V = 8
SAMPLING = dict(temperature=0.9, top_k=6, top_p=0.95, repetition_penalty=1.3, max_new_tokens=3)


def peaked_model(seed: int, **cfg):
    """A tiny model whose next-token distributions are far from uniform, so p and q differ clearly."""
    model = tiny_model(seed, vocab_size=V, n_layers=1, **cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return model


def target_pair_distribution(model, prompt: list[int]) -> torch.Tensor:
    """Exact P(first two tokens) (V, V) under plain sampling: penalty, temperature, top-k, top-p, softmax."""
    def dist(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[:, -1].float()
        logits = apply_repetition_penalty(logits, torch.tensor([ids]), SAMPLING["repetition_penalty"]) / SAMPLING["temperature"]
        return filter_top_p(filter_top_k(logits, SAMPLING["top_k"]), SAMPLING["top_p"]).softmax(-1)[0]

    first = dist(prompt)
    return torch.stack([first[a] * dist(prompt + [a]) for a in range(V)])


def chi_square_z(counts: Counter, expected: torch.Tensor, n: int) -> float:
    """Wilson–Hilferty z-score of Pearson's chi-square (cells expecting < 5 draws pooled); inf if a
    pair of probability 0 was drawn. z > 4 means p < 3e-5."""
    probs = expected.flatten().tolist()
    observed = [counts.get((i // V, i % V), 0) for i in range(V * V)]
    if any(o and p == 0 for o, p in zip(observed, probs)):
        return math.inf
    cells, pool_o, pool_e = [], 0, 0.0
    for o, p in zip(observed, probs):
        if n * p >= 5:
            cells.append((o, n * p))
        else:
            pool_o, pool_e = pool_o + o, pool_e + n * p
    cells.append((pool_o, pool_e))
    chi2 = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def first_pairs(target, prompt: list[int], proposer, runs: int) -> Counter:
    pairs = Counter()
    for seed in range(runs):
        out, _ = speculative_generate(target, prompt, SamplingParams(seed=seed, **SAMPLING), proposer, 2)
        pairs[tuple(out[:2])] += 1
    return pairs


RUNS = 1200  # a naive verifier scores z ≈ 15 here


@pytest.mark.parametrize("which", ["draft", "lookup"])
def test_sampled_tokens_follow_the_target_distribution(which):
    target = peaked_model(11)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2] if which == "lookup" else [3, 5]
    proposer = DraftModel(peaked_model(12)) if which == "draft" else PromptLookup(2)
    counts = first_pairs(target, prompt, proposer, RUNS)
    assert chi_square_z(counts, target_pair_distribution(target, prompt), RUNS) < 4


def test_the_chi_square_test_catches_a_verifier_that_resamples_from_p(monkeypatch):
    """The usual mistake: on rejection, draw from p instead of normalize(max(0, p − q))."""
    def naive(p, q, guesses, generator):
        for i, x in enumerate(guesses):
            if float(torch.rand((), generator=generator)) * float(q[i, x]) >= float(p[i, x]):
                return i, int(torch.multinomial(p[i], 1, generator=generator))
        return len(guesses), int(torch.multinomial(p[-1], 1, generator=generator))

    monkeypatch.setattr(importlib.import_module("decoderlm.generate"), "verify", naive)  # the module, not decoderlm.generate()
    target, prompt = peaked_model(11), [3, 5]
    counts = first_pairs(target, prompt, DraftModel(peaked_model(12)), RUNS)
    assert chi_square_z(counts, target_pair_distribution(target, prompt), RUNS) > 4


# --- vocabularies, cache rollback, CLI ------------------------------------------------------------------


def test_a_draft_with_another_tokenizer_is_refused():
    check_vocabularies(CharTokenizer.from_text("abc"), CharTokenizer.from_text("cab"))
    with pytest.raises(DecoderLMError, match="draft model's tokenizer differs"):
        check_vocabularies(CharTokenizer.from_text("abc"), CharTokenizer.from_text("abd"))


def test_a_draft_vocabulary_of_another_size_is_fitted_to_the_target():
    """Checkpoints pad vocabularies to different sizes: ids only the draft has are never guessed, and
    q always has the target's width."""
    target = tiny_model(3)  # vocab 37
    for draft_vocab in (45, 30):
        model = tiny_model(6, vocab_size=draft_vocab)
        bump = torch.zeros(draft_vocab)
        bump[30:] = 20.0  # ids 30.. (the padding, for the 45-id draft) would win every draw
        model.register_forward_hook(lambda module, args, out: ModelOutput(out.logits + bump))
        draft = DraftModel(model)
        draft.start(32, target.config.vocab_size)
        guesses, q = draft.propose([1, 2], 4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
        assert q.shape == (4, 37) and max(guesses) < 37
        assert (q[:, 30:] == 0).all() if draft_vocab == 30 else (q[:, 30:].sum(-1) > 0.99).all()
        params = SamplingParams(max_new_tokens=15, **GREEDY)
        assert speculative_generate(target, [1, 2], params, draft, 3)[0] == generate(target, [1, 2], params)


def test_truncate_rolls_the_cache_back():
    model = tiny_model(3)
    cache = KVCache(model.config, 1, 16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
        cache.truncate(3)
        got = model(torch.tensor([[9]]), cache=cache).logits[0, -1]
        want = model(torch.tensor([[1, 2, 3, 9]])).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError):
        cache.truncate(5)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", folder)
    return folder


def test_cli_generate_with_speculation_prints_plain_output_and_stats(hf_folder, capsys):
    base = ["generate", "--model", str(hf_folder), "--prompt", "The quick brown fox. The quick", "--max-new-tokens", "20", "--temperature", "0"]
    code, plain, _ = run_cli(base, capsys)
    assert code == 0
    for flags in (["--prompt-lookup"], ["--prompt-lookup", "1", "--num-speculative-tokens", "2"], ["--draft-model", str(hf_folder)]):
        code, out, err = run_cli(base + flags, capsys)
        assert code == 0 and out == plain, flags
        assert "proposed tokens accepted" in err


def test_cli_chat_with_speculation_replies_as_plain(hf_folder, capsys):
    base = ["chat", "--model", str(hf_folder), "--message", "hello fox", "--max-new-tokens", "12", "--temperature", "0"]
    code, plain, _ = run_cli(base, capsys)
    code, out, err = run_cli(base + ["--draft-model", str(hf_folder), "--num-speculative-tokens", "3"], capsys)
    assert code == 0 and out == plain and "accepted" in err


@pytest.mark.parametrize("flags,message", [
    (["--prompt-lookup", "0"], "n-gram size must be at least 1"),
    (["--prompt-lookup", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be at least 1"),
    (["--prompt-lookup", "--draft-model", "x"], "choose one of --draft-model and --prompt-lookup"),
    (["--draft-model", "OTHER"], "tokenizer differs"),
])
def test_cli_bad_speculative_flags_are_one_line(hf_folder, tmp_path, capsys, flags, message):
    other = tmp_path / "other"  # the same model, but its tokenizer has one more token
    shutil.copytree(hf_folder, other)
    tokenizer = Tokenizer.from_file(str(other / "tokenizer.json"))
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save(str(other / "tokenizer.json"))
    flags = [str(other) if f == "OTHER" else f for f in flags]
    code, _, err = run_cli(["generate", "--model", str(hf_folder), "--prompt", "fox", *flags], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_embedded_model_greedy_output_is_unchanged_by_a_few_speculative_tokens():
    """Short version of the slow test below: 8 tokens on SmolLM2-135M, prompt lookup and the model itself as the
    draft (every guess accepted, so the target verifies 4 tokens at once), give plain greedy decoding's reply."""
    from decoderlm.loader import load

    target, tok = load("smollm2-135m-instruct")
    text = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    params = SamplingParams(max_new_tokens=8, **GREEDY)
    want = generate(target, ids, params)
    for proposer in (PromptLookup(2), DraftModel(target)):
        got, stats = speculative_generate(target, ids, params, proposer, 4)
        assert got == want and stats.accepted > 0


@pytest.mark.slow
def test_embedded_model_greedy_output_is_unchanged_by_speculation():
    """On SmolLM2-135M: prompt lookup and an int4 copy as the draft give plain greedy decoding's reply."""
    from decoderlm.loader import load

    target, tok = load("smollm2-135m-instruct")
    draft, draft_tok = load("smollm2-135m-instruct", quantize="int4")
    check_vocabularies(tok, draft_tok)
    text = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
    params = SamplingParams(max_new_tokens=24, **GREEDY)
    want = generate(target, ids, params)
    for proposer in (PromptLookup(3), DraftModel(draft)):
        got, stats = speculative_generate(target, ids, params, proposer, 5)
        assert got == want and stats.accepted > 0


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=1.5), dict(presence_penalty=1.2), dict(frequency_penalty=0.8, repetition_penalty=1.3)])
def test_every_penalty_gives_plain_decodings_tokens(penalties):
    """The verifier penalizes as plain decoding does (sampling.penalize): greedy, the same tokens."""
    model = tiny_model()
    prompt = [1, 2, 3, 1, 2, 3]
    params = SamplingParams(max_new_tokens=24, **GREEDY, **penalties)
    for proposer in (PromptLookup(2), DraftModel(tiny_model())):
        assert speculative_generate(model, prompt, params, proposer, 4)[0] == generate(model, prompt, params)


@given(st.integers(1, 12), st.integers(0, 14), st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_every_decode_loop_ends_where_finish_reason_says(budget, stop_at, seed):
    """generate, speculative decoding and the server's engine share one finish rule: each stops before
    the first stop token and emits at most max_new_tokens, so greedy they give the same tokens."""
    from decoderlm.serve.engine import Engine

    torch.manual_seed(seed)
    model = tiny_model()
    prompt = [1, 2, 3, 4]
    free = generate(model, prompt, SamplingParams(max_new_tokens=15, **GREEDY))
    params = SamplingParams(max_new_tokens=budget, stop_token_ids=[free[stop_at]], **GREEDY)
    expected = free[: min(budget, free.index(free[stop_at]))]
    assert generate(model, prompt, params) == expected
    assert speculative_generate(model, prompt, params, PromptLookup(), 3)[0] == expected
    engine = Engine(model, max_batch=2, num_blocks=8)
    stream = engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    outputs = list(stream)
    assert [o.token_id for o in outputs if o.token_id is not None] == expected
    assert outputs[-1].finish_reason == ("stop" if free.index(free[stop_at]) < budget else "length")


class OneAllowedToken:
    """A logits processor that allows one token, a function of the ids so far (as a grammar would
    allow a set); it records the ids it was shown."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.shown = vocab, []

    def allowed(self, ids) -> int:
        return (sum(ids) * 7 + len(ids)) % self.vocab

    def __call__(self, ids, scores: torch.Tensor) -> torch.Tensor:
        self.shown.append(list(ids))
        out = torch.full_like(scores, float("-inf"))
        out[self.allowed(ids)] = scores[self.allowed(ids)]
        return out


@given(st.integers(1, 12), st.integers(0, 2**16), st.sampled_from([0.0, 1.0]))
@settings(max_examples=10, deadline=None)
def test_a_logits_processor_steers_every_decode_loop_alike(budget, seed, temperature):
    """The processor seam: generate, speculative decoding (draft and prompt lookup) and the server's
    engine each emit only what the request's processor allows, shown the ids so far each time."""
    from decoderlm.serve.engine import Engine

    model, prompt = tiny_model(), [1, 2, 3, 4]
    want = list(prompt)
    processor = OneAllowedToken(model.config.vocab_size)
    for _ in range(budget):
        want.append(processor.allowed(want))
    want = want[len(prompt) :]

    def params() -> SamplingParams:
        processor.shown = []
        return SamplingParams(max_new_tokens=budget, temperature=temperature, seed=seed, logits_processors=[processor])

    assert generate(model, prompt, params()) == want
    assert processor.shown == [prompt + want[:i] for i in range(budget)]
    for proposer in (PromptLookup(), DraftModel(tiny_model(9, n_layers=1))):
        assert speculative_generate(model, prompt, params(), proposer, 3)[0] == want
    engine = Engine(model, max_batch=2, num_blocks=8)
    stream = engine.add_request(prompt, params())
    other = engine.add_request([5, 6], SamplingParams(max_new_tokens=budget, temperature=temperature, seed=seed))  # no processor
    while engine.has_work():
        engine.step()
    assert [o.token_id for o in stream if o.token_id is not None] == want
    assert processor.shown == [prompt + want[:i] for i in range(budget)]  # only its own row
    assert [o.token_id for o in other if o.token_id is not None] == generate(model, [5, 6], SamplingParams(max_new_tokens=budget, temperature=temperature, seed=seed))


@pytest.mark.parametrize("activations", ["auto", "fp32", "int8"])
def test_speculative_decoding_on_the_embedded_model(activations):
    """The default mode (the file's blocks, 16-bit activations in decode steps) and fp32 arithmetic: the
    greedy tokens are plain decoding's. `--activations int8` rounds to 8 bits: a rounding boundary crossed
    by a last-bit difference between a one-token and a several-token forward moves a logit by ~1e-3, so
    its tokens may part from plain decoding's at a near-tie; the prompt is read as plain decoding reads
    it, so the first token is the same."""
    from decoderlm import load
    from decoderlm.names import DEFAULT_MODEL, locate

    model, tok = load(locate(DEFAULT_MODEL), quantize="auto", activations=activations)
    assert model.lm_head.activations == {"auto": "int16"}.get(activations, activations)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat after me: one two three, one two three, one two three."}]),
                        add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, **GREEDY)
    want = generate(model, prompt, params)
    got, stats = speculative_generate(model, prompt, params, PromptLookup(2), 4)
    assert stats.accepted > 0 and (got == want if activations != "int8" else got[0] == want[0])
