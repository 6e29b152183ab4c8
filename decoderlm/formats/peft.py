"""HF PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors), read and written.

Tensors are named by the checkpoint's module names, so `peft.PeftModel.from_pretrained` loads what
`save_adapter` writes on the transformers twin, and `load_adapter` reads PEFT's own adapters. The
layers themselves (`LoRALinear`, apply, merge) live with the model: `decoderlm.model.lora`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from decoderlm.errors import DecoderLMError
from decoderlm.formats.families import expand, family_of
from decoderlm.model import Transformer
from decoderlm.model.lora import apply_lora, lora_layers

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def checkpoint_modules(model: Transformer) -> dict[str, str]:
    """Our module name → the HF checkpoint's, for linear layers stored as they are (not fused or transposed)."""
    params = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters() if "lora_" not in name}
    table = expand(family_of(model.config.family), model.config, params)
    return {row.ours[0].removesuffix(".weight"): row.ckpt.removesuffix(".weight")
            for row in table.values() if len(row.ours) == 1 and not row.transpose and row.ckpt.endswith(".weight")}


def save_adapter(model: Transformer, out_dir: str | Path, base: str) -> None:
    """adapter_config.json + adapter_model.safetensors, as PEFT writes them; `base` is the base model's path or name."""
    layers = lora_layers(model)
    names = checkpoint_modules(model)
    unstorable = sorted({n.rsplit(".", 1)[-1] for n in layers if n not in names})
    if unstorable:
        raise DecoderLMError(f"a {model.config.family} checkpoint fuses or transposes {', '.join(unstorable)}, so PEFT could not "
                             "load adapters on it; choose other --lora-targets")
    first = next(iter(layers.values()))
    tensors = {}
    for name, layer in layers.items():
        for part in ("lora_A", "lora_B"):
            tensors[f"{PEFT_PREFIX}{names[name]}.{part}.weight"] = getattr(layer, part)["default"].weight.detach().contiguous().cpu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    rank = first.lora_A["default"].out_features
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
        "lora_alpha": first.scaling * rank, "lora_dropout": first.lora_dropout.p, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in layers}), "use_rslora": False, "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DecoderLMError(f"cannot read {path} ({e}); it should be a PEFT adapter config") from None
    unsupported = [k for k in ("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform",
                               "modules_to_save") if config.get(k)]
    if config.get("peft_type", "LORA") != "LORA" or unsupported or not isinstance(config.get("r"), int):
        what = ", ".join(unsupported) or f"peft_type {config.get('peft_type')}"
        raise DecoderLMError(f"{path} is not a plain LoRA adapter ({what}); "
                             "decoderlm reads LoRA adapters with one integer r for all target layers")
    return config


def base_model(folder: str | Path) -> str:
    """The path or name of the model the adapter in `folder` was trained on."""
    base = read_adapter_config(folder).get("base_model_name_or_path")
    if not base:
        raise DecoderLMError(f"{Path(folder) / ADAPTER_CONFIG} does not name its base model (base_model_name_or_path); add it")
    return base


def load_adapter(model: Transformer, folder: str | Path) -> Transformer:
    """Wrap `model`'s target layers and fill the adapters from a PEFT folder (ours or PEFT's own)."""
    config = read_adapter_config(folder)
    targets = config["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    layers = apply_lora(model, config["r"], config.get("lora_alpha", 8), targets)
    names = checkpoint_modules(model)
    try:
        tensors = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    except (OSError, SafetensorError) as e:
        raise DecoderLMError(f"cannot read {Path(folder) / ADAPTER_WEIGHTS} ({e}); restore the adapter's weights") from None
    for name, layer in layers.items():
        for part in ("lora_A", "lora_B"):
            key = f"{PEFT_PREFIX}{names.get(name, name)}.{part}.weight"
            if key not in tensors:
                raise DecoderLMError(f"{Path(folder) / ADAPTER_WEIGHTS} lacks {key}; the adapter does not match this base model")
            weight = getattr(layer, part)["default"].weight
            if tensors[key].shape != weight.shape:
                raise DecoderLMError(f"{key} has shape {tuple(tensors[key].shape)}, the base model needs {tuple(weight.shape)}; "
                                     "the adapter was trained on another model")
            with torch.no_grad():
                weight.copy_(tensors[key])
    return model
