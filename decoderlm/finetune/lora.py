"""LoRA: a frozen linear layer plus a trainable low-rank update, y = W x + (alpha / r) · B A x.

B starts at zero, so training starts from the base model exactly. Parameter names follow HF PEFT
(`base_layer`, `lora_A.default`, `lora_B.default`), and adapters are written in PEFT's format
(adapter_config.json + adapter_model.safetensors, tensors named by the checkpoint's module names),
so `peft.PeftModel.from_pretrained` loads them on the transformers twin. `merge_lora` folds B A into W
for export: the merged model is a plain `Transformer`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.formats.families import expand, family_of
from decoderlm.model import Transformer
from decoderlm.model.fuse import unfuse_projections

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        self.lora_dropout = nn.Dropout(dropout)
        self.scaling = alpha / rank
        self.enabled = True  # off: the base model alone (DPO's reference)
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))  # PEFT's init: A random, B zero
        nn.init.zeros_(self.lora_B["default"].weight)
        self.to(base.weight.device, base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.enabled:
            return y
        return y + self.lora_B["default"](self.lora_A["default"](self.lora_dropout(x))) * self.scaling

    def merged(self) -> nn.Linear:
        """The base layer with W + scaling · B A folded in."""
        delta = self.lora_B["default"].weight @ self.lora_A["default"].weight  # (out, in)
        with torch.no_grad():
            self.base_layer.weight += (delta * self.scaling).to(self.base_layer.weight.dtype)
        return self.base_layer


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: Transformer, rank: int, alpha: float, targets: list[str], dropout: float = 0.0) -> dict[str, LoRALinear]:
    """Wrap every nn.Linear whose last name is in `targets` (q_proj, v_proj, ...); freeze everything else."""
    if rank < 1:
        raise DecoderLMError(f"--lora-rank must be a positive integer, got {rank}")
    unfuse_projections(model)  # a model from `decoderlm.load` has q/k/v (gate/up) stacked: one Linear each again
    found = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets}
    missing = sorted(set(targets) - {name.rsplit(".", 1)[-1] for name in found})
    if missing:
        present = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")})
        raise DecoderLMError(f"--lora-targets: this model has no linear layer named {', '.join(missing)}; choose from {', '.join(present)}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in found.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, LoRALinear(linear, rank, alpha, dropout))
    return lora_layers(model)


def set_lora_enabled(model: nn.Module, enabled: bool) -> None:
    for layer in lora_layers(model).values():
        layer.enabled = enabled


def merge_lora(model: Transformer) -> Transformer:
    """Fold every adapter into its base weight and unwrap it: a plain Transformer again."""
    for name, layer in lora_layers(model).items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer.merged())
    return model


def trainable_summary(model: nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)"


# --- PEFT format --------------------------------------------------------------------------------

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


def load_merged(folder: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device = torch.device("cpu")) -> tuple[Transformer, object]:
    """(model, tokenizer) of an adapter folder: the base it names, with the adapter merged in."""
    from decoderlm.loader import load

    base = read_adapter_config(folder).get("base_model_name_or_path")
    if not base:
        raise DecoderLMError(f"{Path(folder) / ADAPTER_CONFIG} does not name its base model (base_model_name_or_path); add it")
    model, tokenizer = load(base, device=device, fuse=False)  # the adapter names q_proj, v_proj, ...; `load` fuses after merging
    merge_lora(load_adapter(model, folder))
    model.to(dtype).init_rope()  # rope tables stay fp32 whatever the weights' dtype
    return model.eval(), tokenizer
