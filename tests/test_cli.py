"""The command line end to end: train → generate → info, and every user mistake is one line, exit 2."""

import argparse
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch
from conftest import corpus_text

import decoderlm
from decoderlm import isa
from decoderlm.cli import build_parser, main
from decoderlm.cli.serve import serve_activations
from decoderlm.loader import load

TRAIN_FLAGS = ["--max-steps", "30", "--eval-interval", "15", "--batch-size", "4", "--context", "32", "--sample-chars", "50"]  # sample > context


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One small trained run shared by this module's tests (training is the slow part)."""
    root = tmp_path_factory.mktemp("cli")
    data = root / "shakespeare.txt"
    data.write_text(corpus_text(), encoding="utf-8")
    assert main(["train", "--data", str(data), "--out", str(root / "run"), *TRAIN_FLAGS]) == 0
    return root / "run"


def test_train_writes_the_run_folder(run_dir):
    for name in ("ckpt.pt", "log.csv", "log.json"):
        assert (run_dir / name).stat().st_size > 0
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = json.loads((run_dir / "log.json").read_text())
    assert log[-1]["step"] == 30 and log[-1]["val_loss"] is not None
    assert (run_dir / "log.csv").read_text().splitlines()[0] == "step,train_loss,val_loss,lr,tokens_seen,tokens_per_s,mfu"


def test_train_prints_the_result_and_a_sample(tmp_path, capsys):
    data = tmp_path / "one_line.txt"
    data.write_text("to be or not to be " * 40, encoding="utf-8")  # no newline: the sample must start elsewhere
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), *TRAIN_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "step 30: val loss" in out and "tokens/s" in out
    sample = out.split("--- sample ---\n")[1]
    assert len(sample[:-1]) == 50 and set(sample[:-1]) <= set("to be or n")


def test_generate_streams_a_continuation(run_dir, capsys):
    args = ["generate", "--model", str(run_dir), "--prompt", "First", "--max-new-tokens", "12", "--seed", "0"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("First") and len(first) == len("First") + 12 + 1  # + newline
    threads = torch.get_num_threads()
    try:
        assert main([*args, "--threads", "2"]) == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out == first  # seeded: reproducible, whatever the thread count
    assert main([*args[:-2], "--temperature", "0"]) == 0  # greedy works too
    assert capsys.readouterr().out.startswith("First")


def test_generate_stops_where_a_stop_text_first_appears(run_dir, capsys):
    """--stop cuts the seeded continuation before the first place any stop text completes (the stop itself
    not printed), whichever stop it is; --stop with --prompt-ids, or an empty one, is one line, exit 2."""
    args = ["generate", "--model", str(run_dir), "--prompt", "First", "--max-new-tokens", "40", "--seed", "0"]
    assert main(args) == 0
    text = capsys.readouterr().out[len("First"):-1]
    late, early = text[30:32], text[12:14]
    for stops in ([late], [late, early]):
        cut = min(text.index(s) for s in stops)
        assert main([*args, *(f for s in stops for f in ("--stop", s))]) == 0
        assert capsys.readouterr().out == "First" + text[:cut] + "\n"
    for extra, message in ((["--prompt-ids", "1,2", "--stop", "x"], "give --prompt instead"), (["--stop", ""], "give the text to stop at")):
        argv = [*args, *extra] if extra[0] == "--stop" else ["generate", "--model", str(run_dir), *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_info_is_the_short_view_of_inspect(run_dir, capsys):
    model, _ = load(run_dir)
    assert main(["info", str(run_dir)]) == 0
    info = capsys.readouterr().out
    assert f"total parameters     {model.num_parameters():,}\n" in info
    assert "family gpt2: 4 layers, d_model 128" in info and "learned table of 32" in info  # the run's context
    assert main(["inspect", "--model", str(run_dir)]) == 0
    full = capsys.readouterr().out.splitlines()
    assert set(info.splitlines()) < set(full) and "all layers" not in info  # the same report without the table
    assert main(["inspect", str(run_dir), "--short"]) == 0 and capsys.readouterr().out == info
    best = min(r["val_loss"] for r in json.loads((run_dir / "log.json").read_text()) if r["val_loss"] is not None)
    assert info.splitlines()[0] == f"training run: step 30 of 30, best val loss {best:.4f}, {30 * 4 * 32:,} tokens seen"


def test_the_progress_bar_and_the_summary_give_the_same_tokens_per_second(tmp_path, capsys):
    data = tmp_path / "c.txt"
    data.write_text(corpus_text(3000), encoding="utf-8")
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "12", "--eval-interval", "6",
                 "--batch-size", "2", "--context", "16", "--sample-chars", "0"]) == 0
    captured = capsys.readouterr()
    bar = re.findall(r"tok_s=([\d,]*\d)", captured.err)[-1]  # the bar's last figure
    summary = re.search(r", ([\d,]+) tokens/s;", captured.out).group(1)
    assert bar == summary and int(bar.replace(",", "")) > 0


