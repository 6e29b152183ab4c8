"""Broken HF folders give one line on stderr naming the problem and the fix, and exit code 2."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from hf_models import make_hf_model
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", folder)
    return folder


@pytest.fixture
def folder(good, tmp_path):
    """A fresh copy of a valid tiny llama folder to break."""
    return shutil.copytree(good, tmp_path / "model")


def fails(cli, capsys, folder, *words: str) -> None:
    assert cli(["generate", "--model", str(folder), "--prompt", "The", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    for word in words:
        assert word in err, err


def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def test_valid_folder_loads(cli, capsys, folder):
    assert cli(["generate", "--model", str(folder), "--prompt", "The", "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out.startswith("The")


def test_truncated_safetensors(cli, capsys, folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    fails(cli, capsys, folder, "model.safetensors", "truncated or corrupt", "download")


def test_header_that_lies_about_sizes(cli, capsys, folder):
    weights = folder / "model.safetensors"
    header, data = _header(weights)
    header["model.norm.weight"]["shape"] = [128]  # its byte range still holds 64 floats
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data)
    fails(cli, capsys, folder, "model.safetensors", "truncated or corrupt")


def test_shape_mismatch_names_tensor_and_both_shapes(cli, capsys, folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 1}))
    fails(cli, capsys, folder, "model.layers.0.self_attn.k_proj.weight", "(32, 64)", "(16, 64)", "config.json does not match")


def test_missing_tensor(cli, capsys, folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    fails(cli, capsys, folder, "lacks tensor model.layers.1.self_attn.v_proj.weight", "incomplete")


def test_unexpected_tensor(cli, capsys, folder):
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = tensors["model.norm.weight"][:16].clone()
    save_file(tensors, folder / "model.safetensors")
    fails(cli, capsys, folder, "model.layers.0.self_attn.q_norm.weight", "does not match")


def test_missing_shard(cli, capsys, folder):
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {name: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, name in enumerate(tensors)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    fails(cli, capsys, folder, "model-00002-of-00002.safetensors", "missing", "all shards")


def test_no_weights(cli, capsys, folder):
    (folder / "model.safetensors").unlink()
    fails(cli, capsys, folder, "no model.safetensors", "save_pretrained")


def test_unknown_family(cli, capsys, folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "bert"}))
    fails(cli, capsys, folder, "'bert' is not supported", "gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, phi3")


def test_config_missing_a_field(cli, capsys, folder):
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    fails(cli, capsys, folder, "'hidden_size'", "original config.json")


def test_config_not_json(cli, capsys, folder):
    (folder / "config.json").write_text("{not json")
    fails(cli, capsys, folder, "config.json", "restore")


def test_missing_tokenizer(cli, capsys, folder):
    (folder / "tokenizer.json").unlink()
    fails(cli, capsys, folder, "has no tokenizer.json", "copy the tokenizer files from the original checkpoint")


def test_convert_reports_broken_source_the_same_way(cli, capsys, folder, tmp_path):
    (folder / "tokenizer.json").unlink()
    assert cli(["convert", str(folder), str(tmp_path / "out")]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
