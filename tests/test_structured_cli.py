"""`decoderlm generate --json-schema / --grammar` and `decoderlm chat --run-tools` on the embedded SmolLM2."""

from __future__ import annotations

import io
import json

import jsonschema
import pytest

import decoderlm.cli as cli

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "A person as JSON:"


def test_generate_json_schema_output_validates(tmp_path, capsys):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    for seed in (0, 1):
        argv = ["generate", "--prompt", PROMPT, "--json-schema", str(tmp_path / "schema.json"), "--temperature", "1",
                "--seed", str(seed), "--max-new-tokens", "40"]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(PROMPT)
        jsonschema.validate(json.loads(out[len(PROMPT):]), SCHEMA)


def test_generate_lark_grammar(tmp_path, capsys):
    (tmp_path / "g.lark").write_text('start: "yes" | "no"\n')
    assert cli.main(["generate", "--prompt", "Is the sky green? Answer: ", "--grammar", str(tmp_path / "g.lark"), "--seed", "0"]) == 0
    assert capsys.readouterr().out.split("Answer: ", 1)[1] in ("yes\n", "no\n")


@pytest.mark.parametrize("content, extra, message", [
    ('{"type": "array", "uniqueItems": true}', [], "keyword(s) uniqueItems cannot be enforced"),
    ('{"type": ', [], "not JSON"),
    (None, [], "cannot read it"),
    (json.dumps(SCHEMA), ["--prompt-lookup"], "cannot be combined with --draft-model or --prompt-lookup"),
])
def test_generate_json_schema_refusals_are_one_line(tmp_path, capsys, content, extra, message):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["generate", "--prompt", "x", "--json-schema", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


TOOLS = [{"type": "function", "function": {"name": name, "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}} for name in ("get_weather", "get_time")]


@pytest.fixture
def tool_files(tmp_path, monkeypatch):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "cli22_tools.py").write_text("def get_weather(city):\n    return f'21 C and sunny in {city}'\n\n"
                                             "def get_time(city):\n    return {'city': city, 'time': '12:00'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["chat", "--tools", str(tmp_path / "tools.json"), "--tool-choice", "get_weather", "--temperature", "0", "--max-new-tokens", "24",
            "--message", "What is the weather in Paris?"]


def test_chat_runs_whitelisted_tools_and_answers(tool_files, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # nothing to ask: the result comes from the function
    assert cli.main([*tool_files, "--run-tools", "cli22_tools:get_weather,cli22_tools:get_time"]) == 0
    call, result, *answer = capsys.readouterr().out.split("\n")
    assert call == 'tool call: get_weather({"city": "Paris"})'
    assert result == "result of get_weather: 21 C and sunny in Paris"
    assert "".join(answer).strip()  # the model answered again after the result


def test_chat_does_not_run_tools_off_the_whitelist(tool_files, capsys):
    assert cli.main([*tool_files, "--run-tools", "cli22_tools:get_time"]) == 0
    assert capsys.readouterr().out == 'tool call: get_weather({"city": "Paris"})\n(not run: get_weather is not in --run-tools)\n'


def test_chat_with_tools_keeps_its_prompts_within_the_context(tool_files, capsys, monkeypatch):
    """A long conversation with tools in a 450-token context: the oldest exchanges leave the prompt, which
    always starts with the system prompt and the tools and leaves room for a reply (before, the prompt
    grew past the context and `generate` slid its window over the template's start)."""
    import decoderlm.cli.chat as chat_cli
    import decoderlm.tools.chat as tools_chat

    real_load, real_generate, prompts, toks = chat_cli.load_model, tools_chat.generate, [], []

    def small_context(args):
        model, tok = real_load(args)
        model.config.max_seq_len = 450
        toks.append(tok)
        return model, tok

    def recording(model, ids, params):
        prompts.append(ids)
        return real_generate(model, ids, params)

    monkeypatch.setattr(chat_cli, "load_model", small_context)
    monkeypatch.setattr(tools_chat, "generate", recording)
    questions = "".join(f"What is the weather in city number {i}? Tell me everything about it, please.\n" for i in range(6))
    monkeypatch.setattr("sys.stdin", io.StringIO(questions))
    argv = [a for a in tool_files if a not in ("--message", "What is the weather in Paris?")]
    flags = ["--system", "Be brief.", "--run-tools", "cli22_tools:get_weather", "--tool-choice", "auto", "--no-compile"]  # no step built for this context
    assert cli.main([*argv, *flags]) == 0
    head = min(len(p) for p in prompts) // 2
    assert len(prompts) >= 6 and all(len(p) <= 450 - 24 for p in prompts)
    assert all(p[:head] == prompts[0][:head] for p in prompts)  # the system prompt and the tools, never cut
    first, last = toks[0].decode(prompts[0]), toks[0].decode(prompts[-1])
    assert "city number 0" in first and "city number 0" not in last and "city number 5" in last
    capsys.readouterr()


def test_interactive_tools_chat_goes_on_after_a_message_longer_than_the_context(tool_files, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("word " * 9000 + "\nWhat is the weather in Paris?\n"))
    argv = [a for a in tool_files if a not in ("--message", "What is the weather in Paris?")]
    assert cli.main([*argv, "--run-tools", "cli22_tools:get_weather"]) == 0
    out, err = capsys.readouterr()
    assert [line for line in err.splitlines() if line.startswith("error:")][0].endswith("send a shorter message")
    assert "result of get_weather: 21 C and sunny in Paris" in out


def test_a_call_cut_by_the_token_limit_is_not_run(tool_files, capsys):
    """18 tokens end the forced call inside its arguments (`{"city`): it is shown, not run, and the chat ends
    in one line instead of a traceback."""
    assert cli.main([*tool_files, "--run-tools", "cli22_tools:get_weather", "--max-new-tokens", "18"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tool call: get_weather({") and len(out) == 2
    assert out[1] == "(not run: the reply reached --max-new-tokens (18) inside its call of get_weather; give a larger --max-new-tokens)"


def test_a_reply_cut_before_its_calls_name_says_so_in_one_line(tool_files, capsys):
    """9 tokens end the forced call before its name is whole: no raw `<tool_call>{...` as the answer, but one
    line that says what happened and what to give."""
    assert cli.main([*tool_files, "--max-new-tokens", "9"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("(the reply reached --max-new-tokens (9) as it began a tool call, '<tool_call>")
    assert out[0].endswith("'; give a larger --max-new-tokens)")


@pytest.mark.parametrize("spec, message", [("cli22_tools", "takes module:function entries"), ("no_such_module_22:f", "cannot import no_such_module_22"),
                                           ("cli22_tools:nope", "cli22_tools has no nope"), ("json:loads", "loads is not among the tools")])
def test_chat_run_tools_refusals_are_one_line(tool_files, capsys, spec, message):
    assert cli.main([*tool_files, "--run-tools", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
