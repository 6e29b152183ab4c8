"""The static-shape cache and the compiled decode step: the same numbers as the eager path, built once
per model and machine (a second process loads the package instead of compiling), eager on failure.

One tiny Llama checkpoint is compiled once for the whole module (by the first CLI run below); the
other compiled tests load that package from the same cache folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import decoderlm
from decoderlm import compiled, kernels
from decoderlm.generate import decode_step, generate, prefill
from decoderlm.kv_cache import KVCache, StaticKVCache
from decoderlm.quantize import BlockLinear, quantize
from decoderlm.sampling import SamplingParams
from tests.conftest import configs, run_cli, tiny_model
from tests.hf_models import make_hf_model

pytestmark = pytest.mark.isa  # run again at every other CPU level (tests/test_cpu_levels.py)

ROOT = Path(__file__).resolve().parents[1]
COMPILING = "compiling the decode step once"


@given(cfg=configs(), prompt_len=st.integers(1, 6), steps=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_static_cache_matches_kv_cache_step_by_step(cfg, prompt_len, steps, seed):
    model = tiny_model(seed, **cfg)
    max_len = prompt_len + steps + 3  # spare slots: they must stay invisible
    static, plain = StaticKVCache(model.config, 1, max_len), KVCache(model.config, 1, max_len)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len + steps), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(prefill(model, ids[:, :prompt_len], static), prefill(model, ids[:, :prompt_len], plain), atol=1e-5, rtol=1e-5)
        for t in range(prompt_len, prompt_len + steps):
            torch.testing.assert_close(decode_step(model, ids[:, t], static), decode_step(model, ids[:, t], plain), atol=1e-5, rtol=1e-5)
            assert static.length == plain.length == t + 1
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(static.k[layer][:, :, : plain.length], plain.k[layer][:, :, : plain.length])
        torch.testing.assert_close(static.v[layer][:, :, : plain.length], plain.v[layer][:, :, : plain.length])


def test_static_cache_refuses_to_overflow():
    model = tiny_model()
    cache = StaticKVCache(model.config, 1, 4)
    with torch.no_grad(), pytest.raises(decoderlm.DecoderLMError, match="holds 4 tokens"):
        prefill(model, torch.zeros(1, 5, dtype=torch.long), cache)


def test_cache_key_follows_weights_and_dtype():
    model = tiny_model()
    key = compiled.cache_key(model, 256)
    assert compiled.cache_key(tiny_model(), 256) == key  # the same weights: the same package
    assert compiled.cache_key(tiny_model(seed=1), 256) != key
    assert compiled.cache_key(model, 512) != key
    assert compiled.cache_key(tiny_model().to(torch.bfloat16), 256) != key
    assert compiled.cache_key(quantize(tiny_model(), "int8"), 256) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert compiled.cache_key(model, 256) != key
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("decoderlm-cache")


def run_generate(checkpoint: Path, cache: Path, *flags: str, background: bool = False) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "decoderlm", "generate", "--model", str(checkpoint), "--prompt", "The quick brown",
            "--temperature", "0", "--max-new-tokens", "12", "--threads", "1", *flags]
    env = {**os.environ, "DECODERLM_CACHE": str(cache), "PYTHONPATH": str(ROOT),
           "DECODERLM_BACKGROUND_COMPILE": "on" if background else "off"}
    result = subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    return result


def test_a_second_process_loads_the_package_instead_of_compiling(checkpoint, package_dir):
    """... and each build sweeps away what no run has used for a month (build_cache): an old kernel library
    when the kernels are built, an old package when the step is; a load stamps the package as used."""
    (package_dir / "compiled").mkdir()
    month = time.time() - 40 * 86400
    for old in (package_dir / "blocks-0ld.so", package_dir / "compiled" / "0ld.pt2"):
        old.write_bytes(b"x")
        os.utime(old, (month, month))
    eager = run_generate(checkpoint, package_dir)  # by default a package is used if there is one (none is built here: background builds are off)
    assert COMPILING not in eager.stderr and list(package_dir.rglob("*.pt2")) == [package_dir / "compiled" / "0ld.pt2"]
    assert not (package_dir / "blocks-0ld.so").exists()
    first = run_generate(checkpoint, package_dir, "--compile")
    assert first.stderr.count(COMPILING) == 1 and "eagerly" not in first.stderr, first.stderr
    packages = list((package_dir / "compiled").glob("*.pt2"))
    assert len(packages) == 1 and packages[0].name != "0ld.pt2"
    second = run_generate(checkpoint, package_dir, "--compile")
    assert COMPILING not in second.stderr and "eagerly" not in second.stderr, second.stderr
    assert list((package_dir / "compiled").glob("*.pt2")) == packages
    assert packages[0].with_suffix(".used").is_file()
    assert first.stdout == second.stdout == eager.stdout


def test_a_chat_ended_by_sigterm_leaves_no_unpacked_package_behind(checkpoint, package_dir, tmp_path):
    """torch's loader unpacks a compiled step's package into the temp folder and deletes it when released:
    SIGTERM ends `chat` by an exception, as Ctrl-C does, so it is released (killed outright, 3 MB stayed)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    argv = [sys.executable, "-m", "decoderlm", "chat", "--model", str(checkpoint), "--temperature", "0", "--max-new-tokens", "4",
            "--threads", "1", "--compile"]
    env = {**os.environ, "DECODERLM_CACHE": str(package_dir), "PYTHONPATH": str(ROOT), "TMPDIR": str(temp)}
    chat = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chat.stdin.write("hello\n")
    chat.stdin.flush()
    chat.stdout.readline()  # the reply has begun: the compiled step is loaded
    assert list(temp.glob("aotinductor_*")), "the chat decoded without its compiled step"
    chat.send_signal(signal.SIGTERM)
    _, err = chat.communicate(timeout=120)
    assert chat.returncode == 128 + signal.SIGTERM, err
    assert not list(temp.glob("aotinductor_*"))


