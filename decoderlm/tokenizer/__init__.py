"""Text ↔ token ids. `CharTokenizer` for models trained here; BPE tokenizers of pretrained models
are wrapped in `decoderlm.tokenizer.bpe`. Both offer encode, decode, vocab_size and eos_token_ids."""

from __future__ import annotations

from decoderlm.tokenizer.char import CharTokenizer
from decoderlm.tokenizer.streaming import StreamDecoder

__all__ = ["CharTokenizer", "StreamDecoder"]
