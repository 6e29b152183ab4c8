"""GGUF (llama.cpp's single-file format): hyper-parameters and tokenizer as metadata, weights as
(often quantized) tensors. `load_gguf` maps all three onto decoderlm's config, model and tokenizer.

The model is built on the meta device and each tensor is read, converted and placed one at a time
(dequantized to the model's dtype, or with --quantize kept as its quantized layer), so peak memory is
the model plus one tensor. Quirks undone here:
- llama.cpp stores Llama's Q/K rows interleaved per head (its RoPE rotates adjacent pairs); ours
  rotates halves (HF layout), so those rows are permuted back;
- GPT-2's fused `attn_qkv` is split into q/k/v;
- no `output` tensor means the LM head is tied to the token embedding;
- Llama 3.1+ RoPE scaling is a `rope_freqs` tensor of per-frequency divisors, read back into the
  llama3 parameters that produced it when they are Llama 3's own;
- Mixtral is arch "llama" with stacked expert tensors (`ffn_*_exps`), split into one MLP per expert;
- Gemma-2/3, gpt-oss, Qwen3-MoE and DeepSeek-V2/V3 (MLA): `gguf_archs`.
"""

from __future__ import annotations

import re
import struct
import sys
import warnings
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tqdm import tqdm

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.formats import gguf_archs, gguf_quants
from decoderlm.formats.build import TensorByTensor
from decoderlm.heap import trim_heap
from decoderlm.model import Transformer
from decoderlm.model.rope import inverse_frequencies
from decoderlm.quantize import Blocks, kernels_vectorized
from decoderlm.tokenizer.bpe import HFTokenizer

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, *gguf_quants.BLOCKS)
# --quantize auto: the quantized mode that keeps a file's layer weights as the file has them. Q4_0 /
# Q4_1 / Q8_0 blocks are computed with as they are (exact); K-quant blocks, and the 5-bit, 2/3-bit,
# non-uniform 4-bit (IQ4) and MXFP4 ones (gguf_quants), do not fit the int4 layout and go onto Q8_0's
# finer grid (int8) rather than back to float; float files stay float.
NATIVE_MODES = {Q.Q4_0: "int4", Q.Q4_1: "int4", Q.Q8_0: "int8", Q.Q4_K: "int8", Q.Q5_K: "int8", Q.Q6_K: "int8",
                **dict.fromkeys(gguf_quants.BLOCKS, "int8")}
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", *gguf_archs.FAMILIES)
PROGRESS_BYTES = 300 * 2**20  # files above this show a progress bar (on a terminal) while they load

# llama.cpp tensor name → ours; {i} is the layer.
TENSOR_NAMES = {
    "token_embd": "embed_tokens",
    "position_embd": "embed_positions",
    "output_norm": "norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "layers.{i}.input_layernorm",
    "blk.{i}.ffn_norm": "layers.{i}.post_attention_layernorm",
    "blk.{i}.attn_q": "layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "layers.{i}.self_attn.o_proj",
    "blk.{i}.attn_q_norm": "layers.{i}.self_attn.q_norm",
    "blk.{i}.attn_k_norm": "layers.{i}.self_attn.k_norm",
    "blk.{i}.ffn_gate": "layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "layers.{i}.mlp.down_proj",
    "blk.{i}.ffn_gate_inp": "layers.{i}.mlp.gate",
}
_NAME_RE = re.compile(r"^(?P<base>.+?)\.(?P<param>weight|bias)$")


