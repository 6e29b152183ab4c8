"""Training settings and data sizes are refused before any work: one-line errors, nothing written."""

import dataclasses
import math
import typing

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decoderlm.cli import build_parser
from decoderlm.errors import DecoderLMError
from decoderlm.train import TrainConfig, train
from decoderlm.train.config import FIXED, RUN, SESSION
from decoderlm.train.data import EVAL_BATCH, check_sizes, min_corpus, split_sizes

SMALL = dict(batch_size=4, context=16, eval_interval=10, log_interval=5, sample_chars=0, max_steps=2)

BAD_SETTINGS = [
    ("max_steps", 0), ("decay_steps", 0), ("stop_after", 0), ("batch_size", 0), ("batch_size", 2.5), ("context", 0),
    ("lr", 0.0), ("lr", -1e-3), ("lr", math.nan), ("lr", math.inf), ("min_lr", -1e-5), ("min_lr", 2e-3), ("warmup", -1),
    ("weight_decay", -0.1), ("beta1", 1.0), ("beta1", -0.1), ("beta2", 1.0), ("grad_clip", -1.0), ("dropout", 1.0),
    ("dropout", -0.5), ("seed", -1), ("seed", 2**64), ("eval_interval", 0), ("eval_batches", 0), ("log_interval", 0),
    ("threads", 0), ("sample_chars", -1), ("device", "tpu"), ("preset", "gpt-5"),
]


@pytest.mark.parametrize("name,value", BAD_SETTINGS)
def test_each_bad_setting_is_refused_before_anything_is_written(corpus, tmp_path, name, value):
    out = tmp_path / "run"
    cfg = TrainConfig(data=str(corpus), out=str(out), **{**SMALL, "lr": 1e-3, name: value})
    with pytest.raises(DecoderLMError) as e:
        train(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert name.replace("_", "-") in message or name == "preset", message  # names the flag to fix
    assert not out.exists()


def test_an_unavailable_device_is_refused_up_front(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for device in ("cuda", "mps"):
        with pytest.raises(DecoderLMError, match=f"--device {device}: .*use --device cpu"):
            train(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), device=device, **SMALL))
    assert not (tmp_path / "run").exists()


def test_a_val_split_too_small_for_one_window_names_the_corpus_size_needed(tmp_path):
    """The message's size is the true minimum: one character fewer fails, that many trains."""
    text = "abcdefghij" * 30  # 300 characters: a val split of 30 tokens, short of context 64 + 1
    (tmp_path / "small.txt").write_text(text)
    with pytest.raises(DecoderLMError, match="val split has 30 tokens") as e:
        train(TrainConfig(data=str(tmp_path / "small.txt"), out=str(tmp_path / "r0"), context=64, max_steps=1, sample_chars=0))
    assert not (tmp_path / "r0").exists()  # refused before the first step, not at the first evaluation
    needed = int(str(e.value).split("at least ")[1].split(" characters")[0])
    assert needed == 641 and "--context of at most 29" in str(e.value)  # 641 - int(0.9 * 641) = 65 = 64 + 1
    (tmp_path / "short.txt").write_text((text * 3)[: needed - 1])
    with pytest.raises(DecoderLMError, match="too few for one window"):
        train(TrainConfig(data=str(tmp_path / "short.txt"), out=str(tmp_path / "r1"), context=64, max_steps=1, sample_chars=0))
    (tmp_path / "enough.txt").write_text((text * 3)[:needed])
    enough = TrainConfig(data=str(tmp_path / "enough.txt"), out=str(tmp_path / "r2"), context=64, max_steps=1, batch_size=1, sample_chars=0)
    result = train(enough)
    assert math.isfinite(result["val_loss"])


def test_more_eval_batches_than_the_val_split_holds_is_refused_up_front(corpus, tmp_path):
    # corpus: 20,000 characters -> val split 2,000 tokens -> 124 windows of 16 -> 2 batches of 64 windows
    with pytest.raises(DecoderLMError, match="--eval-batches 3 needs a val split of at least 2065 tokens .* enough for 2"):
        train(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), eval_batches=3, **SMALL))
    assert not (tmp_path / "run").exists()
    assert train(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), eval_batches=2, **SMALL))["step"] == 2


def test_a_train_split_too_small_is_refused():
    with pytest.raises(DecoderLMError, match="train split has 10 tokens, too few for one window of --context 16"):
        check_sizes(10, 100, 16, None, "run folder r")


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_min_corpus_is_the_smallest_corpus_whose_splits_are_big_enough(train_tokens, val_tokens):
    n = min_corpus(train_tokens, val_tokens)
    assert all(have >= need for have, need in zip(split_sizes(n), (train_tokens, val_tokens)))
    assert n == 1 or any(have < need for have, need in zip(split_sizes(n - 1), (train_tokens, val_tokens)))


@given(st.integers(1, 64), st.integers(1, 4), st.integers(0, 64 * 4 * 8))
def test_eval_batches_are_refused_exactly_when_the_split_has_fewer(context, batches, extra):
    """Accepted iff the split really yields that many eval batches (counted by slicing, independently)."""
    n_val = context + 1 + extra
    windows = (n_val - 1) // context
    have = len(range(0, windows, EVAL_BATCH))
    try:
        check_sizes(10**6, n_val, context, batches, "x")
        assert batches <= have
    except DecoderLMError:
        assert batches > have


def test_every_train_flag_is_a_trainconfig_field_and_back(tmp_path):
    """The CLI has no hand-kept list: each field has a flag that parses to its type, and no flag is extra."""
    train_parser = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {a.dest for a in train_parser._actions if a.dest != "help"}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert flags == set(fields)
    hints = typing.get_type_hints(TrainConfig)
    for name, f in fields.items():
        assert f.metadata["on_resume"] in (FIXED, RUN, SESSION)
        if hints[name] is bool:
            continue
        kind = next(t for t in typing.get_args(hints[name]) if t is not type(None))
        if kind == list[str]:  # repeatable: each use appends
            args = build_parser().parse_args(["train", f"--{name.replace('_', '-')}", "a=1", f"--{name.replace('_', '-')}", "b=2"])
            assert getattr(args, name) == ["a=1", "b=2"]
            continue
        value = f.metadata["choices"][-1] if f.metadata["choices"] else {int: "7", float: "0.5", str: "x"}[kind]
        args = build_parser().parse_args(["train", f"--{name.replace('_', '-')}", value])
        assert getattr(args, name) == kind(value)
