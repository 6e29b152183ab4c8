"""The measuring tools of benchmarks/: the quality guard (perplexity and answers) end to end on a tiny random
model, its scoring and verdict, and the mode table that quality.py and generate_speed.py share."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from decoderlm import isa, kernels, load
from decoderlm.cli import build_parser
from decoderlm.perplexity import perplexity
from decoderlm.quantize import MODES as QUANTIZE_MODES
from tests.conftest import corpus_text

ROOT = Path(__file__).resolve().parents[1]
POSITIONS = 512


def benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("quality")
    text = tmp / "shakespeare.txt"
    text.write_text(corpus_text(8000), encoding="utf-8")
    out = tmp / "quality.json"
    proc = subprocess.run([sys.executable, "benchmarks/quality.py", "--quick", "--skip-answers", "--positions", str(POSITIONS),
                           "--shakespeare", str(text), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "top-1 agree" in proc.stdout
    return json.loads(out.read_text()), text


def test_quality_guard_reports_every_mode_on_both_texts(quality_run: tuple[dict, Path]) -> None:
    result, _ = quality_run
    modes = benchmark("modes").MODES
    assert result["positions"] == POSITIONS and result["reference"] == "fp32"
    assert set(modes) <= set(result["modes"])
    for name, row in result["modes"].items():
        assert set(row["texts"]) == {"shakespeare", "chat"}, name
        for r in row["texts"].values():
            assert r["perplexity"] > 1 and 0 <= r["top1_agreement"] <= 1
        assert row["faithful"] == all(abs(r["perplexity_change"]) <= result["faithful_within"] for r in row["texts"].values())
    fp32 = result["modes"]["fp32"]
    assert all(r["top1_agreement"] == 1.0 and r["perplexity_change"] == 0.0 for r in fp32["texts"].values())  # a second run repeats exactly
    assert fp32["faithful"]


def test_quality_guard_scores_the_next_token_like_decoderlm_perplexity(quality_run: tuple[dict, Path], tmp_path: Path) -> None:
    """The script's teacher-forced perplexity equals `decoderlm.perplexity` over the same ids (one window),
    so the positions and targets line up; the quick model is rebuilt from the same seed."""
    result, text = quality_run
    quality = benchmark("quality")
    model, tokenizer = load(quality.tiny_gguf(tmp_path / "tiny.gguf"))
    inputs = quality.texts(tokenizer, text, POSITIONS)
    for name, ids in inputs.items():
        expected = perplexity(model, ids, context=len(ids), stride=len(ids)).perplexity
        assert result["modes"]["fp32"]["texts"][name]["perplexity"] == pytest.approx(expected, rel=1e-5), name


def llama_cpp_imports() -> bool:
    """Whether llama-cpp-python is installed and imports: what gives quality.py its llama.cpp column."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


LLAMA_CPP = llama_cpp_imports()


@pytest.mark.skipif(not LLAMA_CPP, reason="llama-cpp-python is not installed (`make bench` installs it): no llama.cpp column to check")
def test_llama_cpp_is_a_column_agreeing_with_our_q4_1(quality_run: tuple[dict, Path]) -> None:
    row = quality_run[0]["modes"]["llama.cpp"]
    # Same Q4_1 blocks, same ids: a position shifted by one would agree on ~1/vocab of the tokens.
    assert all(r["top1_agreement"] > 0.8 and abs(r["perplexity_change"]) < 0.05 for r in row["texts"].values())


@pytest.mark.skipif(LLAMA_CPP, reason="llama-cpp-python is installed: the benchmark makes a column, not a note")
def test_a_missing_llama_cpp_is_a_note_not_a_column(quality_run: tuple[dict, Path]) -> None:
    result, _ = quality_run
    assert "not installed" in result["skipped"]["llama.cpp"] and "llama.cpp" not in result["modes"]


ANSWER_LEVELS = tuple(dict.fromkeys(("default", isa.native())))  # the lowest level and this CPU's own


