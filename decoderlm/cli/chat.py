"""`decoderlm chat`: talk to an instruct model through its chat template.

The whole conversation is re-rendered with the template each turn (templates may treat the last
message specially), encoded, and the reply streamed until the model's end-of-turn token. When the
conversation outgrows the context, the oldest turns are dropped; the system prompt stays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from decoderlm.cli.common import (
    SAMPLING_EPILOG,
    add_model_flags,
    add_model_source,
    add_sampling_flags,
    load_model,
    model_source,
    print_stream,
    sampling_params,
)
from decoderlm.cli.speculative import add_speculative_flags, decoding_from_args
from decoderlm.errors import DecoderLMError
from decoderlm.names import DEFAULT_MODEL
from decoderlm.sampling import SamplingParams
from decoderlm.speculative import Decoding
from decoderlm.tokenizer.chat import Message

MAX_TOOL_ROUNDS = 8  # rounds of calls and results per user message, so a model that keeps calling stops
HELP = "type a message and press Enter; /reset forgets the conversation, /exit (or Ctrl-D) quits"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with an instruct model (default: the embedded SmolLM2-135M-Instruct)",
                       epilog=f"{SAMPLING_EPILOG} In the chat: {HELP}.")
    add_model_source(p, default=DEFAULT_MODEL, help="HF folder, .gguf file or known name")
    p.add_argument("--system", default=None, help="system prompt (default: the template's own, if any)")
    p.add_argument("--message", default=None, help="send this one message, print the reply and exit (default: an interactive chat)")
    p.add_argument("--image", action="append", default=None, metavar="FILE",
                   help="an image shown with --message, before its text (repeat for several); vision-language models only")
    p.add_argument("--tools", default=None, metavar="TOOLS_JSON",
                   help="a JSON file with OpenAI tool definitions; the model's calls are shown and their results asked for")
    p.add_argument("--run-tools", default=None, metavar="MODULE:FUNCTION,...",
                   help="with --tools: a whitelist of Python functions (importable from PYTHONPATH or the current folder, "
                        "named as the tools are) that are called with the model's arguments, their results sent back "
                        "automatically; a call to any other tool is shown and its result asked for (with --message: not run)")
    p.add_argument("--tool-choice", default="auto",
                   help="auto, required (a call is forced by a grammar), none, or a tool's name (that call is forced)")
    add_model_flags(p, compile=True, quantize="auto")
    add_sampling_flags(p)
    add_speculative_flags(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    if args.run_tools is not None and args.tools is None:
        raise DecoderLMError("--run-tools goes with --tools: give the tool definitions as --tools tools.json")
    model, tok = load_model(args)
    source = model_source(args)
    if tok.chat_template is None:
        raise DecoderLMError(f"{source} has no chat template; use `decoderlm generate --model {source} --prompt ...` instead")
    decoding = decoding_from_args(args, model, tok)
    params = sampling_params(args, model.generation_defaults, tok.eos_token_ids)
    system = [{"role": "system", "content": args.system}] if args.system else []
    if args.image and args.tools is not None:
        raise DecoderLMError("--image and --tools cannot be combined yet; give one of them")
    if args.image:
        return image_reply(args, model, tok, system, params)
    if args.tools is not None:
        return chat_with_tools(args, model, tok, system, params)
    if args.message is not None:
        reply(model, tok, system + [{"role": "user", "content": args.message}], params, decoding)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {source}: {HELP}", file=sys.stderr)
    history: list[Message] = list(system)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":  # "" is EOF
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            history = list(system)
            print("(conversation reset)", flush=True)
            continue
        if not text.strip():
            continue
        try:
            history = reply(model, tok, history + [{"role": "user", "content": text}], params, decoding)
        except DecoderLMError as e:  # e.g. a message longer than the context: say so, keep the conversation
            print(f"error: {e}", file=sys.stderr, flush=True)


def reply(model, tok, messages: list[Message], params: SamplingParams, decoding: Decoding | None = None) -> list[Message]:
    """Stream the assistant's answer to `messages` (plain decoding unless `decoding` says otherwise);
    return the conversation including it."""
    decoding = decoding or Decoding(model)
    messages, prompt = fit_context(tok, messages, model.config.max_seq_len, params.max_new_tokens)
    text = print_stream(tok, decoding.stream(prompt, params), prompt)
    decoding.report()
    return messages + [{"role": "assistant", "content": text}]


def image_reply(args: argparse.Namespace, model, tok, system: list[Message], params: SamplingParams) -> int:
    """One message with images: each image's placeholder before the text, expanded to the image's tokens."""
    from decoderlm import names
    from decoderlm.generate import stream
    from decoderlm.image import ImageProcessor, expand_image_tokens, image_placeholder

    if args.message is None:
        raise DecoderLMError("--image goes with --message: give the question about the image as --message")
    if model.visual is None:
        raise DecoderLMError(f"{model_source(args)} reads text only (it has no vision tower); --image needs a vision-language model")
    folder = names.resolve(model_source(args))
    processor = ImageProcessor.from_folder(folder) if folder.is_dir() else ImageProcessor()
    images = processor(args.image)
    content = image_placeholder(tok, model.config.image_token_id) * len(args.image) + args.message
    ids = tok.encode(tok.apply_chat_template(system + [{"role": "user", "content": content}], add_generation_prompt=True), add_special_tokens=False)
    prompt = expand_image_tokens(ids, model.config.image_token_id, images.tokens(model.visual.config.merge_size))
    print_stream(tok, stream(model, prompt, params, images=images), prompt)
    return 0


def fit_context(tok, messages: list[Message], max_len: int, max_new_tokens: int,
                tools: list[dict] | None = None) -> tuple[list[Message], list[int]]:
    """Drop the oldest exchanges (a user message and every turn up to the next one: replies, tool calls,
    their results), never the system prompt or the newest exchange, until the prompt (with `tools`'
    definitions) leaves room for a reply of max_new_tokens (at most half the context). Returns (messages
    kept, prompt ids)."""
    room = max_len - min(max_new_tokens, max_len // 2)
    while True:
        # The template writes BOS and other special tokens itself.
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools), add_special_tokens=False)
        first = 1 if messages and messages[0]["role"] == "system" else 0
        later = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None)
        if len(prompt) <= room or later is None:
            break
        messages = messages[:first] + messages[later:]
    if len(prompt) >= max_len:
        raise DecoderLMError(f"the message is {len(prompt)} tokens, but the model's context is {max_len}; send a shorter message")
    return messages, prompt


def chat_with_tools(args: argparse.Namespace, model, tok, system: list[Message], params: SamplingParams) -> int:
    """A conversation with tools: each reply's calls are printed as `name(arguments)`; a whitelisted
    tool (--run-tools) is run, any other's result is read from stdin (interactively), and the model
    answers again, for at most MAX_TOOL_ROUNDS rounds of calls per message."""
    from decoderlm.tools.chat import tool_functions

    try:
        tools = json.loads(Path(args.tools).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DecoderLMError(f"--tools {args.tools}: cannot read it as JSON ({' '.join(str(e).split())})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "name" in t.get("function", {}) for t in tools):
        raise DecoderLMError(f"{args.tools}: expected a JSON list of tools like "
                             '[{"type": "function", "function": {"name": ..., "parameters": {...}}}]')
    names = [t["function"]["name"] for t in tools]
    choice = args.tool_choice if args.tool_choice in ("auto", "required", "none") else {"type": "function", "function": {"name": args.tool_choice}}
    if isinstance(choice, dict) and args.tool_choice not in names:
        raise DecoderLMError(f"--tool-choice {args.tool_choice!r} is not among the tools ({', '.join(names)})")
    runners = tool_functions(args.run_tools) if args.run_tools else {}
    unknown = [name for name in runners if name not in names]
    if unknown:
        raise DecoderLMError(f"--run-tools {unknown[0]} is not among the tools ({', '.join(names)}); name the function as its tool")
    history: list[Message] = list(system)
    lines = [args.message] if args.message is not None else iter(sys.stdin.readline, "")
    for line in lines:
        if not line.strip() or line.strip() == "/exit":
            break
        try:
            history = tool_exchange(model, tok, history + [{"role": "user", "content": line.rstrip("\n")}], tools, choice, runners,
                                    params, asks=args.message is None)
        except DecoderLMError as e:  # interactively, e.g. a message longer than the context: say so, keep the conversation
            if args.message is not None:
                raise
            print(f"error: {e}", file=sys.stderr, flush=True)
    return 0


def tool_exchange(model, tok, history: list[Message], tools: list[dict], choice: str | dict, runners: dict,
                  params: SamplingParams, asks: bool) -> list[Message]:
    """The model's answers to the newest message, for at most MAX_TOOL_ROUNDS rounds of calls: each call
    printed, run if whitelisted (`runners`), else its result read from stdin where the chat `asks`."""
    from decoderlm.tools.chat import chat, run_tool

    turn_choice = choice
    for _ in range(MAX_TOOL_ROUNDS):
        history, _ = fit_context(tok, history, model.config.max_seq_len, params.max_new_tokens, tools)
        answer = chat(model, tok, history, tools=tools, tool_choice=turn_choice, params=params)
        if answer.unfinished_call:  # cut before the call's name: words, if any, and no call
            said = answer.content.removesuffix(answer.unfinished_call).rstrip()
            print(*[said] if said else [], f"(the reply reached --max-new-tokens ({params.max_new_tokens}) as it began a tool call, "
                  f"{answer.unfinished_call!r}; give a larger --max-new-tokens)", sep="\n", flush=True)
            return history + [{"role": "assistant", "content": said}]
        history = history + [answer.message()]
        if answer.content:
            print(answer.content, flush=True)
        for call in answer.tool_calls:
            print(f"tool call: {call.name}({call.arguments})", flush=True)
        cut = [c.name for c in answer.tool_calls if isinstance(c.parsed_arguments(), str)]
        if cut:  # the token limit ended the reply inside a call: nothing to run, and no call to remember
            print(f"(not run: the reply reached --max-new-tokens ({params.max_new_tokens}) inside its call of {cut[0]}; "
                  "give a larger --max-new-tokens)", flush=True)
            return history[:-1] + [{"role": "assistant", "content": answer.content}]
        asked = [c.name for c in answer.tool_calls if c.name not in runners]
        if not answer.tool_calls or (not asks and asked):
            if asked and runners:
                print(f"(not run: {', '.join(asked)} is not in --run-tools)", flush=True)
            return history
        for call in answer.tool_calls:
            if call.name in runners:
                result = run_tool(runners[call.name], call)
                print(f"result of {call.name}: {result}", flush=True)
            else:
                print(f"result of {call.name}> ", end="", flush=True)
                result = sys.stdin.readline().rstrip("\n")
            history = history + [{"role": "tool", "tool_call_id": call.id, "content": result}]
        turn_choice = "auto"  # after the results, the model may answer in words
    return history
