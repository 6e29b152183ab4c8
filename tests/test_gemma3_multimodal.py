"""A Gemma-3 multimodal folder (Gemma3ForConditionalGeneration: text_config + a SigLIP vision_config + a projector)
runs as its language model, text only: transformers' logits and greedy tokens on text ids, cached decoding equal to
recomputation, the vision tower left unread and said so on stderr and by `inspect`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from hf_models import CASES, prompt_ids, write_tokenizer
from safetensors.torch import load_file, save_file

from decoderlm.generate import generate
from decoderlm.inspect.accounting import Accounting
from decoderlm.inspect.arch import read_spec
from decoderlm.kv_cache import cache_for
from decoderlm.loader import load
from decoderlm.sampling import SamplingParams

NOTE = "gemma3: running the language model only; the vision tower (SigLIP) is not loaded"


def make_gemma3(folder: Path, tie: bool = True):
    """A random Gemma3ForConditionalGeneration, its language model the gemma3 case of hf_models (window 6, 2 sliding :
    1 full, each kind its RoPE), a one-layer SigLIP of odd widths; saved to folder, returned in eval mode, fp32."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {"model_type": "gemma3_text", **CASES["gemma3"][1]}
    vision = dict(model_type="siglip_vision_model", hidden_size=36, intermediate_size=74, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=tie)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None  # greedy comparisons run the full length
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, make_gemma3(folder)


def test_saved_names_are_the_published_layout(gemma3):
    """What save_pretrained writes (transformers 5 converts back to the published checkpoints' names): the language
    model under language_model.model., the tower and the projector beside it, no tied lm_head."""
    folder, _ = gemma3
    names = load_file(folder / "model.safetensors").keys()
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in names and not any("lm_head" in n for n in names)
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("multi_modal_projector.") for n in names)


def test_logits_match_transformers_and_loading_says_the_tower_is_left_out(gemma3, capsys):
    folder, hf = gemma3
    capsys.readouterr()
    model, _ = load(folder)
    assert capsys.readouterr().err.splitlines() == [NOTE]
    assert model.config.family == "gemma3_text" and model.config.tie_embeddings and model.config.layer_types[2] == "full_attention"
    assert not any("vision" in name or "projector" in name for name in model.state_dict())
    ids = prompt_ids(24)  # longer than the window of 6
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < 1e-4


def test_cached_decoding_equals_recomputation(gemma3):
    folder, hf = gemma3
    model, _ = load(folder)
    ids = prompt_ids(24, seed=1)
    with torch.no_grad():
        want = model(ids).logits
        cache = cache_for(model.config, 2, 24)
        got = [model(ids[:, :9], cache=cache).logits[:, -1]]
        got += [model(ids[:, t : t + 1], cache=cache).logits[:, -1] for t in range(9, 24)]
        assert (torch.stack(got, dim=1) - want[:, 8:]).abs().max().item() < 1e-4
        assert (hf(ids).logits[:, 8:] - want[:, 8:]).abs().max().item() < 1e-4


def test_greedy_tokens_match_transformers(gemma3):
    folder, hf = gemma3
    model, _ = load(folder)
    ids = prompt_ids(12, seed=2)[:1]
    with torch.no_grad():
        want = hf.generate(ids, do_sample=False, max_new_tokens=24)[0, 12:].tolist()
    assert len(want) == 24 and generate(model, ids[0].tolist(), SamplingParams(temperature=0.0, max_new_tokens=24)) == want


def test_an_untied_head_loads_in_both_layouts(tmp_path):
    """An untied lm_head as saved (language_model.lm_head.weight), then under the names transformers 4.52-4.57 saved:
    model.language_model.*, model.vision_tower.*, model.multi_modal_projector.* and lm_head.weight at the top."""
    hf = make_gemma3(tmp_path, tie=False)
    saved = load_file(tmp_path / "model.safetensors")
    assert "language_model.lm_head.weight" in saved
    ids = prompt_ids(16, seed=3)
    with torch.no_grad():
        assert (hf(ids).logits - load(tmp_path)[0](ids).logits).abs().max().item() < 1e-4
    renamed = {}
    for name, t in saved.items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name.removeprefix("language_model.model.")
        elif name == "language_model.lm_head.weight":
            name = "lm_head.weight"
        else:
            name = "model." + name  # vision_tower.*, multi_modal_projector.*
        renamed[name] = t
    save_file(renamed, tmp_path / "model.safetensors")
    model, _ = load(tmp_path)
    assert not model.config.tie_embeddings
    with torch.no_grad():
        assert (hf(ids).logits - model(ids).logits).abs().max().item() < 1e-4


def test_inspect_says_it_runs_the_language_model_and_names_the_uncounted_tower(gemma3, capsys):
    folder, hf = gemma3
    code, out, _ = run_cli(["inspect", str(folder)], capsys)
    lines = out.splitlines()
    assert code == 0 and "runs in decoderlm: yes, the language model only; the vision tower (SigLIP) is not loaded" in lines
    assert "counts: the text model only; the vision tower (vision_config) is not counted" in lines
    code, out, _ = run_cli(["inspect", str(folder), "--json"], capsys)
    assert json.loads(out)["runs"] == "yes, the language model only; the vision tower (SigLIP) is not loaded"
    language = sum(p.numel() for p in hf.model.language_model.parameters())  # lm_head is tied
    assert Accounting.of(read_spec(folder)).total == language == load(folder)[0].num_parameters()
