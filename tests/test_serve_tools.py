"""Tools and structured output through the server, with the official openai client, on the embedded
SmolLM2-135M-Instruct (plain ChatML: the generic tool prompt and parser). `required`, a named function
and response_format are enforced by the grammar, so even this small model must obey them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import ThreadServer

import decoderlm
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams
from decoderlm.serve import Engine
from decoderlm.serve.api import create_app

NAME = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                                                        "required": ["timezone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1, "maximum": 100},
                                         "capital": {"type": "boolean"}}, "required": ["city", "rank", "capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol():
    model, tok = decoderlm.load(NAME)
    engine = Engine(model, max_batch=16)
    engine.start()
    server = ThreadServer(create_app(engine, tok, NAME, max_seq_len=model.config.max_seq_len, sampling_defaults=model.generation_defaults))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0), model, tok
    server.stop()
    engine.shutdown()


def ask(client, stream: bool = False, **kwargs):
    kwargs = {"model": NAME, "messages": ASK, "max_tokens": 40, "temperature": 0} | kwargs
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call names it
                assert d.id and d.function.name and d.type == "function"
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def calls_of(choice) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_required_and_named_are_enforced_one_call_without_parallel(smol):
    client = smol[0]
    for choice, tools, name in (("required", [WEATHER], "get_weather"),
                                ({"type": "function", "function": {"name": "get_time"}}, [WEATHER, TIME], "get_time")):
        r = ask(client, tools=tools, tool_choice=choice, parallel_tool_calls=False)
        assert r.finish_reason == "tool_calls" and not r.message.content
        [call] = r.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == name
        schema = next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_stream_equals_non_stream(smol):
    client = smol[0]
    for kwargs in (dict(tools=[WEATHER], tool_choice="required"), dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
                   dict(tools=[WEATHER]), dict(tools=[WEATHER], tool_choice="none")):
        whole = ask(client, **kwargs)
        content, calls, finish = ask(client, stream=True, **kwargs)
        assert (content or None, calls, finish) == (whole.message.content or None, calls_of(whole), whole.finish_reason), kwargs
    assert len(calls_of(ask(client, tools=[WEATHER], tool_choice="required"))) >= 1


def test_tool_choice_none_and_auto_answer_in_text(smol):
    """SmolLM2 was not trained on tools: with auto it answers in prose, which stays content."""
    client = smol[0]
    for choice in ("none", "auto"):
        r = ask(client, tools=[WEATHER], tool_choice=choice)
        assert r.message.content and not r.message.tool_calls and r.finish_reason in ("stop", "length")


def test_tool_result_round_trip_is_rendered(smol):
    """A history with the assistant's call and the tool's result: the server's answer is the one
    `decoderlm.generate` gives for the prompt the chat template renders from those messages."""
    client, model, tok = smol
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=24, temperature=0).choices[0]
    rendered = [ASK[0], {"role": "assistant", "content": "", "tool_calls": [call | {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny"}]
    text = tok.apply_chat_template(rendered, add_generation_prompt=True, tools=[WEATHER])
    assert '<tool_response>\n21 °C, sunny\n</tool_response>' in text and '<tool_call>{"name": "get_weather"' in text
    ids = tok.encode(text, add_special_tokens=False)
    out = generate(model, ids, SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=tok.eos_token_ids))
    assert r.message.content == tok.decode(out)


def test_json_schema_always_valid_at_temperature_1(smol):
    """52 samples at temperature 1, every one valid under the strict schema (checked with jsonschema)."""
    client = smol[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    answers = []
    for seed in range(4):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Name a big city of France as JSON."}], n=13,
                                           max_tokens=80, temperature=1.0, top_p=1.0, seed=seed * 100, response_format=fmt)
        answers += r.choices
    assert len(answers) >= 50
    for c in answers:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), CITY)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Give the largest city of France as JSON."}], max_tokens=60,
                                       temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("kwargs, param, needle", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}}),
     "response_format", "uniqueItems"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}], tool_choice="required"),
     "tools", "not"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice", "get_time"),
])
def test_unenforceable_requests_are_400s_naming_the_problem(smol, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        ask(smol[0], **kwargs)
    assert e.value.param == param and needle in e.value.body["message"] and "\n" not in e.value.body["message"]


def test_the_clients_own_call_message_goes_back_with_the_result(smol):
    """An agent loop as written with the openai client: the assistant message object it received is
    appended as is, then the tool's result; the server accepts both and answers in words."""
    client = smol[0]
    first = ask(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.message.tool_calls[0]
    messages = ASK + [first.message, {"role": "tool", "tool_call_id": call.id, "content": "21 °C, sunny"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0).choices[0]
    assert r.message.content and r.finish_reason in ("stop", "length")


def test_a_grammar_too_slow_to_compile_is_a_400_after_the_bound(smol):
    """A schema llguidance needs ~0.5 s to compile (a thousand alternatives, each with its own pattern)
    against a bound of 0.05 s: a 400 that names the bound, and the same at once when it is sent again."""
    _, model, tok = smol
    engine = Engine(model, max_batch=1)
    engine.start()
    server = ThreadServer(create_app(engine, tok, NAME, max_seq_len=model.config.max_seq_len, grammar_timeout=0.05))
    slow = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^x{{{i}}}y+$"}}, "required": [f"k{i}"]}
                      for i in range(1000)]}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    try:
        for _ in range(2):
            with pytest.raises(openai.BadRequestError) as e:
                ask(client, response_format={"type": "json_schema", "json_schema": {"name": "slow", "schema": slow}})
            assert e.value.param == "response_format" and "longer than 0.05 s to compile" in e.value.body["message"]
    finally:
        server.stop()
        engine.shutdown()
