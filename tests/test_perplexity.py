"""Sliding-window perplexity: the same number transformers' perplexity recipe gives, every token scored
once with the history the stride promises, and the command's output and errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import run_cli, tiny_model
from hf_models import VOCAB, make_hf_model
from hypothesis import given
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.loader import load
from decoderlm.perplexity import perplexity, windows
from decoderlm.tokenizer import CharTokenizer


@pytest.fixture(scope="module", params=["llama", "gpt2", "mistral-window"])
def pair(request, tmp_path_factory):
    """(transformers model, our model, its folder) for a tiny random HF checkpoint."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, folder)
    ours, _ = load(folder)
    return hf, ours, folder


def transformers_perplexity(hf, ids: torch.Tensor, context: int, stride: int) -> tuple[float, int]:
    """The recipe of transformers' perplexity guide, written against its model(input_ids, labels=...):
    windows every `stride` tokens, labels -100 on what the previous window already scored."""
    nll_sum, n_scored, prev_end, seq_len = 0.0, 0, 0, ids.shape[1]
    with torch.no_grad():
        for begin in range(0, seq_len, stride):
            end = min(begin + context, seq_len)
            trg_len = end - prev_end
            input_ids = ids[:, begin:end]
            labels = input_ids.clone()
            labels[:, :-trg_len] = -100
            n_valid = int((labels[:, 1:] != -100).sum())  # the model shifts labels left by one
            if n_valid:
                nll_sum += float(hf(input_ids, labels=labels).loss) * n_valid
                n_scored += n_valid
            prev_end = end
            if end == seq_len:
                break
    return math.exp(nll_sum / n_scored), n_scored


@pytest.mark.parametrize("context,stride,batch_size", [(32, 12, 1), (32, 12, 3), (32, 32, 2), (16, 1, 4), (90, 5, 1)])
def test_perplexity_matches_transformers(pair, context, stride, batch_size):
    hf, ours, _ = pair
    ids = torch.randint(0, VOCAB, (1, 77), generator=torch.Generator().manual_seed(context + stride))
    want, n_scored = transformers_perplexity(hf, ids, context, stride)
    got = perplexity(ours, ids[0].tolist(), context, stride, batch_size)
    assert got.tokens_scored == n_scored
    assert abs(got.perplexity - want) / want < 1e-4


@given(n=st.integers(2, 60), context=st.integers(2, 20), data=st.data())
def test_every_token_but_the_first_is_scored_once_with_the_promised_history(n, context, data):
    stride = data.draw(st.integers(1, context - 1))
    plan = windows(n, context, stride)
    scored = [t for w in plan for t in range(w.score_from, w.end)]
    assert scored == list(range(1, n))
    for w in plan:
        assert w.end - w.begin <= context
        assert w.score_from - w.begin >= min(w.score_from, context - stride)  # history inside the window


@given(n=st.integers(2, 30), stride=st.integers(1, 40), batch_size=st.integers(1, 4))
def test_a_window_covering_the_text_gives_the_full_forward_loss(n, stride, batch_size):
    model = tiny_model(1)
    ids = torch.randint(0, 37, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    with torch.no_grad():
        loss = float(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    context = 32
    got = perplexity(model, ids, context, min(stride, context), batch_size)
    assert got.windows == 1 and got.tokens_scored == n - 1
    assert got.nll_per_token == pytest.approx(loss, rel=1e-5)


def test_bits_per_char_for_a_char_model_is_nll_in_bits():
    text = "to be or not to be, that is the question: whether 'tis nobler in the mind"
    tok = CharTokenizer.from_text(text)
    model = tiny_model(2, vocab_size=tok.vocab_size)
    got = perplexity(model, tok.encode(text), context=20, stride=7, tokenizer=tok)
    assert got.chars == len(text) - 1 == got.tokens_scored  # one char per token; the first is context only
    assert got.bits_per_char == pytest.approx(got.nll_per_token / math.log(2))
    assert got.bits_per_byte == got.bits_per_char  # ASCII


def test_cli_prints_the_result_and_json(pair, tmp_path, capsys):
    hf, ours, folder = pair
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. To be, or not to be, that is the question. " * 3)
    code, out, err = run_cli(["perplexity", "--model", str(folder), "--data", str(data), "--context", "24", "--stride", "8", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    _, tok = load(folder)
    want, n_scored = transformers_perplexity(hf, torch.tensor([tok.encode(data.read_text())]), 24, 8)
    assert result["tokens_scored"] == n_scored and abs(result["perplexity"] - want) / want < 1e-4
    assert result["bits_per_byte"] > 0 and result["chars"] > 0
    code, out, err = run_cli(["perplexity", "--model", str(folder), "--data", str(data), "--context", "24", "--max-tokens", "10"], capsys)
    assert code == 0 and "perplexity" in out and "over 9 tokens" in out and "context 24, stride 12" in out


@pytest.mark.parametrize("args,message", [
    (["--context", "1000"], "longer than the model's context"),
    (["--context", "16", "--stride", "17"], "--stride 17 is longer than --context 16"),
    (["--stride", "0"], "--stride must be at least 1"),
    (["--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_cli_bad_settings_are_one_line(pair, tmp_path, capsys, args, message):
    _, _, folder = pair
    data = tmp_path / "text.txt"
    data.write_text("some text to score " * 10)
    code, out, err = run_cli(["perplexity", "--model", str(folder), "--data", str(data), *args], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_cli_bad_data_is_one_line(pair, tmp_path, capsys):
    _, _, folder = pair
    empty, binary = tmp_path / "empty.txt", tmp_path / "bin.txt"
    empty.write_text("  \n")
    binary.write_bytes(b"\xff\xfe\x00abc")
    for path, message in ((empty, "is empty"), (binary, "is not UTF-8"), (tmp_path / "missing.txt", "is not a file")):
        code, _, err = run_cli(["perplexity", "--model", str(folder), "--data", str(path)], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_too_short_data_raises():
    with pytest.raises(DecoderLMError, match="at least 2"):
        perplexity(tiny_model(), [3], context=8, stride=4)