def test_by_default_a_missing_step_is_built_in_the_background_for_later_runs(checkpoint, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = run_generate(checkpoint, cache, background=True)
    assert first.stderr.count("building the compiled decode step in the background") == 1, first.stderr
    folder = cache / "compiled"
    deadline = time.monotonic() + 600
    while not list(folder.glob("*.pt2")):  # `decoderlm compile`, started by the first run, outlives it
        assert not list(folder.glob("*.failed")) and time.monotonic() < deadline, next(folder.glob("*.log")).read_text()
        time.sleep(1)
    deadline = time.monotonic() + 60
    while list(folder.glob("*.building")):  # the build's pid file goes with it: a reused pid is no build
        assert time.monotonic() < deadline, "the ended build left its pid file"
        time.sleep(0.2)
    second = run_generate(checkpoint, cache, background=True)
    assert "background" not in second.stderr and COMPILING not in second.stderr, second.stderr
    assert second.stdout == first.stdout and len(list(folder.glob("*.pt2"))) == 1
    # The package is the one this model, loaded as `generate` loads it, would decode through.
    monkeypatch.setenv("DECODERLM_CACHE", str(cache))
    model, _ = decoderlm.load(checkpoint, quantize="auto")
    step = compiled.CompiledDecoder(model, build=False)
    assert step.new_cache(20) is not None and step.compiles == 0


def test_compile_refuses_a_bad_token_count_in_one_line(capsys):
    code, out, err = run_cli(["compile", "--tokens", "0"], capsys)
    assert code == 2 and err == "error: --tokens must be a positive integer, got 0\n"


def test_without_build_a_package_built_earlier_is_used_and_none_is_built(checkpoint, package_dir, monkeypatch):
    monkeypatch.setenv("DECODERLM_CACHE", str(package_dir))
    model, _ = decoderlm.load(checkpoint)
    params, prompt = SamplingParams(temperature=0, max_new_tokens=6), [5, 17, 3]
    eager = generate(model, prompt, params)
    if not list(package_dir.rglob("*.pt2")):  # the CLI test has not built it: none is built here either
        step = compiled.CompiledDecoder(model, build=False)
        assert generate(model, prompt, params, step=step) == eager
        assert set(step.runners.values()) == {None} and not list(package_dir.rglob("*.pt2"))
        generate(model, prompt, params, step=compiled.CompiledDecoder(model))
    step = compiled.CompiledDecoder(model, build=False)
    assert generate(model, prompt, params, step=step) == eager
    assert step.compiles == 0 and None not in step.runners.values()


def test_compiled_greedy_generation_and_logits_equal_eager(checkpoint, package_dir, monkeypatch):
    monkeypatch.setenv("DECODERLM_CACHE", str(package_dir))  # the package the CLI test built, if it ran first
    model, _ = decoderlm.load(checkpoint)
    params = SamplingParams(temperature=0, max_new_tokens=20)
    prompts = [[5, 17, 3], list(range(40, 90)), [7] * 9]
    eager = [generate(model, p, params) for p in prompts]
    decoder = compiled.CompiledDecoder(model)
    assert [generate(model, p, params, step=decoder) for p in prompts] == eager
    assert decoder.compiles <= 1  # all three prompts share one cache size: one package

    static, plain = decoder.new_cache(30), KVCache(model.config, 1, 30)
    ids = torch.tensor([list(range(10, 30))])
    with torch.inference_mode():
        prefill(model, ids[:, :5], static)
        prefill(model, ids[:, :5], plain)
        for t in range(5, 20):
            torch.testing.assert_close(decoder.step(ids[:, t], static), decode_step(model, ids[:, t], plain), atol=1e-4, rtol=0)


def test_quantized_layers_run_inside_the_compiled_step(tmp_path, monkeypatch):
    """torch's int4 layers (where decoderlm's kernels cannot be built), and int8 ones where the shape does
    not fit int4 (the 37-token head, the 48-wide down_proj)."""
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "available", lambda: False)
    model = quantize(tiny_model(), "int4")
    params = SamplingParams(temperature=0, max_new_tokens=16)
    eager = generate(model, [3, 1, 4, 1, 5], params)
    step = compiled.CompiledDecoder(model)
    assert generate(model, [3, 1, 4, 1, 5], params, step=step) == eager
    assert step.compiles == 1 and step.runners[64] is not None


