"""Tool-call parsers: the same calls and content however the text is split, prose stays content."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm.tools import get_parser, parser_name_for

CASES = {
    "hermes": [
        ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, "}"]}}\n</tool_call>\n'
         '<tool_call>{"arguments": {"q": "x\\"y"}, "name": "find"}</tool_call>\n', "Sure.", [("add", {"a": 1, "b": [2, "}"]}), ("find", {"q": 'x"y'})]),
        ("Use the <tool_call> tag to call a tool.", "Use the <tool_call> tag to call a tool.", []),
        ("a <tool_call> b </tool_call> c", "a <tool_call> b </tool_call> c", []),
        ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}', "", [("f", {"s": "</tool_call>"})]),
        ("plain answer, no call <tool", "plain answer, no call <tool", []),
    ],
    "llama3": [
        ('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', "", [("f", {"x": 1}), ("g", {})]),
        ('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}', "", [("f", {"x": "y"})]),
        ('{"answer": 1}', '{"answer": 1}', []),
        ('The JSON {"name": "f", "parameters": {}} is an example.', 'The JSON {"name": "f", "parameters": {}} is an example.', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', "", [("f", {"x": 1}), ("g", {})]),
        ('[{"name": "f", "arguments": {"n": [1, {"m": 2}]}}]', "", [("f", {"n": [1, {"m": 2}]})]),
        ("[1, 2]", "[1, 2]", []),
        ("The token [TOOL_CALLS] starts calls.", "The token [TOOL_CALLS] starts calls.", []),
        # the newer format: the tag and the name before each call's arguments object
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
        ('Sure. [TOOL_CALLS]f[ARGS]{"x": [1, "]}"], "y": {"z": null}}\n[TOOL_CALLS]g.v-2[ARGS] {}', "Sure.",
         [("f", {"x": [1, "]}"], "y": {"z": None}}), ("g.v-2", {})]),
        ("Write [TOOL_CALLS]name[ARGS] then the JSON.", "Write [TOOL_CALLS]name[ARGS] then the JSON.", []),
        ("[TOOL_CALLS]not a call[ARGS]{}", "[TOOL_CALLS]not a call[ARGS]{}", []),
        ("[TOOL_CALLS]f[ARG", "[TOOL_CALLS]f[ARG", []),
    ],
}
CASES["generic"] = CASES["hermes"]
ALL = [(fmt, *case) for fmt, cases in CASES.items() for case in cases]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and (id, name, arguments) per call, accumulated from the deltas as a client would."""
    parser = get_parser(fmt, ids())
    content, calls = "", {}
    for delta in [parser.push(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for c in delta.calls:
            if c.index not in calls:
                assert c.id is not None and c.name is not None, "a call's first delta names it"
                calls[c.index] = [c.id, c.name, ""]
            else:
                assert c.id is None and c.name is None
            calls[c.index][2] += c.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


def whole(fmt: str, text: str) -> tuple[str, list[tuple[str, str, str]]]:
    content, calls = get_parser(fmt, ids()).parse(text)
    return content, [(c.id, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", ALL)
def test_whole_answer(fmt, text, content, calls):
    got_content, got_calls = whole(fmt, text)
    assert got_content == content
    assert [(name, json.loads(args)) for _, name, args in got_calls] == calls


@pytest.mark.parametrize("fmt,text,content,calls", ALL)
def test_every_single_split(fmt, text, content, calls):
    expected = whole(fmt, text)
    for i in range(len(text) + 1):
        assert streamed(fmt, [text[:i], text[i:]]) == expected, i
    assert streamed(fmt, list(text)) == expected  # one character at a time


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(ALL), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_random_splits(case, cuts):
    fmt, text = case[0], case[1]
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    assert streamed(fmt, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == whole(fmt, text)


@settings(max_examples=100, deadline=None)
@given(fmt=st.sampled_from(sorted(CASES)), text=st.text(alphabet='<>{}[]";,:/\\ \n abc_nametoolcall|TOOLCALSRG', max_size=60),
       cuts=st.lists(st.integers(0, 60), max_size=6))
def test_any_text_any_split(fmt, text, cuts):
    """Arbitrary text made of the formats' own characters: streaming and whole agree, and with no
    call found the content is the text itself (nothing swallowed)."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    content, calls = whole(fmt, text)
    assert streamed(fmt, [text[a:b] for a, b in zip(bounds, bounds[1:])]) == (content, calls)
    if not calls:
        assert content == text


def test_parser_from_template():
    assert parser_name_for("{% for m in messages %}<tool_call>{{ m }}</tool_call>{% endfor %}") == "hermes"
    assert parser_name_for("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert parser_name_for("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert parser_name_for("<|im_start|>{{ message['role'] }}") == "generic"


@pytest.mark.parametrize("fmt, said, call", [
    ("hermes", "Sure.\n", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'),
    ("llama3", "", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", "", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
])
def test_an_answer_ending_before_a_calls_name_says_where_the_call_began(fmt, said, call):
    """Cut anywhere before the call's header is whole (the token limit), the answer has no call, its text is
    content, and `unfinished` is that call's text, so a chat can tell it apart from words; whole answers and
    prose leave it empty."""
    header_end = call.index('"', call.index('"get_weather"') + len('"get_weather"') + 1)  # inside the arguments key
    for i in range(1, header_end):
        reader = get_parser(fmt)
        content, calls = reader.parse(said + call[:i])
        assert not calls and content == said + call[:i]
        assert reader.unfinished == call[:i] and content.removesuffix(reader.unfinished).rstrip() == said.strip()
    for text in (said + call, "Hello there.", "Use the <tool_call> tag."):
        reader = get_parser(fmt)
        reader.parse(text)
        assert reader.unfinished == ""
