"""`decoderlm train`, `decoderlm generate`, `decoderlm compile`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
import typing
from pathlib import Path

from decoderlm import compiled
from decoderlm.cli.common import (
    SAMPLING_EPILOG,
    add_model_flags,
    add_model_source,
    add_sampling_flags,
    load_model,
    print_stream,
    sampling_params,
)
from decoderlm.cli.speculative import add_speculative_flags, decoding_from_args
from decoderlm.errors import DecoderLMError
from decoderlm.generate import stream
from decoderlm.names import DEFAULT_MODEL
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer import CharTokenizer
from decoderlm.train import TrainConfig, train
from decoderlm.train.config import DEFAULT_RECIPE, FIXED, RUN, SESSION, flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on a text file (char-level) or a prepared folder; torchrun-ready",
                       epilog=resume_rules(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("generate", help="continue a prompt (streams to stdout)", epilog=SAMPLING_EPILOG)
    add_model_source(p, default=DEFAULT_MODEL)
    p.add_argument("--prompt", help="the text to continue")
    p.add_argument("--prompt-ids", metavar="IDS", help="token ids to continue instead of text, comma-separated (e.g. 1,2,3); "
                                                       "prints the generated ids the same way. Needs no tokenizer files")
    p.add_argument("--stop", metavar="TEXT", action="append", default=[],
                   help="end the continuation where TEXT first appears (not printed); repeatable, as OpenAI's `stop`")
    g = p.add_argument_group("structured output (a grammar masks every token that would leave it; not with speculative decoding)")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA_JSON", help="a JSON schema file: the continuation is compact JSON valid under it "
                                                                     "(a keyword the engine cannot enforce is refused, never dropped)")
    shape.add_argument("--grammar", metavar="LARK_FILE", help="a Lark grammar file as llguidance reads it (rule `start`, "
                                                               "`%%json {schema}` for embedded JSON): the continuation is a sentence of it")
    add_model_flags(p, compile=True, quantize="auto")
    add_sampling_flags(p)
    add_speculative_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("compile", help="build the compiled decode step for a model on this machine, once (generate and chat "
                                       "use it, and start this in the background when it is missing)")
    add_model_source(p, default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=compiled.MIN_BUCKET,
                   help="the longest prompt + reply the step serves; one step is built per power of two from "
                        f"{compiled.MIN_BUCKET} (generate and chat pick theirs)")
    p.add_argument("--server", action="store_true",
                   help="build `decoderlm serve`'s batched step instead, for the server's --max-batch and --kv-cache-memory")
    p.add_argument("--max-batch", type=int, default=16, help="with --server: the server's --max-batch")
    p.add_argument("--kv-cache-memory", default=None, help="with --server: the server's --kv-cache-memory")
    add_model_flags(p, quantize="auto")
    p.set_defaults(func=cmd_compile)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, with its type, choices and help taken from the field itself."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if hints[f.name] is bool:
            p.add_argument(flag(f.name), action="store_true", help=f.metadata["help"])
        elif hints[f.name] == list[str] | None:
            p.add_argument(flag(f.name), action="append", default=None, metavar="KEY=VALUE", help=f.metadata["help"])
        else:
            kind = next(t for t in typing.get_args(hints[f.name]) if t is not type(None))  # X from `X | None`
            p.add_argument(flag(f.name), type=kind, default=None, choices=f.metadata["choices"], help=flag_help(f))


def flag_help(f: dataclasses.Field) -> str:
    """The field's help and its default, unless the help already names it."""
    text, default = f.metadata["help"], f.metadata["default"]
    if "default:" in text or (default is None and f.name not in DEFAULT_RECIPE):
        return text
    return f"{text} (default: {'the preset recipe' if default is None else default})"


def resume_rules() -> str:
    """The --resume rule for --help, listed from the fields' own on_resume."""
    listed = [f for f in dataclasses.fields(TrainConfig) if f.name not in ("out", "resume")]
    names = {kind: ", ".join(flag(f.name) for f in listed if f.metadata["on_resume"] == kind) for kind in (FIXED, RUN, SESSION)}
    paragraphs = [
        "With --resume, training continues the run in --out exactly where its last checkpoint left it.",
        f"Cannot change (refused if given with another value): {names[FIXED]}.",
        f"May change (applied with a note): {names[RUN]}. A larger --max-steps extends the run: the schedule "
        "keeps its --decay-steps horizon, so steps past it run at --min-lr (the lr never jumps back up).",
        f"For this invocation only: {names[SESSION]}.",
    ]
    return "\n".join(textwrap.fill(text, 100) for text in paragraphs)


def cmd_train(args: argparse.Namespace) -> int:
    result = train(TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}))
    if result["model"] is None:  # not rank 0 under torchrun: rank 0 reports
        return 0
    cfg = result["config"]
    val = "not evaluated yet" if result["val_loss"] is None else f"{result['val_loss']:.4f}"
    speed = "" if result["tokens_per_s"] is None else f", {result['tokens_per_s']:,.0f} tokens/s"
    print(f"step {result['step']}: val loss {val}, {result['seconds']:.0f}s{speed}; run folder {result['out']}")
    model, tok = result["model"], result["tokenizer"]
    print("--- sample ---")
    params = SamplingParams(temperature=0.8, top_k=200, max_new_tokens=cfg.sample_chars, seed=cfg.seed)
    start = sample_start(tok)
    print_stream(tok, stream(model, start, params))
    return 0


