"""The `decoderlm` command: one subcommand per job. Each module in this package adds its own.

Every user-facing error (`DecoderLMError`, a bad flag) becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from decoderlm.cli import chat, convert, finetune, inspect, perplexity, prepare, run, serve
from decoderlm.errors import DecoderLMError

COMMAND_MODULES = [run, prepare, chat, convert, inspect, perplexity, serve, finetune]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise DecoderLMError(f"{self.prog}: {message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="decoderlm", description="Decoder-only Transformer language models: train, load, generate, chat, inspect.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args) or 0
    except DecoderLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
