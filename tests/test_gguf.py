"""GGUF reading: dequantization of every supported type against block-format references, and tiny
models written as GGUF (llama.cpp's names and layouts) whose logits must match the transformers model
the weights came from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from decoderlm.errors import DecoderLMError
from decoderlm.formats.gguf import byte_alphabet, dequantize_tensor, load_gguf

# --- references: ggml's block layouts, decoded plainly --------------------------------------


def f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)


def ref_q8_0(raw):  # d (f16), 32 × int8
    b = raw.reshape(-1, 34)
    return (f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)).ravel()


def ref_q4_0(raw):  # d, 16 bytes: low nibbles are values 0..15, high nibbles 16..31, offset 8
    b = raw.reshape(-1, 18)
    q = b[:, 2:]
    vals = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32) - 8
    return (f16(b[:, :2]) * vals).ravel()


def ref_q4_1(raw):  # d, m, 16 bytes; y = d·q + m
    b = raw.reshape(-1, 20)
    q = b[:, 4:]
    vals = np.concatenate([q & 0xF, q >> 4], axis=1).astype(np.float32)
    return (f16(b[:, :2]) * vals + f16(b[:, 2:4])).ravel()


def k_scale_min(s: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """6-bit scale and min of sub-block j from the 12 packed bytes of Q4_K/Q5_K."""
    s = s.astype(np.int32)
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def ref_q4_k(raw):  # d, dmin, scales[12], qs[128] → 256 values in 8 sub-blocks of 32
    b = raw.reshape(-1, 144)
    d, dmin, sc, qs = f16(b[:, 0:2]), f16(b[:, 2:4]), b[:, 4:16], b[:, 16:].astype(np.int32)
    out = []
    for chunk in range(4):
        q = qs[:, 32 * chunk : 32 * chunk + 32]
        for half, vals in enumerate((q & 0xF, q >> 4)):
            s, m = k_scale_min(sc, 2 * chunk + half)
            out.append(d * s[:, None] * vals - dmin * m[:, None])
    return np.concatenate(out, axis=1).ravel()


def ref_q5_k(raw):  # d, dmin, scales[12], qh[32], qs[128]; the 5th bit of value l of sub-block j is bit j of qh[l]
    b = raw.reshape(-1, 176)
    d, dmin, sc, qh, qs = f16(b[:, 0:2]), f16(b[:, 2:4]), b[:, 4:16], b[:, 16:48].astype(np.int32), b[:, 48:].astype(np.int32)
    out = []
    for chunk in range(4):
        q = qs[:, 32 * chunk : 32 * chunk + 32]
        for half, vals in enumerate((q & 0xF, q >> 4)):
            j = 2 * chunk + half
            s, m = k_scale_min(sc, j)
            out.append(d * s[:, None] * (vals + 16 * ((qh >> j) & 1)) - dmin * m[:, None])
    return np.concatenate(out, axis=1).ravel()


def ref_q6_k(raw):  # ql[128], qh[64], scales[16] (int8), d; 16 sub-blocks of 16, values 6-bit minus 32
    b = raw.reshape(-1, 210)
    ql, qh, sc, d = b[:, :128].astype(np.int32), b[:, 128:192].astype(np.int32), b[:, 192:208].view(np.int8).astype(np.float32), f16(b[:, 208:210])
    y = np.zeros((b.shape[0], 256), np.float32)
    for n in range(2):
        L, H = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32]
        quads = ((L[:, :32] & 0xF) | ((H & 3) << 4), (L[:, 32:] & 0xF) | (((H >> 2) & 3) << 4),
                 (L[:, :32] >> 4) | (((H >> 4) & 3) << 4), (L[:, 32:] >> 4) | (((H >> 6) & 3) << 4))
        for k, q in enumerate(quads):
            for l in range(32):
                y[:, 128 * n + 32 * k + l] = d[:, 0] * sc[:, 8 * n + l // 16 + 2 * k] * (q[:, l] - 32)
    return y.ravel()


REFERENCES = {Q.Q8_0: ref_q8_0, Q.Q4_0: ref_q4_0, Q.Q4_1: ref_q4_1, Q.Q4_K: ref_q4_k, Q.Q5_K: ref_q5_k, Q.Q6_K: ref_q6_k}


def write_gguf(path, arch, meta: dict, tensors: list[tuple[str, np.ndarray, Q]], hparams=None) -> None:
    """A GGUF file written by the gguf package itself: `meta` (gguf.Keys names → values) and
    hparams(writer), which calls the writer's own add_* methods. Tensors are float arrays to quantize
    with gguf.quants, or uint8 blocks already in `qtype` (K-quants, which gguf cannot quantize)."""
    w = GGUFWriter(str(path), arch)
    if hparams is not None:
        hparams(w)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, data, qtype in tensors:
        if data.dtype == np.uint8 or qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data if data.dtype == np.uint8 else quantize(data, qtype), raw_dtype=None if data.dtype != np.uint8 else qtype)
        else:
            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_tensor(path, name="t"):
    return next(t for t in GGUFReader(path).tensors if t.name == name)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_dequantize_quantized_random_data(tmp_path, qtype):
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    write_gguf(tmp_path / "q.gguf", "llama", {}, [("t", x, qtype)])
    t = read_tensor(tmp_path / "q.gguf")
    ours = dequantize_tensor(t).numpy()
    assert ours.shape == (8, 256) and t.tensor_type == qtype
    if qtype in REFERENCES:
        np.testing.assert_allclose(ours.ravel(), REFERENCES[qtype](np.asarray(t.data).view(np.uint8)), rtol=1e-6, atol=1e-6)
    tolerance = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.02, Q.Q4_0: 0.35, Q.Q4_1: 0.3}[qtype]
    assert np.abs(ours - x).max() <= tolerance * np.abs(x).max() + 1e-7


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_k_quants_against_reference(tmp_path, qtype):
    """gguf cannot quantize K-types, so write random blocks (with sane fp16 scales) and decode them."""
    rng = np.random.default_rng(1)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (4, 3 * block_bytes), dtype=np.uint8)  # 4 rows × 768 values
    blocks = raw.reshape(-1, block_bytes)
    scales = rng.uniform(0.001, 0.1, (blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[:, -2:] = scales[:, :2]
    else:
        blocks[:, :4] = scales
    write_gguf(tmp_path / "k.gguf", "llama", {}, [("t", raw, qtype)])
    ours = dequantize_tensor(read_tensor(tmp_path / "k.gguf")).numpy()
    assert ours.shape == (4, 768)
    np.testing.assert_allclose(ours.ravel(), REFERENCES[qtype](raw), rtol=1e-5, atol=1e-6)


def test_unsupported_quant_type_is_one_line_error(tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    write_gguf(tmp_path / "q.gguf", "llama", {}, [("t", np.tile(x, 4), Q.TQ2_0)])
    with pytest.raises(DecoderLMError, match=r"TQ2_0.*not supported; supported: F32, F16, BF16, Q8_0") as e:
        dequantize_tensor(read_tensor(tmp_path / "q.gguf"))
    assert "\n" not in str(e.value)


# --- tiny models: transformers weights → GGUF (llama.cpp names/layout) → load_gguf → same logits --

SPECIAL = "<|end|>"


def tokenizer_meta() -> tuple[dict, int]:
    letters = list(byte_alphabet().values())
    tokens = letters + ["Ġt", "he", SPECIAL]
    types = [1] * (len(tokens) - 1) + [3]
    T = gguf.Keys.Tokenizer
    meta = {T.MODEL: "gpt2", T.PRE: "gpt2", T.LIST: tokens, T.TOKEN_TYPE: types, T.MERGES: ["Ġ t", "h e"],
            T.BOS_ID: len(tokens) - 1, T.EOS_ID: len(tokens) - 1,
            T.CHAT_TEMPLATE: "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}
    return meta, len(tokens)


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama's q/k rows (pairs (i, i + d/2) become adjacent)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_model(arch: str, vocab: int):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=vocab - 1, eos_token_id=vocab - 1))
    for p in model.parameters():  # random norms and biases too, so a misplaced one shows
        torch.nn.init.normal_(p, mean=0.5 if p.dim() == 1 else 0.0, std=0.3 if p.dim() == 1 else 0.2)
    return model.eval()


ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "gpt2": gguf.MODEL_ARCH.GPT2}
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def gguf_tensors(arch: str, model) -> list[tuple[str, torch.Tensor]]:
    """What llama.cpp's converter writes for a transformers model: names from the gguf package's own
    HF → GGUF table, GPT-2's Conv1D weights transposed, Llama's q/k rows permuted, experts stacked per kind."""
    cfg = model.config
    n_layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    table = gguf.get_tensor_name_map(ARCHS[arch], n_layers)
    out = []
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:  # llama.cpp writes no output tensor then
            continue
        if ".mlp.experts." in key:  # transformers fuses the experts' gate/up: (E, 2·ff, D); llama.cpp names Mixtral's w1/w3/w2
            prefix = key.split(".mlp.")[0] + ".block_sparse_moe.experts"
            parts = zip(("w1", "w3"), value.chunk(2, dim=1)) if key.endswith("gate_up_proj") else [("w2", value)]
            out += [(table.get_name(f"{prefix}.{w}.weight", try_suffixes=(".weight",)), v) for w, v in parts]
            continue
        if arch == "gpt2" and key.endswith(CONV1D):
            value = value.T
        if arch == "llama" and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            value = permute(value, cfg.num_attention_heads if "q_proj" in key else cfg.num_key_value_heads)
        name = table.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, key
        out.append((name, value))
    return out


def write_model(path, arch: str, model, qtype: Q, extra_tensors: list[tuple[str, torch.Tensor]] = ()) -> None:
    cfg = model.config
    meta, _ = tokenizer_meta()

    def hparams(w: GGUFWriter) -> None:
        if arch == "gpt2":
            w.add_block_count(cfg.n_layer)
            w.add_context_length(cfg.n_positions)
            w.add_embedding_length(cfg.n_embd)
            w.add_feed_forward_length(4 * cfg.n_embd)
            w.add_head_count(cfg.n_head)
            w.add_layer_norm_eps(cfg.layer_norm_epsilon)
            return
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if getattr(cfg, "num_local_experts", None):
            w.add_expert_count(cfg.num_local_experts)
            w.add_expert_used_count(cfg.num_experts_per_tok)

    named = [*gguf_tensors(arch, model), *extra_tensors]
    tensors = [(name, value.float().numpy(), qtype if value.dim() >= 2 else Q.F32) for name, value in named]
    write_gguf(path, arch, meta, tensors, hparams)


def quantized_copy(model, qtype: Q):
    """The transformers model with every matrix rounded through `qtype` (rows are quantized independently,
    so llama.cpp's row permutation does not change the result)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), qtype), qtype)))
    return model


@pytest.mark.parametrize("arch,qtype", [("llama", Q.F32), ("llama", Q.F16), ("llama", Q.Q8_0), ("qwen2", Q.F32), ("qwen3", Q.Q8_0), ("gpt2", Q.F32)])
def test_tiny_model_round_trip(tmp_path, arch, qtype):
    _, vocab = tokenizer_meta()
    model = hf_model(arch, vocab)
    write_model(tmp_path / "m.gguf", arch, model, qtype)
    ours, tok = load_gguf(tmp_path / "m.gguf", torch.float32)
    if qtype != Q.F32:
        model = quantized_copy(model, qtype)
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-4
    assert ours.config.tie_embeddings == (arch in ("qwen2", "gpt2"))
    assert tok.encode("the" + SPECIAL) == [tok.token_id("t"), tok.token_id("he"), vocab - 1]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\n"