@pytest.fixture(scope="module")
def answers_run(quality_run: tuple[dict, Path]) -> dict:
    """The answers part alone, one prompt per kind, into the perplexity run's file (which keeps its part)."""
    out = quality_run[1].parent / "quality.json"
    proc = subprocess.run([sys.executable, "benchmarks/quality.py", "--quick", "--answers-only", "--per-kind", "1", "--modes", "fp32",
                           "llama.cpp", "--levels", *ANSWER_LEVELS, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| level | mode | agree 32/32 |" in proc.stdout
    return json.loads(out.read_text())


def test_answers_are_scored_per_level_in_a_child_process_at_that_level(answers_run: dict) -> None:
    answers = benchmark("answers")
    part, items = answers_run["answers"], answers.prompts(1)
    questions = {it["id"] for it in items if "answers" in it}
    assert answers_run["modes"]["fp32"]["faithful"]  # the perplexity part is kept
    assert (part["prompts"], part["questions"], part["agree_tokens"]) == (len(items), len(questions), 32)
    assert tuple(part["levels"]) == ANSWER_LEVELS
    for level, entry in part["levels"].items():
        assert entry["isa"] == level and entry["torch"]
        rows = entry["modes"]
        assert {"fp32", "auto"} <= set(rows) and "int8" not in rows and "bf16" not in rows  # --modes fp32 llama.cpp
        assert rows["fp32"]["agree_all32"] == len(items) and rows["fp32"]["mean_prefix"] == 32
        for row in rows.values():
            assert 0 <= row["agree_all32"] <= len(items) and 0 <= row["mean_prefix"] <= 32
            assert len(row["parts"]) == len(items) - row["agree_all32"] and all(0 <= p < 32 for p in row["parts"].values())
            assert row["mean_prefix"] == (32 * row["agree_all32"] + sum(row["parts"].values())) / len(items)
            assert set(row["wrong"]) <= questions and row["correct"] == len(questions) - len(row["wrong"])
        assert entry["verdict"] == answers.verdict(rows)
        assert ("fp32_vs_native" in entry) == (level != isa.native())
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        assert "not installed" in part["skipped"]["llama.cpp"]
        assert all(entry["verdict"]["agrees_as_llama_cpp"] is None for entry in part["levels"].values())
        return
    for entry in part["levels"].values():  # same weights, same ids: replies that start alike (none did when its logits were misread)
        assert entry["modes"]["llama.cpp"]["mean_prefix"] >= 1 and entry["verdict"]["agrees_as_llama_cpp"] is not None


def test_the_verdict_needs_the_defaults_answers_and_its_agreement_against_llama_cpp() -> None:
    verdict = benchmark("answers").verdict

    def rows(fp32_correct: int, auto_correct: int, auto_agree: int, peer_agree: int | None) -> dict:
        out = {"fp32": {"correct": fp32_correct, "agree_all32": 60}, "auto": {"correct": auto_correct, "agree_all32": auto_agree}}
        return out | ({} if peer_agree is None else {"llama.cpp": {"correct": 0, "agree_all32": peer_agree}})

    assert verdict(rows(20, 20, 40, 40)) == {"pass": True, "answers_as_fp32": True, "agrees_as_llama_cpp": True}
    assert verdict(rows(20, 21, 41, 40))["pass"] is True
    assert verdict(rows(20, 19, 60, 40)) == {"pass": False, "answers_as_fp32": False, "agrees_as_llama_cpp": True}
    assert verdict(rows(20, 20, 39, 40)) == {"pass": False, "answers_as_fp32": True, "agrees_as_llama_cpp": False}
    assert verdict(rows(20, 20, 39, None)) == {"pass": None, "answers_as_fp32": True, "agrees_as_llama_cpp": None}
    assert verdict(rows(20, 19, 39, None))["pass"] is False  # the answers alone fail it


def test_replies_agree_token_by_token_and_answers_match_whole_words() -> None:
    answers = benchmark("answers")
    assert answers.agreeing_prefix([1, 2, 3], [1, 2, 3]) == 32  # the same reply, the same stop
    assert answers.agreeing_prefix([1, 2], [1, 2, 3]) == 2  # one stopped where the other went on
    assert answers.agreeing_prefix([1, 5, 3], [1, 2, 3]) == 1 and answers.agreeing_prefix([], [4]) == 0
    assert answers.is_correct("The capital of France is Paris.", ["Paris"]) and answers.is_correct("PARIS!", ["paris"])
    assert not answers.is_correct("L'Étoile, la Marseillaise", ["Paris"])
    assert not answers.is_correct("It is 100.", ["10", "ten"]) and answers.is_correct("It is 10.", ["10", "ten"])
    assert answers.is_correct("Plants take in CO2.", ["carbon dioxide", "CO2"])
    items = [{"id": "q", "kind": "k", "prompt": "", "answers": ["b"]}, {"id": "o", "kind": "k", "prompt": ""}]
    scored = answers.score({"q": [ord("a")], "o": [1, 2]}, {"q": [ord("b")], "o": [1, 2]}, items, lambda ids: "".join(map(chr, ids)))
    assert scored == {"agree_all32": 1, "mean_prefix": 16.0, "parts": {"q": 0}, "correct": 0, "wrong": {"q": "a"}}


def test_the_answer_fixture_has_varied_prompts_and_enough_questions() -> None:
    answers = benchmark("answers")
    items = answers.prompts()
    questions = [it for it in items if "answers" in it]
    assert len(items) >= 50 and len(questions) >= 30 and len({it["id"] for it in items}) == len(items)
    assert len({it["kind"] for it in items}) >= 10
    assert {"id": "capital-france", "kind": "capital", "prompt": "What is the capital of France?", "answers": ["Paris"]} in items
    few = answers.prompts(3)
    assert all(sum(it["kind"] == kind for it in few) == 3 for kind in {it["kind"] for it in items})
    assert set(answers.level_modes("avx512", "avx512", {"int8", "bf16"})) == {"fp32", "auto", "int8", "bf16"}
    assert set(answers.level_modes("avx2", "avx512", {"int8", "bf16"})) == {"fp32", "auto", "int8"}  # bf16: native only
    assert set(answers.level_modes("default", "avx512", {"int8", "bf16"})) == {"fp32", "auto"}  # int8: scalar kernel there


def test_the_mode_table_covers_every_quantization_and_its_flags_load_the_same_mode() -> None:
    modes = benchmark("modes")
    assert {kw.get("quantize") for kw in modes.MODES.values()} >= set(QUANTIZE_MODES)
    for name, kwargs in modes.MODES.items():
        args = build_parser().parse_args(["chat", "--message", "hi", *modes.cli_flags(kwargs)])
        assert {k: getattr(args, k) for k in kwargs} == kwargs, name


def test_cold_start_reports_the_childs_own_peak_memory_not_the_parents() -> None:
    """A forked child starts from its parent's peak RSS; the benchmark's parent holds every model, so the
    child must be measured from a small launcher, or every mode would show the parent's memory."""
    import torch

    generate_speed = benchmark("generate_speed")
    ballast = torch.ones(600 * 10**6 // 4)  # 600 MB held by this process while the child runs
    run = generate_speed.cold_run([sys.executable, "-c", "b = b'x' * (150 * 10**6); print('ready', flush=True)"])
    assert 150 < run.peak_rss_mb < 400 and ballast.sum() > 0
    assert 0 < run.first_output_s < 60


def test_transformers_runs_in_this_thread_and_its_tokens_are_timed_as_they_came(tmp_path: Path) -> None:
    """A second thread running torch gives the process a second OpenMP pool, which slowed the peer by up to
    2x here: transformers generates on the caller's thread, and timed() uses the stamps of its streamer."""
    import threading

    import torch

    quality, generate_speed = benchmark("quality"), benchmark("generate_speed")
    gguf = quality.tiny_gguf(tmp_path / "tiny.gguf")
    run = generate_speed.transformers_engine(gguf, torch.float32)
    threads = []
    real_thread_start = threading.Thread.start
    threading.Thread.start = lambda self: (threads.append(self), real_thread_start(self))[1]
    try:
        first, rest, out = generate_speed.timed(run([1, 2, 3, 4], 6))
    finally:
        threading.Thread.start = real_thread_start
    assert not threads
    assert len(out) == 6 and first > 0 and rest > 0
    model, _ = load(gguf)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        for tok in out:  # greedy, as the streamer saw it
            nxt = int(model(ids).logits[0, -1].argmax())
            assert nxt == tok
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    stamped = generate_speed.timed(iter([(10.0, 7), (10.5, 8), (12.0, 9)]))
    assert stamped[1:] == (2.0, [7, 8, 9])


def test_a_faithful_mode_keeps_fp32s_answers_where_they_were_asked(tmp_path, monkeypatch):
    """generate_speed names the fastest faithful mode: perplexity within 1 %, and no fewer correct answers
    than fp32 at any level the answers part ran it (--activations int8 passed the first, not the second)."""
    speed = benchmark("generate_speed")
    row = {"engine": "decoderlm", "faithful": True}
    quality = {"modes": {"fp32": row, "auto": row, "int8-act": row, "bf16": {**row, "faithful": False}},
               "answers": {"levels": {"avx2": {"modes": {"fp32": {"correct": 48}, "auto": {"correct": 48}, "int8-act": {"correct": 45}}},
                                      "avx512": {"modes": {"fp32": {"correct": 48}, "auto": {"correct": 49}}}}}}
    (tmp_path / "quality.json").write_text(json.dumps(quality))
    monkeypatch.setattr(speed, "QUALITY", tmp_path / "quality.json")
    assert speed.faithful_modes() == {"decoderlm fp32": True, "decoderlm auto": True, "decoderlm int8-act": False, "decoderlm bf16": False}


@pytest.mark.skipif(not kernels.amx(), reason="this CPU has no AMX tiles")
def test_generate_speeds_no_amx_engine_runs_off_the_tiles_and_gives_them_back():
    """generate_speed's "auto no-amx" row: the engine's own runs with the tiles off, the others' with them on."""
    speed = benchmark("generate_speed")
    seen = []

    def engine(ids: list[int], n: int):
        seen.append(kernels.amx())
        yield 1

    assert list(speed.without_amx(engine)([1], 1)) == [1]
    assert seen == [False] and kernels.amx()


def test_qdot_ab_runs_two_builds_of_the_kernel_side_by_side(tmp_path):
    """benchmarks/qdot_ab.py compiles qdot.c twice into libraries one process holds together, times them
    call by call and compares their products' bits (here one source twice: the same bits)."""
    ab = benchmark("qdot_ab")
    libs = {"a": ab.build(None, "a", tmp_path), "b": ab.build(None, "b", tmp_path)}
    for bits in (4, 8):
        r = ab.measure(libs, 40, 576, bits, 5, 1, 2)
        assert r["same_bits"] and r["speedup"] > 0 and set(r["us"]) == {"a", "b"}
    with pytest.raises(SystemExit, match=r"^qdot_ab: no decoderlm/kernels/qdot.c at revision 'no-such-rev' \(fatal: "):
        ab.build("no-such-rev", "c", tmp_path)
