"""Flags and helpers shared by several subcommands, so each flag means the same everywhere:
`--model` names a model (some commands also take it as a positional MODEL), `--dtype`, `--quantize`,
`--threads` and `--device` go wherever a model runs, and `--seed` is unseeded unless given."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.device import DEVICE_HELP
from decoderlm.loader import DTYPES, KV_CACHE, load, resolve_device
from decoderlm.model import Transformer
from decoderlm.quantize import ACTIVATIONS, MODES
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import StopMatcher, StreamDecoder, Tokenizer

MODEL_HELP = "run folder, HF folder, .gguf file or known name"
SEED_HELP = "seed for every random choice, for reproducible runs (default: unseeded, different each run)"


def add_model_source(p: argparse.ArgumentParser, positional: bool = False, default: str | None = None, help: str = MODEL_HELP) -> None:
    """--model MODEL (and, where it reads naturally, a positional MODEL); read it with `model_source`."""
    suffix = f" (default: {default})" if default else ""
    if positional:
        p.add_argument("model_arg", nargs="?", metavar="MODEL", help=f"{help}; the same as --model")
    p.add_argument("--model", default=None, help=help + suffix)
    p.set_defaults(model_default=default)


def model_source(args: argparse.Namespace) -> str:
    """The model named by the positional MODEL or --model (the same thing twice is fine)."""
    given = {v for v in (getattr(args, "model_arg", None), args.model) if v is not None}
    if len(given) > 1:
        raise DecoderLMError("the model is given twice (as MODEL and as --model); give it once")
    source = given.pop() if given else args.model_default
    if source is None:
        raise DecoderLMError(f"no model given; name one with --model ({MODEL_HELP})")
    return source


def add_seed_flag(p: argparse.ArgumentParser, help: str = SEED_HELP) -> None:
    p.add_argument("--seed", type=int, default=None, help=help)


def add_dtype_flag(p: argparse.ArgumentParser, help: str = "dtype of the weights and the compute") -> None:
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help=help)


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """--threads and --device: wherever a model runs or trains."""
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is faster when other work holds the cores)")
    p.add_argument("--device", default="cpu", help=f"where the model runs: {DEVICE_HELP}")


# Sampling for a checkpoint that recommends none (no generation_config.json, a GGUF without
# general.sampling.*), in `generate` and `chat` alike: the model card values of the embedded default
# model, SmolLM2-135M-Instruct. Fields not named here are off.
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
SAMPLING_EPILOG = ("Sampling defaults: the checkpoint's generation_config (GGUF: general.sampling.*), else "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_SAMPLING.items()) + "; flags override them.")


def checkpoint_default(name: str) -> str:
    return f"default: the checkpoint's, else {DEFAULT_SAMPLING.get(name, 'off')}"


MAX_NEW_TOKENS = 256  # chat and generate alike: a full answer, not a page of rambling


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                   help="the most tokens to generate (default: %(default)s); a reply ends earlier at the model's end-of-turn or EOS token")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy (default: the checkpoint's, else {DEFAULT_SAMPLING['temperature']})")
    g.add_argument("--top-k", type=int, default=None, help=f"keep the k most likely tokens (0 = off; {checkpoint_default('top_k')})")
    g.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass in (0, 1] ({checkpoint_default('top_p')})")
    g.add_argument("--min-p", type=float, default=None, help=f"drop tokens below min_p × the top probability ({checkpoint_default('min_p')})")
    g.add_argument("--repetition-penalty", type=float, default=None, help=f"> 1 discourages repeats (1 = off; {checkpoint_default('repetition_penalty')})")
    add_seed_flag(g)


QUANTIZE_HELP = {
    "auto": "a quantized GGUF runs on its own blocks (Q4_0/Q4_1: int4, Q8_0 and K-quants: int8), the fastest mode "
            "within 1%% of float32's perplexity; other models (and any on an x86 CPU without AVX2, "
            "where the packed kernels are scalar) run in --dtype",
    "none": "weights in --dtype (a quantized GGUF dequantized exactly): the reference path, slowest",
}


ACTIVATIONS_HELP = {  # the default's description, by the default
    "auto": "auto: int16 where it applies",
    None: "auto at the AVX2 and AVX-512 levels and with --max-batch 1; fp32 for a server that batches on a CPU "
          "without AVX2, where batches of rows run faster in fp32 arithmetic than in int16",
}


def add_model_flags(p: argparse.ArgumentParser, compile: bool = False, quantize: str = "none", activations: str | None = "auto") -> None:
    """How to run the model: every command that runs one takes these; commands that decode token by
    token (generate, chat) also take --compile. `quantize`: the --quantize default (auto for the
    commands that serve a user, none for those that measure the model); `activations`: the
    --activations default (None for the server: chosen by its batch size and CPU level, `serve.serve_activations`)."""
    add_dtype_flag(p)
    p.add_argument("--quantize", default=quantize, choices=["auto", "none", *MODES],
                   help=f"weight precision (default: {quantize}: {QUANTIZE_HELP[quantize]}); int8/int4 quantize any model "
                        "for faster CPU decoding (decode vs float32: int8 ~3x, int4 ~4x; logits move slightly)")
    p.add_argument("--activations", default=activations, choices=list(ACTIVATIONS),
                   help="how quantized layers take their inputs in decode steps (prompts: fp32; auto's int16 on AVX512-VNNI): int16 (rounded to 16 bits "
                        "per 32, integer dot products: 1.2-2.2x fp32's speed for one row, answers as fp32's), int8 (llama.cpp's "
                        f"arithmetic: a little faster, a few answers differ) or fp32 (default: {ACTIVATIONS_HELP[activations]})")
    p.add_argument("--kv-cache", default="auto", choices=list(KV_CACHE),
                   help="the precision keys and values are kept in: fp16 (half the cache's memory and bytes to read a step; "
                        "every path rounds k and v so, no cache included) or fp32 (default: auto: fp16 with quantized weights, "
                        "as llama.cpp's cache, else the model's dtype)")
    if compile:
        p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="decode through a compiled step, built now if missing (once per model, mode and machine: "
                            "about a minute; cached in $DECODERLM_CACHE or ~/.cache/decoderlm; eager if compiling fails). "
                            "Default: a step built earlier is used; without one, this run decodes eagerly and "
                            "`decoderlm compile` builds it in the background for later runs; --no-compile: always eager")
    add_device_flags(p)


def apply_run_flags(args: argparse.Namespace) -> torch.device:
    """Check --threads and --device (before any slow work) and apply --threads; return the device."""
    if args.threads is not None:
        if args.threads < 1:
            raise DecoderLMError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    return resolve_device(args.device)


def load_model(args: argparse.Namespace, text: bool = True) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer named by --model, with --dtype, --quantize, --activations, --kv-cache, --threads and --device applied.
    Sampling flags, where the command has them, are checked first: a bad value fails before the load.
    text=False: an HF folder without tokenizer files loads too (see `load`)."""
    source = model_source(args)
    if hasattr(args, "temperature"):
        sampling_params(args)
    device = apply_run_flags(args)
    return load(source, dtype=args.dtype, quantize=args.quantize, device=device, text=text, activations=args.activations,
                kv_cache=args.kv_cache)


