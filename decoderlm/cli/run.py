"""`decoderlm train`, `decoderlm generate`, `decoderlm info`."""

from __future__ import annotations

import argparse
import json

from decoderlm.cli.common import add_model_flags, add_sampling_flags, load_model, print_stream, sampling_params
from decoderlm.cli.speculative import add_speculative_flags, decoding_from_args
from decoderlm.config import PRESETS
from decoderlm.generate import stream
from decoderlm.loader import load
from decoderlm.names import DEFAULT_MODEL
from decoderlm.sampling import SamplingParams
from decoderlm.train import TrainConfig, train


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on a text file (char-level)")
    p.add_argument("--data", help="UTF-8 text file (not needed with --resume)")
    p.add_argument("--preset", default="seed-char", choices=sorted(PRESETS))
    p.add_argument("--out", default="runs/seed-char", help="run folder (checkpoint, logs, loss.png)")
    p.add_argument("--max-steps", type=int, default=None, help="default: 2000, or with --resume the run's own")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--stop-after", type=int, default=None, help="stop at this step (resumable); the lr schedule still spans --max-steps")
    for flag, kind in (("batch-size", int), ("context", int), ("lr", float), ("min-lr", float), ("warmup", int),
                       ("weight-decay", float), ("beta2", float), ("dropout", float), ("eval-batches", int)):
        p.add_argument(f"--{flag}", type=kind, default=None, help="default: the preset's recipe")
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sample-chars", type=int, default=300, help="length of the sample printed at the end")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="continue a prompt (streams to stdout)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"run folder, HF folder, .gguf file or known name (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt", required=True)
    add_model_flags(p)
    add_sampling_flags(p)
    add_speculative_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="print a model's config and parameter count")
    p.add_argument("model", help="run folder, HF folder, .gguf file or known name")
    p.set_defaults(func=cmd_info)


def cmd_train(args: argparse.Namespace) -> int:
    names = ("data", "out", "preset", "max_steps", "batch_size", "context", "lr", "min_lr", "warmup", "weight_decay",
             "beta2", "dropout", "eval_batches", "eval_interval", "log_interval", "seed", "device", "resume", "stop_after", "sample_chars")
    result = train(TrainConfig(**{n: getattr(args, n) for n in names}))
    val = "not evaluated yet" if result["val_loss"] is None else f"{result['val_loss']:.4f}"
    speed = "" if result["tokens_per_s"] is None else f", {result['tokens_per_s']:,.0f} tokens/s"
    print(f"step {result['step']}: val loss {val}, {result['seconds']:.0f}s{speed}; run folder {result['out']}")
    model, tok = result["model"], result["tokenizer"]
    print("--- sample ---")
    params = SamplingParams(temperature=0.8, top_k=200, max_new_tokens=args.sample_chars, seed=args.seed)
    start = tok.encode("\n") if "\n" in tok.stoi else [0]  # a one-line corpus has no newline
    print_stream(tok, stream(model, start, params))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    model, tok = load_model(args)
    decoding = decoding_from_args(args, model, tok)
    params = sampling_params(args, model.generation_defaults, getattr(tok, "eos_token_ids", []))
    tokens = decoding.stream(tok.encode(args.prompt), params)  # raises on a bad prompt before anything is printed
    print(args.prompt, end="", flush=True)
    print_stream(tok, tokens)
    decoding.report()
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    model, _ = load(args.model)
    print(json.dumps(model.config.to_dict(), indent=2))
    print(f"parameters: {model.num_parameters():,} ({model.num_parameters(exclude_embeddings=True):,} without embeddings)")
    return 0
