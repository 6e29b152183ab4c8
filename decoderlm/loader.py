"""`load(source)`: one place that turns what a user names into (model, tokenizer).

A source is a decoderlm training run folder, an HF folder (config.json + safetensors), a LoRA adapter
folder (merged into the base it names), a `.gguf` file, or a known name (see `decoderlm.names`).
`decoderlm.formats.detect` tells which; each format's reader lives in `decoderlm.formats`.
The model is built on the meta device and its weights are copied straight onto the requested
device, one tensor at a time, so a GPU load never holds a second full copy on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decoderlm import names
from decoderlm.device import resolve_device
from decoderlm.errors import DecoderLMError
from decoderlm.formats import Format, detect, peft, runs
from decoderlm.model import Transformer
from decoderlm.model.fuse import fuse_projections
from decoderlm.model.lora import merge_lora
from decoderlm.kv_cache import store_keys_in
from decoderlm.quantize import ACTIVATIONS, BlockLinear, Int4Linear, Int8Linear, parse_mode, round_activations
from decoderlm.quantize import quantize as quantize_weights
from decoderlm.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE = {"auto": None, "fp16": torch.float16, "fp32": torch.float32}  # --kv-cache: what keys and values are kept in


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DecoderLMError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load(source: str | Path, dtype: str | torch.dtype = "float32", quantize: str | None = None,
         device: str | torch.device = "cpu", fuse: bool = True, text: bool = True,
         activations: str = "auto", kv_cache: str = "auto") -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, tokenizer) from any source decoderlm understands, built on `device`.
    quantize: "int8" or "int4" weights for faster CPU decoding (see `decoderlm.quantize`); "auto": a
    quantized GGUF keeps its own precision (Q4 blocks int4, Q8_0 and K-quants int8), anything else
    loads in `dtype`; None or "none": `dtype` (a quantized GGUF dequantized exactly).
    fuse: q/k/v and gate/up projections stacked for fast inference (see `decoderlm.model.fuse`);
    False keeps one module per checkpoint matrix, for LoRA, which wraps q_proj, v_proj, ... by name.
    text=False: an HF folder without tokenizer files loads with an `IdsOnly` tokenizer (driven by token ids).
    activations: how quantized layers on decoderlm's block kernels take their inputs in decode steps
    (see `decoderlm.quantize.BlockLinear`): "int16", rounded to 16 bits per 32 with integer dot products
    (nearly the speed of int8 for one row, 1/65024 of a block's largest input from fp32); "int8",
    llama.cpp's arithmetic; "fp32"; "auto" (the default): int16 where there are such layers, else fp32.
    Prompts are read in fp32, but with "auto" on a CPU with AVX512-VNNI in int16, faster there than fp32
    BLAS (`quantize.round_activations`).
    kv_cache: the precision keys and values are kept in (`kv_cache.store_keys_in`): "fp16", "fp32", or "auto"
    (the default): fp16 for a model with quantized layers, as llama.cpp keeps its cache, else the model's dtype."""
    if activations not in ACTIVATIONS:
        raise DecoderLMError(f"activations {activations!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
    if kv_cache not in KV_CACHE:
        raise DecoderLMError(f"kv_cache {kv_cache!r} is not supported; use one of {', '.join(KV_CACHE)}")
    model, tokenizer = _load_weights(source, dtype, quantize, device, fuse, text)
    if not round_activations(model, activations) and activations in ("int16", "int8"):
        raise DecoderLMError(f"--activations {activations} needs layers on decoderlm's block kernels: a quantized GGUF with "
                             "--quantize auto, or --quantize int4 / int8, on an x86-64 CPU with a C compiler")
    quantized = model.norm.weight.dtype == torch.float32 and any(isinstance(m, (BlockLinear, Int4Linear, Int8Linear)) for m in model.modules())
    store_keys_in(model, KV_CACHE[kv_cache] or (torch.float16 if quantized else None))
    return model, tokenizer


def _load_weights(source: str | Path, dtype: str | torch.dtype, quantize: str | None, device: str | torch.device,
                  fuse: bool, text: bool) -> tuple[Transformer, Tokenizer]:
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    mode = parse_mode(quantize)
    path = names.resolve(source)
    kind = detect(path)
    if kind == "gguf" and mode is not None:  # quantized tensor by tensor as it loads
        from decoderlm.formats.gguf import load_gguf

        model, tokenizer = load_gguf(path, torch_dtype, torch_device, mode)
        if fuse:  # a quantized model's layers are stacked as they are (decoderlm.quantize.concat)
            fuse_projections(model)
        return model, tokenizer
    model, tokenizer = _load(source, path, kind, torch_dtype, torch_device, text)
    if fuse:  # before quantizing: a stacked matrix quantizes row by row to the same numbers
        fuse_projections(model)
    if mode not in (None, "auto"):  # auto: float weights stay float
        quantize_weights(model, mode)
    return model, tokenizer


def _load(source: str | Path, path: Path, kind: Format | None, torch_dtype: torch.dtype, device: torch.device,
          text: bool = True) -> tuple[Transformer, Tokenizer]:
    if kind == "run":
        return runs.load_run(path, torch_dtype, device)
    if kind == "peft":  # a LoRA run: its base with the adapter merged in
        return _load_merged(path, torch_dtype, device)
    if kind == "hf":
        from decoderlm.formats.hf import load_hf

        return load_hf(path, torch_dtype, device, text)
    if kind == "gguf":
        from decoderlm.formats.gguf import load_gguf

        return load_gguf(path, torch_dtype, device)
    raise DecoderLMError(f"{source} is not a model decoderlm can load: expected a run folder (ckpt.pt), an HF folder (config.json + *.safetensors) or a .gguf file")


def _load_merged(folder: Path, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, Tokenizer]:
    """(model, tokenizer) of an adapter folder: the base it names, with the adapter merged in."""
    model, tokenizer = load(peft.base_model(folder), device=device, fuse=False)  # the adapter names q_proj, v_proj, ...; `load` fuses after merging
    merge_lora(peft.load_adapter(model, folder))
    model.to(dtype).init_rope()  # rope tables stay fp32 whatever the weights' dtype
    return model.eval(), tokenizer
