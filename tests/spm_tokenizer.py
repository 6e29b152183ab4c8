"""A Llama-2 / Mistral style SentencePiece tokenizer, built locally: a BPE trained on a few sentences,
plus the 256 byte-fallback pieces, written by transformers' LlamaTokenizerFast (nothing is downloaded).
Words carry the "▁" marker, the decoder strips the first one, characters outside the vocabulary
(emoji) become <0xNN> byte pieces."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

SENTENCES = ["Hello world, the quick brown fox jumps over the lazy dog.", "the thing is the world and the world is a thing",
             "世界 你好 café naïve façade", "One two three, 1 2 3; 12 + 30 = 42"] * 5


@lru_cache(maxsize=1)
def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=160, show_progress=False))
    trained = bpe.get_vocab()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained, key=trained.get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    return vocab, merges


def write_spm_tokenizer(folder: Path) -> int:
    """tokenizer.json + tokenizer_config.json (with a chat template) in folder; returns the vocabulary size."""
    from transformers import LlamaTokenizerFast

    vocab, merges = _vocab_and_merges()
    tok = LlamaTokenizerFast(vocab=dict(vocab), merges=list(merges))
    tok.chat_template = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok.save_pretrained(folder)
    return len(vocab)
