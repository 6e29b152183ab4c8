"""LoRA: merged weights give the adapter's output, adapters round-trip through HF PEFT both ways, only
adapters train, and an adapter run folder loads (and converts) as its merged model."""

from __future__ import annotations

import pytest
import torch

import decoderlm
from conftest import tiny_model
from decoderlm.errors import DecoderLMError
from decoderlm.formats.peft import load_adapter, save_adapter
from decoderlm.model.lora import apply_lora, lora_layers, merge_lora
from hf_models import make_hf_model, prompt_ids

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def randomize_adapters(model, seed: int = 1) -> None:
    """B starts at zero (a no-op adapter); give every adapter a real update."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for part in (layer.lora_A["default"], layer.lora_B["default"]):
                part.weight.copy_(torch.randn(part.weight.shape, generator=g) * 0.1)


@pytest.mark.parametrize("overrides", [{}, dict(n_kv_heads=2, attn_bias=True), dict(n_experts=4, n_experts_per_tok=2, moe_hidden=16)],
                         ids=["llama", "gqa-bias", "moe"])
def test_merged_equals_adapter_output(overrides):
    model = tiny_model(**overrides)
    targets = ["q_proj", "v_proj", "o_proj"] + ([] if overrides.get("n_experts") else ["gate_proj", "down_proj"])
    apply_lora(model, rank=4, alpha=8, targets=targets)
    randomize_adapters(model)
    ids = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(ids).logits
        base = [layer.enabled for layer in lora_layers(model).values()]
        merged = merge_lora(model)(ids).logits
    assert all(base) and not lora_layers(model)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)


def test_a_fresh_adapter_is_the_base_model_and_only_adapters_train():
    model = tiny_model()
    ids = torch.randint(0, 37, (1, 10))
    with torch.no_grad():
        before = model(ids).logits
    layers = apply_lora(model, rank=2, alpha=4, targets=["q_proj", "v_proj"])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=0, rtol=0)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(layers) == 2 * 2 * model.config.n_layers


@pytest.mark.parametrize("case", ["llama", "qwen2-bias-tied", "gemma"])
def test_adapter_written_by_decoderlm_loads_in_peft(case, tmp_path):
    from peft import PeftModel

    hf = make_hf_model(case, tmp_path / "base")
    model, _ = decoderlm.load(tmp_path / "base")
    apply_lora(model, rank=4, alpha=16, targets=TARGETS)
    randomize_adapters(model)
    save_adapter(model, tmp_path / "adapter", base=str(tmp_path / "base"))
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = prompt_ids()
    with torch.no_grad():
        ours, theirs = model(ids).logits, peft_model(ids).logits
    assert (peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight != 0).any()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_adapter_written_by_peft_loads_in_decoderlm(tmp_path):
    from peft import LoraConfig, get_peft_model

    hf = make_hf_model("llama", tmp_path / "base")
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    model, _ = decoderlm.load(tmp_path / "base")
    load_adapter(model, tmp_path / "adapter")
    ids = prompt_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, peft_model(ids).logits, atol=1e-4, rtol=1e-4)


def test_adapter_folder_loads_merged_and_converts(tmp_path, cli, capsys):
    from transformers import AutoModelForCausalLM

    make_hf_model("llama", tmp_path / "base")
    model, tok = decoderlm.load(tmp_path / "base")
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"])
    randomize_adapters(model)
    save_adapter(model, tmp_path / "run", base=str(tmp_path / "base"))
    ids = prompt_ids()
    with torch.no_grad():
        adapted = model(ids).logits
        loaded, _ = decoderlm.load(tmp_path / "run")
        assert not lora_layers(loaded)  # merged: a plain model
        torch.testing.assert_close(loaded(ids).logits, adapted, atol=1e-5, rtol=1e-5)
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, adapted, atol=1e-4, rtol=1e-4)


def test_bad_targets_and_fused_layers_are_refused(tmp_path):
    with pytest.raises(DecoderLMError, match="no linear layer named qkv_proj; choose from"):
        apply_lora(tiny_model(), rank=2, alpha=4, targets=["qkv_proj"])
    make_hf_model("gpt2", tmp_path / "gpt2")
    model, _ = decoderlm.load(tmp_path / "gpt2")
    apply_lora(model, rank=2, alpha=4, targets=["q_proj"])
    with pytest.raises(DecoderLMError, match="fuses or transposes q_proj"):
        save_adapter(model, tmp_path / "adapter", base="x")


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "-1"], "--lora-rank must be an integer >= 0"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be positive"),
    (["--lora-rank", "4", "--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1)"),
])
def test_bad_lora_flags_are_one_line_errors(tmp_path, cli, capsys, flags, message):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"prompt": "hi", "completion": "hello"}\n')
    code = cli(["sft", "--model", "smollm2-135m-instruct", "--data", str(data), "--out", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1
