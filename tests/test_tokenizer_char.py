"""The character tokenizer: exact round trip, clear errors."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer import CharTokenizer


@given(st.text(min_size=1))
def test_round_trip(text):
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@given(st.text(min_size=1))
def test_vocab_is_sorted_distinct_chars_and_survives_serialization(text):
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text))
    again = CharTokenizer.from_dict(tok.to_dict())
    assert again.encode(text) == tok.encode(text)


def test_unseen_character_is_a_clear_error():
    tok = CharTokenizer.from_text("hello world")
    with pytest.raises(DecoderLMError, match="'Z'.*never appeared"):
        tok.encode("hello Z")


def test_empty_corpus_is_an_error():
    with pytest.raises(DecoderLMError, match="empty"):
        CharTokenizer.from_text("")


def test_a_char_tokenizer_is_a_tokenizer_without_specials_or_chat():
    """What callers ask of any `Tokenizer`, answered without special tokens: nothing to add, no chat template."""
    tok = CharTokenizer.from_text("hello world")
    assert tok.encode("hello", add_special_tokens=False) == tok.encode("hello")
    assert tok.get_vocab() == {c: i for i, c in enumerate(tok.chars)} and tok.bos_token_id is None and tok.eos_token_ids == []
    assert tok.chat_template is None
    with pytest.raises(DecoderLMError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])
