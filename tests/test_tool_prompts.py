"""Tools in chat templates: rendered as transformers' apply_chat_template(tools=...) renders them, and
the generic fallback for a template without a tool section."""

from __future__ import annotations

import json

import pytest
from hf_models import write_tokenizer

from decoderlm.tokenizer.bpe import HFTokenizer
from decoderlm.tools.prompt import GENERIC_SYSTEM, template_reads_tools

# Qwen2.5's tool section, condensed: tools in the system turn, calls and results as hermes tags.
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# SmolLM2-135M-Instruct's template: plain ChatML, no tool section.
CHATML = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city (°C)",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12"},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


def ours(folder, template: str, messages, tools) -> str:
    tok = HFTokenizer.from_hf_folder(folder)
    tok.chat_template = template
    return tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools)


def test_tool_section_renders_as_transformers(folder):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for messages in (CONVERSATION[:2], CONVERSATION):
        expected = hf.apply_chat_template(messages, tools=TOOLS, chat_template=HERMES, tokenize=False, add_generation_prompt=True)
        assert ours(folder, HERMES, messages, TOOLS) == expected
    assert '"name": "get_weather", "arguments": {"city": "Zürich"}' in expected


def test_generic_fallback_puts_tools_in_the_system_turn(folder):
    assert not template_reads_tools(CHATML) and template_reads_tools(HERMES)
    text = ours(folder, CHATML, CONVERSATION, TOOLS)
    system = GENERIC_SYSTEM.format(tools=json.dumps(TOOLS[0]["function"], ensure_ascii=False))
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{system}<|im_end|>\n<|im_start|>user\nWeather in Zürich and Oslo?<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n12\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_no_tools_leaves_the_prompt_alone(folder):
    messages = [{"role": "user", "content": "hi"}]
    assert ours(folder, CHATML, messages, None) == ours(folder, CHATML, messages, [])
    assert "You are a helpful AI assistant named SmolLM" in ours(folder, CHATML, messages, None)
