"""`decoderlm perplexity`: sliding-window perplexity of a model on a text file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from decoderlm.cli.common import add_model_flags, add_model_source, load_model, model_source
from decoderlm.errors import DecoderLMError
from decoderlm.names import DEFAULT_MODEL
from decoderlm.perplexity import perplexity

DEFAULT_CONTEXT = 512  # llama-perplexity's customary -c; capped by the model's own context


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a model on a text file (sliding windows)",
                       description="Each window of --context tokens starts --stride tokens after the previous one and scores only "
                                   "the tokens the previous window did not, so every token is scored once.")
    add_model_source(p, default=DEFAULT_MODEL)
    p.add_argument("--data", required=True, help="UTF-8 text file")
    p.add_argument("--context", type=int, default=None, help=f"window length in tokens (default: {DEFAULT_CONTEXT}, or the model's context if shorter)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: half the context)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first M tokens of the data (default: all)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_model_flags(p)
    p.set_defaults(func=cmd_perplexity)


def cmd_perplexity(args: argparse.Namespace) -> int:
    text = read_text(Path(args.data))
    if args.max_tokens is not None and args.max_tokens < 2:
        raise DecoderLMError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    model, tok = load_model(args)
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, model.config.max_seq_len)
    stride = args.stride if args.stride is not None else max(1, context // 2)
    ids = tok.encode(text)[: args.max_tokens]
    result = perplexity(model, ids, context, stride, args.batch_size, tokenizer=tok, progress=None)
    if args.json:
        print(json.dumps({"model": model_source(args), "data": str(args.data), **result.to_dict()}))
        return 0
    per_char = "" if result.bits_per_char is None else f", {result.bits_per_char:.4f} bits/char, {result.bits_per_byte:.4f} bits/byte"
    print(f"perplexity {result.perplexity:.4f} over {result.tokens_scored:,} tokens (nll {result.nll_per_token:.4f}/token{per_char})")
    print(f"context {result.context}, stride {result.stride}, {result.windows} window(s), {result.seconds:.1f} s")
    return 0


def read_text(path: Path) -> str:
    if not path.is_file():
        raise DecoderLMError(f"{path} is not a file; give --data a UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DecoderLMError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None
    if not text.strip():
        raise DecoderLMError(f"{path} is empty; give a text file with some content")
    return text
