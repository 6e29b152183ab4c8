"""`decoderlm generate` and `decoderlm chat` end to end, against transformers on the same tiny
checkpoint: the printed text is transformers' greedy continuation, decoded as transformers decodes the
whole sequence; both commands take the same sampling defaults."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import LLAMA, make_hf_model
from spm_tokenizer import write_spm_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import decoderlm.cli as cli
from decoderlm import speculative
from decoderlm.cli.common import DEFAULT_SAMPLING
from decoderlm.sampling import SamplingParams


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory):
    """A tiny Llama with a SentencePiece tokenizer whose greedy choice is always a "▁word" piece: the
    pieces that do not start a word get logit 0, below the best of the others."""
    folder = tmp_path_factory.mktemp("spm-llama")
    vocab = write_spm_tokenizer(folder)
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **(LLAMA | dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    pieces = AutoTokenizer.from_pretrained(folder).convert_ids_to_tokens(list(range(vocab)))
    with torch.no_grad():
        model.lm_head.weight[[i for i, p in enumerate(pieces) if not p.startswith("▁")]] = 0.0
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return folder, model


def transformers_continuation(folder, model, prompt_ids: list[int], n: int) -> str:
    """transformers' greedy ids, as its tokenizer decodes them after the prompt."""
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)[0].tolist()
    assert tok.convert_ids_to_tokens(out[len(prompt_ids)])[0] == "▁"  # a new word first: the case that used to lose its space
    before = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(out, skip_special_tokens=True)
    assert full.startswith(before)
    return full[len(before) :]


def test_generate_prints_the_prompt_then_transformers_continuation(spm_folder, capsys):
    folder, model = spm_folder
    prompt = "Hello"
    ids = AutoTokenizer.from_pretrained(folder)(prompt)["input_ids"]
    expected = transformers_continuation(folder, model, ids, 12)
    assert cli.main(["generate", "--model", str(folder), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == prompt + expected + "\n"


def test_chat_prints_transformers_reply(spm_folder, capsys):
    folder, model = spm_folder
    message = "the world"
    tok = AutoTokenizer.from_pretrained(folder)
    rendered = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    expected = transformers_continuation(folder, model, tok(rendered, add_special_tokens=False)["input_ids"], 10)
    assert cli.main(["chat", "--model", str(folder), "--message", message, "--temperature", "0", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def sampling_of(argv: list[str], monkeypatch) -> SamplingParams:
    """The SamplingParams a command hands to generation."""
    seen = []

    def fake_stream(model, prompt, params, *plugins):
        seen.append(params)
        return iter(())

    monkeypatch.setattr(speculative, "stream", fake_stream)  # both commands decode through speculative.Decoding
    assert cli.main(argv) == 0
    return seen[0]


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


@pytest.mark.parametrize("generation_config", [None, {"do_sample": True, "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}])
def test_chat_and_generate_take_the_same_sampling_defaults(tmp_path, monkeypatch, capsys, generation_config):
    make_hf_model("llama", tmp_path)
    (tmp_path / "generation_config.json").unlink()
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    gen = sampling_of(["generate", "--model", str(tmp_path), "--prompt", "The"], monkeypatch)
    talk = sampling_of(["chat", "--model", str(tmp_path), "--message", "The"], monkeypatch)
    assert {f: getattr(gen, f) for f in SAMPLING_FIELDS} == {f: getattr(talk, f) for f in SAMPLING_FIELDS}
    if generation_config is None:  # the one documented default ...
        assert (gen.temperature, gen.top_p) == (DEFAULT_SAMPLING["temperature"], DEFAULT_SAMPLING["top_p"]) == (0.2, 0.9)
        assert (gen.top_k, gen.min_p, gen.repetition_penalty) == (0, 0.0, 1.0)
    else:  # ... else the checkpoint's (transformers' top_p default, 1.0, where the file names none)
        assert (gen.temperature, gen.top_k, gen.top_p, gen.repetition_penalty) == (0.6, 20, 1.0, 1.1)
    for command in ("generate", "chat"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert "else temperature 0.2, top_p 0.9" in " ".join(capsys.readouterr().out.split())


@pytest.fixture(scope="module")
def ids_only_folder(tmp_path_factory):
    """A tiny random Gemma-3 saved without tokenizer files (window 6, shorter than prompt + reply)."""
    folder = tmp_path_factory.mktemp("no-tokenizer")
    model = make_hf_model("gemma3", folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return folder, model


def test_generate_prompt_ids_prints_transformers_greedy_ids(ids_only_folder, capsys):
    folder, model = ids_only_folder
    prompt = [5, 17, 42, 7, 99, 3, 250]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    argv = ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0", "--max-new-tokens", "10"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == ",".join(map(str, expected)) + "\n"


def test_generate_prompt_ids_stops_at_generation_config_eos(ids_only_folder, tmp_path, capsys):
    folder, model = ids_only_folder
    prompt = [5, 17, 42, 7, 99, 3, 250]
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    stop = next(t for t in greedy if t != greedy[0])  # the reply ends before it (the stop id is not printed)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    assert cli.main(["generate", "--model", str(copy), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == ",".join(map(str, greedy[:greedy.index(stop)])) + "\n"


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "Hi", "--prompt-ids", "1,2"], "give one of --prompt (text) and --prompt-ids"),
    ([], "give one of --prompt (text) and --prompt-ids"),
    (["--prompt-ids", "1,x"], "--prompt-ids takes comma-separated token ids such as 1,2,3, got '1,x'"),
    (["--prompt-ids", "1,-2"], "--prompt-ids: token ids are non-negative, got -2"),
    (["--prompt-ids", "1,320,2"], "--prompt-ids: 320 is outside the model's vocabulary (ids 0 to 319)"),
    (["--prompt", "Hi"], "has no tokenizer.json (decoderlm reads the fast-tokenizer file)"),
])
def test_generate_prompt_ids_refusals_are_one_line(ids_only_folder, capsys, argv, message):
    folder, _ = ids_only_folder
    assert cli.main(["generate", "--model", str(folder), *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