def sample_start(tok) -> list[int]:
    """The sample's first token: a newline (char corpora; a one-line corpus has none, so id 0), or end-of-text."""
    if isinstance(tok, CharTokenizer):
        return tok.encode("\n") if "\n" in tok.stoi else [0]
    return tok.eos_token_ids[:1] or tok.encode("\n", add_special_tokens=False)


def cmd_compile(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        raise DecoderLMError(f"--tokens must be a positive integer, got {args.tokens}")
    if args.server:
        return compile_server_step(args)
    model, _ = load_model(args, text=False)
    decoder = compiled.CompiledDecoder(model)
    if decoder.new_cache(args.tokens) is None:
        return 1  # it said why on stderr
    print(f"compiled decode step ready for up to {compiled.bucket(args.tokens, model.config.max_seq_len)} tokens "
          f"({'built' if decoder.compiles else 'built earlier'}; cached in {compiled.cache_dir()})")
    return 0


def compile_server_step(args: argparse.Namespace) -> int:
    from decoderlm.cli.serve import parse_size
    from decoderlm.serve import Engine

    if args.max_batch < 1:
        raise DecoderLMError(f"--max-batch must be a positive integer, got {args.max_batch}")
    memory = parse_size(args.kv_cache_memory) if args.kv_cache_memory is not None else None
    model, _ = load_model(args, text=False)
    engine = Engine(model, max_batch=args.max_batch, kv_cache_memory=memory, compile=True)
    if not engine.compiled.ready():
        return 1  # it said why on stderr
    print(f"compiled server step ready for batches of up to {args.max_batch} (cached in {compiled.cache_dir()})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise DecoderLMError("give one of --prompt (text) and --prompt-ids (token ids, e.g. 1,2,3)")
    ids = None if args.prompt_ids is None else parse_ids(args.prompt_ids)
    if args.stop and ids is not None:
        raise DecoderLMError("--stop matches text, and --prompt-ids prints ids; give --prompt instead")
    if "" in args.stop:
        raise DecoderLMError("--stop '' would match before the first token; give the text to stop at")
    grammar = grammar_from_args(args)
    model, tok = load_model(args, text=ids is None)
    decoding = decoding_from_args(args, model, tok)
    params = sampling_params(args, model.generation_defaults, tok.eos_token_ids)
    if grammar is not None:
        from decoderlm.tools.grammar import GrammarError, Grammars

        try:
            processor = Grammars(tok).processor(grammar)
        except GrammarError as e:
            raise DecoderLMError(f"{'--json-schema' if args.json_schema else '--grammar'} {args.json_schema or args.grammar}: {e}") from None
        params = dataclasses.replace(params, logits_processors=[*params.logits_processors, processor])
    if ids is not None:
        vocab = model.config.vocab_size
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise DecoderLMError(f"--prompt-ids: {outside[0]} is outside the model's vocabulary (ids 0 to {vocab - 1})")
        tokens = decoding.stream(ids, params)
        for i, t in enumerate(tokens):
            print(f",{t}" if i else t, end="", flush=True)
        print()
    else:
        prompt = tok.encode(args.prompt)
        tokens = decoding.stream(prompt, params)  # raises on a bad prompt before anything is printed
        print(args.prompt, end="", flush=True)
        print_stream(tok, tokens, prompt, args.stop)
    decoding.report()
    return 0


def grammar_from_args(args: argparse.Namespace) -> str | None:
    """The llguidance grammar --json-schema or --grammar asks for (None: neither), checked before the
    model loads: a readable file, a JSON object for a schema, no speculative decoding, text prompts."""
    path = args.json_schema or args.grammar
    if path is None:
        return None
    flag = "--json-schema" if args.json_schema else "--grammar"
    if args.draft_model is not None or args.prompt_lookup is not None:
        raise DecoderLMError(f"{flag} cannot be combined with --draft-model or --prompt-lookup (speculative guesses would "
                             "have to roll back the grammar); drop one of them")
    if args.prompt_ids is not None:
        raise DecoderLMError(f"{flag} needs the tokenizer's text of each token; give --prompt instead of --prompt-ids")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DecoderLMError(f"{flag} {path}: cannot read it ({' '.join(str(e).split())})") from None
    from decoderlm.tools.grammar import GrammarError, json_schema_grammar, lark_grammar

    if args.grammar:
        return lark_grammar(text)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise DecoderLMError(f"--json-schema {path}: not JSON ({e})") from None
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise DecoderLMError(f"--json-schema {path}: {e}") from None


def parse_ids(text: str) -> list[int]:
    """`1,2,3` → [1, 2, 3] (spaces allowed); one clear line for anything else."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise DecoderLMError(f"--prompt-ids takes comma-separated token ids such as 1,2,3, got {text!r}") from None
    if any(t < 0 for t in ids):
        raise DecoderLMError(f"--prompt-ids: token ids are non-negative, got {min(ids)}")
    return ids

