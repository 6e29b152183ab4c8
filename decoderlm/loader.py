"""`load(source)`: one place that turns what a user names into (model, tokenizer).

A source is a decoderlm training run folder, an HF folder (config.json + safetensors), a LoRA adapter
folder (merged into the base it names), a `.gguf` file, or a known name (see `decoderlm.names`).
Each format's reader lives in `decoderlm.formats`.
The model is built on the meta device and its weights are copied straight onto the requested
device, one tensor at a time, so a GPU load never holds a second full copy on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decoderlm.config import ModelConfig
from decoderlm.device import resolve_device
from decoderlm.errors import DecoderLMError
from decoderlm.model import Transformer
from decoderlm.model.fuse import fuse_projections
from decoderlm.train import checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DecoderLMError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_source(source: str | Path) -> Path:
    """A path as given, or the file a known name stands for."""
    from decoderlm import names

    path = Path(source)
    if path.exists():
        return path
    if str(source) in names.KNOWN:
        return names.locate(str(source))
    raise DecoderLMError(f"model {source!s} not found: give a run folder, an HF folder, a .gguf file, or a known name ({', '.join(names.KNOWN)})")


def load(source: str | Path, dtype: str | torch.dtype = "float32", quantize: str | None = None,
         device: str | torch.device = "cpu", fuse: bool = True) -> tuple[Transformer, object]:
    """(model in eval mode, tokenizer) from any source decoderlm understands, built on `device`.
    quantize: "int8" or "int4" weights for faster CPU decoding (see `decoderlm.quantize`); "auto": a
    quantized GGUF keeps its own precision (Q4 blocks int4, Q8_0 and K-quants int8), anything else
    loads in `dtype`; None or "none": `dtype` (a quantized GGUF dequantized exactly).
    fuse: q/k/v and gate/up projections stacked for fast inference (see `decoderlm.model.fuse`);
    False keeps one module per checkpoint matrix, for LoRA, which wraps q_proj, v_proj, ... by name."""
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    if quantize == "none":  # the CLI's spelling of None
        quantize = None
    if quantize is not None:
        from decoderlm.quantize import MODES

        if quantize not in (*MODES, "auto"):
            raise DecoderLMError(f"quantize {quantize!r} is not supported; use one of {', '.join(MODES)}, auto, none")
        path = resolve_source(source)
        if path.is_file() and path.suffix == ".gguf":  # quantized tensor by tensor as it loads
            from decoderlm.formats.gguf import load_gguf

            model, tokenizer = load_gguf(path, torch_dtype, torch_device, quantize)
            if fuse:  # a quantized model's layers are stacked as they are (decoderlm.quantize.concat)
                fuse_projections(model)
            return model, tokenizer
        if quantize == "auto":  # float weights stay float
            quantize = None
    model, tokenizer = _load(source, torch_dtype, torch_device)
    if fuse:  # before quantizing: a stacked matrix quantizes row by row to the same numbers
        fuse_projections(model)
    if quantize is not None:
        from decoderlm.quantize import quantize as quantize_weights

        quantize_weights(model, quantize)
    return model, tokenizer


def _load(source: str | Path, torch_dtype: torch.dtype, device: torch.device) -> tuple[Transformer, object]:
    path = resolve_source(source)
    if path.is_dir() and (path / checkpoint.CKPT_NAME).is_file():
        return _load_run(path, torch_dtype, device)
    if path.is_dir() and (path / "adapter_config.json").is_file():  # a LoRA run: its base with the adapter merged in
        from decoderlm.finetune.lora import load_merged

        return load_merged(path, torch_dtype, device)
    if path.is_dir() and (path / "config.json").exists():  # read_json explains a config.json that is not a file
        from decoderlm.formats.hf import load_hf

        return load_hf(path, torch_dtype, device)
    if path.is_file() and path.suffix == ".gguf":
        from decoderlm.formats.gguf import load_gguf

        return load_gguf(path, torch_dtype, device)
    raise DecoderLMError(f"{source} is not a model decoderlm can load: expected a run folder (ckpt.pt), an HF folder (config.json + *.safetensors) or a .gguf file")


def _load_run(path: Path, torch_dtype: torch.dtype, device: torch.device) -> tuple[Transformer, object]:
    """A decoderlm training run folder: the checkpoint's weights copied into a model built on `device`
    (an FSDP run's shards are gathered whole, in float32, then cast)."""
    from decoderlm.formats import empty_model

    state = checkpoint.read(path)
    config = ModelConfig.from_dict(state["config"])
    sharded = state.get("sharded")
    model = empty_model(config, torch.float32 if sharded else torch_dtype, device)
    try:
        if sharded:
            checkpoint.load_sharded(path / sharded, model)
        else:
            model.load_state_dict(state["model"])
    except RuntimeError as e:
        problem = " ".join(str(e).split())[:200]
        raise DecoderLMError(f"checkpoint {path / checkpoint.CKPT_NAME} does not match its own config ({problem}); retrain or restore it") from None
    if sharded:
        model.to(torch_dtype).init_rope()
    return model.eval(), checkpoint.tokenizer_from_dict(state["tokenizer"])
