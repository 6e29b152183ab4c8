"""Answers guard: each mode's greedy chat replies, at every CPU dispatch level, against the float32 path's.

Perplexity can stay within 1 % of float32 while greedy replies change (on an AVX2 CPU the default once
answered "What is the capital of France?" with "L'Étoile, la Marseillaise..."), so the default is also
judged by what it answers. Each prompt of benchmarks/fixtures/answers.json is one user turn, rendered
with the model's chat template as `decoderlm chat` renders it, and answered greedily for AGREE_TOKENS
tokens. Per level and mode:
- agreement with fp32 at the same level: the prompts whose whole reply (AGREE_TOKENS tokens, or fewer
  and the same stop) is fp32's, and the mean number of leading tokens that agree;
- correct answers: a question (a prompt with "answers") is answered correctly when one of its answers
  appears, case-insensitive and as a whole word ("10" is not in "100"), in its first ANSWER_TOKENS tokens.
Each level of `decoderlm.isa.supported()` runs in a child process of its own (`isa.env(level)`): fp32
(the reference), auto (the default), int8, and bf16 at the native level only (without native bf16 its
matmuls are ~100x slower). llama.cpp runs the same GGUF greedily on the same token ids, once, in a
child process too (its kernels pick their own instruction set), and is compared with each level's fp32.
A level passes when the default answers at least as many questions as fp32 and agrees with fp32 on at
least as many prompts as llama.cpp; without llama.cpp the verdict is open (None) unless the answers
already fail it.

quality.py runs this (`run`); `python benchmarks/answers.py JOB OUT` is a child process.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import decoderlm
from decoderlm import SamplingParams, generate, isa, load
from decoderlm.cli.chat import fit_context

sys.path.insert(0, str(Path(__file__).parent))
from modes import DEFAULT, FP32_ACT, INT8_ACT, MODES, REFERENCE  # a sibling file: benchmarks/ is not a package

FIXTURE = Path(__file__).parent / "fixtures" / "answers.json"
AGREE_TOKENS = 32  # the reply compared with fp32's
ANSWER_TOKENS = 24  # the reply searched for a question's answer
NATIVE_ONLY = "bf16"
ANSWER_MODES = {REFERENCE: MODES[REFERENCE], DEFAULT: MODES[DEFAULT], FP32_ACT: MODES[FP32_ACT], INT8_ACT: MODES[INT8_ACT], "int8": MODES["int8"],
                NATIVE_ONLY: MODES[NATIVE_ONLY]}
LLAMA_CPP = "llama.cpp"
Replies = dict[str, list[int]]  # prompt id → generated ids (the stop token left out)


def prompts(per_kind: int | None = None) -> list[dict]:
    """The fixture's prompts in file order, at most `per_kind` of each kind."""
    items = json.loads(FIXTURE.read_text(encoding="utf-8"))["prompts"]
    return [it for i, it in enumerate(items) if per_kind is None or [o["kind"] for o in items[:i]].count(it["kind"]) < per_kind]


def render(tok, items: list[dict], context: int) -> Replies:
    """Each prompt's ids as `decoderlm chat --message` sends them: one user turn through the chat template."""
    return {it["id"]: fit_context(tok, [{"role": "user", "content": it["prompt"]}], context, AGREE_TOKENS)[1] for it in items}


def level_modes(level: str, native: str, wanted: Iterable[str]) -> dict[str, dict]:
    """The modes run at `level` (name → load keyword arguments): fp32 and the default always, bf16 only at
    the native level, int8 not at the plain one (its packed kernel is scalar there, ~0.7 tok/s, and the
    default there is float: `quantize.kernels_vectorized`)."""
    skip = {NATIVE_ONLY} if level != native else set()
    skip |= {"int8"} if level == "default" else set()
    return {m: kw for m, kw in ANSWER_MODES.items() if (m in wanted or m in (REFERENCE, DEFAULT)) and m not in skip}


def agreeing_prefix(reply: list[int], reference: list[int]) -> int:
    """Leading tokens of `reply` that are `reference`'s; a stop counts as a token, so equal replies give AGREE_TOKENS."""
    if reply == reference:
        return AGREE_TOKENS
    return next(i for i, (a, b) in enumerate(zip([*reply, None], [*reference, None])) if a != b)


def is_correct(text: str, answers: Sequence[str]) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE) for a in answers)