def load_gguf(path: str | Path, torch_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              quantize: str | None = None) -> tuple[Transformer, HFTokenizer]:
    """(model in eval mode on `device`, tokenizer) from a .gguf file. quantize ("int8", "int4"): each
    weight becomes its quantized layer as it is read (Q4_0/Q4_1 blocks as they are, for int4);
    "auto": the file's own precision kept (`native_mode`)."""
    path = Path(path)
    reader = open_gguf(path)
    meta = Metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    if quantize == "auto":
        quantize = native_mode(reader.tensors, torch.device(device))
    config = gguf_config(meta, tensors)
    tokenizer = gguf_tokenizer(meta)
    generation_defaults = meta.sampling_defaults()
    reader.fields.clear()  # the metadata, read: its ~100k small arrays (SmolLM2: 63 MB) go before the weights come
    fill = TensorByTensor(config, torch_dtype, device, quantize)
    kv_b = gguf_archs.KvB()
    big = path.stat().st_size > PROGRESS_BYTES
    with path.open("rb") as file:
        for t in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False, disable=None if big else True):
            for name, value in convert_tensor(t, config, meta.arch, read_tensor(file, t, blocks=quantize is not None), kv_b):
                if name not in fill.shapes:
                    raise DecoderLMError(f"GGUF tensor {t.name} ({name}) has no place in a {meta.arch} model; the file does not match its metadata")
                if fill.shapes[name] != value.shape:
                    raise DecoderLMError(f"GGUF tensor {t.name} has shape {tuple(value.shape)}, expected {tuple(fill.shapes[name])} for {name}")
                fill.put(name, value)
            trim_heap()
    model, missing = fill.finish()
    if missing:
        raise DecoderLMError(f"{path.name} lacks tensors for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; the file is incomplete or its architecture is not supported")
    model.generation_defaults = generation_defaults
    return model, tokenizer


def native_mode(tensors: list[ReaderTensor], device: torch.device) -> str | None:
    """The mode (NATIVE_MODES) of the type that holds most of the layers' matrix weights; None (float)
    for a float file, off the CPU, or on an x86-64 CPU without AVX2: where the quantized kernels are not fast."""
    sizes = Counter()
    for t in tensors:
        if t.name.startswith("blk.") and len(t.shape) >= 2:
            sizes[t.tensor_type] += int(t.n_elements)
    if device.type != "cpu" or not sizes or not kernels_vectorized():
        return None
    return NATIVE_MODES.get(sizes.most_common(1)[0][0])


def open_gguf(path: Path) -> "FastReader":
    """The file's header and tensor index (nothing is read into memory yet)."""
    if path.is_dir():
        raise DecoderLMError(f"{path} is a directory; give the .gguf file itself")
    try:
        return FastReader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors ... on a truncated or foreign file
        raise DecoderLMError(f"cannot read {path} as GGUF ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                             "the file is truncated or not a GGUF model: download or convert it again") from None


class FastReader(GGUFReader):
    """GGUFReader, faster where a file's header is long (a tokenizer's ~100k strings): it reads a plain
    ndarray view of the memory map (slicing an np.memmap runs Python code per slice), and it cuts
    arrays of strings or numbers in one pass into the parts the library would make (it makes each
    element with several numpy calls: 0.8 s of a cold `chat`'s start on SmolLM2, now well under 0.1 s)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data" and isinstance(value, np.memmap):
            value = value.view(np.ndarray)  # still backed by (and keeping alive) the same mapping
        super().__setattr__(name, value)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        """(size, parts, indices of the value parts, types) of the value at orig_offs, as the library's."""
        data = self.data
        item_type = int(data[orig_offs : orig_offs + 4].view(np.uint32)[0]) if raw_type == GGUFValueType.ARRAY else None
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_type)) if item_type is not None else None
        if self.byte_order != "I" or sys.byteorder != "little" or not (item_type == GGUFValueType.STRING or scalar):
            return super()._get_field_parts(orig_offs, raw_type)  # single values, nested arrays, big-endian files
        parts = [data[orig_offs : orig_offs + 4].view(np.uint32), data[orig_offs + 4 : orig_offs + 12].view(np.uint64)]
        count, offs = int(parts[1][0]), orig_offs + 12
        if scalar is not None:  # one (1,) view per element, like the library's
            values = data[offs : offs + count * np.dtype(scalar).itemsize].view(scalar)
            parts += list(values.reshape(count, 1))
            offs += values.nbytes
        else:  # per string: its uint64 length, then its bytes
            for _ in range(count):
                n = struct.unpack_from("<Q", data, offs)[0]
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + n])
                offs += 8 + n
        values_at = list(range(2, len(parts))) if scalar is not None else list(range(3, len(parts), 2))
        types = [GGUFValueType.ARRAY] + ([GGUFValueType(item_type)] if count else [])
        return offs - orig_offs, parts, values_at, types


