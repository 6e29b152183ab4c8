"""The `decoderlm` command: one subcommand per job. Each module in this package adds its own.

Every user-facing error (`DecoderLMError`, a bad flag) becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from decoderlm import __version__
from decoderlm.cli import chat, convert, finetune, inspect, perplexity, prepare, run, serve
from decoderlm.errors import DecoderLMError

COMMAND_MODULES = [run, prepare, chat, convert, inspect, perplexity, serve, finetune]


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless it names one already or has none to show (unset, off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is None or action.default is False \
                or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class: type[argparse.HelpFormatter] = HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage too)
        raise DecoderLMError(f"{self.prog}: {message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="decoderlm", description="Decoder-only Transformer language models: train, load, generate, chat, inspect.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


ENDED_LIKE_CTRL_C = ("generate", "chat")  # the commands that decode through torch's loader of a compiled step


def terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM ends the command by an exception, as Ctrl-C does, so objects are released on the way out: torch's
    loader of a compiled step deletes the copy of its package it unpacked into the temp folder only then (a
    process that SIGTERM killed outright left 3 MB there each time)."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command in ENDED_LIKE_CTRL_C and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, terminated)
            try:
                return args.func(args) or 0
            finally:
                signal.signal(signal.SIGTERM, previous)
        return args.func(args) or 0
    except DecoderLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
