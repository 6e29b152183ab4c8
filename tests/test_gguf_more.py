"""GGUF features beyond the plain dense models of test_gguf.py: Llama 3.1+ RoPE scaling stored as a
`rope_freqs` tensor, Mixtral-style MoE (arch "llama" with stacked expert tensors), and SentencePiece
tokenizers. Each tiny model is written the way llama.cpp's converter writes it and must give the
transformers model's logits, also after `save_hf` (what `decoderlm convert` runs); tokenizers must give
transformers' GGUF tokenizer's ids."""

from __future__ import annotations

import math

import gguf
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from test_gguf import SPECIAL, tokenizer_meta, write_gguf, write_model

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats.gguf import FastReader, Metadata, gguf_tokenizer, load_gguf
from decoderlm.formats.hf import save_hf
from decoderlm.model import Transformer

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FAR = torch.arange(3000, 3012).repeat(2, 1)  # far positions, where the scaled low frequencies matter


def randomize(model):
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, mean=0.5 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.2)
    return model.eval()


def llama(vocab: int, rope: dict):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   rope_parameters={"rope_theta": 10000.0, **rope})
    return randomize(transformers.LlamaForCausalLM(cfg))


def llama3_factors(head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """llama.cpp's converter: one divisor per frequency, 1 for short wavelengths, `factor` for long ones."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    old, low, high, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def max_diff(ours, theirs, ids, positions=None) -> float:
    with torch.no_grad():
        return (ours(ids, positions=positions).logits - theirs(ids, position_ids=positions).logits).abs().max().item()


def ids_for(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))


def test_rope_freqs_llama3_loads_and_converts(tmp_path):
    _, vocab = tokenizer_meta()
    model = llama(vocab, LLAMA3)
    factors = llama3_factors(16, 10000.0, LLAMA3)  # head_dim 16, θ 1e4: kept, blended and divided frequencies
    write_model(tmp_path / "m.gguf", "llama", model, Q.F32, extra_tensors=[("rope_freqs.weight", factors)])
    ours, tok = load_gguf(tmp_path / "m.gguf")
    assert ours.config.rope_scaling == LLAMA3  # read back as the parameters that produced it
    ids = ids_for(vocab)
    assert max_diff(ours, model, ids, FAR) < 1e-4
    unscaled = llama(vocab, {"rope_type": "default"})
    assert max_diff(ours, unscaled, ids, FAR) > 1e-3  # the scaling is visible at these positions
    save_hf(ours, tok, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert max_diff(ours, back, ids, FAR) < 1e-4


def test_rope_freqs_other_factors_load_but_refuse_hf_export(tmp_path):
    """Divisors that are not Llama 3's are kept as they are (freq_factors), which config.json cannot say."""
    _, vocab = tokenizer_meta()
    model = llama(vocab, {"rope_type": "default"})
    factors = torch.linspace(1.0, 5.0, 8)
    rotary = model.model.rotary_emb
    rotary.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16) / factors
    write_model(tmp_path / "m.gguf", "llama", model, Q.F32, extra_tensors=[("rope_freqs.weight", factors)])
    ours, tok = load_gguf(tmp_path / "m.gguf")
    assert ours.config.rope_scaling["rope_type"] == "freq_factors"
    assert max_diff(ours, model, ids_for(vocab), FAR) < 1e-4
    with pytest.raises(DecoderLMError, match="rope_freqs") as e:
        save_hf(ours, tok, tmp_path / "hf")
    assert "\n" not in str(e.value)
    ours.config.to_json(tmp_path / "config.json")  # a run folder keeps them
    again = ModelConfig.from_json(tmp_path / "config.json")
    assert again == ours.config
    torch.testing.assert_close(Transformer(again).inv_freq, ours.inv_freq, rtol=0, atol=0)


def test_rope_freqs_of_wrong_length_is_one_line_error(tmp_path):
    _, vocab = tokenizer_meta()
    model = llama(vocab, {"rope_type": "default"})
    write_model(tmp_path / "m.gguf", "llama", model, Q.F32, extra_tensors=[("rope_freqs.weight", torch.ones(5))])
    with pytest.raises(DecoderLMError, match="rope_freqs has 5 values, expected 8"):
        load_gguf(tmp_path / "m.gguf")


def test_mixtral_moe_gguf_loads_and_converts(tmp_path):
    _, vocab = tokenizer_meta()
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                                     rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = randomize(transformers.MixtralForCausalLM(cfg))
    write_model(tmp_path / "m.gguf", "llama", model, Q.F32)
    ours, tok = load_gguf(tmp_path / "m.gguf")
    c = ours.config
    assert (c.n_experts, c.n_experts_per_tok, c.moe_hidden, c.family) == (4, 2, 48, "mixtral")
    ids = ids_for(vocab)
    assert max_diff(ours, model, ids) < 1e-4
    assert tok.encode("the" + SPECIAL)[-1] == vocab - 1
    save_hf(ours, tok, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    assert max_diff(ours, back, ids) < 1e-4


# --- SentencePiece tokenizers (tokenizer.ggml.model "llama": Llama 2, Mistral 7B) -----------------

SPM_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "in", "ing", "▁th", "▁a", "▁thing", "▁s", "pa", "ce", "▁▁",
              "ll", "▁he", "▁hell", "▁hello", "or", "▁w", "▁wor", "▁world", "▁two", "▁tw", "es", "▁spa"]


def write_spm_tokenizer(path, *, add_space_prefix: bool | None = None) -> list[str]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES, "<tool>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES), 4]
    rng = torch.Generator().manual_seed(0)
    scores = [0.0] * 259 + (-torch.rand(len(SPM_PIECES), generator=rng) * 100).tolist() + [0.0]  # merge order unlike file order
    T = gguf.Keys.Tokenizer
    meta = {T.MODEL: "llama", T.LIST: tokens, T.SCORES: scores, T.TOKEN_TYPE: types, T.BOS_ID: 1, T.EOS_ID: 2, T.UNK_ID: 0}
    if add_space_prefix is not None:
        meta[T.ADD_PREFIX] = add_space_prefix
    write_gguf(path, "llama", meta, [])
    return tokens


TEXTS = ["the thing", "hello world", "  two  spaces ", "héllo wörld", "line\nbreak\t tab", "<s>the</s> thing", "a<tool>b <tool> c",
         "emoji 🙂 end", "", " ", "UPPER case 123", "<unk> x", "thethethe hellohello"]


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    write_spm_tokenizer(tmp_path / "t.gguf")
    ours = gguf_tokenizer(Metadata(FastReader(tmp_path / "t.gguf")))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.encode("the thing") == [1, ours.token_id("▁the"), ours.token_id("▁thing")]  # BOS by default, scores drive merges
    assert ours.decode(ours.encode("héllo wörld", add_special_tokens=False)) == "héllo wörld"  # byte fallback round trip


def test_sentencepiece_without_space_prefix(tmp_path):
    write_spm_tokenizer(tmp_path / "t.gguf", add_space_prefix=False)
    ours = gguf_tokenizer(Metadata(FastReader(tmp_path / "t.gguf")))
    assert ours.encode("the thing", add_special_tokens=False)[:2] == [ours.token_id("t"), ours.token_id("he")]
    assert ours.decode(ours.encode(" the", add_special_tokens=False)) == " the"


def test_sentencepiece_tokenizer_survives_hf_save(tmp_path):
    write_spm_tokenizer(tmp_path / "t.gguf")
    ours = gguf_tokenizer(Metadata(FastReader(tmp_path / "t.gguf")))
    ours.save(tmp_path / "hf")
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert back(text)["input_ids"] == ours.encode(text), text
