"""The OpenAI-compatible server, end to end: a real `decoderlm serve` subprocess on an ephemeral port,
driven by the official `openai` client (sync and async) and by raw HTTP where the client would hide
what is being checked (SSE framing, malformed bodies, missing keys).

Greedy answers are compared with `decoderlm.generate` run here on the same checkpoint, so a wrong
prompt encoding, detokenization, stop handling or engine result shows up as a different text.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI
from hf_models import make_hf_model
from hypothesis import given
from hypothesis import strategies as st
from serve_helpers import ServerProcess, ThreadServer, metrics
from starlette.requests import Request

import decoderlm
from decoderlm.cli.serve import in_passing_thread, parse_size
from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams
from decoderlm.serve import Engine
from decoderlm.serve.api import create_app, server_config, until_disconnect
from decoderlm.tokenizer import StopMatcher

KEY = "test-key"
PROMPT = "The quick brown fox jumps"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random Llama with a real BPE tokenizer and chat template, served with an API key."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", folder)
    model, tok = decoderlm.load(folder)
    server = ServerProcess("--model", str(folder), "--api-key", KEY, "--max-batch", "16", "--kv-cache-memory", "4MiB")
    yield server, str(folder), model, tok
    server.stop()


@pytest.fixture(scope="module")
def url(tiny) -> str:
    return tiny[0].url


@pytest.fixture(scope="module")
def name(tiny) -> str:
    return tiny[1]


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def reference(model, tok, ids: list[int], max_tokens: int, **sampling) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) that `decoderlm.generate` gives for ids, alone."""
    params = SamplingParams(**({"temperature": 0.0} | sampling), max_new_tokens=max_tokens, stop_token_ids=tok.eos_token_ids)
    out = generate(model, ids, params)
    return tok.decode(out).rstrip("\ufffd"), out, "length" if len(out) == max_tokens else "stop"


