"""Flags and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import StreamDecoder


# Sampling for a checkpoint that recommends none (no generation_config.json, a GGUF without
# general.sampling.*), in `generate` and `chat` alike: the model card values of the embedded default
# model, SmolLM2-135M-Instruct. Fields not named here are off.
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
SAMPLING_EPILOG = ("Sampling defaults: the checkpoint's generation_config (GGUF: general.sampling.*), else "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_SAMPLING.items()) + "; flags override them.")


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int = 200) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy (default: the checkpoint's, else {DEFAULT_SAMPLING['temperature']})")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p × the top probability")
    g.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="quantize weights for faster CPU decoding (decode vs fp32: int4 ~3x, int8 ~2x; logits move slightly)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is faster when other work holds the cores)")


def load_model(args: argparse.Namespace) -> tuple[Transformer, object]:
    """The model and tokenizer named by --model, with --dtype, --quantize and --threads applied."""
    if args.threads is not None:
        if args.threads < 1:
            raise DecoderLMError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    return load(args.model, dtype=args.dtype, quantize=args.quantize)


def sampling_params(args: argparse.Namespace, defaults: dict | None = None, stop_token_ids: list[int] | None = None) -> SamplingParams:
    """Flags override the checkpoint's defaults (generation_config), else DEFAULT_SAMPLING."""
    values = dict(defaults or DEFAULT_SAMPLING)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=list(stop_token_ids or []), **values)


def print_stream(tokenizer, tokens: Iterator[int], prompt_ids: Sequence[int] = ()) -> str:
    """Print text as tokens arrive (never half a character; decoded after the prompt, so the first
    word keeps its space); return the whole text."""
    decoder, parts = StreamDecoder(tokenizer, prompt_ids), []
    for tok in tokens:
        piece = decoder.push(tok)
        if piece:
            parts.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    tail = decoder.flush()
    parts.append(tail)
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    return "".join(parts)
