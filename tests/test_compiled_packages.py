"""The compiled step's packages as processes meet them: built once per model and machine (a second process
loads the package instead of compiling), in the background for later runs, released when a chat is ended,
eager on failure. How a process finds, builds and frees a package does not depend on the CPU level, so
these run at this machine's own level only; the compiled step's numbers are tests/test_compiled.py's, at
every level.

One tiny Llama checkpoint is compiled once for the whole module (by the first CLI run below); the tests
after it load that package from the same cache folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import decoderlm
from decoderlm import compiled
from decoderlm.generate import generate
from decoderlm.sampling import SamplingParams
from tests.conftest import run_cli, tiny_model
from tests.hf_models import make_hf_model

ROOT = Path(__file__).resolve().parents[1]
COMPILING = "compiling the decode step once"


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


def test_a_background_build_gives_way_to_the_run_that_started_it(tmp_path, monkeypatch):
    """`build_later` starts the build in its own session (it outlives the run) at nice 19, and sets that session's
    scheduling group to nice 19 too where Linux has one (autogroup): against a build at nice 19 in a group at 0,
    the run that started it got half the CPU, and a 128-token `generate` took 58-64 s instead of ~6. The settings
    are checked on a real process started as the build would be, one that only sleeps."""
    started = []
    popen = subprocess.Popen

    def sleeper(command: list[str], **kwargs) -> subprocess.Popen:
        assert command[1:4] == ["-m", "decoderlm", "compile"]
        started.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    monkeypatch.setenv("DECODERLM_BACKGROUND_COMPILE", "on")
    monkeypatch.setattr(compiled.subprocess, "Popen", sleeper)
    compiled.build_later(tmp_path / "step.pt2", ["--model", "m"], "the step")
    (build,) = started
    try:
        assert os.getsid(build.pid) == build.pid and os.getpriority(os.PRIO_PROCESS, build.pid) == 19
        group = Path(f"/proc/{build.pid}/autogroup")  # "/autogroup-375 nice 19"; absent without autogroups
        assert not group.exists() or group.read_text().split()[-1] == "19", group.read_text()
        assert (tmp_path / "step.building").read_text() == str(build.pid)
    finally:
        build.kill()
        build.wait()


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
