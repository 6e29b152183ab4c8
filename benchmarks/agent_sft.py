"""An agent that learns: SmolLM2-135M-Instruct fine-tuned (LoRA) to call tools, judged through the server.

Tool-use conversations are synthesized (--train, 96 by default): arithmetic and unit conversions answered through
a `calculator` tool, and look-ups (a city's population, an element's atomic number) through a `lookup`
tool over a small local table. Each is user question → assistant call → tool result → assistant answer.
SmolLM2's chat template has no tool section, so the server shows it the tools through decoderlm's
generic fallback (the tool list in the system turn, calls as `<tool_call>{json}</tool_call>`, results
in `<tool_response>` blocks: the Hermes format); the training records are those same turns, rendered
by the same function (`decoderlm.tools.prompt.generic_messages`), so `decoderlm sft` trains on exactly
what `decoderlm serve` shows at inference.

Then the agent loop runs through `decoderlm serve` with the official `openai` client on held-out
questions (new numbers, and cities and elements never seen in training): send the question with the
tools → the model calls a tool → this script runs it → sends the result → the model answers. The first
turn uses the mode's tool_choice ("auto", or "required", which the server enforces by a grammar); later
turns use "auto"; each task needs one call, so `parallel_tool_calls` is false. Reported per mode,
before and after fine-tuning:
- well_formed_calls: the first turn is a call to a known tool whose arguments are valid under its schema;
- right_tool_result: the first call's result is the question's answer (right tool, right arguments);
- correct_answers: the final answer (the first turn without calls, within 3 turns) states the answer.

    python benchmarks/agent_sft.py [--threads 2] [--quick]     # → benchmarks/results/agent_sft.json

The recorded run (the defaults: 96 conversations, one epoch of 24 steps of 4, 12 held-out questions)
took 28 min on 2 cores shared with other jobs (load ~6; training 18 min at ~45 s a step, each of the
four evaluations 1-3 min). --train 192 --steps 48 --test 24 is the size meant for a quiet machine (not measured).

--quick trains a handful of steps on a few conversations and asks a few questions (a smoke test of the
pipeline, not a measurement); it writes nothing unless --out is given.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decoderlm.tools.prompt import generic_messages  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "agent_sft.json"
MODEL = "smollm2-135m-instruct"
SEED = 0
BATCH = 4

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 60}},
                   "required": ["expression"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a value in a local table",
    "parameters": {"type": "object", "properties": {"table": {"type": "string", "enum": ["population", "atomic_number"]},
                                                    "key": {"type": "string", "maxLength": 30}},
                   "required": ["table", "key"], "additionalProperties": False}}}
TOOLS = [CALCULATOR, LOOKUP]

TABLES = {
    "population": {"Paris": 2102650, "Berlin": 3755251, "Madrid": 3332035, "Rome": 2749031, "Vienna": 2005760,
                   "Warsaw": 1863056, "Prague": 1357326, "Lisbon": 548703, "Dublin": 592713, "Oslo": 709037,
                   "Helsinki": 674500, "Athens": 643452, "Lyon": 522250, "Munich": 1510378, "Milan": 1371498,
                   "Porto": 231962, "Geneva": 203856, "Krakow": 806201, "Seville": 684025, "Zurich": 447082,
                   "Bergen": 291940, "Ghent": 265086, "Turin": 841600, "Leipzig": 619879},
    "atomic_number": {"hydrogen": 1, "helium": 2, "lithium": 3, "carbon": 6, "nitrogen": 7, "oxygen": 8, "neon": 10,
                      "sodium": 11, "magnesium": 12, "aluminium": 13, "silicon": 14, "sulfur": 16, "chlorine": 17,
                      "argon": 18, "potassium": 19, "calcium": 20, "iron": 26, "copper": 29, "zinc": 30, "silver": 47,
                      "tin": 50, "iodine": 53, "gold": 79, "lead": 82},
}
# keys only the held-out questions ask for: the model must copy a name it never saw in a call
HELD_OUT_KEYS = {"population": {"Lyon", "Porto", "Geneva", "Krakow", "Bergen", "Ghent"},
                 "atomic_number": {"neon", "sulfur", "zinc", "tin", "iodine", "lead"}}
LOOKUP_QUESTIONS = {"population": ["What is the population of {k}?", "How many people live in {k}?", "Look up the population of {k}."],
                    "atomic_number": ["What is the atomic number of {k}?", "Which atomic number does {k} have?",
                                      "Look up the atomic number of {k}."]}
LOOKUP_ANSWERS = {"population": "{k} has a population of {v}.", "atomic_number": "The atomic number of {k} is {v}."}

# (from, to, factor): x from = x * factor to
UNITS = [("kilometers", "miles", "0.621371"), ("miles", "kilometers", "1.609344"), ("kilograms", "pounds", "2.20462"),
         ("pounds", "kilograms", "0.453592"), ("inches", "centimeters", "2.54"), ("feet", "meters", "0.3048"),
         ("liters", "gallons", "0.264172"), ("hours", "minutes", "60")]
CONVERT_QUESTIONS = ["How many {b} is {x} {a}?", "Convert {x} {a} to {b}.", "What is {x} {a} in {b}?"]
ARITHMETIC = [  # (question, expression) templates over numbers a, b
    ("What is {a} + {b}?", "{a} + {b}"), ("Add {a} and {b}.", "{a} + {b}"), ("What is {a} minus {b}?", "{a} - {b}"),
    ("Subtract {b} from {a}.", "{a} - {b}"), ("What is {a} times {b}?", "{a} * {b}"), ("Multiply {a} by {b}.", "{a} * {b}"),
    ("What is {a} divided by {b}?", "{a} / {b}"), ("What is {b}% of {a}?", "{a} * {b} / 100")]


@dataclass
class Task:
    kind: str  # arithmetic, conversion or lookup
    question: str
    tool: str
    arguments: dict
    answer: float

    def result(self) -> str:
        return run_tool(self.tool, self.arguments)

    def final(self) -> str:
        """The answer the training data gives after the tool's result."""
        r = self.result()
        if self.tool == "lookup":
            return LOOKUP_ANSWERS[self.arguments["table"]].format(k=self.arguments["key"], v=r)
        return f"{self.arguments['expression']} = {r}."


