"""Checkpoint reading tells each failure apart, and the train entry point never loses the user's data."""

import pytest
import torch
from conftest import corpus_text

from decoderlm.errors import DecoderLMError
from decoderlm.formats import runs
from decoderlm.loader import load
from decoderlm.train import TrainConfig, checkpoint, train

SMALL = dict(batch_size=4, context=16, eval_interval=10, log_interval=5, sample_chars=0)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 10-step run (read-only for the tests: copy its ckpt.pt before changing it)."""
    root = tmp_path_factory.mktemp("ckpt")
    (root / "corpus.txt").write_text(corpus_text(), encoding="utf-8")
    train(TrainConfig(data=str(root / "corpus.txt"), out=str(root / "run"), max_steps=10, **SMALL))
    return root / "run"


def run_with(tmp_path, state=None, raw: bytes | None = None, name: str = "run"):
    """A run folder whose ckpt.pt is `state` saved by torch, or the bytes `raw`."""
    run = tmp_path / name
    run.mkdir()
    path = run / runs.CKPT_NAME
    if raw is not None:
        path.write_bytes(raw)
    else:
        torch.save(state, path)
    return run


def test_missing_folder_a_file_and_a_folder_without_checkpoint_are_told_apart(tmp_path):
    with pytest.raises(DecoderLMError, match="run folder .* does not exist"):
        runs.read(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DecoderLMError, match="is a file, not a run folder"):
        runs.read(tmp_path / "file")
    with pytest.raises(DecoderLMError, match="has no ckpt.pt"):
        runs.read(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 10])
def test_a_truncated_checkpoint_is_called_truncated(tmp_path, finished, keep):
    data = (finished / runs.CKPT_NAME).read_bytes()
    cut = int(len(data) * keep) if keep < 1 else keep
    run = run_with(tmp_path, raw=data[:cut])
    for read in (runs.read, load, lambda r: train(TrainConfig(out=str(r), resume=True))):
        with pytest.raises(DecoderLMError, match="truncated or corrupt"):
            read(run)


def test_bytes_that_are_no_checkpoint_are_called_corrupt(tmp_path, finished):
    with pytest.raises(DecoderLMError, match="truncated or corrupt"):
        runs.read(run_with(tmp_path, raw=b"this is not a checkpoint"))


def test_a_newer_format_version_is_refused_naming_both_versions(tmp_path, finished):
    state = runs.read(finished) | {"format_version": runs.FORMAT_VERSION + 1}
    run = run_with(tmp_path, state)
    newer, ours = runs.FORMAT_VERSION + 1, runs.FORMAT_VERSION
    with pytest.raises(DecoderLMError, match=f"format version {newer}, but this decoderlm reads versions up to {ours}"):
        load(run)


def test_training_settings_from_a_newer_decoderlm_are_refused_on_resume(tmp_path, finished):
    state = runs.read(finished)
    run = run_with(tmp_path, state | {"train_config": state["train_config"] | {"mixed_precision": "fp8"}})
    with pytest.raises(DecoderLMError, match="training settings this decoderlm does not know \\(mixed_precision\\)"):
        train(TrainConfig(out=str(run), resume=True, max_steps=20))


def test_a_torch_file_that_is_not_a_run_checkpoint_is_named_so(tmp_path, finished):
    with pytest.raises(DecoderLMError, match="not a decoderlm run checkpoint"):
        runs.read(run_with(tmp_path, {"weight": torch.ones(2)}))
    state = {k: v for k, v in runs.read(finished).items() if k not in ("optimizer", "rng")}
    run = run_with(tmp_path, state, name="model-only")
    assert load(run)[0].config.max_seq_len == 16  # enough to use the model
    with pytest.raises(DecoderLMError, match="not the training state --resume needs \\(optimizer, rng\\)"):
        train(TrainConfig(out=str(run), resume=True, max_steps=20))


def test_a_checkpoint_from_before_format_versions_still_loads_and_resumes(tmp_path, finished):
    """Version 0 files (RNG states as torch_rng/batch_rng, no decay_steps) are upgraded when read."""
    state = runs.read(finished)
    legacy = {k: v for k, v in state.items() if k not in ("format_version", "rng")}
    legacy |= {"torch_rng": state["rng"]["torch"], "batch_rng": state["rng"]["batch"]}
    legacy["train_config"] = {k: v for k, v in state["train_config"].items() if k not in ("decay_steps", "threads")}
    run = run_with(tmp_path, legacy)
    for name in ("train.bin", "val.bin"):
        (run / name).write_bytes((finished / name).read_bytes())
    assert runs.read(run)["train_config"]["decay_steps"] == 10
    assert train(TrainConfig(out=str(run), resume=True, max_steps=12))["step"] == 12


def test_a_run_saved_with_precision_resumes_with_the_same_dtype(tmp_path, finished):
    """Runs trained before --precision fp32|bf16 became --dtype float32|bfloat16 keep their setting."""
    state = runs.read(finished)
    settings = {k: v for k, v in state["train_config"].items() if k != "dtype"} | {"precision": "bf16"}
    run = run_with(tmp_path, state | {"train_config": settings})
    for name in ("train.bin", "val.bin"):
        (run / name).write_bytes((finished / name).read_bytes())
    with pytest.raises(DecoderLMError, match="--dtype float32 \\(the run's: bfloat16\\)"):
        train(TrainConfig(out=str(run), resume=True, max_steps=12, dtype="float32"))
    assert train(TrainConfig(out=str(run), resume=True, max_steps=12))["config"].dtype == "bfloat16"
    assert runs.read(run)["train_config"]["dtype"] == "bfloat16" and "precision" not in runs.read(run)["train_config"]


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temp_file(tmp_path, finished, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / runs.CKPT_NAME).write_bytes((finished / runs.CKPT_NAME).read_bytes())

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(DecoderLMError, match="cannot write checkpoint .*No space left on device.*previous checkpoint.*intact"):
        checkpoint.save(run, {"step": 99})
    monkeypatch.undo()
    assert runs.read(run)["step"] == 10
    assert sorted(p.name for p in run.iterdir()) == [runs.CKPT_NAME]


def test_a_new_run_never_writes_over_the_users_files(tmp_path, finished):
    data = finished.parent / "corpus.txt"
    (tmp_path / "a_file").write_text("precious")
    with pytest.raises(DecoderLMError, match="--out .*a_file is a file"):
        train(TrainConfig(data=str(data), out=str(tmp_path / "a_file"), max_steps=1, **SMALL))
    with pytest.raises(DecoderLMError, match="cannot write the run folder .*choose a writable --out"):
        train(TrainConfig(data=str(data), out=str(tmp_path / "a_file" / "run"), max_steps=1, **SMALL))
    home = tmp_path / "home"
    home.mkdir()
    (home / "log.txt").write_text("precious")
    (home / "log.csv").write_text("precious")
    with pytest.raises(DecoderLMError, match="holds files that are not a decoderlm run's \\(log.txt\\)"):
        train(TrainConfig(data=str(data), out=str(home), max_steps=1, **SMALL))
    assert (home / "log.csv").read_text() == (tmp_path / "a_file").read_text() == "precious"
    with pytest.raises(DecoderLMError, match="already holds a run; pass --resume to continue it or choose another --out"):
        train(TrainConfig(data=str(data), out=str(finished), max_steps=1, **SMALL))


def test_a_run_killed_before_its_first_checkpoint_can_start_over(tmp_path, finished):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("train.bin", "val.bin"):
        (run / name).write_bytes((finished / name).read_bytes())
    (run / "ckpt.pt.tmp").write_bytes(b"PK half")
    result = train(TrainConfig(data=str(finished.parent / "corpus.txt"), out=str(run), max_steps=2, **SMALL))
    assert result["step"] == 2 and not (run / "ckpt.pt.tmp").exists()


@pytest.mark.parametrize("content,message", [(None, "is a folder"), (b"\x00\x01\x02binary", "looks binary"),
                                             (b"", "is empty"), (b"caf\xe9", "not UTF-8")])
def test_a_corpus_that_is_no_text_file_is_one_clear_error(tmp_path, content, message):
    data = tmp_path / "data"
    data.mkdir() if content is None else data.write_bytes(content)
    with pytest.raises(DecoderLMError, match=message):
        train(TrainConfig(data=str(data), out=str(tmp_path / "run"), max_steps=1, **SMALL))
    assert not (tmp_path / "run").exists()


def test_resuming_a_run_whose_token_files_are_gone_is_one_clear_error(tmp_path, finished):
    run = run_with(tmp_path, raw=(finished / runs.CKPT_NAME).read_bytes())
    with pytest.raises(DecoderLMError, match="cannot read .*train.bin, the run's tokenized data"):
        train(TrainConfig(out=str(run), resume=True, max_steps=20))