def compile_flags(args: argparse.Namespace) -> list[str]:
    """The flags that make `decoderlm compile` load the model that `load_model(args)` loaded."""
    return ["--model", model_source(args), "--dtype", args.dtype, "--quantize", args.quantize, "--activations", args.activations,
            "--kv-cache", args.kv_cache, "--device", args.device]


def check_out_file(path: str | Path, what: str = "--out") -> Path:
    """A file the command can write at the end: refuse a missing folder or a directory before the work."""
    path = Path(path)
    if path.is_dir():
        raise DecoderLMError(f"{what} {path} is a directory; give a file name, e.g. {path / 'out.png'}")
    if not path.parent.is_dir():
        raise DecoderLMError(f"{what} {path}: folder {path.parent} does not exist; create it first")
    return path


def sampling_params(args: argparse.Namespace, defaults: dict | None = None, stop_token_ids: list[int] | None = None) -> SamplingParams:
    """Flags override the checkpoint's defaults (generation_config), else DEFAULT_SAMPLING."""
    values = dict(defaults or DEFAULT_SAMPLING)
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=list(stop_token_ids or []), **values)


def print_stream(tokenizer, tokens: Iterator[int], prompt_ids: Sequence[int] = (), stops: Sequence[str] = ()) -> str:
    """Print text as tokens arrive (never half a character; decoded after the prompt, so the first
    word keeps its space), up to the first of `stops` (not printed; no token is asked for after it);
    return the whole text."""
    decoder, matcher, parts = StreamDecoder(tokenizer, prompt_ids), StopMatcher(list(stops)), []
    for tok in tokens:
        piece = matcher.push(decoder.push(tok))
        if piece:
            parts.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        if matcher.stopped:
            break
    tail = "" if matcher.stopped else matcher.push(decoder.flush()) + matcher.flush()
    parts.append(tail)
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    return "".join(parts)
