"""`decoderlm prepare`: tokenize a corpus once into token shards for `decoderlm train --data DATA_DIR`."""

from __future__ import annotations

import argparse

from decoderlm.train.data import VAL_FRACTION
from decoderlm.train.prepare import SHARD_TOKENS, prepare


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text files / folders / JSONL into token shards for train --data")
    p.add_argument("--data", nargs="+", required=True, help="text files, folders of them, or JSONL files (a `text` field per line; or "
                   "image, prompt and answer fields: image+text data, with --tokenizer bpe:N or a vision-language model)")
    p.add_argument("--out", required=True, help="new folder for the shards, tokenizer and manifest.json")
    p.add_argument("--tokenizer", default="char", help="char, bpe:VOCAB (train a byte-level BPE, e.g. bpe:2048), "
                   "or a model (run folder, HF folder, .gguf, known name) whose tokenizer to use (default: char)")
    p.add_argument("--val-fraction", type=float, default=VAL_FRACTION,
                   help=f"last share of the corpus kept for val (default: {VAL_FRACTION})")
    p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: one per CPU)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help=f"tokens per shard file (default: {SHARD_TOKENS:,})")
    p.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    manifest = prepare(args.data, args.out, args.tokenizer, args.val_fraction, args.workers, args.shard_tokens)
    splits = manifest["splits"]
    if "examples" in splits["train"]:
        print(f"{args.out}: {splits['train']['examples']:,} train + {splits['val']['examples']:,} val image+text examples "
              f"({splits['train']['images']:,} + {splits['val']['images']:,} images, vocab {manifest['vocab_size']:,}, "
              f"image token {manifest['image_token_id']})")
        return 0
    print(f"{args.out}: {splits['train']['tokens']:,} train + {splits['val']['tokens']:,} val tokens "
          f"({manifest['dtype']}, vocab {manifest['vocab_size']:,}, {len(manifest['sources'])} source files)")
    return 0
