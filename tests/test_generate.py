"""Generation against references that share no code with it: a cache-free loop over a sliding window
of the context; stop conditions; streamed text equals the full decode (byte-level BPE and SentencePiece)."""

import pytest
import torch
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from spm_tokenizer import write_spm_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate, stream
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import StreamDecoder
from decoderlm.tokenizer.bpe import HFTokenizer

GREEDY = dict(temperature=0.0)


def greedy_over_last_window(model, prompt: list[int], n: int) -> list[int]:
    """The reference: for every new token, run the last max_seq_len tokens afresh (no cache) and take the argmax."""
    ids, max_len = list(prompt), model.config.max_seq_len
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids[-max_len:]])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("cfg", [dict(position="rope", n_kv_heads=2), dict(position="learned"), dict(sliding_window=4, n_kv_heads=1),
                                 dict(position="learned", sliding_window=3)])
@pytest.mark.parametrize("max_seq_len", [64, 9])  # 9: the context fills up after 6 new tokens and slides for the other 24
def test_greedy_generation_equals_the_sliding_window_reference(cfg, max_seq_len):
    model = tiny_model(3, max_seq_len=max_seq_len, **cfg)
    prompt = [5, 1, 7]
    assert generate(model, prompt, SamplingParams(max_new_tokens=30, **GREEDY)) == greedy_over_last_window(model, prompt, 30)


def test_max_new_tokens_is_respected_and_the_last_token_costs_no_forward():
    model = tiny_model()
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    for n in (0, 1, 9):
        calls.clear()
        assert len(generate(model, [1, 2], SamplingParams(max_new_tokens=n, seed=0))) == n
        assert len(calls) == n  # one prefill, then one decode per token but the last


def test_past_the_context_every_step_sees_exactly_the_last_window():
    model = tiny_model(max_seq_len=16, position="learned")
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    out = generate(model, [1] * 10, SamplingParams(max_new_tokens=50, seed=0))
    assert len(out) == 50
    # prefill 10, decode until 16 tokens are cached, then a full window per new token
    assert seen == [10] + [1] * 6 + [16] * 43


def test_stop_token_ends_generation_and_is_not_yielded():
    model = tiny_model()
    prompt = [4, 2]
    free = generate(model, prompt, SamplingParams(max_new_tokens=30, seed=5))  # a seed replays the same draws
    stop_at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # a token first drawn at index >= 3
    stopped = generate(model, prompt, SamplingParams(max_new_tokens=30, seed=5, stop_token_ids=[free[stop_at]]))
    assert stopped == free[:stop_at]


def test_bad_prompt_raises_at_the_call():
    model = tiny_model(max_seq_len=8)
    with pytest.raises(DecoderLMError):
        stream(model, [], SamplingParams())  # no next() needed
    with pytest.raises(DecoderLMError, match="context is 8"):
        stream(model, [1] * 8, SamplingParams())
    for bad in (37, -1):  # the tiny model's vocabulary is 37 ids: an id from another tokenizer
        with pytest.raises(DecoderLMError, match=r"token ids must be in \[0, 37\)"):
            stream(model, [1, bad], SamplingParams())


# --- streaming text --------------------------------------------------------------------------

TEXT = "Hello 世界! 你好，朋友。🙂🚀 naïve café — 東京で寿司を食べる 👩‍👩‍👧 emoji 🎉 end."


def byte_level_bpe() -> HFTokenizer:
    """A byte-level BPE (GPT-2 style) trained on TEXT: its tokens are bytes and merges, so many split UTF-8 characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT * 3], trainer)
    return HFTokenizer(tok)


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte-level":
        return byte_level_bpe()
    folder = tmp_path_factory.mktemp("spm")
    write_spm_tokenizer(folder)
    return HFTokenizer.from_hf_folder(folder)


def stable(text: str) -> str:
    """Text without a trailing U+FFFD: an incomplete character that later ids may complete."""
    return text.rstrip("\ufffd")


def streamed(tok, prompt: list[int], new: list[int]) -> str:
    decoder = StreamDecoder(tok, prompt)
    pieces = [decoder.push(i) for i in new] + [decoder.flush()]
    assert not any(p.endswith("\ufffd") for p in pieces[-1:])  # the flush never ends on half a character
    return "".join(pieces)


def test_the_tokenizers_exercise_what_streaming_must_handle(tokenizer):
    """Guards the properties below: characters split over ids, and (SentencePiece) a first word that
    decodes differently alone than after the prompt."""
    ids = tokenizer.encode("Hello world 🙂", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    if tokenizer.tokenizer.decoder.__class__.__name__ == "Sequence":  # SentencePiece
        assert tokenizer.decode(ids[1:2]) == "world" and tokenizer.decode(ids[:2]) == "Hello world"


def random_ids(tokenizer) -> st.SearchStrategy[list[int]]:
    """Any ids for byte-level BPE. For SentencePiece, any ids but byte pieces, which come as whole
    characters (a run of byte pieces with one invalid byte decodes to U+FFFD as a whole; see streaming.py)."""
    vocab = tokenizer.tokenizer.get_vocab()
    byte_piece = {b: vocab[f"<0x{b:02X}>"] for b in range(256) if f"<0x{b:02X}>" in vocab}
    if not byte_piece:
        return st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40)
    other = st.sampled_from(sorted(set(vocab.values()) - set(byte_piece.values()))).map(lambda i: [i])
    character = st.characters(codec="utf-8").map(lambda c: [byte_piece[b] for b in c.encode()])
    return st.lists(st.one_of(other, character), max_size=20).map(lambda units: [i for unit in units for i in unit])


@given(data=st.data())
@settings(max_examples=150)
def test_prompt_text_plus_streamed_text_is_the_full_text_for_random_ids(tokenizer, data):
    """decode(prompt) + streamed == decode(prompt + new) for random ids cut anywhere (inside a
    character, between special ids), up to a trailing incomplete character."""
    ids = data.draw(random_ids(tokenizer))
    cut = data.draw(st.integers(0, len(ids)))
    prompt, new = ids[:cut], ids[cut:]
    assert stable(tokenizer.decode(prompt)) + streamed(tokenizer, prompt, new) == stable(tokenizer.decode(ids))


@given(st.text(alphabet=st.sampled_from(list("the world 世界 café🙂🚀👩‍👧 \n")), max_size=40), st.integers(0, 40))
@settings(max_examples=150)
def test_a_continuation_streams_exactly_the_text_after_the_prompt(tokenizer, text, cut):
    """Real text split into prompt and continuation anywhere, even inside a character: the stream is
    the full decode minus the prompt's decode (the first word keeps its space)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt, new = ids[: min(cut, len(ids))], ids[min(cut, len(ids)) :]
    full, before = tokenizer.decode(ids), stable(tokenizer.decode(prompt))
    assert full.startswith(before)
    assert streamed(tokenizer, prompt, new) == full[len(before) :]


def test_stream_without_a_prompt_is_the_plain_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
