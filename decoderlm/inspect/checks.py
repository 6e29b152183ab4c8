"""Properties every decoder-only LM must have, measured on a real model.

- causal: a token's logits cannot depend on later tokens, so changing the future must leave every
  earlier row of logits unchanged (exactly, up to rounding).
- kv-cache: decoding token by token through the cache must give the logits of one full forward.
- overfit: a fresh small model of the same config must be able to memorize one sentence; if it
  cannot, gradients do not reach the weights or the model cannot see its context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from decoderlm.config import ModelConfig
from decoderlm.kv_cache import cache_dtype, cache_for
from decoderlm.model import Transformer

SENTENCE = "The quick brown fox jumps over the lazy dog."


@dataclass
class CheckResult:
    name: str
    measured: str  # what was measured, in words
    value: float
    threshold: float

    @property
    def passed(self) -> bool:
        return self.value <= self.threshold  # NaN fails

    def line(self) -> str:
        return f"{self.name}: {self.measured} = {self.value:.3g} (must be <= {self.threshold:g}) {'PASS' if self.passed else 'FAIL'}"


def _tolerance(model: Transformer, fp32: float, low: float) -> float:
    return fp32 if next(model.parameters()).dtype == torch.float32 else low


def _random_ids(model: Transformer, n_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = min(n_tokens, model.config.max_seq_len)
    ids = torch.randint(model.config.vocab_size, (1, n), generator=gen)
    return ids.to(next(model.parameters()).device)  # (1, T)


@torch.inference_mode()
def check_causal(model: Transformer, n_tokens: int = 16, seed: int = 0, tol: float | None = None) -> CheckResult:
    """Replace every token from a cut on; logits before the cut must not move."""
    model.eval()
    ids = _random_ids(model, n_tokens, seed)
    T, V = ids.shape[1], model.config.vocab_size
    base = model(ids).logits.float()  # (1, T, V)
    worst = 0.0
    for cut in sorted({T // 2, T - 1}):
        changed = ids.clone()
        changed[:, cut:] = (ids[:, cut:] + 1) % V  # every future token differs
        moved = (model(changed).logits.float()[:, :cut] - base[:, :cut]).abs().max()
        worst = max(worst, float(moved))
    tol = tol if tol is not None else _tolerance(model, 1e-5, 1e-3)
    return CheckResult("causal", "max |Δ logit| before the changed tokens", worst, tol)


@torch.inference_mode()
def check_kv_cache(model: Transformer, n_tokens: int = 24, seed: int = 0, tol: float | None = None) -> CheckResult:
    """Prefill half the tokens, decode the rest one at a time; compare with one forward of all."""
    model.eval()
    ids = _random_ids(model, n_tokens, seed)
    T = ids.shape[1]
    param = next(model.parameters())
    full = model(ids).logits.float()  # (1, T, V)
    if tol is None:  # rounding differs between the two paths: allow a small fraction of the logits' scale
        tol = max(10.0, float(full.abs().max())) * _tolerance(model, 1e-5, 5e-3)
    cache = cache_for(model.config, 1, T, dtype=cache_dtype(model), device=param.device)
    try:
        steps = [model(ids[:, : T // 2], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(T // 2, T)]
    except RuntimeError as e:  # a cache that breaks shapes is a failed check, not a crash
        return CheckResult("kv-cache", f"cached decoding crashed ({str(e).splitlines()[0][:80]}); max |cached − full logits|", float("inf"), tol)
    cached = torch.cat(steps, dim=1).float()  # (1, T, V)
    diff = float((cached - full).abs().max())
    return CheckResult("kv-cache", "max |cached − full logits|", diff, tol)


def shrink(config: ModelConfig, vocab_size: int = 256) -> ModelConfig:
    """The same family (norm, MLP, positions, GQA ratio, experts, window) at a size a CPU trains in seconds."""
    n_heads = min(config.n_heads, 4)
    n_kv = max(1, n_heads // config.gqa_group)
    while n_heads % n_kv:
        n_kv -= 1
    head_dim = 16
    n_experts = min(config.n_experts, 4)
    n_layers = min(config.n_layers, 2)
    types = config.layer_types
    if types is not None:  # both kinds where the model has both (Gemma-3's first full layer is its 6th)
        types = sorted(set(types), reverse=True) if n_layers == 2 and len(set(types)) == 2 else types[:n_layers]
    return dataclasses.replace(
        config, vocab_size=vocab_size, n_layers=n_layers, layer_types=types, d_model=n_heads * head_dim, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=head_dim, ffn_hidden=4 * n_heads * head_dim, max_seq_len=128, dropout=0.0,
        sliding_window=min(config.sliding_window, 16) if config.sliding_window else None, n_experts=n_experts,
        n_experts_per_tok=min(config.n_experts_per_tok, max(n_experts, 1)), moe_hidden=2 * n_heads * head_dim if n_experts else None,
    )


def check_overfit(config: ModelConfig, text: str = SENTENCE, steps: int = 300, lr: float = 1e-2, seed: int = 0, threshold: float = 0.05) -> CheckResult:
    """Train a fresh shrunk model on the bytes of one sentence; stop once the loss is below threshold.

    Runs on one thread: for matrices this small, more threads cost more in synchronization than they save.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _overfit(config, text, steps, lr, seed, threshold)
    finally:
        torch.set_num_threads(threads)


def _overfit(config: ModelConfig, text: str, steps: int, lr: float, seed: int, threshold: float) -> CheckResult:
    torch.manual_seed(seed)
    model = Transformer(shrink(config)).train()
    ids = torch.tensor([list(text.encode("utf-8"))])  # (1, T): bytes fit the shrunk vocabulary
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = float("nan")
    for _ in range(steps):
        out = model(ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss = out.loss.item()
        if loss < threshold:
            break
    return CheckResult("overfit", f"training loss on one sentence ({len(text)} bytes)", loss, threshold)