def score(replies: Replies, reference: Replies, items: list[dict], decode: Callable[[list[int]], str]) -> dict:
    """Agreement with `reference` over every prompt, and where each reply that parts from it does (id → tokens
    in agreement); the questions answered wrongly, id → what was answered."""
    prefixes = {it["id"]: agreeing_prefix(replies[it["id"]], reference[it["id"]]) for it in items}
    texts = {it["id"]: decode(replies[it["id"]][:ANSWER_TOKENS]) for it in items if "answers" in it}
    wrong = {it["id"]: texts[it["id"]] for it in items if "answers" in it and not is_correct(texts[it["id"]], it["answers"])}
    return {"agree_all32": sum(p == AGREE_TOKENS for p in prefixes.values()), "mean_prefix": sum(prefixes.values()) / len(prefixes),
            "parts": {pid: p for pid, p in prefixes.items() if p < AGREE_TOKENS}, "correct": len(texts) - len(wrong), "wrong": wrong}


def verdict(rows: dict[str, dict]) -> dict:
    """Whether the default answers as many questions as fp32 and agrees with fp32 as often as llama.cpp
    (rows: mode → score); "pass" is None when llama.cpp did not run and the answers do not fail it."""
    default, peer = rows[DEFAULT], rows.get(LLAMA_CPP)
    answers = default["correct"] >= rows[REFERENCE]["correct"]
    agreement = None if peer is None else default["agree_all32"] >= peer["agree_all32"]
    return {"pass": agreement if answers else False, "answers_as_fp32": answers, "agrees_as_llama_cpp": agreement}


def child(job_path: Path, out_path: Path) -> None:
    """A child process's replies: one level's decoderlm modes (the environment set the level) or llama.cpp's."""
    job = json.loads(job_path.read_text())
    out_path.write_text(json.dumps(llamacpp_replies(job) if job["engine"] == LLAMA_CPP else decoderlm_replies(job)))


def decoderlm_replies(job: dict) -> dict:
    """Every mode's replies in turn, one model in memory at a time."""
    torch.set_num_threads(job["threads"])
    out = {"isa": isa.current(), "torch": torch.__version__, "modes": {}}
    for mode, kwargs in job["modes"].items():
        t0 = time.perf_counter()
        model, tok = load(job["gguf"], **kwargs)
        params = SamplingParams(temperature=0, max_new_tokens=AGREE_TOKENS, stop_token_ids=tok.eos_token_ids)
        progress = tqdm(job["prompts"].items(), desc=f"{job['level']} {mode}", unit="prompt")
        replies = {pid: generate(model, ids, params) for pid, ids in progress}
        out["modes"][mode] = {"replies": replies, "seconds": time.perf_counter() - t0, "tokens": sum(map(len, replies.values()))}
        del model
        gc.collect()
    return out


def llamacpp_replies(job: dict) -> dict:
    """llama.cpp's greedy replies to the same ids and what it ran with, or why there are none ("skipped")."""
    try:
        import llama_cpp
    except (ImportError, OSError) as e:
        return {"skipped": f"llama-cpp-python is not installed or does not import ({e}); pip install llama-cpp-python"}
    n_ctx = max(map(len, job["prompts"].values())) + AGREE_TOKENS
    t0 = time.perf_counter()
    # logits_all: llama-cpp-python keeps no logits in `scores` without it
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=n_ctx, n_batch=n_ctx, n_threads=job["threads"], logits_all=True, verbose=False)
    replies: Replies = {}
    for pid, prompt in tqdm(job["prompts"].items(), desc=LLAMA_CPP, unit="prompt"):
        llm.reset()
        llm.eval(prompt)
        reply = replies[pid] = []
        for _ in range(AGREE_TOKENS):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))  # the newest position's logits
            if token in job["stop"]:
                break
            reply.append(token)
            llm.eval([token])
    info = {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "seconds": time.perf_counter() - t0, "tokens": sum(map(len, replies.values()))}
    return {"replies": replies, "info": info}


def run_child(job: dict, env: dict[str, str]) -> dict:
    """What `child` returns for `job`, run in a process with `env` and the same decoderlm as this one."""
    env = env | {"PYTHONPATH": os.pathsep.join(p for p in (str(Path(decoderlm.__file__).parents[1]), env.get("PYTHONPATH")) if p)}
    # Nothing here is timed: OpenMP threads that sleep instead of spinning keep a shared CPU from slowing decoding ~20x.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        if subprocess.run([sys.executable, __file__, str(job_path), str(out)], env=env, check=False).returncode:
            raise SystemExit(f"the {job.get('level', job['engine'])} child process failed (its error is above)")
        return json.loads(out.read_text())


