"""Grammar-constrained decoding through the logits-processor seam, on a tiny random model: every
sample is valid, the tool grammars write what the tool parsers read, the state rolls back."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import torch
from hf_models import make_hf_model

import decoderlm
from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams
from decoderlm.speculative import PromptLookup
from decoderlm.tools.grammar import GrammarError, Grammars, json_schema_grammar, tool_call_grammar
from decoderlm.tools.parsers import get_parser

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "b"]}}, "required": ["n", "ok", "tag"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9},
                                                                                                          "b": {"type": "integer", "maximum": 9}},
                                                                         "required": ["a", "b"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", folder)
    model, tok = decoderlm.load(folder)
    return model, tok, Grammars(tok)


def sample(tiny, grammar: str, seed: int, max_new_tokens: int = 60, may_run_out: bool = False) -> str:
    """A sample at temperature 1; it must end with EOS (the grammar complete) unless `may_run_out`."""
    model, tok, grammars = tiny
    params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=max_new_tokens, stop_token_ids=tok.eos_token_ids,
                            logits_processors=[grammars.processor(grammar)])
    out = generate(model, tok.encode("The quick brown fox"), params)
    assert may_run_out or len(out) < max_new_tokens, "the grammar did not end the answer"
    return tok.decode(out)


def test_json_schema_samples_are_valid(tiny):
    grammar = json_schema_grammar(SCHEMA)
    for seed in range(10):
        jsonschema.validate(json.loads(sample(tiny, grammar, seed)), SCHEMA)


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_tool_grammar_writes_what_the_parser_reads(tiny, parser, parallel):
    """One call, ended by EOS; or (parallel, which a random model continues until it runs out) calls
    of which all but the last are complete."""
    for seed in range(4):
        text = sample(tiny, tool_call_grammar(TOOLS, parser, parallel), seed, max_new_tokens=120, may_run_out=parallel)
        content, calls = get_parser(parser).parse(text)
        assert calls and (content == "" or parallel), text
        assert len(calls) == 1 or parallel
        for call in calls[:-1] if parallel else calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)


def test_state_rolls_back_to_a_shorter_history(tiny):
    model, tok, grammars = tiny
    prompt, answer = [1, 2, 3], tok.encode('{"n": 7, "ok": true')
    grammar = json_schema_grammar(SCHEMA)
    scores = torch.zeros(model.config.vocab_size)
    p = grammars.processor(grammar)
    p(prompt, scores)
    later = p(prompt + answer, scores)
    again = p(prompt + answer[:2], scores)  # a recomputed step: fewer tokens than consumed
    fresh = grammars.processor(grammar)
    fresh(prompt, scores)
    assert torch.equal(again, fresh(prompt + answer[:2], scores))
    assert not torch.equal(later, again)


def test_unenforceable_keywords_and_speculative_decoding_are_refused(tiny):
    model, tok, grammars = tiny
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.processor(json_schema_grammar({"type": "array", "uniqueItems": True}))
    params = SamplingParams(max_new_tokens=4, logits_processors=[grammars.processor(json_schema_grammar(SCHEMA))])
    with pytest.raises(DecoderLMError, match="speculative decoding cannot follow a grammar"):
        generate(model, [1, 2, 3], params, proposer=PromptLookup())


def test_library_chat_returns_parsed_calls(tiny):
    """`decoderlm.tools.chat.chat`: a forced call comes back parsed, and its message renders back into
    the conversation (a short hermes template: the generic prompt would not fit the tiny context)."""
    from decoderlm.tools.chat import chat

    model, tok, _ = tiny
    tok = copy.copy(tok)
    tok.chat_template = ("{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}{% for m in messages %}"
                         "<|{{ m.role }}|>{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                         "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "user", "content": "add two and three"}]
    reply = chat(model, tok, messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False,
                 params=SamplingParams(temperature=1.0, seed=0, max_new_tokens=80))
    assert reply.finish_reason == "tool_calls" and [c.name for c in reply.tool_calls] == ["add"]
    jsonschema.validate(json.loads(reply.tool_calls[0].arguments), TOOLS[0]["function"]["parameters"])
    history = messages + [reply.message(), {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"}]
    rendered = tok.apply_chat_template(history, tools=TOOLS)
    assert f'<tool_call>{{"name": "add", "arguments": {reply.tool_calls[0].arguments}}}</tool_call>' in rendered and "<|tool|>5" in rendered
    plain = chat(model, tok, messages, tools=TOOLS, tool_choice="none", params=SamplingParams(temperature=0.0, max_new_tokens=5))
    assert plain.tool_calls == [] and plain.finish_reason == "length"


def test_a_conversation_longer_than_the_context_is_refused_in_one_line(tiny):
    from decoderlm.tools.chat import chat

    model, tok, _ = tiny
    with pytest.raises(DecoderLMError, match=rf"^the conversation is \d+ tokens, but the model's context is {model.config.max_seq_len}; drop"):
        chat(model, tok, [{"role": "user", "content": "word " * model.config.max_seq_len}], tools=TOOLS)


def test_a_reply_cut_inside_a_call_keeps_its_arguments_text():
    """A call the token limit cut short has no whole JSON: the message keeps its text instead of raising."""
    from decoderlm.tools.chat import Reply
    from decoderlm.tools.parsers import ToolCall

    message = Reply("", [ToolCall("a", "add", '{"a": 1}'), ToolCall("b", "add", '{"a')], "length").message()
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [{"a": 1}, '{"a']
