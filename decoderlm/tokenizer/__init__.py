"""Text ↔ token ids. `CharTokenizer` for models trained here; BPE tokenizers of pretrained models
are wrapped in `decoderlm.tokenizer.bpe`. Both are a `Tokenizer` (encode, decode, vocab_size,
eos_token_ids, the chat template)."""

from __future__ import annotations

from decoderlm.tokenizer.char import CharTokenizer
from decoderlm.tokenizer.protocol import Tokenizer
from decoderlm.tokenizer.streaming import StopMatcher, StreamDecoder

__all__ = ["CharTokenizer", "StopMatcher", "StreamDecoder", "Tokenizer"]