def test_version():
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and decoderlm.__version__ == version("decoderlm")


def parsers(parser: argparse.ArgumentParser, name: str = "decoderlm"):
    """(command name, parser) for the command and every subcommand, nested ones too."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from parsers(p, f"{name} {sub}")


def test_every_flag_has_help_and_shows_its_default():
    for name, p in parsers(build_parser()):
        for action in p._actions:
            if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
                continue
            text = p._get_formatter()._expand_help(action) if action.help else ""
            assert text.strip(), (name, action.dest)
            shown = action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool)
            if action.option_strings and shown:
                assert "default" in text.lower(), (name, action.dest, text)


def test_every_command_takes_the_common_model_flags_alike():
    """--model, --seed, --device and --threads are built in one place (cli/common): the same help, type and default."""
    seen: dict[str, dict[str, tuple]] = {}
    for name, p in parsers(build_parser()):
        if name == "decoderlm train":  # TrainConfig's own flags
            continue
        for action in p._actions:
            if set(action.option_strings) & {"--device", "--threads", "--model", "--seed"}:
                seen.setdefault(action.dest, {})[name] = (action.type, action.default if action.dest != "model" else None)
    assert {"decoderlm serve", "decoderlm perplexity", "decoderlm convert", "decoderlm sft", "decoderlm dpo"} <= set(seen["model"])
    assert {"decoderlm serve", "decoderlm perplexity", "decoderlm sft", "decoderlm dpo", "decoderlm generate"} <= set(seen["device"])
    for dest in ("device", "threads", "seed"):
        assert len(set(seen[dest].values())) == 1, (dest, seen[dest])
    device_help = {a.help for _, p in parsers(build_parser()) for a in p._actions if "--device" in a.option_strings}
    assert all("cuda:N" in h for h in device_help)


def test_stop_after_then_resume(tmp_path, capsys):
    data = tmp_path / "c.txt"
    data.write_text(corpus_text(5000), encoding="utf-8")
    flags = ["--out", str(tmp_path / "run"), "--batch-size", "2", "--context", "16", "--eval-interval", "5", "--sample-chars", "5"]
    assert main(["train", "--data", str(data), "--max-steps", "10", "--stop-after", "4", *flags]) == 0
    assert "step 4: val loss not evaluated yet" in capsys.readouterr().out
    assert main(["train", "--resume", *flags]) == 0  # no --data, no --max-steps: the run's own
    assert "step 10: val loss" in capsys.readouterr().out


def corrupt_run(tmp_path):
    run = tmp_path / "corrupt"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"this is not a checkpoint")
    return run


def bad_invocations(tmp_path, run_dir):
    files = {"empty.txt": b"", "latin1.txt": "caf\xe9 na\xefve".encode("latin-1"), "binary.bin": b"\x00\x01PK\x03",
             "ok.txt": corpus_text(2000).encode()}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    gen = ["generate", "--model", str(run_dir), "--prompt", "First"]
    return {
        "missing data file": ["train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "r1")],
        "empty corpus": ["train", "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "r2")],
        "non-UTF-8 corpus": ["train", "--data", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "r3")],
        "max steps 0": ["train", "--data", str(tmp_path / "latin1.txt"), "--max-steps", "0"],
        "no data": ["train", "--out", str(tmp_path / "r4")],
        "resume nothing": ["train", "--resume", "--out", str(tmp_path / "r5")],
        "non-integer flag": ["train", "--data", "x.txt", "--max-steps", "many"],
        "data is a folder": ["train", "--data", str(tmp_path), "--out", str(tmp_path / "r6")],
        "binary corpus": ["train", "--data", str(tmp_path / "binary.bin"), "--out", str(tmp_path / "r7")],
        "out is a file": ["train", "--data", str(tmp_path / "ok.txt"), "--out", str(tmp_path / "ok.txt")],
        "beta2 1": ["train", "--data", str(tmp_path / "ok.txt"), "--out", str(tmp_path / "r8"), "--beta2", "1"],
        "corpus shorter than the context": ["train", "--data", str(tmp_path / "ok.txt"), "--out", str(tmp_path / "r9"), "--context", "256"],
        "more eval batches than val": ["train", "--data", str(tmp_path / "ok.txt"), "--out", str(tmp_path / "r10"), "--eval-batches", "9"],
        "unknown device": ["train", "--data", str(tmp_path / "ok.txt"), "--device", "tpu"],
        "resume with another batch size": ["train", "--resume", "--out", str(run_dir), "--batch-size", "99"],
        "resume a finished run": ["train", "--resume", "--out", str(run_dir)],
        "resume a file": ["train", "--resume", "--out", str(tmp_path / "ok.txt")],
        "unknown flag": ["generate", "--model", str(run_dir), "--prompt", "x", "--temprature", "1"],
        "negative temperature": [*gen, "--temperature", "-1"],
        "top-p 2": [*gen, "--top-p", "2"],
        "threads 0": [*gen, "--threads", "0"],
        "top-k -1": [*gen, "--top-k", "-1"],
        "min-p 1": [*gen, "--min-p", "1"],
        "repetition penalty 0": [*gen, "--repetition-penalty", "0"],
        "unseen character": ["generate", "--model", str(run_dir), "--prompt", "日本"],
        "empty prompt": ["generate", "--model", str(run_dir), "--prompt", ""],
        "prompt over the context": ["generate", "--model", str(run_dir), "--prompt", "First " * 10],
        "corrupt checkpoint": ["generate", "--model", str(corrupt_run(tmp_path)), "--prompt", "a"],
        "missing model": ["generate", "--model", str(tmp_path / "no-such-model"), "--prompt", "a"],
        "info missing model": ["info", str(tmp_path / "no-such-model")],
        "no command": [],
    }


def test_every_user_mistake_is_one_line_and_exit_2(tmp_path, run_dir, capsys):
    for what, argv in bad_invocations(tmp_path, run_dir).items():
        assert main(argv) == 2, what
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (what, captured.err)
        assert captured.out == "", (what, captured.out)


@pytest.mark.parametrize("what", ["corrupt checkpoint", "non-UTF-8 corpus"])
def test_the_installed_entry_point_reports_errors_without_traceback(tmp_path, run_dir, what):
    argv = bad_invocations(tmp_path, run_dir)[what]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "decoderlm", *argv], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr


def test_a_batching_server_decodes_in_int16_from_avx2_and_in_fp32_below_and_with_one_row_in_int16():
    """`serve` decodes every batch size in one arithmetic, the fastest over batches at the CPU's level: at AVX2
    and AVX-512 int16 is as fast as fp32 in batches and faster for one row (benchmarks/results/serve_step_avx2_emulated.json,
    serve_step_avx512.json); at the plain level batches of rows run faster in fp32 (serve_step_default.json); with
    --max-batch 1 every step is one row, as in `chat`, `generate` and `compile`: auto (int16). An explicit
    --activations wins."""
    defaults = {name: a.default for name, p in parsers(build_parser()) for a in p._actions if a.dest == "activations"}
    assert defaults["decoderlm chat"] == defaults["decoderlm generate"] == defaults["decoderlm compile"] == "auto"
    parser = build_parser()
    assert serve_activations(parser.parse_args(["serve"]), "default") == "fp32"
    assert serve_activations(parser.parse_args(["serve", "--max-batch", "2"]), "default") == "fp32"
    for level in ("default", "avx2", "avx512"):
        assert serve_activations(parser.parse_args(["serve", "--max-batch", "1"]), level) == "auto"
    for level in ("avx2", "avx512"):
        assert serve_activations(parser.parse_args(["serve"]), level) == "auto"
    assert serve_activations(parser.parse_args(["serve"])) == ("fp32" if isa.current() == "default" else "auto")  # this process's level
    for level in ("default", "avx2", "avx512"):
        assert serve_activations(parser.parse_args(["serve", "--max-batch", "1", "--activations", "fp32"]), level) == "fp32"
        assert serve_activations(parser.parse_args(["serve", "--activations", "int8"]), level) == "int8"
