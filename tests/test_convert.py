"""`decoderlm convert`: what it writes, transformers loads, and it computes the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import corpus_text
from hf_models import CASES, make_hf_model, prompt_ids
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import config_to_hf, parse_size
from decoderlm.generate import generate
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import CharTokenizer
from decoderlm.train import checkpoint

TOL = 1e-4


def _hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_round_trip(case, tmp_path, cli, capsys):
    """HF → decoderlm → convert → transformers: the same function, for every family's table."""
    make_hf_model(case, tmp_path / "src")
    assert cli(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    assert "wrote" in capsys.readouterr().out
    ours, _ = load(tmp_path / "src")
    ids = prompt_ids()
    with torch.no_grad():
        want = ours(ids).logits
    assert (_hf_logits(tmp_path / "dst", ids) - want).abs().max().item() < TOL
    written = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert written["model_type"] == CASES[case][0]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in (tmp_path / "dst").iterdir()}


def test_sharded_bfloat16_convert(tmp_path, cli):
    make_hf_model("mixtral", tmp_path / "src")
    assert cli(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--max-shard-size", "30KB", "--dtype", "bfloat16"]) == 0
    index = json.loads((tmp_path / "dst" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / "dst" / s).is_file() for s in shards)
    with safe_open(str(tmp_path / "dst" / shards[0]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    rounded, _ = load(tmp_path / "src", "bfloat16")
    exported, _ = load(tmp_path / "dst", "bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(rounded.state_dict().values(), exported.state_dict().values()))
    ours, _ = load(tmp_path / "dst")  # the bf16 values, computed in fp32 by both
    ids = prompt_ids()
    with torch.no_grad():
        want = ours(ids).logits
    assert (_hf_logits(tmp_path / "dst", ids) - want).abs().max().item() < TOL


def _char_run(folder, seed: int = 0) -> tuple[Transformer, CharTokenizer]:
    """A seed-char run folder holding a random model, as `decoderlm train` would write it."""
    tok = CharTokenizer.from_text(corpus_text(5000))
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_preset("seed-char", vocab_size=tok.vocab_size)).eval()
    folder.mkdir()
    checkpoint.save(folder, {"model": model.state_dict(), "config": model.config.to_dict(), "tokenizer": tok.to_dict(), "step": 0})
    return model, tok


def test_char_run_converts_for_transformers(tmp_path, cli):
    model, tok = _char_run(tmp_path / "run")
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"  # seed-char uses exact GELU
    text = corpus_text(300)
    ids = torch.tensor([tok.encode(text)[:64]])
    with torch.no_grad():
        want = model(ids).logits
    assert (_hf_logits(tmp_path / "hf", ids) - want).abs().max().item() < TOL
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok(text)["input_ids"] == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    again, again_tok = load(tmp_path / "hf")  # and decoderlm reads its own export
    assert again_tok.encode(text) == tok.encode(text)
    with torch.no_grad():
        assert (again(ids).logits - want).abs().max().item() < TOL


def test_refuses_non_empty_destination_without_force(tmp_path, cli, capsys):
    _char_run(tmp_path / "run")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "notes.txt").write_text("mine")
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and "--force" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["notes.txt"]
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "dst"), "--force"]) == 0
    assert (tmp_path / "dst" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "dst" / "model.safetensors").is_file()


def test_bad_shard_size_is_refused_before_loading(tmp_path, cli, capsys):
    assert cli(["convert", str(tmp_path / "nowhere"), str(tmp_path / "dst"), "--max-shard-size", "lots"]) == 2
    assert "500MB" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("1GiB") == 2**30
    assert parse_size("30kb") == 30_000 and parse_size(1234) == 1234


def test_config_without_hf_equivalent_is_refused():
    config = ModelConfig.from_preset("llama-tiny", qk_norm=True)  # Llama has no q/k norm
    with pytest.raises(DecoderLMError, match="qk_norm=True has no llama equivalent"):
        config_to_hf(config)
    with pytest.raises(DecoderLMError, match="supported families"):
        config_to_hf(ModelConfig.from_preset("llama-tiny", family="custom"))


def test_the_embedded_gguf_converted_gives_transformers_our_logits_and_greedy_tokens(tmp_path, cli):
    """Short version of the slow test below: the packaged GGUF dequantized into an fp32 HF folder; transformers'
    logits on a few tokens are ours from the GGUF itself, and so are its first greedy tokens."""
    assert cli(["convert", "smollm2-135m-instruct", str(tmp_path / "hf")]) == 0
    ours, tok = load("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = tok.encode("The capital of France is")
    with torch.no_grad():
        assert (hf(torch.tensor([ids])).logits - ours(torch.tensor([ids])).logits).abs().max().item() < TOL
        want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=4)[0, len(ids):].tolist()
    assert generate(ours, ids, SamplingParams(temperature=0.0, max_new_tokens=4)) == want


@pytest.mark.slow
def test_gguf_converts_for_transformers(tmp_path, cli):
    """The packaged SmolLM2 GGUF (4-bit, dequantized) → HF folder → transformers computes what we compute."""
    assert cli(["convert", "smollm2-135m-instruct", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    ours, tok = load(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    text = "The capital of France is"
    ids = tok.encode(text)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == ids
    with torch.no_grad():
        assert (hf(torch.tensor([ids])).logits - ours(torch.tensor([ids])).logits).abs().max().item() < 1e-3  # logits of size ~20
        want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    got = generate(ours, ids, SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=tok.eos_token_ids))
    stop = next((i for i, t in enumerate(want) if t in tok.eos_token_ids), len(want))  # transformers keeps the EOS, we drop it
    assert got == want[:stop] and got