# --- the tools ------------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> float:
    """+ - * / and parentheses over numbers; anything else is a ValueError."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"unsupported expression: {ast.unparse(node)}")
    return value(ast.parse(expression, mode="eval").body)


def number_text(x: float) -> str:
    """A result as the tools write it: an integer plainly, else rounded to 4 decimals."""
    x = round(x, 4)
    return str(int(x)) if x == int(x) else f"{x:.4f}".rstrip("0")


def run_tool(name: str, arguments: dict) -> str:
    """The tool's result as the tool message's content; a failure is an `error: ...` result the model reads."""
    try:
        if name == "calculator":
            return number_text(calculate(arguments["expression"]))
        if name == "lookup":
            table = TABLES[arguments["table"]]
            key = next((k for k in table if k.lower() == str(arguments["key"]).strip().lower()), None)
            return str(table[key]) if key is not None else f"error: no {arguments['key']!r} in the {arguments['table']} table"
        return f"error: no tool named {name!r}"
    except (KeyError, ValueError, SyntaxError, ZeroDivisionError, TypeError) as e:
        return f"error: {type(e).__name__}: {e}"


# --- the data ---------------------------------------------------------------------------------------

def make_tasks(n: int, rng: random.Random, held_out: bool) -> list[Task]:
    """n tasks, a third of each kind; held-out ones ask for keys no training task names."""
    tasks = []
    for i in range(n):
        kind = ("arithmetic", "conversion", "lookup")[i % 3]
        if kind == "arithmetic":
            q, e = rng.choice(ARITHMETIC)
            a, b = rng.randint(12, 999), rng.randint(2, 99)
            expr = e.format(a=a, b=b)
            tasks.append(Task(kind, q.format(a=a, b=b), "calculator", {"expression": expr}, calculate(expr)))
        elif kind == "conversion":
            (a, b, f), q = rng.choice(UNITS), rng.choice(CONVERT_QUESTIONS)
            x = number_text(rng.choice([rng.randint(2, 500), round(rng.uniform(1, 100), 1)]))
            expr = f"{x} * {f}"
            tasks.append(Task(kind, q.format(x=x, a=a, b=b), "calculator", {"expression": expr}, calculate(expr)))
        else:
            table = rng.choice(sorted(TABLES))
            keys = sorted(k for k in TABLES[table] if (k in HELD_OUT_KEYS[table]) == held_out)
            k = rng.choice(keys)
            q = rng.choice(LOOKUP_QUESTIONS[table]).format(k=k)
            tasks.append(Task(kind, q, "lookup", {"table": table, "key": k}, TABLES[table][k]))
    return tasks


def conversation(task: Task) -> list[dict]:
    """The task as OpenAI messages: question, call, tool result, answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": task.tool, "arguments": task.arguments}}
    return [{"role": "user", "content": task.question}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": task.result()}, {"role": "assistant", "content": task.final()}]


def write_data(path: Path, tasks: list[Task]) -> None:
    """SFT records: each conversation in the plain turns the server renders for a template without tools."""
    path.write_text("".join(json.dumps({"messages": generic_messages(conversation(t), TOOLS)}) + "\n" for t in tasks))


def states_answer(text: str | None, answer: float) -> bool:
    """Whether `text` states `answer`: a number in it equal within 0.1 % (or 0.01)."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", re.sub(r"(?<=\d),(?=\d{3})", "", text or ""))
    return any(math.isclose(float(x), answer, rel_tol=1e-3, abs_tol=1e-2) for x in numbers)


def valid_call(name: str, arguments: str) -> bool:
    """A call to a known tool with arguments valid under its schema."""
    import jsonschema

    tool = next((t for t in TOOLS if t["function"]["name"] == name), None)
    try:
        jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])
    except (TypeError, json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


# --- the agent loop through the server -----------------------------------------------------------

def agent(client, model: str, task: Task, tool_choice: str, max_turns: int = 3) -> dict:
    """Question → calls run here → results sent back → a final answer; the outcome and the messages."""
    messages: list[dict] = [{"role": "user", "content": task.question}]
    outcome = {"question": task.question, "answer": task.answer, "well_formed": False, "right_tool_result": False, "final": None}
    for turn in range(max_turns):
        msg = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice if turn == 0 else "auto",
                                             parallel_tool_calls=False, temperature=0, max_tokens=48).choices[0].message
        calls = msg.tool_calls or []
        messages.append({"role": "assistant", "content": msg.content,
                         **({"tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in calls]} if calls else {})})
        if turn == 0:
            outcome["first_reply"] = msg.content
            outcome["well_formed"] = bool(calls) and all(valid_call(c.function.name, c.function.arguments) for c in calls)
        if not calls:
            outcome["final"] = msg.content
            break
        for c in calls:
            try:
                result = run_tool(c.function.name, json.loads(c.function.arguments))
            except json.JSONDecodeError:
                result = "error: the arguments are not JSON"
            if turn == 0 and c is calls[0]:
                outcome["right_tool_result"] = states_answer(result, task.answer) and not result.startswith("error")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    outcome["correct"] = states_answer(outcome["final"], task.answer)
    outcome["messages"] = messages
    return outcome


class Server:
    """`python -m decoderlm serve --model M --port 0`, its URL once /health answers."""

    def __init__(self, model: str, threads: int | None, timeout: float = 300) -> None:
        import httpx

        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "decoderlm", "serve", "--model", model, "--port", "0", "--quantize", "none"]
        cmd += ["--threads", str(threads)] if threads else []
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{Path(self.log.name).read_text()}")
            line = next((ln for ln in Path(self.log.name).read_text().splitlines() if ln.startswith("serving ")), None)
            if line is not None:
                self.url = line.split(" on ", 1)[1].split("/v1")[0]
                try:
                    if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start in time")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def evaluate(model: str, tasks: list[Task], threads: int | None, concurrency: int = 12) -> dict:
    """Each mode's rates over `tasks`, and every outcome, through one server for `model`."""
    import openai

    server = Server(model, threads)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
        out = {}
        for mode in ("auto", "required"):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                outcomes = list(pool.map(lambda t: agent(client, model, t, mode), tasks))
            n = len(outcomes)
            out[mode] = {"well_formed_calls": sum(o["well_formed"] for o in outcomes) / n,
                         "right_tool_result": sum(o["right_tool_result"] for o in outcomes) / n,
                         "correct_answers": sum(o["correct"] for o in outcomes) / n,
                         "seconds": round(time.perf_counter() - t0, 1), "outcomes": outcomes}
            print(f"{model} {mode}: " + ", ".join(f"{k} {v:.0%}" for k, v in out[mode].items() if isinstance(v, float) and k != "seconds")
                  + f" ({out[mode]['seconds']} s)", flush=True)
    finally:
        server.stop()
    return out


def fine_tune(data: Path, run: Path, steps: int, threads: int | None) -> float:
    cmd = [sys.executable, "-m", "decoderlm", "sft", "--model", MODEL, "--data", str(data), "--out", str(run),
           "--max-steps", str(steps), "--batch-size", str(BATCH), "--lr", "1e-3", "--lora-rank", "16",
           "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--eval-fraction", "0",
           "--log-interval", "5", "--seed", str(SEED)]
    cmd += ["--threads", str(threads)] if threads else []
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    return time.perf_counter() - t0


def table(result: dict) -> str:
    rows = ["| tool_choice | metric | before | after |", "|---|---|---|---|"]
    for mode in ("auto", "required"):
        for metric in ("well_formed_calls", "right_tool_result", "correct_answers"):
            b, a = result["before"][mode][metric], result["after"][mode][metric]
            rows.append(f"| {mode} | {metric.replace('_', ' ')} | {b:.0%} | {a:.0%} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=96, help="training conversations")
    ap.add_argument("--test", type=int, default=12, help="held-out questions")
    ap.add_argument("--steps", type=int, default=24, help=f"optimizer steps of {BATCH} conversations (default: one epoch)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 8 conversations, 2 steps, 3 questions")
    ap.add_argument("--out", default=None, help=f"JSON path (default: {RESULTS.relative_to(ROOT)}; none with --quick)")
    args = ap.parse_args()
    if args.quick:
        args.train, args.test, args.steps = 8, 3, 2
    rng = random.Random(SEED)
    train, test = make_tasks(args.train, rng, held_out=False), make_tasks(args.test, rng, held_out=True)
    with tempfile.TemporaryDirectory() as tmp:
        data, run = Path(tmp) / "agent.jsonl", Path(tmp) / "run"
        write_data(data, train)
        t0 = time.perf_counter()
        before = evaluate(MODEL, test, args.threads)
        seconds = fine_tune(data, run, args.steps, args.threads)
        after = evaluate(str(run), test, args.threads)
        log = json.loads((run / "log.json").read_text())
    from decoderlm import isa

    result = {"model": MODEL, "machine": isa.describe(), "threads": args.threads, "seed": SEED, "train_conversations": len(train),
              "held_out_questions": len(test), "steps": args.steps, "batch_size": BATCH, "train_seconds": round(seconds, 1),
              "total_seconds": round(time.perf_counter() - t0, 1), "before": before, "after": after, "log": log}
    shown = next((o for o in after["auto"]["outcomes"] if o["correct"]), after["auto"]["outcomes"][0])
    result["transcript"] = shown["messages"]
    print(table(result))
    print(json.dumps(shown["messages"], indent=1))
    print(f"trained {args.steps} steps on {len(train)} conversations in {seconds:.0f} s; total {result['total_seconds']:.0f} s")
    out = Path(args.out) if args.out else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
