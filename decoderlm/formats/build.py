"""Building a model for a checkpoint's weights: on the meta device, then given its weights in place
(`empty_model`) or one tensor at a time, each quantized as it arrives (`TensorByTensor`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from decoderlm.config import ModelConfig
from decoderlm.model import Transformer


def empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> Transformer:
    """A model whose parameters are allocated once, in `dtype` on `device`, with no values yet: built on
    the meta device, so no time goes to a random init (or a CPU copy) that the weights overwrite."""
    model = meta_model(config).to(dtype)
    for module in model.modules():  # kept in fp32 whatever the dtype, as the checkpoint's own code does (DeepSeek-V3's router)
        if getattr(module, "keep_fp32", False):
            module.float()
    model = model.to_empty(device=device)
    if config.tie_embeddings:  # to_empty gives each module its own storage
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope()  # a computed buffer: the meta build held no values
    return model


class _OnMeta(TorchFunctionMode):
    """Modules built inside get their parameters on the meta device, without random init (nothing
    to initialize). Only the constructors of parameters are redirected: `with torch.device("meta")`
    would move everything, and the meta kernels of normal_ and arange import torch._dynamo and
    sympy, ~75 MB a loader has no use for. Small computed tables (RoPE's) stay on the CPU."""

    FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.init.normal_, torch.Tensor.normal_):
            return args[0] if args else kwargs["tensor"]
        if func in self.FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def meta_model(config: ModelConfig) -> Transformer:
    """The model's modules with shapes but no storage (and no values)."""
    with _OnMeta():
        return Transformer(config)


class TensorByTensor:
    """A model built on the meta device and given its weights one tensor at a time, each becoming its
    parameter (in `dtype` on `device`) or, with `quantize`, its quantized layer straight away: the
    model never exists whole in full precision, so loading peaks near the size of what it keeps.
    Weights may be float tensors or `decoderlm.quantize.Blocks` (a GGUF file's own blocks)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", quantize: str | None = None) -> None:
        """quantize: one of `decoderlm.quantize.MODES`, or None for float weights."""
        self.model = meta_model(config)
        self.dtype, self.device, self.quantize = dtype, torch.device(device), quantize
        self.shapes = {name: p.shape for name, p in self.model.named_parameters(remove_duplicate=False)}
        self.buffers = {name for name in self.model.state_dict(keep_vars=True) if name not in self.shapes}  # persistent: DeepSeek-V3's router bias
        self.shapes |= {name: self.model.get_buffer(name).shape for name in self.buffers}
        self.loaded: set[str] = set()

    def put(self, name: str, value: torch.Tensor) -> None:
        """Place the weight `name` (one of self.shapes, with that shape): as the quantized layers
        `decoderlm.quantize.quantized_layers` makes of it, or as a parameter."""
        from decoderlm.quantize import dequantize, quantized_layers, set_module

        owner, _, param = name.rpartition(".")
        module = self.model.get_submodule(owner)
        bias = getattr(module, "bias", None) if f"{owner}.bias" in self.loaded else None
        if name in self.buffers:  # the router reads it in fp32
            module.register_buffer(param, dequantize(value).to(self.device, torch.float32))
            self.loaded.add(name)
            return
        layers = quantized_layers(self.model, name, value, self.quantize, self.dtype, bias) if self.quantize else {}
        for layer_name, layer in layers.items():
            set_module(self.model, layer_name, layer.to(self.device))
            self.loaded.add(f"{layer_name}.weight")
        if not layers:
            setattr(module, param, nn.Parameter(dequantize(value).to(self.device, self.dtype)))
        self.loaded.add(name)

    def finish(self) -> tuple[Transformer, list[str]]:
        """(the model in eval mode, names of the weights never given)."""
        if self.model.config.tie_embeddings and not self.quantize:
            self.model.lm_head.weight = self.model.embed_tokens.weight
            self.loaded.add("lm_head.weight")
        missing = sorted(n for n in self.shapes if n not in self.loaded)
        if not missing:
            self.model.init_rope()
        return self.model.eval(), missing
