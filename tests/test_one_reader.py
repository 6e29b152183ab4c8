"""One reading per format: `inspect` (which reads no weights) and `load` describe the same checkpoint
the same way. The model that `load` builds is the reference: its tensors' shapes, biases, norms and
tying are checked against every field the inspect report shares with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hf_models import CASES, make_hf_model
from test_gguf import hf_model, tokenizer_meta, write_model
from test_gguf_more import LLAMA3, llama, llama3_factors

from decoderlm.formats.hf import config_from_hf
from decoderlm.inspect.accounting import Accounting
from decoderlm.inspect.arch import ArchSpec, read_spec
from decoderlm.loader import load
from decoderlm.model import Transformer

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
RUNNABLE = ["gpt2", "llama-3.1-8b", "mistral-7b-v0.1", "mixtral-8x7b-v0.1", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-30b-a3b", "smollm2-135m"]


def assert_describes(spec: ArchSpec, model: Transformer) -> None:
    """Every field inspect reports that the built model also has, read off the model's own modules (loaded
    with fuse=False: one module per checkpoint matrix)."""
    c, layer = model.config, model.layers[0]
    attn, ffn = layer.self_attn, layer.mlp
    moe = hasattr(ffn, "experts")
    expert = ffn.experts[0] if moe else ffn
    assert spec.family == c.family
    assert (spec.vocab_size, spec.d_model) == tuple(model.embed_tokens.weight.shape)
    assert spec.n_layers == len(model.layers)
    assert spec.n_heads * spec.head_dim == attn.q_proj.out_features
    assert spec.n_kv_heads * spec.head_dim == attn.k_proj.out_features == attn.v_proj.out_features
    assert spec.head_dim == attn.head_dim
    assert (spec.qkv_bias, spec.o_bias) == (attn.q_proj.bias is not None, attn.o_proj.bias is not None)
    assert spec.qk_norm == (attn.q_norm is not None)
    assert spec.gated_mlp == (expert.gate_proj is not None) and spec.mlp_bias == (expert.up_proj.bias is not None)
    if moe:
        assert (spec.n_experts, spec.moe_hidden) == (len(ffn.experts), expert.up_proj.out_features)
        assert spec.n_experts_per_tok == c.n_experts_per_tok
    else:
        assert spec.n_experts == 0 and spec.ffn_hidden == ffn.up_proj.out_features
    assert spec.norm == ("layernorm" if isinstance(layer.input_layernorm, torch.nn.LayerNorm) else "rmsnorm")
    assert spec.tie_embeddings == (model.lm_head.weight is model.embed_tokens.weight)
    learned = model.embed_positions.weight.shape[0] if model.embed_positions is not None else 0
    assert spec.learned_positions == learned
    assert spec.max_seq_len == c.max_seq_len and spec.sliding_window == c.sliding_window
    if not learned:
        assert (spec.rope_theta, spec.rope_scaling) == (c.rope_theta, c.rope_scaling)
    assert Accounting.of(spec).total == model.num_parameters()


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_and_load_agree_on_every_hf_family(case, tmp_path):
    make_hf_model(case, tmp_path)
    model, _ = load(tmp_path, fuse=False)
    assert_describes(read_spec(tmp_path), model)


def meta_model(d: dict) -> Transformer:
    """What `load` builds for this config.json, on the meta device (the real weights are not here)."""
    with torch.device("meta"):
        return Transformer(config_from_hf(d))


QWEN_WINDOW_DEFAULT = {"use_sliding_window": True, "sliding_window": 4096}  # max_window_layers absent: transformers says 28


@pytest.mark.parametrize("name, change", [*((n, {}) for n in RUNNABLE), ("qwen2.5-0.5b", QWEN_WINDOW_DEFAULT),
                                          ("qwen3-0.6b", QWEN_WINDOW_DEFAULT | {"num_hidden_layers": 20})])
def test_inspect_and_load_agree_on_every_fixture(name, change, tmp_path):
    d = json.loads((FIXTURES / f"{name}.json").read_text()) | change
    d.pop("max_window_layers", None) if change else None
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert_describes(read_spec(tmp_path / "config.json"), meta_model(d))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_inspect_and_load_agree_on_gguf(arch, tmp_path):
    _, vocab = tokenizer_meta()
    write_model(tmp_path / "m.gguf", arch, hf_model(arch, vocab), Q.Q8_0)
    model, _ = load(tmp_path / "m.gguf", fuse=False)
    assert_describes(read_spec(tmp_path / "m.gguf"), model)


def test_inspect_reads_gguf_rope_scaling_as_load_does(tmp_path):
    """Llama 3.1's RoPE scaling lives in a rope_freqs tensor, not in the metadata keys."""
    _, vocab = tokenizer_meta()
    extra = [("rope_freqs.weight", llama3_factors(16, 10000.0, LLAMA3))]
    write_model(tmp_path / "m.gguf", "llama", llama(vocab, LLAMA3), Q.F32, extra_tensors=extra)
    model, _ = load(tmp_path / "m.gguf", fuse=False)
    spec = read_spec(tmp_path / "m.gguf")
    assert spec.rope_scaling == LLAMA3
    assert_describes(spec, model)


def test_one_detect_tells_the_formats_apart(tmp_path):
    """`load` and `inspect` both ask `formats.detect` what a path holds; a run folder wins over a config.json beside it."""
    from decoderlm.formats import detect

    files = {"run/ckpt.pt": b"", "run/config.json": b"{}", "adapter/adapter_config.json": b"{}", "hf/config.json": b"{}",
             "m.gguf": b"", "c.json": b"{}", "notes.txt": b"", "empty/x.txt": b""}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    kinds = {name: detect(tmp_path / name) for name in ("run", "adapter", "hf", "m.gguf", "c.json", "notes.txt", "empty", "missing")}
    assert kinds == {"run": "run", "adapter": "peft", "hf": "hf", "m.gguf": "gguf", "c.json": "json", "notes.txt": None, "empty": None, "missing": None}