class Metadata:
    """GGUF key/value metadata, read lazily (the token list is long)."""

    def __init__(self, reader: GGUFReader) -> None:
        self.fields = reader.fields
        self.arch = str(self.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key.replace("{arch}", getattr(self, "arch", "")))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise DecoderLMError(f"GGUF metadata lacks {key.replace('{arch}', self.arch)}; the file is incomplete, re-convert it with llama.cpp")
        return value

    def sampling_defaults(self) -> dict[str, Any]:
        """llama.cpp's recommended sampling settings (general.sampling.*), when the file has them."""
        keys = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "penalty_repeat": "repetition_penalty"}
        out = {ours: self.get(f"general.sampling.{theirs}") for theirs, ours in keys.items()}
        return {k: (int(v) if k == "top_k" else float(v)) for k, v in out.items() if v is not None}


def gguf_config(meta: Metadata, tensors: dict[str, ReaderTensor]) -> ModelConfig:
    """The model a GGUF file holds, for the architectures decoderlm runs."""
    if meta.arch not in ARCHITECTURES:
        raise DecoderLMError(f"GGUF architecture {meta.arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return ModelConfig(**gguf_fields(meta, tensors))


def gguf_fields(meta: Metadata, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """The one reading of a GGUF header into ModelConfig fields, for any architecture: loading uses it
    (after checking the architecture is one decoderlm runs) and so does `inspect` (for every file)."""
    arch = meta.arch
    if "token_embd.weight" not in tensors:
        raise DecoderLMError("the GGUF file has no token_embd.weight tensor; it is not a language model decoderlm can read")
    n_heads = int(meta.require("{arch}.attention.head_count"))
    d_model = int(meta.require("{arch}.embedding_length"))
    head_dim = int(meta.get("{arch}.attention.key_length", d_model // n_heads))
    rot_dim = int(meta.get("{arch}.rope.dimension_count", head_dim))
    n_kv = meta.get("{arch}.attention.head_count_kv", n_heads)
    n_kv = max(n_kv) if isinstance(n_kv, list) else n_kv
    vocab = tensors["token_embd.weight"].shape[-1]  # the embedding's rows (the token list may be padded or short)
    n_experts = int(meta.get("{arch}.expert_count") or 0)
    fields: dict[str, Any] = dict(
        vocab_size=int(vocab), n_layers=int(meta.require("{arch}.block_count")), d_model=d_model, n_heads=n_heads,
        n_kv_heads=int(n_kv), head_dim=head_dim, ffn_hidden=int(meta.require("{arch}.feed_forward_length")),
        max_seq_len=int(meta.get("{arch}.context_length", 2048)), family="mixtral" if n_experts and arch == "llama" else arch,
        tie_embeddings="output.weight" not in tensors,
        attn_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        attn_out_bias="blk.0.attn_output.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
    if "blk.0.ffn_gate.weight" not in tensors and "blk.0.ffn_gate_exps.weight" not in tensors:
        fields["mlp"] = "gelu_tanh"  # no gate: a plain MLP (GPT-2, and architectures decoderlm only inspects)
    if "blk.0.attn_norm.bias" in tensors:
        fields["norm"] = "layernorm"
    if arch == "gpt2":
        fields.update(norm="layernorm", position="learned", mlp="gelu_tanh", norm_eps=float(meta.get("{arch}.attention.layer_norm_epsilon", 1e-5)))
    else:
        fields.update(norm_eps=float(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6)), rope_theta=float(meta.get("{arch}.rope.freq_base", 10000.0)),
                      partial_rotary_factor=rot_dim / head_dim)
        if "rope_freqs.weight" in tensors:
            factors = dequantize_tensor(tensors["rope_freqs.weight"]).flatten()
            fields["rope_scaling"] = rope_freqs_scaling(factors, rot_dim, fields["rope_theta"])
        elif meta.get("{arch}.rope.scaling.type") == "linear":
            fields["rope_scaling"] = {"rope_type": "linear", "factor": float(meta.require("{arch}.rope.scaling.factor"))}
        elif meta.get("{arch}.rope.scaling.type") == "yarn":  # llama.cpp rounds the blended dims' range (truncate)
            fields["rope_scaling"] = {"rope_type": "yarn", "factor": float(meta.require("{arch}.rope.scaling.factor")),
                                      "original_max_position_embeddings": int(meta.require("{arch}.rope.scaling.original_context_length")),
                                      "beta_fast": float(meta.get("{arch}.rope.scaling.yarn_beta_fast") or 32.0),
                                      "beta_slow": float(meta.get("{arch}.rope.scaling.yarn_beta_slow") or 1.0), "truncate": True}
        elif meta.get("{arch}.rope.scaling.type") not in (None, "none"):
            raise DecoderLMError(f"GGUF rope scaling {meta.get('{arch}.rope.scaling.type')!r} is not supported; supported: linear, yarn")
    if meta.get("{arch}.attention.sliding_window"):
        fields["sliding_window"] = int(meta.get("{arch}.attention.sliding_window"))
    if n_experts:  # llama.cpp's llama arch mixes the chosen experts with renormalized weights, as Mixtral does
        moe_hidden = int(meta.get("{arch}.expert_feed_forward_length") or fields["ffn_hidden"])
        fields.update(n_experts=n_experts, n_experts_per_tok=int(meta.require("{arch}.expert_used_count")),
                      moe_hidden=moe_hidden, moe_renormalize=True)
    if arch in gguf_archs.FAMILIES:
        fields.update(gguf_archs.arch_fields(meta, tensors, fields))
    return fields


def rope_freqs_scaling(factors: torch.Tensor, rot_dim: int, theta: float) -> dict[str, Any] | None:
    """rope_scaling for a `rope_freqs` tensor (one divisor per frequency, shape (rot_dim/2,)).
    llama.cpp writes llama3 scaling this way; when the divisors are exactly those of Llama 3.1/3.2's
    parameters (low 1, high 4, original context 8192; factor = the largest divisor) say llama3, which
    an HF config.json can express, else keep the divisors themselves."""
    if factors.numel() != rot_dim // 2:
        raise DecoderLMError(f"GGUF rope_freqs has {factors.numel()} values, expected {rot_dim // 2} (rotary dims / 2); "
                             "the file does not match its metadata")
    if bool((factors == 1).all()):
        return None
    llama3 = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    implied = inverse_frequencies(rot_dim, theta, None) / inverse_frequencies(rot_dim, theta, llama3)
    if torch.allclose(implied, factors.float(), rtol=1e-5, atol=0):
        return llama3
    return {"rope_type": "freq_factors", "factors": factors.tolist()}


def dequantize_tensor(t: ReaderTensor) -> torch.Tensor:
    """fp32 torch tensor in PyTorch's (out, in) order, read through the memory map (small tensors)."""
    check_type(t)
    if t.tensor_type in gguf_quants.BLOCKS:
        raw = torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(-1).copy())
        return gguf_quants.dequantize_blocks(raw, t.tensor_type).reshape(torch_shape(t))
    values = dequantize(t.data, t.tensor_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values).reshape(torch_shape(t))


def check_type(t: ReaderTensor) -> None:
    if t.tensor_type not in SUPPORTED_TYPES:
        names = ", ".join(q.name for q in SUPPORTED_TYPES)
        raise DecoderLMError(f"GGUF tensor {t.name} is quantized as {t.tensor_type.name}, which is not supported; supported: {names}")


def torch_shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first


def read_tensor(file: BinaryIO, t: ReaderTensor, blocks: bool = False) -> torch.Tensor | Blocks:
    """One tensor in PyTorch's (out, in) order: Q4_0 / Q4_1 / Q8_0 as `Blocks` when `blocks`, else fp32.
    Its bytes are read from the file into memory of their own, not through the memory map: mapped
    pages, once touched, would count in the process's memory until the whole file is unmapped."""
    check_type(t)
    raw = bytearray(int(t.n_bytes))
    file.seek(t.data_offset)
    file.readinto(raw)
    if t.tensor_type in BLOCK_BYTES:
        b = unpack_blocks(torch.frombuffer(raw, dtype=torch.uint8), t.tensor_type, torch_shape(t))
        return b if blocks else b.dequantize()
    if t.tensor_type == Q.F32:
        return torch.frombuffer(raw, dtype=torch.float32).reshape(torch_shape(t))
    if t.tensor_type in gguf_quants.BLOCKS:
        return gguf_quants.dequantize_blocks(torch.frombuffer(raw, dtype=torch.uint8), t.tensor_type).reshape(torch_shape(t))
    return torch.from_numpy(dequantize(np.frombuffer(raw, dtype=np.uint8), t.tensor_type).reshape(torch_shape(t)))


BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}  # per 32 weights: fp16 d (and fp16 m), then the values


def unpack_blocks(raw: torch.Tensor, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> Blocks:
    """ggml's block layout: d (fp16), Q4_1's m (fp16), then Q8_0's 32 int8 values or Q4's 16 bytes
    whose low nibbles are the block's values 0..15 and high nibbles 16..31."""
    grid = (*shape[:-1], shape[-1] // 32)  # (..., N, K/32)
    raw = raw.view(-1, BLOCK_BYTES[kind])  # (blocks, bytes)
    d = raw[:, 0:2].view(torch.float16).float().view(grid)
    if kind == Q.Q8_0:
        return Blocks(raw[:, 2:].view(torch.int8).reshape(shape), d, None)
    packed = raw[:, 4:] if kind == Q.Q4_1 else raw[:, 2:]  # (blocks, 16)
    q = torch.cat((packed & 0x0F, packed >> 4), dim=1).reshape(shape)
    m = raw[:, 2:4].view(torch.float16).float().view(grid) if kind == Q.Q4_1 else -8 * d
    return Blocks(q, d, m)


def convert_tensor(t: ReaderTensor, config: ModelConfig, arch: str, value: torch.Tensor | Blocks,
                   kv_b: gguf_archs.KvB | None = None) -> list[tuple[str, torch.Tensor | Blocks]]:
    """One GGUF tensor's value → (our parameter name, value) pairs (several for fused or stacked tensors;
    none for a part kept until its other half comes: DeepSeek's split kv_b_proj, joined in `kv_b`)."""
    match = _NAME_RE.match(t.name)
    if match is None:
        raise DecoderLMError(f"unexpected GGUF tensor name {t.name}; the file is not a supported {arch} model")
    base, param = match["base"], match["param"]
    if base == "rope_freqs":  # RoPE scaling, already in config.rope_scaling
        return []
    layer = re.match(r"blk\.(\d+)\.(.+)", base)
    key, i = (f"blk.{{i}}.{layer[2]}", layer[1]) if layer else (base, "")
    hd = config.head_dim
    if key == "blk.{i}.attn_qkv":  # GPT-2: q, k, v stacked along rows
        q, k, v = value.split([config.n_heads * hd, config.n_kv_heads * hd, config.n_kv_heads * hd])
        prefix = f"layers.{i}.self_attn"
        return [(f"{prefix}.q_proj.{param}", q), (f"{prefix}.k_proj.{param}", k), (f"{prefix}.v_proj.{param}", v)]
    if key.endswith("_exps"):  # MoE: (n_experts, out, in), one slice per expert
        proj = {"blk.{i}.ffn_gate_exps": "gate_proj", "blk.{i}.ffn_up_exps": "up_proj", "blk.{i}.ffn_down_exps": "down_proj"}[key]
        return [(f"layers.{i}.mlp.experts.{e}.{proj}.{param}", w) for e, w in enumerate(value.unbind(0))]
    if key in ("blk.{i}.attn_k_b", "blk.{i}.attn_v_b") and kv_b is not None:
        return kv_b.add(i, key[-3], value.dequantize() if isinstance(value, Blocks) else value)
    ours = gguf_archs.tensor_name(arch, key) or TENSOR_NAMES.get(key)
    if ours is None:
        raise DecoderLMError(f"GGUF tensor {t.name} is not supported for architecture {arch}")
    if key in gguf_archs.NO_SUFFIX:
        return [(ours.format(i=i), value)]
    if arch in ("llama", "mistral") and key in ("blk.{i}.attn_q", "blk.{i}.attn_k"):
        n_heads = config.n_heads if key.endswith("q") else config.n_kv_heads
        value = value.map(lambda w: unpermute_rope_rows(w, n_heads)) if isinstance(value, Blocks) else unpermute_rope_rows(value, n_heads)
    return [(f"{ours.format(i=i)}.{param}", value)]


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rows (pairs (0, d/2), (1, d/2+1), ... become adjacent); undo it.
    w (n_heads·D, in) or a bias (n_heads·D,)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


# --- tokenizer -------------------------------------------------------------------------------

# How each `tokenizer.ggml.pre` splits text into words before BPE (the regex its merges were learned with).
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_DIGIT_SPLIT = ("smollm", "starcoder", "refact")  # GPT-2's regex after cutting digits apart


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in ("gpt2", "gpt-2", "default", ""):
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known to decoderlm; splitting words like GPT-2", stacklevel=3)
    return byte_level


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map, the spelling byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def gguf_tokenizer(meta: Metadata) -> HFTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise DecoderLMError(f"GGUF tokenizer model {kind!r} is not supported; "
                             "supported: gpt2 (byte-level BPE: SmolLM2, Llama 3, Qwen, GPT-2), "
                             "llama (SentencePiece BPE: Llama 2, Mistral 7B)")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    tk = _byte_level_bpe(meta, tokens, types) if kind == "gpt2" else _sentencepiece_bpe(meta, tokens, types)
    special = (TokenType.CONTROL, TokenType.UNKNOWN) if kind == "llama" else (TokenType.CONTROL,)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in special])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    specials = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    end_of_turn = [int(meta.get(f"tokenizer.ggml.{k}")) for k in ("eot_token_id", "eom_token_id") if meta.get(f"tokenizer.ggml.{k}") is not None]
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp adds BOS to SentencePiece text unless told not to
    return HFTokenizer(tk, special_tokens=specials, eos_token_ids=end_of_turn, chat_template=meta.get("tokenizer.chat_template"),
                       add_bos_token=bool(add_bos), add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)))


def _byte_level_bpe(meta: Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    alphabet = set(byte_alphabet().values())
    spell = byte_alphabet()
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == TokenType.NORMAL and not set(tok) <= alphabet:  # stored as raw text: respell its bytes
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama3", "llama-v3", "llama-bpe"))
    tk = Tokenizer(bpe)
    if pre in _SPLITS and pre.startswith("qwen"):
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = _pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(meta: Metadata, tokens: list[str], types: list[int]) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral 7B): spaces become "▁" (one is prepended to the text),
    characters outside the vocabulary fall back to <0xXX> byte tokens, and pairs merge in the order of
    the merged piece's score — the file lists scores rather than merges."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    else:
        scores: list[float] = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        ranked = sorted(range(len(tokens)), key=lambda i: -scores[i])  # stable: ties keep file order
        merges = [(tokens[i][:j], tokens[i][j:]) for i in ranked if types[i] == TokenType.NORMAL
                  for j in range(1, len(tokens[i])) if tokens[i][:j] in vocab and tokens[i][j:] in vocab]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if unk is not None else None
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prepend = "first" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    strip = [decoders.Strip(content=" ", left=1)] if prepend == "first" else []
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tk
