"""Pictures and small demonstrations of what the model does: masks, attention weights, masked softmax, parameters.

Figures are drawn on a bare `matplotlib.figure.Figure` (the Agg renderer, no pyplot state), so they
work headless and in tests. The masks come from the model's own `build_mask`, and the attention
weights are recomputed from the layer's real inputs, so the pictures show what the code does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from matplotlib.figure import Figure

from decoderlm.errors import DecoderLMError
from decoderlm.inspect.accounting import GROUPS, Accounting
from decoderlm.model import Transformer
from decoderlm.model.cache import build_mask


def mask_matrices(n: int, prefix: int, window: int) -> dict[str, torch.Tensor]:
    """(n, n) boolean 'query row may attend to key column' for the four classic attention patterns."""
    keys = torch.arange(n)
    causal = build_mask(keys[None], keys[None], None, torch.float32)[0, 0] == 0
    sliding = build_mask(keys[None], keys[None], window, torch.float32)[0, 0] == 0
    return {
        "encoder-only (bidirectional)": torch.ones(n, n, dtype=torch.bool),
        "decoder-only (causal)": causal,
        f"prefix-LM (prefix {prefix})": causal | (keys < prefix)[None, :],  # the prefix sees itself fully
        f"sliding window ({window})": sliding,
    }


def _label_axes(ax, tokens: list[str], fontsize: float) -> None:
    ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(tokens)), tokens, fontsize=fontsize)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")


def plot_masks(tokens: list[str], prefix: int, window: int, out: str | Path) -> Path:
    masks = mask_matrices(len(tokens), prefix, window)
    fig = Figure(figsize=(4.2 * len(masks), 4.8), layout="constrained")
    for ax, (title, allowed) in zip(fig.subplots(1, len(masks)), masks.items()):
        ax.imshow(allowed.numpy(), cmap="Blues", vmin=-0.3, vmax=1.2)
        ax.set_xticks([x - 0.5 for x in range(1, len(tokens))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(tokens))], minor=True)
        ax.grid(which="minor", color="white", linewidth=1)
        _label_axes(ax, tokens, fontsize=9)
        ax.set_title(title)
    fig.suptitle("Who may attend to whom (blue = allowed)")
    return _save(fig, out)


@torch.inference_mode()
def attention_weights(model: Transformer, ids: torch.Tensor, layer: int, sink: bool = False) -> torch.Tensor:
    """Attention probabilities (B, H, T, T) of one layer, rebuilt from the q/k it really sees; with
    sink=True and a model with attention sinks, one more column: the share each sink took (B, H, T, T + 1).

    A forward pre-hook captures the layer's input (normed hidden states, RoPE tables, mask); the
    probabilities are then recomputed by the layer's own `probabilities` (its scale, soft-cap and sinks).
    """
    attn = model.layers[layer].self_attn
    captured: dict[str, tuple] = {}
    handle = attn.register_forward_pre_hook(lambda module, args: captured.setdefault("args", args))
    try:
        model(ids)
    finally:
        handle.remove()
    x, rope, mask, _ = captured["args"]
    B, T, _ = x.shape
    if mask is None:  # the model relied on SDPA's is_causal (with causal=False: no mask at all)
        slots = torch.arange(T, device=x.device)[None]
        mask = build_mask(slots, slots, None, x.dtype) if attn.causal else torch.zeros(1, 1, T, T, dtype=x.dtype, device=x.device)
    if hasattr(attn, "queries_and_keys"):  # multi-head latent attention: keys up-projected from the latents
        q, k = attn.queries_and_keys(x, rope)  # (B, H, T, D) each
        probs = ((q.float() @ k.float().transpose(-2, -1)) * attn.scale + mask.float()).softmax(dim=-1)  # (B, H, T, T)
    else:
        q, k, _ = attn.project_qkv(x, rope)  # (B, H, T, D), (B, Hkv, T, D)
        probs = attn.probabilities(q, k, mask.float())  # (B, H, T, T [+ 1])
    return probs if sink else probs[..., :T]


def plot_attention(model: Transformer, tokenizer, prompt: str, layer: int, out: str | Path) -> Path:
    ids = tokenizer.encode(prompt)
    if not ids:
        raise DecoderLMError("the prompt is empty; give --prompt with some text")
    n_layers = model.config.n_layers
    if not -n_layers <= layer < n_layers:
        raise DecoderLMError(f"--layer {layer} is out of range; this model has layers 0..{n_layers - 1}")
    layer %= n_layers
    weights = attention_weights(model, torch.tensor([ids], device=next(model.parameters()).device), layer, sink=True)[0].cpu()
    sinks = weights[..., len(ids):].sum(-1).mean(-1) if weights.shape[-1] > len(ids) else None  # (H,): mean share the sink took
    weights = weights[..., : len(ids)]  # (H, T, T)
    tokens = [repr(tokenizer.decode([i]))[1:-1] for i in ids]
    H = weights.shape[0]
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    fig = Figure(figsize=(3.6 * cols, 3.6 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for h, ax in enumerate(axes):
        if h >= H:
            ax.set_axis_off()
            continue
        ax.imshow(weights[h].numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}" + (f" (sink takes {sinks[h]:.0%})" if sinks is not None else ""), fontsize=10)
        if len(tokens) <= 32:
            _label_axes(ax, tokens, fontsize=7)
        ax.xaxis.label.set_visible(h // cols == rows - 1)
        ax.yaxis.label.set_visible(h % cols == 0)
    sunk = f"; the attention sinks take {sinks.mean():.0%} of the mass" if sinks is not None else ""
    fig.suptitle(f"Attention weights, layer {layer} ({H} heads){sunk}: {prompt[:60]!r}")
    return _save(fig, out)


def softmax_rows() -> dict[str, torch.Tensor]:
    """The cases the softmax demonstration prints, computed (also used by the tests)."""
    half = torch.float16
    scores = torch.tensor([2.0, 1.0, 0.5, -1.0])
    future = torch.tensor([False, False, True, True])  # keys after the query
    nothing = torch.ones(4, dtype=torch.bool)  # a padding row: every key masked
    return {
        "scores (fp32)": scores,
        "future masked with -inf": scores.masked_fill(future, float("-inf")).softmax(-1),
        "future masked with finfo.min": scores.masked_fill(future, torch.finfo(torch.float32).min).softmax(-1),
        "fp16, whole row -inf": scores.half().masked_fill(nothing, float("-inf")).softmax(-1),
        "fp16, whole row finfo.min": scores.half().masked_fill(nothing, torch.finfo(half).min).softmax(-1),
        "fp16, scores + finfo.min": (scores.half() * 50 + torch.finfo(half).min),
    }


def softmax_demo() -> str:
    r = softmax_rows()

    def row(label: str, t: torch.Tensor, note: str = "") -> str:
        return f"  {label:<38}[" + ", ".join(f"{float(v):.4g}" for v in t) + "]" + note

    return "\n".join([
        "Why masked attention scores are -inf (or the dtype's minimum) before softmax",
        row("scores of one query over 4 keys:", r["scores (fp32)"], "; keys 2 and 3 are in its future"),
        row("softmax with future = -inf:", r["future masked with -inf"]),
        row("softmax with future = finfo.min:", r["future masked with finfo.min"]),
        "  exp(-inf) = 0 and exp(finfo.min - max) underflows to 0: the future gets exactly no weight",
        "  and the past still sums to 1 — the same answer as if the future keys did not exist.",
        "",
        "A row whose every key is masked (a padding query) behaves differently:",
        row("fp16, all -inf:", r["fp16, whole row -inf"], "  (-inf - (-inf) = NaN, and NaN spreads)"),
        row(f"fp16, all finfo.min ({torch.finfo(torch.float16).min:g}):", r["fp16, whole row finfo.min"], "  (uniform, finite, harmless)"),
        "  so masks are filled with finfo(dtype).min: padding rows stay finite and are simply ignored.",
        "",
        "Adding finfo.min (an additive mask) leaves no headroom in fp16:",
        row("50 × scores + finfo.min in fp16:", r["fp16, scores + finfo.min"]),
        "  masked scores saturate at finfo.min or overflow to -inf. That is harmless while a row keeps",
        "  one real key (its exp dominates); a padding row becomes uniform noise, and its output is ignored.",
    ])


def plot_params(accs: list[Accounting], names: list[str], out: str | Path) -> Path:
    """One stacked bar per model: the share of parameters in each part, labelled with the totals."""
    colors = dict(zip(GROUPS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"), strict=True))
    fig = Figure(figsize=(10, 1.2 + 0.8 * len(accs)), layout="constrained")
    ax = fig.subplots()
    for row, acc in enumerate(accs):
        left = 0.0
        for group in GROUPS:
            share = 100 * acc.group(group) / acc.total
            ax.barh(row, share, left=left, color=colors[group], label=group if row == 0 else None)
            if share >= 6:
                ax.text(left + share / 2, row, f"{share:.0f}%", ha="center", va="center", color="white", fontsize=9)
            left += share
        active = f", {acc.active / 1e9:.2f}B active" if acc.spec.n_experts else ""
        ax.text(101, row, f"{acc.total:,}{active}", va="center", fontsize=9)
    ax.set_yticks(range(len(accs)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 135)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("share of parameters (%)")
    ax.legend(ncols=len(GROUPS), loc="lower center", bbox_to_anchor=(0.4, 1.0), fontsize=8, frameon=False)
    ax.set_title("Where the parameters are", pad=24)
    return _save(fig, out)


def _save(fig: Figure, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
