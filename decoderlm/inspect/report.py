"""Text and JSON views of an `Accounting`: one model in detail, or several side by side (--compare)."""

from __future__ import annotations

import dataclasses
from typing import Any

from decoderlm.inspect.accounting import BYTES, GROUPS, Accounting, Part


def fmt_bytes(n: float, binary: bool = True) -> str:
    base, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    for unit in units:
        if n < base or unit == units[-1]:
            return f"{n:.2f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= base
    raise AssertionError("unreachable")


def fmt_flops(n: float) -> str:
    for unit, scale in (("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6), ("KFLOPs", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOPs"


def fmt_weights(acc: Accounting, dtype: str) -> str:
    n = acc.weight_bytes(dtype)
    return f"{fmt_bytes(n, binary=False)} ({fmt_bytes(n)})"


def _per_layer(counts: list[int]) -> str:
    """The count if every layer has the same, 'N ×k' if the k layers that have it agree, else 'varies'."""
    nonzero = {c for c in counts if c}
    if len(nonzero) != 1:
        return "varies" if nonzero else ""
    value = nonzero.pop()
    used = sum(1 for c in counts if c)
    return f"{value:,}" if used == len(counts) else f"{value:,} ×{used}"


def _row(name: str, per_layer: str, total: int, grand: int, note: str = "") -> str:
    return f"{name:<22}{per_layer:>20}{total:>20,}{100 * total / grand:>8.1f} %{note}"


def parameter_table(acc: Accounting) -> list[str]:
    grand = acc.total
    lines = [f"{'part':<22}{'per layer':>20}{'all layers':>20}{'share':>10}"]
    for group in GROUPS:
        parts: list[Part] = [p for p in acc.parts if p.group == group]
        if not parts:
            continue
        if len(parts) > 1:
            lines += [_row(f"  {p.name}", _per_layer(p.per_layer), p.total, grand) for p in parts]
        note = "  (tied: reuses embedding)" if group == "lm_head" and acc.spec.tie_embeddings else ""
        lines.append(_row(group, _per_layer(acc.group_per_layer(group)), acc.group(group), grand, note))
    lines.append(_row("total", "", grand, grand))
    return lines


def summary(acc: Accounting, context: int, batch: int) -> list[str]:
    s = acc.spec
    lines = [f"total parameters     {acc.total:,}", f"non-embedding        {acc.non_embedding:,}"]
    if s.n_experts:
        lines.append(f"active per token     {acc.active:,} ({100 * acc.active / acc.total:.1f} % of all; {s.n_experts_per_tok} of {s.n_experts} experts)")
    lines.append(f"compute              {fmt_flops(acc.flops_per_token())} per token forward (lm_head {fmt_flops(acc.lm_head_flops())})"
                 f" + attention {fmt_flops(acc.attention_flops(context))} at {context:,} tokens of context")
    lines.append("weights              " + " | ".join(f"{d} {fmt_weights(acc, d)}" for d in BYTES))
    per_token = acc.kv_elements_per_token() * BYTES["bf16"]
    lines.append(f"KV cache (bf16)      {fmt_bytes(per_token)} per token; {fmt_bytes(acc.kv_bytes(context, batch))} for {context:,} tokens × batch {batch}")
    if s.vision:
        lines.append("images               " + "; ".join(f"{w}×{h} px: {n:,} tokens, KV {fmt_bytes(n * per_token)}"
                                                          for (w, h), n in image_costs(s.vision).items()))
    return lines


def image_costs(vision: dict[str, Any], sizes: tuple[tuple[int, int], ...] = ((448, 448), (1280, 720), (1920, 1080))) -> dict[tuple[int, int], int]:
    """Language-model tokens an image of each (width, height) becomes, under the processor's default pixel limits."""
    from decoderlm.image import ImageProcessor

    processor = ImageProcessor(patch_size=vision["patch_size"], merge_size=vision["merge_size"])
    return {(w, h): processor.tokens(h, w) for w, h in sizes}


def header(acc: Accounting) -> list[str]:
    """What the model is: source, family, shape, and what sets the family apart."""
    s = acc.spec
    head = [f"{s.source or s.family}", f"family {s.family}: {s.n_layers} layers, d_model {s.d_model:,}, head_dim {s.head_dim}, "
            f"FFN hidden {s.ffn_hidden:,}, vocab {s.vocab_size:,}"]
    towers = " and ".join(f"the {key.removesuffix('_config')} tower ({key})" for key in s.uncounted)
    uncounted = [f"counts: the text model only; {towers} {'is' if len(s.uncounted) == 1 else 'are'} not counted"] if towers else []
    return head + [f"runs in decoderlm: {s.runs()}", *uncounted] + [f"  {line}" for line in s.features()]


def report(acc: Accounting, context: int, batch: int) -> str:
    """The full report: the short one with the parameter table by part in between."""
    return "\n".join(header(acc) + [""] + parameter_table(acc) + [""] + summary(acc, context, batch))


def short(acc: Accounting, context: int, batch: int) -> str:
    """`decoderlm info` (= `inspect --short`): the report without the parameter table."""
    return "\n".join(header(acc) + [""] + summary(acc, context, batch))


def compare(accs: list[Accounting], names: list[str], context: int, batch: int) -> str:
    """Key numbers of several models in columns, e.g. MHA vs GQA vs MQA variants of one config."""
    rows: list[tuple[str, list[str]]] = [
        ("family", [a.spec.family for a in accs]),
        ("runs in decoderlm", ["yes" if a.spec.refused is None else "no" for a in accs]),
        ("layers × d_model", [f"{a.spec.n_layers} × {a.spec.d_model:,}" for a in accs]),
        ("attention", [a.spec.attention_kind() for a in accs]),
        ("head_dim", [str(a.spec.head_dim) for a in accs]),
        ("sliding window", [f"{a.spec.sliding_window:,}" if a.spec.sliding_window else "-" for a in accs]),
        ("experts", [f"{a.spec.n_experts_per_tok} of {a.spec.n_experts}" if a.spec.n_experts else "-" for a in accs]),
        ("parameters", [f"{a.total:,}" for a in accs]),
        ("active per token", [f"{a.active:,}" for a in accs]),
        ("non-embedding", [f"{a.non_embedding:,}" for a in accs]),
        ("FLOPs per token", [fmt_flops(a.flops_per_token()) for a in accs]),
        (f"attention @ {context:,}", [fmt_flops(a.attention_flops(context)) for a in accs]),
        ("KV cache per token", [fmt_bytes(a.kv_elements_per_token() * BYTES["bf16"]) for a in accs]),
        (f"KV @ {context:,} × {batch}", [fmt_bytes(a.kv_bytes(context, batch)) for a in accs]),
        ("weights bf16", [fmt_bytes(a.weight_bytes("bf16"), binary=False) for a in accs]),
    ]
    width = max(18, *(len(n) + 2 for n in names), *(len(v) + 2 for _, vals in rows for v in vals))
    lines = [f"{'':<22}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:<22}" + "".join(f"{v:>{width}}" for v in vals) for label, vals in rows]
    return "\n".join(lines)


def as_dict(acc: Accounting, context: int, batch: int) -> dict[str, Any]:
    return {
        "spec": dataclasses.asdict(acc.spec),
        "features": acc.spec.features(),
        "runs": acc.spec.runs(),
        "parts": [dataclasses.asdict(p) for p in acc.parts],
        "groups": {g: acc.group(g) for g in GROUPS},
        "total": acc.total, "non_embedding": acc.non_embedding, "active": acc.active,
        "flops_per_token": acc.flops_per_token(), "lm_head_flops": acc.lm_head_flops(),
        "context": context, "batch": batch, "attention_flops": acc.attention_flops(context),
        "weight_bytes": {d: acc.weight_bytes(d) for d in BYTES},
        "kv_bytes_per_token": {d: acc.kv_elements_per_token() * b for d, b in BYTES.items()},
        "kv_bytes": {d: acc.kv_bytes(context, batch, d) for d in BYTES},
        **({"image_tokens": {f"{w}x{h}": n for (w, h), n in image_costs(acc.spec.vision).items()}} if acc.spec.vision else {}),
    }
