"""Every command that takes a model takes it the same way, with the same run flags, and turns each bad
input (missing, broken or foreign files, bad flag values, devices this machine lacks) into one line on
stderr and exit code 2 before any slow work. `load(device=...)` builds the model on that device."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from gguf import GGMLQuantizationType as Q
from hf_models import make_hf_model, prompt_ids
from test_gguf import hf_model, tokenizer_meta, write_model

import decoderlm.loader
from decoderlm import names
from decoderlm.cli import build_parser
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.jsonio import read_json
from decoderlm.loader import load, resolve_device
from decoderlm.model import Transformer
from decoderlm.tokenizer import CharTokenizer
from decoderlm.train import TrainConfig, checkpoint
from decoderlm.train.config import TRAIN_SEED


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny HF folder, GGUF file and run folder, and broken variants of each."""
    root = tmp_path_factory.mktemp("models")
    make_hf_model("llama", root / "hf")
    _, vocab = tokenizer_meta()
    write_model(root / "m.gguf", "llama", hf_model("llama", vocab), Q.F32)
    tok = CharTokenizer.from_text("abcdefgh ")
    config = ModelConfig.from_preset("seed-char", vocab_size=tok.vocab_size, n_layers=1, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(config)
    (root / "run").mkdir()
    checkpoint.save(root / "run", {"model": model.state_dict(), "config": config.to_dict(), "tokenizer": tok.to_dict(), "step": 0})
    broken = root / "broken"
    broken.mkdir()
    raw = (root / "m.gguf").read_bytes()
    (broken / "truncated.gguf").write_bytes(raw[: len(raw) // 2])
    (broken / "header-only.gguf").write_bytes(raw[:64])
    (broken / "text.gguf").write_text("not a gguf file")
    (broken / "dir.gguf").mkdir()
    (broken / "invalid.json").write_text("{")
    (broken / "list.json").write_text("[1, 2]")
    (broken / "typo.json").write_text(json.dumps(config.to_dict() | {"d_model": "128"}))
    shutil.copytree(root / "hf", broken / "config-is-a-dir")
    (broken / "config-is-a-dir" / "config.json").unlink()
    (broken / "config-is-a-dir" / "config.json").mkdir()
    shutil.copytree(root / "hf", broken / "hf-bad-type")
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    (broken / "hf-bad-type" / "config.json").write_text(json.dumps(hf_config | {"num_hidden_layers": "two"}))
    fixtures = Path(__file__).parent / "fixtures" / "configs"
    deepseek = json.loads((fixtures / "deepseek-v3.json").read_text())
    (broken / "deepseek-no-v-head-dim.json").write_text(json.dumps({k: v for k, v in deepseek.items() if k != "v_head_dim"}))
    oss = json.loads((fixtures / "gpt-oss-20b.json").read_text())
    (broken / "gpt-oss-window-text.json").write_text(json.dumps(oss | {"sliding_window": "big"}))
    shutil.copytree(root / "run", broken / "run-mismatch")
    other = config.to_dict() | {"n_layers": 2}
    checkpoint.save(broken / "run-mismatch", {"model": model.state_dict(), "config": other, "tokenizer": tok.to_dict(), "step": 0})
    return root


def bad_invocations(m, tmp_path) -> dict[str, tuple[list[str], str]]:
    """what → (argv, a phrase the one-line error must contain)."""
    b = m / "broken"
    hf, run, gguf = str(m / "hf"), str(m / "run"), str(m / "m.gguf")
    gen = ["generate", "--model", hf, "--prompt", "The"]
    return {
        "truncated gguf": (["generate", "--model", str(b / "truncated.gguf"), "--prompt", "a"], "truncated"),
        "gguf header only": (["info", str(b / "header-only.gguf")], "truncated"),
        "text named .gguf": (["inspect", str(b / "text.gguf")], "not a GGUF"),
        "text named .gguf, convert": (["convert", str(b / "text.gguf"), str(tmp_path / "out")], "not a GGUF"),
        "directory named .gguf": (["chat", "--model", str(b / "dir.gguf"), "--message", "hi"], "not a model"),
        "config.json is a directory": (["generate", "--model", str(b / "config-is-a-dir"), "--prompt", "a"], "directory"),
        "config.json value of the wrong type": (["generate", "--model", str(b / "hf-bad-type"), "--prompt", "a"], "wrong type"),
        "config.json value of the wrong type, info": (["info", str(b / "hf-bad-type")], "wrong type"),
        "invalid JSON": (["info", str(b / "invalid.json")], "not valid JSON"),
        "unrunnable family missing a field": (["info", str(b / "deepseek-no-v-head-dim.json")], "lacks 'v_head_dim'"),
        "unrunnable family with a text number": (["inspect", str(b / "gpt-oss-window-text.json")], "wrong type"),
        "JSON list": (["inspect", str(b / "list.json")], "not an object"),
        "ModelConfig with a string size": (["check", "causal", "--preset", str(b / "typo.json")], "d_model='128'"),
        "invalid JSON preset": (["check", "overfit", "--preset", str(b / "invalid.json")], "not valid JSON"),
        "checkpoint not matching its config": (["generate", "--model", str(b / "run-mismatch"), "--prompt", "a"], "does not match"),
        "model twice": (["info", hf, "--model", run], "given twice"),
        "no model": (["info"], "give a model"),
        "convert without DST": (["convert", hf], "MODEL DST"),
        "convert with three paths": (["convert", "--model", hf, str(tmp_path / "a"), str(tmp_path / "b")], "MODEL DST"),
        "unknown device": ([*gen, "--device", "tpu"], "not supported"),
        "cuda on a machine without": ([*gen, "--device", "cuda"], "cuda"),
        "mps on a machine without": (["check", "causal", "--model", run, "--device", "mps"], "mps"),
        "check with model and preset": (["check", "causal", "--model", run, "--preset", "llama-tiny"], "either --model or --preset"),
        "check with no tokens": (["check", "causal", "--model", run, "--tokens", "0"], "--tokens"),
        "check threads 0": (["check", "kv-cache", "--preset", "llama-tiny", "--threads", "0"], "--threads"),
        "bad sampling flag before the load": (["generate", "--model", str(tmp_path / "absent"), "--prompt", "a", "--top-p", "0"], "top_p"),
        "explain into a missing folder": (["explain", "attention", "--model", gguf, "--prompt", "the", "--out", str(tmp_path / "no" / "a.png")], "does not exist"),
        "explain into a directory": (["explain", "masks", "--out", str(tmp_path)], "directory"),
        "explain layer out of range": (["explain", "attention", "--model", gguf, "--prompt", "the", "--layer", "2", "--out", str(tmp_path / "a.png")], "out of range"),
        "explain empty prompt": (["explain", "attention", "--model", run, "--prompt", "", "--out", str(tmp_path / "a.png")], "empty"),
        "explain masks negative prefix": (["explain", "masks", "--prefix", "-1", "--out", str(tmp_path / "a.png")], "--prefix"),
        "override of the wrong type": (["inspect", "--compare", "llama-tiny::n_kv_heads=abc"], "must be int"),
        "override that breaks the shape": (["inspect", "--compare", "llama-tiny::n_layers=0"], "positive"),
        "inspect context 0": (["info", "llama-tiny", "--context", "0"], "--context"),
    }


def test_every_bad_input_is_one_line_and_exit_2(models, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a machine with a GPU
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    threads = torch.get_num_threads()
    for what, (argv, phrase) in bad_invocations(models, tmp_path).items():
        code, out, err = run_cli(argv, capsys)
        assert code == 2, (what, out, err)
        assert out == "" and err.count("\n") == 1 and err.startswith("error: "), (what, err)
        assert phrase in err, (what, err)
    assert torch.get_num_threads() == threads
    assert not (tmp_path / "out").exists() and not (tmp_path / "a.png").exists()  # nothing written


def test_the_model_is_named_the_same_way_everywhere(models, tmp_path, capsys):
    hf = str(models / "hf")
    first = run_cli(["info", hf], capsys)
    assert first[0] == 0 and run_cli(["info", "--model", hf], capsys) == first
    assert run_cli(["inspect", hf, "--short"], capsys) == first
    assert run_cli(["info", hf, "--model", hf], capsys) == first  # the same model twice is no conflict
    assert run_cli(["convert", "--model", hf, str(tmp_path / "a")], capsys)[0] == 0
    assert run_cli(["convert", hf, str(tmp_path / "b")], capsys)[0] == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)subcommand's parser by name: "generate", "explain attention", ..."""
    def walk(parser: argparse.ArgumentParser, prefix: str) -> dict[str, argparse.ArgumentParser]:
        out = {prefix.strip(): parser} if prefix else {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out |= walk(sub, f"{prefix} {name}")
        return out
    return walk(build_parser(), "")


RUNS_A_MODEL = ["generate", "chat", "check", "explain attention"]


def test_run_flags_exist_wherever_a_model_runs():
    parsers = subcommands()
    for name in RUNS_A_MODEL:
        flags = {option for action in parsers[name]._actions for option in action.option_strings}
        assert {"--model", "--dtype", "--quantize", "--threads", "--device"} <= flags, name


def test_seed_has_one_meaning():
    """Unseeded unless --seed is given, with the same help everywhere (train's, sft's and dpo's flags belong to training)."""
    seeds = {name: a for name, p in subcommands().items() if name not in ("train", "sft", "dpo") for a in p._actions if a.dest == "seed"}
    assert set(seeds) >= {"generate", "chat", "check"}
    assert {a.default for a in seeds.values()} == {None} and len({a.help for a in seeds.values()}) == 1
    training = {name: a.default for name, p in subcommands().items() if name in ("train", "sft", "dpo") for a in p._actions if a.dest == "seed"}
    assert set(training) == {"train", "sft", "dpo"}
    assert {TrainConfig.__dataclass_fields__["seed"].metadata["default"], *[d for d in training.values() if d is not None]} == {TRAIN_SEED}


@pytest.mark.parametrize("source", ["hf", "m.gguf", "run"])
def test_load_on_cpu_gives_the_same_model(models, source):
    default, _ = load(models / source)
    on_cpu, _ = load(models / source, device="cpu")
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
    ids = prompt_ids(8) % on_cpu.config.vocab_size
    with torch.no_grad():
        assert torch.equal(default(ids).logits, on_cpu(ids).logits)


@pytest.mark.filterwarnings("ignore:for .* meta parameter")  # copying into meta tensors is a no-op, as intended here
@pytest.mark.parametrize("source", ["hf", "m.gguf", "run"])
def test_load_builds_the_model_on_the_device_directly(models, source, monkeypatch):
    """With "meta" as the device, a model built anywhere else first and moved would hold real storage."""
    monkeypatch.setattr(decoderlm.loader, "resolve_device", torch.device)
    model, _ = load(models / source, device="meta")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_device_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DecoderLMError, match="no CUDA GPU"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DecoderLMError, match="has 1 CUDA GPU"):
        resolve_device("cuda:1")
    for bad in ("tpu", "gpu", "cpu:x", ""):
        with pytest.raises(DecoderLMError, match="not supported"):
            resolve_device(bad)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DecoderLMError, match="not supported"):
        load(names.DEFAULT_MODEL, device="tpu")


def test_one_json_reader(tmp_path):
    cases = {"missing": None, "invalid": "{'a': 1}", "list": "[]", "number": "3", "not utf-8": b"\xff\xfe{"}
    for what, content in cases.items():
        path = tmp_path / f"{what}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        with pytest.raises(DecoderLMError) as e:
            read_json(path, "config.json", "restore it")
        assert "\n" not in str(e.value) and str(path) in str(e.value) and str(e.value).endswith("restore it"), what
    with pytest.raises(DecoderLMError, match="directory"):
        read_json(tmp_path)
    assert read_json(tmp_path / "missing.json", missing_ok=True) == {}
    (tmp_path / "ok.json").write_text('{"a": [1]}')
    assert read_json(tmp_path / "ok.json") == {"a": [1]}


def test_run_folders_saved_before_extra_was_removed_still_load(models, tmp_path):
    state = runs.read(models / "run")
    state["config"] = state["config"] | {"extra": {}}  # what ModelConfig.to_dict wrote then
    checkpoint.save(tmp_path, state)
    old, _ = load(tmp_path)
    assert old.config == ModelConfig.from_dict(runs.read(models / "run")["config"])
    with pytest.raises(DecoderLMError, match="unknown ModelConfig fields: extra"):
        ModelConfig.from_dict(old.config.to_dict() | {"extra": {"x": 1}})  # one that held something is not silently dropped
