"""Chat tokenizers and tiny chat models for the fine-tuning tests (nothing is downloaded)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

from decoderlm.tokenizer.bpe import HFTokenizer
from hf_models import make_hf_model, tokenizer_json

SPECIALS = ["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"]

# ChatML, as Qwen and SmolLM2 lay out a conversation; the reply and its <|im_end|> are the model's.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Gemma's layout: the assistant is "model", a system prompt is folded into the first user turn.
GEMMA = ("{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}{% set messages = messages[1:] %}"
         "{% else %}{% set first = '' %}{% endif %}"
         "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' }}"
         "{% if role == 'model' %}{% generation %}{{ m['content'] | trim }}<end_of_turn>{% endgeneration %}"
         "{% else %}{{ (first if loop.first else '') + m['content'] | trim }}<end_of_turn>{% endif %}{{ '\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "gemma": (GEMMA, "<end_of_turn>")}


@lru_cache(maxsize=1)
def chat_tokenizer_json() -> str:
    tok = Tokenizer.from_str(tokenizer_json())
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def chat_tokenizer(template: str = "chatml") -> HFTokenizer:
    source, end_of_turn = TEMPLATES[template]
    tok = Tokenizer.from_str(chat_tokenizer_json())
    return HFTokenizer(tok, special_tokens={"eos_token": end_of_turn}, chat_template=source)


def write_chat_tokenizer(folder: Path, template: str = "chatml") -> None:
    source, end_of_turn = TEMPLATES[template]
    (folder / "tokenizer.json").write_text(chat_tokenizer_json())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": end_of_turn, "pad_token": end_of_turn, "chat_template": source}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def make_chat_model(folder: Path, case: str = "llama", seed: int = 0):
    """A tiny random HF model with a ChatML tokenizer in `folder`; returns the transformers model."""
    model = make_hf_model(case, folder, seed)
    write_chat_tokenizer(folder)
    return model


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path
