"""`decoderlm inspect` (and `info`, its short view), `check` and `explain`: count a model, test its
invariants, draw how it works."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from decoderlm.cli.common import (
    MODEL_HELP,
    add_model_flags,
    add_model_source,
    add_seed_flag,
    apply_run_flags,
    check_out_file,
    load_model,
    model_source,
)
from decoderlm.config import ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.finetune import resume
from decoderlm.formats import runs
from decoderlm.inspect import checks, report
from decoderlm.inspect.accounting import Accounting
from decoderlm.inspect.arch import read_spec, with_overrides
from decoderlm.loader import resolve_dtype
from decoderlm.model import Transformer
from decoderlm.quantize import parse_mode, quantize
from decoderlm.train.state import TrainState

DEFAULT_CONTEXT = 8192


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="parameters, FLOPs and memory of a model, by part (no weights are loaded)")
    _inspect_flags(p)
    p.add_argument("--compare", nargs="+", metavar="SOURCE", help="several sources side by side; SOURCE::key=value,... overrides fields (e.g. ::n_kv_heads=1)")
    p.add_argument("--short", action="store_true", help="only the summary: what the model is and what it costs (= decoderlm info)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run_inspect)

    p = sub.add_parser("info", help="a model's short summary: the `inspect --short` view (reads no weights)",
                       description="The short view of `decoderlm inspect`: family, shape, features, parameters, compute and memory. "
                                   "It reads only the config or header, never the weights; for the parameters by part use `inspect`.")
    _inspect_flags(p)
    p.set_defaults(func=run_inspect, short=True, json=False, compare=None)

    p = sub.add_parser("check", help="test causality, KV-cache agreement or the ability to overfit; exit 1 on FAIL")
    p.add_argument("property", choices=("causal", "kv-cache", "overfit"),
                   help="causal: no token sees a later one; kv-cache: cached decoding equals a full forward; overfit: it learns one batch")
    add_model_source(p, help=f"a loadable model: {MODEL_HELP}")
    p.add_argument("--preset", help="instead of --model: a fresh random model of this preset or ModelConfig .json")
    add_model_flags(p)
    p.add_argument("--tokens", type=int, default=24, help="sequence length for causal / kv-cache")
    p.add_argument("--steps", type=int, default=300, help="most training steps for overfit")
    add_seed_flag(p)
    p.set_defaults(func=run_check)

    p = sub.add_parser("explain", help="draw masks, attention weights or parameter shares; demonstrate masked softmax")
    what = p.add_subparsers(dest="what", required=True, parser_class=type(p))
    m = what.add_parser("masks", help="bidirectional, causal, prefix-LM and sliding-window masks side by side")
    m.add_argument("--text", default="the cat sat on the mat", help="tokens (split on spaces) that label the cells")
    m.add_argument("--prefix", type=int, default=3, help="prefix length for prefix-LM")
    m.add_argument("--window", type=int, default=3, help="sliding-window size")
    m.add_argument("--out", required=True, help="PNG file to write")
    a = what.add_parser("attention", help="attention weights of every head of one layer for a prompt")
    add_model_source(a)
    a.add_argument("--prompt", required=True, help="the text whose attention weights are drawn")
    a.add_argument("--layer", type=int, default=0, help="layer index (negative counts from the end)")
    a.add_argument("--out", required=True, help="PNG file to write")
    add_model_flags(a)
    what.add_parser("softmax", help="why masked scores are -inf / finfo.min before softmax (printed)")
    s = what.add_parser("params", help="a chart of where the parameters are")
    s.add_argument("sources", nargs="+", metavar="SOURCE", help="what inspect accepts: config.json, HF folder, .gguf, run folder, preset or known name")
    s.add_argument("--out", required=True, help="PNG file to write")
    p.set_defaults(func=run_explain)


def _inspect_flags(p: argparse.ArgumentParser) -> None:
    """What `inspect` and `info` share: the source and the workload the costs are computed for."""
    add_model_source(p, positional=True, help="config.json, HF folder, .gguf, run folder, preset or known name")
    p.add_argument("--context", type=int, default=None, help=f"context length for attention FLOPs and KV cache (default: {DEFAULT_CONTEXT:,} or the model's maximum)")
    p.add_argument("--batch", type=int, default=1, help="sequences held in the KV cache")


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
        return args.context
    limits = [a.spec.max_seq_len for a in accs if a.spec.max_seq_len]
    return min([DEFAULT_CONTEXT, *limits])


def run_inspect(args: argparse.Namespace) -> int:
    given = args.model_arg is not None or args.model is not None
    sources = ([model_source(args)] if given else []) + (args.compare or [])
    if not sources:
        raise DecoderLMError(f"give a model to {args.command} (MODEL or --model)" + (", or --compare A B ..." if args.command == "inspect" else ""))
    if args.batch <= 0:
        raise DecoderLMError("--batch must be a positive number of sequences")
    if args.context is not None and args.context <= 0:
        raise DecoderLMError("--context must be a positive number of tokens")
    named = [_accounting(s) for s in sources]
    names, accs = [n for n, _ in named], [a for _, a in named]
    context = _context(args, accs)
    if args.json:
        data = [report.as_dict(a, context, args.batch) for a in accs]
        print(json.dumps(data if len(data) > 1 else data[0], indent=2))
    elif len(accs) > 1:
        print(report.compare(accs, names, context, args.batch))
    else:
        progress = run_progress(sources[0])
        print(*([progress] if progress else []), (report.short if args.short else report.report)(accs[0], context, args.batch), sep="\n")
    return 0


def run_progress(source: str) -> str | None:
    """A training or fine-tuning run folder's progress (step, best val loss, tokens seen); None for other sources."""
    path = Path(source)
    if (path / runs.CKPT_NAME).is_file():
        saved = runs.read(path)
        max_steps, kind = saved.get("train_config", {}).get("max_steps", saved["step"]), "training run"
    elif (path / resume.STATE_NAME).is_file():
        saved = resume.read_state(path)
        max_steps, kind = saved["settings"]["max_steps"], f"{saved['settings']['method']} run"
    else:
        return None
    state = TrainState()
    state.load_state_dict({"history": [], "window": (0.0, 0)} | saved)
    return f"{kind}: {state.describe(max_steps)}"


