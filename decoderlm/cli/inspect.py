"""`decoderlm inspect`, `check` and `explain`: count a model, test its invariants, draw how it works."""

from __future__ import annotations

import argparse
import json

from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.inspect import checks, explain, report
from decoderlm.inspect.accounting import Accounting
from decoderlm.inspect.arch import read_spec, with_overrides

DEFAULT_CONTEXT = 8192


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="parameters, FLOPs and memory of a model, by part (no weights are loaded)")
    p.add_argument("source", nargs="?", help="config.json, HF folder, .gguf, run folder, preset or known name")
    p.add_argument("--compare", nargs="+", metavar="SOURCE", help="several sources side by side; SOURCE::key=value,... overrides fields (e.g. ::n_kv_heads=1)")
    p.add_argument("--context", type=int, default=None, help=f"context length for attention FLOPs and KV cache (default: {DEFAULT_CONTEXT:,} or the model's maximum)")
    p.add_argument("--batch", type=int, default=1, help="sequences held in the KV cache")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run_inspect)

    p = sub.add_parser("check", help="test causality, KV-cache agreement or the ability to overfit; exit 1 on FAIL")
    p.add_argument("property", choices=("causal", "kv-cache", "overfit"))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a loadable model (run folder, HF folder, .gguf, known name)")
    src.add_argument("--preset", help="a fresh random model of this preset or ModelConfig .json")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--tokens", type=int, default=24, help="sequence length for causal / kv-cache")
    p.add_argument("--steps", type=int, default=300, help="most training steps for overfit")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_check)

    p = sub.add_parser("explain", help="draw masks, attention weights or parameter shares; demonstrate masked softmax")
    what = p.add_subparsers(dest="what", required=True, parser_class=type(p))
    m = what.add_parser("masks", help="bidirectional, causal, prefix-LM and sliding-window masks side by side")
    m.add_argument("--text", default="the cat sat on the mat", help="tokens (split on spaces) that label the cells")
    m.add_argument("--prefix", type=int, default=3, help="prefix length for prefix-LM")
    m.add_argument("--window", type=int, default=3, help="sliding-window size")
    m.add_argument("--out", required=True, help="PNG file to write")
    a = what.add_parser("attention", help="attention weights of every head of one layer for a prompt")
    a.add_argument("--model", required=True)
    a.add_argument("--prompt", required=True)
    a.add_argument("--layer", type=int, default=0, help="layer index (negative counts from the end)")
    a.add_argument("--out", required=True)
    what.add_parser("softmax", help="why masked scores are -inf / finfo.min before softmax (printed)")
    s = what.add_parser("params", help="a chart of where the parameters are")
    s.add_argument("sources", nargs="+")
    s.add_argument("--out", required=True)
    p.set_defaults(func=run_explain)


def _accounting(source: str) -> tuple[str, Accounting]:
    """(display name, accounting) for SOURCE or SOURCE::key=value,key=value."""
    path, _, overrides = source.partition("::")
    spec = read_spec(path)
    if overrides:
        pairs = dict(item.split("=", 1) for item in overrides.split(",") if "=" in item)
        if len(pairs) != len(overrides.split(",")):
            raise DecoderLMError(f"bad overrides {overrides!r}; write SOURCE::key=value,key=value")
        spec = with_overrides(spec, pairs)
    name = path.rstrip("/").split("/")[-1].removesuffix(".json") + (f" [{overrides}]" if overrides else "")
    return name, Accounting.of(spec)


def _context(args: argparse.Namespace, accs: list[Accounting]) -> int:
    if args.context is not None:
        if args.context <= 0:
            raise DecoderLMError("--context must be a positive number of tokens")
        return args.context
    limits = [a.spec.max_seq_len for a in accs if a.spec.max_seq_len]
    return min([DEFAULT_CONTEXT, *limits])


def run_inspect(args: argparse.Namespace) -> int:
    sources = ([args.source] if args.source else []) + (args.compare or [])
    if not sources:
        raise DecoderLMError("give a SOURCE to inspect, or --compare A B ...")
    if args.batch <= 0:
        raise DecoderLMError("--batch must be a positive number of sequences")
    named = [_accounting(s) for s in sources]
    names, accs = [n for n, _ in named], [a for _, a in named]
    context = _context(args, accs)
    if args.json:
        data = [report.as_dict(a, context, args.batch) for a in accs]
        print(json.dumps(data if len(data) > 1 else data[0], indent=2))
    elif len(accs) > 1:
        print(report.compare(accs, names, context, args.batch))
    else:
        print(report.report(accs[0], context, args.batch))
    return 0


def _model(args: argparse.Namespace):
    from decoderlm.loader import load, resolve_dtype
    from decoderlm.model import Transformer

    if args.model:
        return load(args.model, args.dtype)[0]
    config = ModelConfig.from_json(args.preset) if args.preset.endswith(".json") else ModelConfig.from_preset(args.preset)
    return Transformer(config).to(resolve_dtype(args.dtype)).eval()


def run_check(args: argparse.Namespace) -> int:
    if args.property == "overfit" and args.preset:
        config = ModelConfig.from_json(args.preset) if args.preset.endswith(".json") else ModelConfig.from_preset(args.preset)
        result = checks.check_overfit(config, steps=args.steps, seed=args.seed)
    else:
        model = _model(args)
        if args.property == "overfit":
            result = checks.check_overfit(model.config, steps=args.steps, seed=args.seed)
        elif args.property == "causal":
            result = checks.check_causal(model, args.tokens, args.seed)
        else:
            result = checks.check_kv_cache(model, args.tokens, args.seed)
    print(result.line())
    return 0 if result.passed else 1


def run_explain(args: argparse.Namespace) -> int:
    if args.what == "softmax":
        print(explain.softmax_demo())
        return 0
    if args.what == "masks":
        tokens = args.text.split()
        if not tokens:
            raise DecoderLMError("--text has no tokens; give a few words")
        out = explain.plot_masks(tokens, args.prefix, args.window, args.out)
    elif args.what == "attention":
        from decoderlm.loader import load

        model, tokenizer = load(args.model)
        out = explain.plot_attention(model, tokenizer, args.prompt, args.layer, args.out)
    else:
        named = [_accounting(s) for s in args.sources]
        out = explain.plot_params([a for _, a in named], [n for n, _ in named], args.out)
    print(f"wrote {out}")
    return 0