def run(gguf: Path, levels: Sequence[str], wanted: Iterable[str], threads: int, per_kind: int | None = None) -> dict:
    """Every level's scores and verdict, printed as a table; the results file's "answers" part."""
    wanted, items = set(wanted), prompts(per_kind)
    model, tok = load(gguf, quantize="auto")  # here for its tokenizer and context only
    ids = render(tok, items, model.config.max_seq_len)
    del model
    native = isa.native()
    job = {"gguf": str(gguf), "prompts": ids, "threads": threads}
    runs = {level: run_child(job | {"engine": "decoderlm", "level": level, "modes": level_modes(level, native, wanted)}, isa.env(level))
            for level in levels}
    peer = (run_child(job | {"engine": LLAMA_CPP, "stop": tok.eos_token_ids}, dict(os.environ)) if LLAMA_CPP in wanted
            else {"skipped": f"{LLAMA_CPP} not among --modes"})
    native_fp32 = runs[native]["modes"][REFERENCE]["replies"] if native in runs else None
    out_levels = {level: level_entry(result, peer, items, tok.decode, None if level == native else native_fp32)
                  for level, result in runs.items()}
    questions = sum("answers" in it for it in items)
    skipped = {LLAMA_CPP: peer["skipped"]} if "skipped" in peer else {}
    print_table(out_levels, len(items), questions, skipped.get(LLAMA_CPP))
    return {"fixture": str(FIXTURE.relative_to(FIXTURE.parents[2])), "prompts": len(items), "questions": questions,
            "per_kind": per_kind, "agree_tokens": AGREE_TOKENS, "answer_tokens": ANSWER_TOKENS, "default": DEFAULT,
            "native_level": native, "threads": threads, "levels": out_levels, "skipped": skipped}


def level_entry(result: dict, peer: dict, items: list[dict], decode: Callable[[list[int]], str], native_fp32: Replies | None) -> dict:
    """A level's rows (mode → its score against this level's fp32, llama.cpp's too when it ran) and verdict;
    with the native level's fp32 replies, how far this level's fp32 is from them."""
    reference = result["modes"][REFERENCE]["replies"]
    rows = {mode: {"engine": "decoderlm", "load": ANSWER_MODES[mode], "seconds": r["seconds"], "tokens": r["tokens"],
                   **score(r["replies"], reference, items, decode)} for mode, r in result["modes"].items()}
    if "replies" in peer:
        rows[LLAMA_CPP] = {"engine": LLAMA_CPP, **peer["info"], **score(peer["replies"], reference, items, decode)}
    entry = {"isa": result["isa"], "torch": result["torch"], "modes": rows, "verdict": verdict(rows)}
    if native_fp32 is not None:
        moved = score(reference, native_fp32, items, decode)
        entry["fp32_vs_native"] = {k: moved[k] for k in ("agree_all32", "mean_prefix")}
    return entry


def print_table(levels: dict[str, dict], n_prompts: int, n_questions: int, skipped: str | None) -> None:
    names = {REFERENCE: f"{REFERENCE} (reference)", DEFAULT: f"{DEFAULT} (the default)"}
    print(f"\nGreedy chat replies against {REFERENCE} at the same level: {n_prompts} prompts ({AGREE_TOKENS} tokens), "
          f"{n_questions} questions (answer in the first {ANSWER_TOKENS} tokens)\n")
    print(f"| level | mode | agree {AGREE_TOKENS}/{AGREE_TOKENS} | mean agreeing prefix | correct |")
    print("|---|---|---:|---:|---:|")
    for level, entry in levels.items():
        for mode, row in entry["modes"].items():
            print(f"| {level} | {names.get(mode, mode)} | {row['agree_all32']}/{n_prompts} | {row['mean_prefix']:.1f} "
                  f"| {row['correct']}/{n_questions} |")
    print()
    for level, entry in levels.items():
        rows, v = entry["modes"], entry["verdict"]
        word = {True: "PASS", False: "FAIL", None: "OPEN"}[v["pass"]]
        peer = (f"llama.cpp {rows[LLAMA_CPP]['agree_all32']}/{n_prompts}" if LLAMA_CPP in rows else f"llama.cpp did not run: {skipped}")
        ran_at = "" if entry["isa"] == level else f" (but torch ran at {entry['isa']})"
        moved = f"; fp32 here = native fp32 on {entry['fp32_vs_native']['agree_all32']}/{n_prompts}" if "fp32_vs_native" in entry else ""
        print(f"{level}{ran_at}: {word}: {DEFAULT} answers {rows[DEFAULT]['correct']}/{n_questions} ({REFERENCE} "
              f"{rows[REFERENCE]['correct']}), agrees with {REFERENCE} on {rows[DEFAULT]['agree_all32']}/{n_prompts} ({peer}){moved}")


if __name__ == "__main__":
    child(Path(sys.argv[1]), Path(sys.argv[2]))