def run_check(args: argparse.Namespace) -> int:
    if (args.preset is None) == (args.model is None):
        raise DecoderLMError("check needs a model: give either --model or --preset (not both)")
    if args.tokens < 2 or args.steps < 1:
        raise DecoderLMError("--tokens must be at least 2 and --steps at least 1")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    if args.preset:
        config = ModelConfig.from_name(args.preset)  # a bad preset fails before --threads / --device take effect
        device = apply_run_flags(args)
        if args.property == "overfit":
            result = checks.check_overfit(config, steps=args.steps, seed=seed)
        else:
            torch.manual_seed(seed)
            with torch.device(device):
                model = Transformer(config).to(resolve_dtype(args.dtype)).eval()
            mode = parse_mode(args.quantize)
            if mode not in (None, "auto"):  # auto keeps a float model float
                quantize(model, mode)
            result = _check_model(args.property, model, args, seed)
    else:
        result = _check_model(args.property, load_model(args)[0], args, seed)
    if args.seed is None:  # say which, so a failure can be rerun with --seed
        result.measured += f" (seed {seed})"
    print(result.line())
    return 0 if result.passed else 1


def _check_model(prop: str, model: Transformer, args: argparse.Namespace, seed: int) -> checks.CheckResult:
    if prop == "overfit":
        return checks.check_overfit(model.config, steps=args.steps, seed=seed)
    if prop == "causal":
        return checks.check_causal(model, args.tokens, seed)
    return checks.check_kv_cache(model, args.tokens, seed)


def run_explain(args: argparse.Namespace) -> int:
    from decoderlm.inspect import explain  # matplotlib: 0.4 s that no other command should pay at start

    if args.what == "softmax":
        print(explain.softmax_demo())
        return 0
    check_out_file(args.out)
    if args.what == "masks":
        tokens = args.text.split()
        if not tokens:
            raise DecoderLMError("--text has no tokens; give a few words")
        if args.prefix < 0 or args.window < 1:
            raise DecoderLMError(f"--prefix must be >= 0 and --window >= 1, got {args.prefix} and {args.window}")
        out = explain.plot_masks(tokens, args.prefix, args.window, args.out)
    elif args.what == "attention":
        if not args.prompt:
            raise DecoderLMError("the prompt is empty; give --prompt with some text")
        n_layers = read_spec(model_source(args)).n_layers  # the header alone: a bad --layer fails before the load
        if not -n_layers <= args.layer < n_layers:
            raise DecoderLMError(f"--layer {args.layer} is out of range; this model has layers 0..{n_layers - 1}")
        model, tokenizer = load_model(args)
        out = explain.plot_attention(model, tokenizer, args.prompt, args.layer, args.out)
    else:
        named = [_accounting(s) for s in args.sources]
        out = explain.plot_params([a for _, a in named], [n for n, _ in named], args.out)
    print(f"wrote {out}")
    return 0
