"""Generation: the cached loop equals recomputation; stop conditions; streaming text never splits a character."""

import pytest
import torch
from conftest import tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate, stream
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import StreamDecoder

GREEDY = dict(temperature=0.0)


def greedy_by_recomputation(model, prompt: list[int], n: int) -> list[int]:
    """The reference: re-run the whole context for every new token, no cache. A full context
    restarts from its last half."""
    ids, start, max_len = list(prompt), 0, model.config.max_seq_len
    with torch.no_grad():
        for _ in range(n):
            if len(ids) - start > max_len:
                start = len(ids) - max_len // 2
            ids.append(int(model(torch.tensor([ids[start:]])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("cfg", [dict(position="rope", n_kv_heads=2), dict(position="learned"), dict(sliding_window=4, n_kv_heads=1)])
@pytest.mark.parametrize("max_seq_len", [64, 9])  # 9: the context fills up (three times) and slides
def test_greedy_generation_equals_recomputation(cfg, max_seq_len):
    model = tiny_model(3, max_seq_len=max_seq_len, **cfg)
    prompt = [5, 1, 7]
    assert generate(model, prompt, SamplingParams(max_new_tokens=20, **GREEDY)) == greedy_by_recomputation(model, prompt, 20)


def test_max_new_tokens_is_respected_and_the_last_token_costs_no_forward():
    model = tiny_model()
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    for n in (0, 1, 9):
        calls.clear()
        assert len(generate(model, [1, 2], SamplingParams(max_new_tokens=n, seed=0))) == n
        assert len(calls) == n  # one prefill, then one decode per token but the last


def test_generation_goes_on_past_the_context():
    model = tiny_model(max_seq_len=16, position="learned")
    assert len(generate(model, [1] * 10, SamplingParams(max_new_tokens=50, seed=0))) == 50


def test_stop_token_ends_generation_and_is_not_yielded():
    model = tiny_model()
    prompt = [4, 2]
    free = generate(model, prompt, SamplingParams(max_new_tokens=30, seed=5))  # a seed replays the same draws
    stop_at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # a token first drawn at index >= 3
    stopped = generate(model, prompt, SamplingParams(max_new_tokens=30, seed=5, stop_token_ids=[free[stop_at]]))
    assert stopped == free[:stop_at]


def test_stream_equals_generate():
    model = tiny_model()
    params = dict(max_new_tokens=25, temperature=0.9, top_k=10, top_p=0.9, repetition_penalty=1.3, seed=11)
    assert list(stream(model, [3, 1, 4], SamplingParams(**params))) == generate(model, [3, 1, 4], SamplingParams(**params))


def test_bad_prompt_raises_at_the_call():
    model = tiny_model(max_seq_len=8)
    with pytest.raises(DecoderLMError):
        stream(model, [], SamplingParams())  # no next() needed
    with pytest.raises(DecoderLMError):
        stream(model, [1] * 8, SamplingParams())


def byte_level_bpe(text: str) -> Tokenizer:
    """A byte-level BPE trained on `text`: its tokens are bytes and merges, so many split UTF-8 characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


class Wrapped:
    """The tokenizer interface decoderlm uses (decode a list of ids to text)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


TEXT = "Hello 世界! 你好，朋友。🙂🚀 naïve café — 東京で寿司を食べる 👩‍👩‍👧 emoji 🎉 end."


def test_byte_level_bpe_splits_characters():
    tok = byte_level_bpe(TEXT * 3)
    pieces = [tok.decode([i]) for i in tok.encode("世界🙂🚀").ids]
    assert any("\ufffd" in p for p in pieces)  # otherwise the streaming test below proves nothing


@pytest.mark.parametrize("text", [TEXT, "🙂🙂🙂", "a世b界c", "你好" * 5 + "🎉"])
def test_stream_decoder_never_emits_half_a_character(text):
    tok = Wrapped(byte_level_bpe(TEXT * 3))
    ids = tok.tok.encode(text).ids
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_stream_decoder_on_random_ids_matches_full_decode():
    """Random byte tokens: complete characters stream out; only a dangling partial one is dropped."""
    tok = Wrapped(byte_level_bpe(TEXT * 3))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, 300, (30,), generator=gen).tolist()
        decoder = StreamDecoder(tok)
        streamed = "".join(decoder.push(i) for i in ids) + decoder.flush()
        full = tok.decode(ids)
        assert streamed.replace("\ufffd", "") == full.replace("\ufffd", "")
