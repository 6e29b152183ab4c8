"""Speculative-decoding flags shared by `generate` and `chat` (no subcommand of its own)."""

from __future__ import annotations

import argparse

from decoderlm.cli.common import compile_flags
from decoderlm.compiled import CompiledDecoder
from decoderlm.errors import DecoderLMError
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.speculative import Decoding, DraftModel, PromptLookup, check_vocabularies
from decoderlm.tokenizer import Tokenizer


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (plain decoding's greedy output or sampling distribution, in fewer target forwards)")
    g.add_argument("--draft-model", default=None, metavar="NAME_OR_PATH",
                   help="a smaller model with the same tokenizer guesses tokens that the model checks in one forward "
                        "(default: none, plain decoding)")
    g.add_argument("--prompt-lookup", type=int, nargs="?", const=3, default=None, metavar="N",
                   help="guess the tokens that followed the latest match of the text's last N tokens (default N: 3); "
                        "pays when the reply repeats the prompt")
    g.add_argument("--num-speculative-tokens", type=int, default=5, metavar="K", help="tokens guessed per step (default: 5)")


def decoding_from_args(args: argparse.Namespace, model: Transformer, tokenizer: Tokenizer) -> Decoding:
    """The decoding the flags ask for: speculative with --draft-model (loaded like the model: --dtype,
    --quantize) or --prompt-lookup, else plain, through the compiled step unless --no-compile."""
    if args.draft_model is not None and args.prompt_lookup is not None:
        raise DecoderLMError("choose one of --draft-model and --prompt-lookup")
    if args.num_speculative_tokens < 1:
        raise DecoderLMError(f"--num-speculative-tokens must be at least 1, got {args.num_speculative_tokens}")
    if args.prompt_lookup is not None:
        return Decoding(model, PromptLookup(args.prompt_lookup), args.num_speculative_tokens)
    if args.draft_model is None:
        # --compile: build the step if missing; default (None): a step built earlier, else one built in the
        # background for later runs; --no-compile: eager
        background = compile_flags(args) if args.compile is None else None
        step = CompiledDecoder(model, build=args.compile is True, background=background) if args.compile is not False else None
        return Decoding(model, step=step)
    draft, draft_tokenizer = load(args.draft_model, dtype=args.dtype, quantize=args.quantize)
    check_vocabularies(tokenizer, draft_tokenizer)
    draft.to(next(model.parameters()).device)
    return Decoding(model, DraftModel(draft), args.num_speculative_tokens)
