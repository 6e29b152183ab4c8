"""The measuring tools of benchmarks/: the quality guard end to end on a tiny random model, and the mode
table that quality.py and generate_speed.py share."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from decoderlm import load
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
    proc = subprocess.run([sys.executable, "benchmarks/quality.py", "--quick", "--positions", str(POSITIONS), "--shakespeare", str(text),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
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
    except ImportError:
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
