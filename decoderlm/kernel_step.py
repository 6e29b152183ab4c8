"""An eager decode step without the dispatch: a Llama-shaped model's one-token forward as decoderlm's
kernels called one after another, with what every call needs prepared once.

Why: the kernels of SmolLM2-135M's decode step take ~11.5 ms a token on a 2-core CPU, but the step
through `Transformer.forward` took ~16.5: per layer nine nn.Module calls, checks written for every kind
of input, a new tensor per op. Here the checks are made once per model (`unsupported`), each layer's
outputs go to buffers allocated once, and each projection's kernel is called with its weights'
addresses read once. That comes near the compiled step's speed (`decoderlm.compiled`; ~10 % behind it
on SmolLM2, the Python left between the kernels) with nothing to build, so a model's first run decodes
almost as fast as its later ones.

It computes what `Transformer.forward` computes for one token per row over a `KVCache`: the same
kernels on the same inputs in the same order, so the same bits (tests/test_kernel_step.py holds it to
that, logit for logit). A model it does not cover (another layer kind, hooks on a module, float
projections, a rolling cache) decodes through `Transformer.forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from decoderlm import kernels
from decoderlm.kv_cache import KVCache, cache_dtype
from decoderlm.model import Transformer
from decoderlm.model.attention import Attention
from decoderlm.model.mlp import MLP
from decoderlm.model.norm import RMSNorm
from decoderlm.model.rope import rope_cos_sin
from decoderlm.quantize import BlockLinear


def unsupported(model: Transformer) -> str | None:
    """Why `KernelStep` cannot run this model's decode steps; None when it can."""
    cfg = model.config
    if not kernels.available():
        return "decoderlm's kernels are not available here"
    param = next(model.parameters())
    if model.training or param.dtype != torch.float32 or param.device.type != "cpu":
        return "the kernels' steps run an fp32 model in eval mode on the CPU"
    if cfg.position != "rope" or cfg.mrope_section or model.rope_by_length or cfg.rope_local_theta is not None:
        return "positions other than plain RoPE"
    if cfg.embed_scale != 1.0 or cfg.final_logit_softcapping is not None or not cfg.causal or model.windows != [None]:
        return "an embedding scale, logit soft-capping, a sliding window or non-causal attention"
    hooked = nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
    if hooked or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "a module has forward hooks, which only its forward calls"
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        if block.post_norm or block.attn_out_norm is not None or block.ffn_out_norm is not None:
            return "norms other than pre-norm"
        if not all(type(n) is RMSNorm and not n.offset for n in (block.input_layernorm, block.post_attention_layernorm)):
            return "a norm other than RMSNorm"
        if type(attn) is not Attention or attn.q_norm is not None or attn.softcap is not None or attn.sinks is not None:
            return "an attention with QK-norm, soft-capping or sinks, or multi-head latent attention"
        if type(mlp) is not MLP or mlp.gate_up_proj is None:
            return "an MLP other than a fused gated one"
        if not all(type(p) is BlockLinear and not p.exact for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "projections not on decoderlm's block kernels"
    return None


class Projection:
    """A BlockLinear's kernel call (`kernels.matmul`) into a buffer of its own, its weights' addresses read once."""

    def __init__(self, layer: BlockLinear) -> None:
        q, d, m = layer.blocks, layer.block_scales, layer.block_offsets
        self.kernel = kernels.matmul_entry(m is None, layer.activations)  # a decode step's rounding (no prompt here)
        self.weights = (q.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr())
        self.K, self.N, self.bias = d.shape[1] * 32, q.shape[0], layer.bias
        self.out: torch.Tensor | None = None  # (B, N), reused while B stays

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, K) contiguous fp32 → (B, N), the layer's output."""
        B = x.shape[0]
        if self.out is None or self.out.shape[0] != B:
            self.out = torch.empty(B, self.N)
        self.kernel(x.data_ptr(), B, self.K, *self.weights, self.N, self.out.data_ptr())
        return self.out if self.bias is None else self.out.add_(self.bias)


class Norm:
    """An RMSNorm's kernel call (`kernels.rms_norm`) into a buffer of its own."""

    def __init__(self, norm: RMSNorm) -> None:
        self.kernel, self.weight, self.eps = kernels.function("rms_norm"), norm.weight.data_ptr(), norm.eps
        self.out: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, D) contiguous → (B, D)."""
        if self.out is None or self.out.shape != x.shape:
            self.out = torch.empty_like(x)
        self.kernel(x.data_ptr(), x.shape[0], x.shape[1], self.weight, self.eps, self.out.data_ptr())
        return self.out


class KernelStep:
    """A `generate.Step` for models `unsupported` accepts: `stream` decodes through it where no compiled
    step runs. Built per generation (it reads the layers' weights and activations setting as they are)."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.layers = [(block.self_attn, block.mlp, Norm(block.input_layernorm), Projection(block.self_attn.qkv_proj),
                        Projection(block.self_attn.o_proj), Norm(block.post_attention_layernorm),
                        Projection(block.mlp.gate_up_proj), Projection(block.mlp.down_proj)) for block in model.layers]

    @classmethod
    def of(cls, model: Transformer) -> KernelStep | None:
        """The model's kernel step, or None where `unsupported` gives a reason."""
        return None if unsupported(model) else cls(model)

    def new_cache(self, n_slots: int) -> KVCache:
        return KVCache(self.model.config, 1, n_slots, dtype=cache_dtype(self.model), device=self.model.norm.weight.device)

    def step(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed one token per row (B,) at the cache's next position; return its logits (B, V)."""
        model, B = self.model, token.shape[0]
        x = model.embed_tokens(token[:, None]).view(B, -1)  # (B, D): the residual stream, added to in place
        rope = rope_cos_sin(cache.positions(1, None, x.device), model.inv_freq, x.dtype, model.rope_factor)  # (B or 1, 1, 1, rot) each
        mask = cache.mask(1, None, None, x.dtype, x.device)  # (B, 1, 1, L)
        for attn, mlp, norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj in self.layers:  # Block.forward, pre-norm
            qkv = qkv_proj(norm1(x)).view(B, -1, attn.head_dim)  # (B, H + 2·Hkv, D)
            y = cache.rope_attend_one(attn.layer, qkv, rope, mask, attn.scale or attn.head_dim ** -0.5)  # (B, H, D)
            x.add_(o_proj(y.view(B, -1)))
            gate, up = gate_up_proj(norm2(x)).chunk(2, dim=-1)  # (B, hidden) each
            x.add_(down_proj(mlp.glu(gate, up)))
        cache.advance(1)
        return model.lm_head(model.norm(x.view(B, 1, -1)))[:, -1]  # (B, V), as one token per sequence
