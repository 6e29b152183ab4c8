"""HFTokenizer on HF folders, against transformers' AutoTokenizer on the same folder. The folder is
SmolLM2's tokenizer as transformers saves it (built from the embedded GGUF: no download)."""

from __future__ import annotations

import json

import pytest
import transformers

from decoderlm.errors import DecoderLMError
from decoderlm.names import DEFAULT_MODEL, locate
from decoderlm.tokenizer.bpe import HFTokenizer, generation_defaults

TEXTS = ["Hello world", "年假怎么申请？", "emoji 😀👍🏽", "def f(x):\n    return x  # 42\n", "a   b\t\tc\n\n\nd", "x1y22 333", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "年假？"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = locate(DEFAULT_MODEL)
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "do_sample": True, "temperature": 0.2, "top_p": 0.9}))
    return out


def same_as_transformers(tok: HFTokenizer, folder) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tok.encode(text) == ref(text)["input_ids"], text
        assert tok.decode(ref(text)["input_ids"]) == ref.decode(ref(text)["input_ids"], skip_special_tokens=True)
    for gen in (True, False):
        assert tok.apply_chat_template(MESSAGES, add_generation_prompt=gen) == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)


def test_hf_folder_matches_transformers(folder):
    tok = HFTokenizer.from_hf_folder(folder)
    same_as_transformers(tok, folder)
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1
    assert tok.eos_token_ids == [2, 0]  # EOS, then generation_config's other stop ids


def test_bos_from_tokenizer_json_post_processor(folder, tmp_path):
    """Llama-3-style checkpoints add BOS in tokenizer.json's post-processor; transformers follows it, so do we."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).exists():
            (tmp_path / name).write_text((folder / name).read_text())
    tok = HFTokenizer.from_hf_folder(tmp_path)
    assert tok.encode("hi")[0] == tok.bos_token_id == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    same_as_transformers(tok, tmp_path)
    tok.save(tmp_path / "saved")
    same_as_transformers(HFTokenizer.from_hf_folder(tmp_path / "saved"), tmp_path / "saved")


def test_save_round_trip_loads_in_transformers(folder, tmp_path):
    HFTokenizer.from_hf_folder(folder).save(tmp_path)
    again = HFTokenizer.from_hf_folder(tmp_path)
    same_as_transformers(again, tmp_path)
    assert again.chat_template == HFTokenizer.from_hf_folder(folder).chat_template


def test_missing_tokenizer_json_names_the_fix(tmp_path):
    with pytest.raises(DecoderLMError, match="no tokenizer.json.*save_pretrained"):
        HFTokenizer.from_hf_folder(tmp_path)


def test_no_chat_template_is_an_error(folder, tmp_path):
    tok = HFTokenizer.from_hf_folder(folder)
    tok.chat_template = None
    with pytest.raises(DecoderLMError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_generation_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    assert generation_defaults(tmp_path)["temperature"] == 0.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_defaults(tmp_path)["temperature"] == 0.0  # transformers' default is greedy too
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}))
    assert generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
    assert transformers.GenerationConfig._get_default_generation_params()["top_k"] == 50  # the default we copy