def test_a_failed_compile_falls_back_to_eager_with_one_note_and_is_not_retried(tmp_path, monkeypatch, capsys):
    exports = []

    def fail(*args, **kwargs):
        exports.append(1)
        raise RuntimeError("no compiler here\nmore detail")

    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.export, "export", fail)
    model = tiny_model()
    params = SamplingParams(temperature=0, max_new_tokens=10)
    eager = generate(model, [1, 2, 3], params)
    step = compiled.CompiledDecoder(model)
    assert generate(model, [1, 2, 3], params, step=step) == eager
    assert capsys.readouterr().err.splitlines() == [
        f"{COMPILING} for this model and machine (cached in {tmp_path / 'compiled'})",
        "compiled decoding unavailable (RuntimeError: no compiler here); decoding eagerly"]
    assert generate(model, [1, 2, 3], params, step=step) == eager  # the failure is remembered in this process: no second note
    assert capsys.readouterr().err == ""

    step = compiled.CompiledDecoder(model)  # as a new process would: the failure is remembered on disk
    assert generate(model, [1, 2, 3], params, step=step) == eager
    (note,) = capsys.readouterr().err.splitlines()
    assert note.startswith("compiled decoding unavailable (RuntimeError: no compiler here (earlier; delete ")
    assert len(exports) == 1


@pytest.mark.parametrize("case", ["gpt_oss", pytest.param("deepseek_v3", marks=pytest.mark.slow), pytest.param("mixtral", marks=pytest.mark.slow)])
def test_moe_decodes_compiled_with_eager_tokens(tmp_path, monkeypatch, case):
    """The experts run under torch.cond, each only when the token chose it: gpt-oss (sinks, router bias, the
    clamped SwiGLU), DeepSeek-V3 (MLA, grouped sigmoid routing, shared experts) and Mixtral compile and give
    eager's greedy tokens and logits."""
    from tests.test_deepseek import make_model

    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    (make_model if case.startswith("deepseek") else make_hf_model)(case, tmp_path / "model")
    model, _ = decoderlm.load(tmp_path / "model")
    params, prompts = SamplingParams(temperature=0, max_new_tokens=12), [[5, 17, 3], list(range(40, 60))]
    decoder = compiled.CompiledDecoder(model)
    assert [generate(model, p, params, step=decoder) for p in prompts] == [generate(model, p, params) for p in prompts]
    assert decoder.compiles == 1 and None not in decoder.runners.values()
    static, plain = decoder.new_cache(20), KVCache(model.config, 1, 20)
    ids = torch.tensor([list(range(10, 20))])
    with torch.inference_mode():
        prefill(model, ids[:, :3], static)
        prefill(model, ids[:, :3], plain)
        for t in range(3, 10):
            torch.testing.assert_close(decoder.step(ids[:, t], static), decode_step(model, ids[:, t], plain), atol=1e-4, rtol=0)


@pytest.mark.skipif(not kernels.available(), reason="decoderlm's kernels are off or cannot be built here: the quantized layers are torch's")
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_block_layers_compile_with_their_kernels(tmp_path, monkeypatch, capsys, mode):
    """The compiled step calls decoderlm's block kernels as C++ operators: the eager step's logits (the kernels
    are the same; the float ops around them are inductor's) and its greedy tokens, and no note."""
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    model = quantize(tiny_model(), mode)
    assert any(isinstance(m, BlockLinear) for m in model.modules())
    decoder = compiled.CompiledDecoder(model)
    static, plain = decoder.new_cache(20), KVCache(model.config, 1, 20)
    assert static is not None and decoder.compiles == 1
    ids = torch.tensor([list(range(10, 20))])
    with torch.inference_mode():
        prefill(model, ids[:, :3], static)
        prefill(model, ids[:, :3], plain)
        for t in range(3, 10):
            torch.testing.assert_close(decoder.step(ids[:, t], static), decode_step(model, ids[:, t], plain), atol=1e-5, rtol=0)
    params = SamplingParams(temperature=0, max_new_tokens=6)
    assert generate(model, [3, 1, 4], params, step=decoder) == generate(model, [3, 1, 4], params)
    assert "unavailable" not in capsys.readouterr().err
    wrapper = next(tmp_path.rglob("*.pt2"))
    assert b"decoderlm.block_matmul" in wrapper.read_bytes()  # the package calls the kernel, not a float copy of the weights


def test_quantized_experts_decode_eagerly_with_one_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path))
    model = quantize(tiny_model(n_experts=4, n_experts_per_tok=2, moe_hidden=16), "int8")
    params = SamplingParams(temperature=0, max_new_tokens=6)
    step = compiled.CompiledDecoder(model)
    assert generate(model, [3, 1, 4], params, step=step) == generate(model, [3, 1, 4], params)
    assert step.compiles == 0 and capsys.readouterr().err.splitlines() == [
        "compiled decoding unavailable (quantized MoE experts do not compile yet; --quantize none compiles them); decoding eagerly"]
    assert not list(tmp_path.rglob("*.failed"))  # known before trying: nothing to remember