def chat_ids(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


# --- pieces that need no server -------------------------------------------------------------------


@given(st.text(alphabet="abc\u00e9", max_size=30), st.lists(st.text(alphabet="abc\u00e9", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_cuts_at_first_stop_however_text_is_split(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(text[a:b]) for a, b in zip(bounds, bounds[1:])) + matcher.flush()
    assert out == first_stop(text, stops)
    assert matcher.stopped == any(s in text for s in stops)


def first_stop(text: str, stops: list[str]) -> str:
    """The text up to where a stop string is first completed (reading left to right)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


@pytest.mark.parametrize("text, size", [("512MiB", 512 * 2**20), ("1GiB", 2**30), ("2GB", 2 * 10**9), ("1.5kb", 1500), ("4096", 4096)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["serve", "--kv-cache-memory", "0MiB"], "--kv-cache-memory"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--grammar-timeout", "0"], "--grammar-timeout"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--host", "not a host"], "cannot listen"),
])
def test_bad_flags_are_one_line_exit_2(cli, capsys, argv, needle):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_model_load_error_through_the_loading_thread_is_one_line_exit_2(cli, capsys, tmp_path):
    assert cli(["serve", "--port", "0", "--model", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and err.count("\n") == 1


def test_work_before_the_engine_runs_on_a_thread_that_has_ended():
    """The engine's thread must hold the process's only OpenMP pool (see in_passing_thread)."""
    import threading

    ran_on = []
    result = in_passing_thread(lambda: ran_on.append(threading.current_thread()) or torch.ones(4096).sum().item())
    assert result == 4096 and ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
    with pytest.raises(DecoderLMError, match="bad"):
        in_passing_thread(lambda: (_ for _ in ()).throw(DecoderLMError("bad")))


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build (not a dependency there)")
def test_the_server_runs_on_uvloop_and_httptools():
    """Both are dependencies: with asyncio's loop and h11 the loop's thread takes ~1.5x the CPU per streamed
    token, from the decode step's cores."""
    import uvloop
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = server_config(FastAPI())
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol
    loop = config.get_loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_port_in_use_is_one_line_exit_2(cli, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert cli(["serve", "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and err.count("\n") == 1


def test_size_errors_name_the_fix():
    with pytest.raises(DecoderLMError, match="512MiB"):
        parse_size("12 parsecs")


# --- the real server: OpenAI client, sync and async --------------------------------------------------


def test_models_and_health(url, client, name):
    assert [m.id for m in client.models.list().data] == [name]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_completion_matches_generate(client, tiny, name):
    _, _, model, tok = tiny
    ids = tok.encode(PROMPT)
    text, out, finish = reference(model, tok, ids, 12)
    for prompt in (PROMPT, ids):  # text, and the same prompt as token ids
        r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == finish
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(out))


def test_stream_equals_non_stream_with_usage(client, name):
    kwargs = dict(model=name, prompt=PROMPT, max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing_ends_with_done(url, name):
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_chat_async_stream_and_not(url, tiny, name):
    _, _, model, tok = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    text, out, finish = reference(model, tok, chat_ids(tok, messages), 16)

    async def ask():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        whole = await client.chat.completions.create(model=name, messages=messages, max_completion_tokens=16, temperature=0)
        stream = await client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream]
        await client.close()
        return whole, "".join(pieces)

    whole, streamed = asyncio.run(ask())
    assert whole.choices[0].message.content == text == streamed
    assert whole.choices[0].finish_reason == finish
    assert whole.usage.completion_tokens == len(out)


def test_stop_string_split_across_tokens_is_not_emitted(client, tiny, name):
    _, _, model, tok = tiny
    text, out, _ = reference(model, tok, tok.encode(PROMPT), 24)
    # a stop string that starts inside one token and ends in the next
    pieces = [tok.decode(out[:i]) for i in range(1, len(out))]
    cut = next(len(p) for p in pieces
               if 2 <= len(p) <= len(text) - 2 and p == text[: len(p)] and "\ufffd" not in text[len(p) - 1 : len(p) + 1])
    stop = text[cut - 1 : cut + 1]
    expected = text[: text.find(stop)]
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never-seen-stop"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_get_seed_plus_i(client, name):
    many = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7, extra_body={"top_k": 50})
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    for c in many.choices:
        alone = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7 + c.index,
                                          extra_body={"top_k": 50})
        assert alone.choices[0].text == c.text
    assert len({c.text for c in many.choices}) > 1  # three seeds, three samples
    assert many.usage.prompt_tokens == client.completions.create(model=name, prompt=PROMPT, max_tokens=1).usage.prompt_tokens


def test_list_of_prompts_gives_n_choices_per_prompt(client, name):
    prompts = ["Keys and values", "To be, or not"]
    r = client.completions.create(model=name, prompt=prompts, n=2, max_tokens=6, temperature=0)
    alone = [client.completions.create(model=name, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [(c.index, c.text) for c in r.choices] == [(2 * p + i, alone[p].choices[0].text) for p in range(2) for i in range(2)]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_logprobs_are_the_models(client, tiny, name):
    _, _, model, tok = tiny
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=name, prompt=ids, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    _, out, _ = reference(model, tok, ids, 6)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float().log_softmax(-1)  # (T, V)
    expected = logits.gather(-1, torch.tensor(out)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs), expected, atol=1e-4)
    assert lp.tokens == [tok.decode([t]) for t in out]
    for row, top in zip(logits, lp.top_logprobs):  # OpenAI's shape is {text: logprob}: tokens with the same text collide
        best = row.topk(3).values.tolist()
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())

    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4) for c in content)


def test_eos_ends_with_stop_unless_ignore_eos(client, tiny, name):
    _, _, model, tok = tiny
    eos = tok.eos_token_ids[0]
    prompts = torch.randint(1, 300, (4096, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = model(prompts).logits[:, -1].argmax(-1)  # (4096,) greedy first tokens
    prompt = prompts[(first == eos).nonzero()[0, 0]].tolist()  # a prompt whose greedy answer is EOS at once
    r = client.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 0)
    r = client.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)


def test_penalties_match_generate(client, tiny, name):
    _, _, model, tok = tiny
    ids = tok.encode(PROMPT)
    sampling = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    text, _, _ = reference(model, tok, ids, 16, **sampling)
    assert text != reference(model, tok, ids, 16)[0]  # the penalties change this answer
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
                                  extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == text


# --- bad requests: each a 4xx in OpenAI's error shape, and the server carries on -----------------------

GOOD = {"prompt": PROMPT, "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (route, body or raw bytes, headers, status, param)
    ("completions", GOOD, {"Authorization": ""}, 401, None),
    ("completions", GOOD, {"Authorization": "Bearer wrong"}, 401, None),
    ("completions", b'{"model": "x", "prompt": ', {}, 400, None),
    ("completions", b"[1, 2, 3]", {}, 400, None),
    ("completions", json.dumps({"prompt": PROMPT}).encode(), {}, 400, "model"),
    ("completions", GOOD | {"model": "gpt-4o"}, {}, 404, "model"),
    ("completions", {"max_tokens": 4}, {}, 400, "prompt"),
    ("completions", GOOD | {"prompt": 42}, {}, 400, None),
    ("completions", GOOD | {"prompt": ""}, {}, 400, "prompt"),
    ("completions", GOOD | {"prompt": []}, {}, 400, "prompt"),
    ("completions", GOOD | {"prompt": [1, 99999]}, {}, 400, "prompt"),
    ("completions", GOOD | {"prompt": [5] * 300}, {}, 400, "prompt"),
    ("completions", GOOD | {"prompt": [[]]}, {}, 400, "prompt"),
    ("completions", GOOD | {"temprature": 0.5}, {}, 400, "temprature"),
    ("completions", GOOD | {"max_tokens": -1}, {}, 400, "max_tokens"),
    ("completions", GOOD | {"max_tokens": 10**9}, {}, 400, "max_tokens"),
    ("completions", GOOD | {"max_tokens": "ten"}, {}, 400, "max_tokens"),
    ("completions", GOOD | {"temperature": -0.5}, {}, 400, "temperature"),
    ("completions", GOOD | {"temperature": "hot"}, {}, 400, "temperature"),
    ("completions", GOOD | {"top_p": 1.5}, {}, 400, "top_p"),
    ("completions", GOOD | {"top_p": 0}, {}, 400, "top_p"),
    ("completions", GOOD | {"top_k": -7}, {}, 400, "top_k"),
    ("completions", GOOD | {"min_p": 1.0}, {}, 400, "min_p"),
    ("completions", GOOD | {"frequency_penalty": 2.5}, {}, 400, "frequency_penalty"),
    ("completions", GOOD | {"presence_penalty": -3}, {}, 400, "presence_penalty"),
    ("completions", GOOD | {"repetition_penalty": 0}, {}, 400, "repetition_penalty"),
    ("completions", GOOD | {"n": 0}, {}, 400, "n"),
    ("completions", GOOD | {"n": 1000}, {}, 400, "n"),
    ("completions", GOOD | {"seed": -1}, {}, 400, "seed"),
    ("completions", GOOD | {"logprobs": 50}, {}, 400, "logprobs"),
    ("completions", GOOD | {"stop": ["a", "b", "c", "d", "e"]}, {}, 400, "stop"),
    ("completions", GOOD | {"stop": [""]}, {}, 400, "stop"),
    ("completions", GOOD | {"stream": "yes"}, {}, 400, "stream"),
    ("completions", GOOD | {"stream_options": {"include_usage": True}}, {}, 400, "stream_options"),
    ("completions", GOOD | {"logit_bias": {"5": 10}}, {}, 400, "logit_bias"),
    ("completions", GOOD | {"echo": True}, {}, 400, "echo"),
    ("chat/completions", CHAT | {"messages": []}, {}, 400, "messages"),
    ("chat/completions", CHAT | {"messages": "hi"}, {}, 400, "messages"),
    ("chat/completions", CHAT | {"messages": [{"content": "hi"}]}, {}, 400, "messages.0.role"),
    ("chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages.0.role"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": 5}]}, {}, 400, None),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, {}, 400,
     "messages.0.content"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "txt": "hi"}]}]}, {}, 400,
     "messages.0.content"),
    ("chat/completions", CHAT | {"messages": [{"role": "tool", "content": "42"}]}, {}, 400, "messages.0.tool_call_id"),
    ("chat/completions", CHAT | {"messages": [{"role": "function", "content": "42", "name": "f"}]}, {}, 400, "messages.0.role"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": "hi", "nmae": "x"}]}, {}, 400, "messages.0.nmae"),
    ("chat/completions", CHAT | {"tool_choice": "auto"}, {}, 400, "tool_choice"),
    ("chat/completions", CHAT | {"max_token": 4}, {}, 400, "max_token"),
    ("chat/completions", CHAT | {"stream": True, "stream_options": {"include_usage": True, "usage": True}}, {}, 400,
     "stream_options.usage"),
    ("chat/completions", CHAT | {"top_logprobs": 2}, {}, 400, "top_logprobs"),
    ("chat/completions", CHAT | {"max_completion_tokens": 0}, {}, 400, "max_completion_tokens"),
    ("chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "two words"}}]}, {}, 400, "tools.0.function.name"),
    ("chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     {}, 400, "tool_choice"),
    ("chat/completions", CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, {}, 400, "tool_choice"),
    ("chat/completions", CHAT | {"response_format": {"type": "xml"}}, {}, 400, "response_format.type"),
    ("chat/completions", CHAT | {"response_format": {"type": "json_schema"}}, {}, 400, "response_format.json_schema"),
    ("chat/completions", CHAT | {"messages": [{"role": "user", "content": "word " * 400}]}, {}, 400, "messages"),
    ("completions", {"prompt": "x" * 3_000_000}, {}, 413, None),
]


@pytest.mark.parametrize("route, body, headers, status, param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_openai_error(url, name, route, body, headers, status, param):
    headers = {"Authorization": f"Bearer {KEY}"} | headers
    content = body if isinstance(body, bytes) else json.dumps({"model": name} | body).encode()
    r = httpx.post(f"{url}/v1/{route}", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in r.text and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_unknown_and_unsupported_fields_are_400s_in_the_users_words(client, name):
    """OpenAI answers 400 for an argument it does not know, so a misspelled one never passes silently;
    a message this server cannot read is refused in words that name what it has, not pydantic's."""
    cases = [
        (dict(prompt=PROMPT, extra_body={"temprature": 0.5}), "temprature", "unrecognized request argument 'temprature'"),
        (dict(messages=[{"role": "user", "content": "What is 6 x 7?", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}]),
         "messages.0.tool_calls", "tool_calls: only assistant messages carry tool calls"),
        (dict(messages=[{"role": "tool", "content": "42"}]), "messages.0.tool_call_id", "tool_call_id: a tool message must name the call"),
        (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                     {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]),
         "messages.0.content", "image content parts need a vision model"),
    ]
    for kwargs, param, text in cases:
        create = client.completions.create if "prompt" in kwargs else client.chat.completions.create
        with pytest.raises(openai.BadRequestError) as e:
            create(model=name, max_tokens=4, **kwargs)
        assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
        assert e.value.param == param and e.value.body["message"].startswith(text), e.value.body


def test_a_prompt_too_long_is_context_length_exceeded(client, name):
    for create, kwargs in ((client.completions.create, dict(prompt=[5] * 300)),
                           (client.chat.completions.create, dict(messages=[{"role": "user", "content": "word " * 400}]))):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=name, max_tokens=4, **kwargs)
        assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt" if "prompt" in kwargs else "messages")


def test_what_the_openai_client_sends_back_is_accepted(client, name):
    """A reply passed back as the client returned it (refusal: null) and every stream option it knows."""
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0).choices[0].message
    messages += [reply, {"role": "user", "content": [{"type": "text", "text": "and then?"}]}]
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0, n=1, user="u1", stream=True,
                                                 stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0


def test_chunked_oversized_body_is_413(url):
    def chunks():
        for _ in range(40):
            yield b"x" * 100_000

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_json(url):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/v1/nothing", headers=headers).json()["error"]["message"]
    r = httpx.get(f"{url}/v1/completions", headers=headers)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_still_correct_after_bad_requests(client, tiny, name):
    _, _, model, tok = tiny
    text, _, _ = reference(model, tok, tok.encode(PROMPT), 8)
    assert client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text == text


# --- load: 16 concurrent clients, some hang up mid-stream ------------------------------------------------


def test_load_with_disconnects_frees_every_block(url, tiny, name):
    _, _, model, tok = tiny
    assert reference(model, tok, tok.encode(PROMPT), 200)[2] == "length"  # so only a disconnect can end those early
    before = metrics(url)
    total, workers = 208, 16
    results = {"ok": 0, "tokens": 0, "prompt_tokens": 0, "disconnected": 0}

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        chat = i % 2 == 0
        kwargs = dict(model=name, max_tokens=4 + i % 13, temperature=0.8, seed=i)
        if i % 10 == 3:  # hang up after the first chunk of a long greedy answer that has no stop token
            stream = await client.completions.create(model=name, prompt=PROMPT, max_tokens=200, temperature=0, stream=True)
            async for _ in stream:
                break
            await stream.close()
            results["disconnected"] += 1
            return
        stream_it = i % 3 == 0
        if chat:
            r = await client.chat.completions.create(messages=[{"role": "user", "content": f"question {i}"}], stream=stream_it,
                                                     stream_options={"include_usage": True} if stream_it else None, **kwargs)
        else:
            r = await client.completions.create(prompt=f"{PROMPT} {i}", stream=stream_it,
                                                stream_options={"include_usage": True} if stream_it else None, **kwargs)
        if stream_it:
            chunks = [c async for c in r]
            r = chunks[-1]
        assert r.usage.completion_tokens <= kwargs["max_tokens"]
        results["ok"] += 1
        results["tokens"] += r.usage.completion_tokens
        results["prompt_tokens"] += r.usage.prompt_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        queue = list(range(total))

        async def worker():
            while queue:
                await one(client, queue.pop())

        await asyncio.gather(*(worker() for _ in range(workers)))
        await client.close()

    asyncio.run(main())
    assert results["ok"] + results["disconnected"] == total and results["disconnected"] >= total // 11

    after = wait_idle(url)

    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert after["decoderlm_kv_blocks_used"] == 0 and after["decoderlm_requests_running"] == 0
    assert after["decoderlm_requests_waiting"] == 0
    assert after["decoderlm_kv_blocks_free"] == after["decoderlm_kv_blocks_total"]
    assert delta('decoderlm_http_requests_total{outcome="ok"}') == results["ok"]
    assert delta('decoderlm_http_requests_total{outcome="aborted"}') == results["disconnected"]
    assert delta('decoderlm_sequences_finished_total{reason="abort"}') == results["disconnected"]
    assert delta("decoderlm_completion_tokens_total") == results["tokens"]
    assert delta("decoderlm_generated_tokens_total") >= results["tokens"] + results["disconnected"]
    assert delta("decoderlm_prompt_tokens_total") >= results["prompt_tokens"]
    assert delta("decoderlm_time_to_first_token_seconds_count") == total
    assert 0 <= after["decoderlm_prefix_cache_hit_rate"] <= 1


def wait_idle(url: str) -> dict[str, float]:
    """/metrics once the engine holds no sequence and no block (aborts land within a step or two)."""
    for _ in range(200):
        now = metrics(url)
        if now["decoderlm_kv_blocks_used"] == 0 and now["decoderlm_requests_running"] == 0 and now["decoderlm_requests_waiting"] == 0:
            return now
        time.sleep(0.05)
    return now


def test_non_stream_client_that_leaves_aborts_its_request(url, name):
    key = 'decoderlm_http_requests_total{outcome="aborted"}'
    before = wait_idle(url).get(key, 0)
    body = json.dumps({"model": name, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "n": 8}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:  # a client that hangs up once generation runs
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        while metrics(url)["decoderlm_requests_running"] == 0:
            time.sleep(0.01)
    for _ in range(200):
        after = wait_idle(url)
        if after.get(key, 0) > before:
            break
        time.sleep(0.05)
    assert after[key] == before + 1
    assert after['decoderlm_sequences_finished_total{reason="abort"}'] >= 8
    assert after["decoderlm_kv_blocks_used"] == 0



def test_a_hang_up_cancels_work_at_once_not_at_the_next_poll():
    """Work that would end 0.2 s after the client left is cancelled, not finished and thrown away."""
    async def main() -> tuple[bool, bool]:
        async def receive() -> dict:
            return {"type": "http.disconnect"}  # the body was read; the client has already gone

        cancelled = False

        async def work() -> None:
            nonlocal cancelled
            try:
                await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                cancelled = True
                raise

        finished = await until_disconnect(Request({"type": "http", "headers": []}, receive), work())
        return finished, cancelled

    assert asyncio.run(main()) == (False, True)


def test_work_that_ends_while_the_client_waits_is_finished():
    """A client that stays gets its answer: listening for the hang-up cancels nothing."""
    async def main() -> bool:
        async def receive() -> dict:
            await asyncio.Event().wait()  # the client stays
            return {"type": "http.disconnect"}

        return await until_disconnect(Request({"type": "http", "headers": []}, receive), asyncio.sleep(0.01))

    assert asyncio.run(main()) is True

# --- the real SmolLM2-135M-Instruct ----------------------------------------------------------------------


def test_sigterm_with_a_stream_in_flight_exits_cleanly(tiny, name):
    server = tiny[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    stream = client.completions.create(model=name, prompt=PROMPT, max_tokens=230, stream=True)
    next(iter(stream))
    assert server.stop() == 0
    output = server.output()
    assert "Traceback" not in output and "ERROR" not in output and "server stopped" in output


def test_smollm2_chat():
    """The embedded SmolLM2-135M-Instruct through its own chat template: the served answer is the one
    `decoderlm generate` gives. Served in-process, so the model is loaded once for both."""
    model, tok = decoderlm.load("smollm2-135m-instruct")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text, _, _ = reference(model, tok, chat_ids(tok, messages), 24)
    engine = Engine(model, max_batch=4)
    engine.start()
    server = ThreadServer(create_app(engine, tok, "smollm2-135m-instruct", max_seq_len=model.config.max_seq_len,
                                     sampling_defaults=model.generation_defaults))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="anything", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == text
        assert "Paris" in text
    finally:
        server.stop()
        engine.shutdown()


def test_a_request_after_shutdown_is_503_not_a_client_error(tiny):
    """The request was fine; the server is going away: 503 (retry elsewhere), not 400."""
    _, _, model, tok = tiny
    engine = Engine(model)
    engine.start()
    engine.shutdown()
    server = ThreadServer(create_app(engine, tok, "tiny", max_seq_len=model.config.max_seq_len))
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503
        assert "shutting down" in r.json()["error"]["message"]
    finally:
        server.stop()
