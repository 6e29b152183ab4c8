"""`decoderlm convert MODEL DST`: write any model decoderlm loads as an HF folder transformers loads."""

from __future__ import annotations

import argparse
from pathlib import Path

from decoderlm.cli.common import MODEL_HELP, add_dtype_flag, add_model_source
from decoderlm.errors import DecoderLMError
from decoderlm.formats.hf import parse_size, save_hf
from decoderlm.loader import load


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="save a model as an HF folder (config.json, safetensors, tokenizer)",
                       usage="decoderlm convert [-h] (MODEL DST | --model MODEL DST) [options]")
    p.add_argument("paths", nargs="+", metavar="MODEL DST", help=f"the model ({MODEL_HELP}), then the output folder (new or empty)")
    add_model_source(p, help=f"the model, instead of the first positional ({MODEL_HELP})")
    add_dtype_flag(p, help="dtype of the written weights")
    p.add_argument("--max-shard-size", default="2GB", help="split the weights into files of at most this size (e.g. 500MB)")
    p.add_argument("--force", action="store_true", help="write into a non-empty DST, replacing its model files")
    p.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    src, dst = _src_dst(args)
    if dst.exists() and not dst.is_dir():
        raise DecoderLMError(f"{dst} is a file; give a folder for the converted model")
    if Path(src).exists() and dst.exists() and Path(src).resolve() == dst.resolve():
        raise DecoderLMError(f"{dst} is the source itself; give a different output folder")
    if dst.is_dir() and any(dst.iterdir()) and not args.force:
        raise DecoderLMError(f"{dst} is not empty; choose a new folder, or pass --force to write into it")
    max_shard = parse_size(args.max_shard_size)  # check flags before the (possibly long) load
    model, tokenizer = load(src, dtype=args.dtype)
    files = save_hf(model, tokenizer, dst, max_shard_size=max_shard)
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {dst}: {model.config.family} model, {model.num_parameters():,} parameters, {size / 1e6:,.1f} MB in {len(files)} file(s)")
    return 0


def _src_dst(args: argparse.Namespace) -> tuple[str, Path]:
    """(model, output folder) from `MODEL DST` or `--model MODEL DST`."""
    paths = ([args.model] if args.model is not None else []) + args.paths
    if len(paths) != 2:
        raise DecoderLMError("convert takes a model and an output folder: decoderlm convert MODEL DST (or --model MODEL DST)")
    return paths[0], Path(paths[1])
