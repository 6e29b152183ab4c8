"""benchmarks/agent_sft.py's pieces (the whole run takes minutes): the synthesized data, which the
server would render the same way, its tools, the answer check and the agent loop against a stub client."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageToolCall

import decoderlm
from decoderlm.finetune.data import check_chat
from decoderlm.finetune.sft import assistant_spans
from tests.test_benchmarks import benchmark

agent = benchmark("agent_sft")


@pytest.fixture(scope="module")
def tok():
    return decoderlm.load(agent.MODEL)[1]


def test_held_out_questions_ask_what_training_never_shows():
    rng = random.Random(agent.SEED)
    train, test = agent.make_tasks(192, rng, held_out=False), agent.make_tasks(24, rng, held_out=True)
    assert {t.kind for t in test} == {"arithmetic", "conversion", "lookup"}
    trained_keys = {t.arguments["key"] for t in train if t.tool == "lookup"}
    tested_keys = {t.arguments["key"] for t in test if t.tool == "lookup"}
    assert tested_keys and not trained_keys & tested_keys
    assert not {t.question for t in train} & {t.question for t in test}
    for t in train + test:
        assert agent.valid_call(t.tool, json.dumps(t.arguments)) and agent.states_answer(t.result(), t.answer), t


def test_a_training_record_is_what_the_server_renders_and_the_call_is_learned(tok, tmp_path):
    task = agent.make_tasks(1, random.Random(1), held_out=False)[0]
    agent.write_data(tmp_path / "d.jsonl", [task])
    record = json.loads((tmp_path / "d.jsonl").read_text())
    assert check_chat(record) is None  # `decoderlm sft` reads it
    served = tok.apply_chat_template(agent.conversation(task), add_generation_prompt=False, tools=agent.TOOLS)
    text, spans = assistant_spans(tok, record["messages"])
    assert text == served
    call, final = (text[a:b] for a, b in spans)
    assert call == f'<tool_call>{{"name": "calculator", "arguments": {json.dumps(task.arguments)}}}</tool_call><|im_end|>'
    assert final == f"{task.final()}<|im_end|>"


def test_tools_and_the_answer_check():
    assert agent.calculate("(2 + 3) * 4 / 8 - -1") == 3.5
    for bad in ("__import__('os').getcwd()", "2 ** 100", "x + 1"):
        with pytest.raises(ValueError):
            agent.calculate(bad)
    assert agent.run_tool("calculator", {"expression": "1 / 0"}).startswith("error: ZeroDivisionError")
    assert agent.run_tool("calculator", {"expression": "10.4 * 2.54"}) == "26.416"
    assert agent.run_tool("lookup", {"table": "population", "key": " lyon"}) == "522250"
    assert agent.run_tool("lookup", {"table": "atomic_number", "key": "unobtainium"}).startswith("error")
    assert agent.states_answer("Lyon has a population of 522,250.", 522250)
    assert agent.states_answer("51.6 * 0.621371 = 32.0627.", 51.6 * 0.621371)
    assert not agent.states_answer("2 + 2 = 5.", 4) and not agent.states_answer(None, 4)
    assert not agent.valid_call("lookup", '{"table": "rivers", "key": "Rhine"}') and not agent.valid_call("search", "{}")


class StubClient:
    """Answers like a server would: a call to the calculator, then a final answer stating its result."""

    def __init__(self, replies: list[ChatCompletionMessage]) -> None:
        self.replies, self.sent = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kwargs):
        self.sent.append(kwargs | {"messages": list(kwargs["messages"])})  # as sent, before the loop appends more
        return SimpleNamespace(choices=[SimpleNamespace(message=self.replies.pop(0))])


def test_the_agent_loop_runs_the_call_and_sends_the_result_back():
    task = agent.Task("arithmetic", "What is 6 times 7?", "calculator", {"expression": "6 * 7"}, 42)
    call = ChatCompletionMessageToolCall(id="call_1", type="function", function={"name": "calculator", "arguments": '{"expression": "6 * 7"}'})
    client = StubClient([ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]),
                         ChatCompletionMessage(role="assistant", content="6 * 7 = 42.")])
    out = agent.agent(client, "m", task, "required")
    assert out["well_formed"] and out["right_tool_result"] and out["correct"] and out["final"] == "6 * 7 = 42."
    assert [s["tool_choice"] for s in client.sent] == ["required", "auto"]
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    assert client.sent[1]["messages"] == out["messages"][:3]

    prose = agent.agent(StubClient([ChatCompletionMessage(role="assistant", content="It is 41.")]), "m", task, "auto")
    assert not prose["well_formed"] and not prose["correct"] and len(prose["messages"]) == 2
