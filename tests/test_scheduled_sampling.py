"""Scheduled sampling: P = 0 is plain teacher forcing to the bit; otherwise the expected share of the
replaceable tokens (never the first, never prompt tokens) becomes the model's prediction of them, with a
probability ramping from 0 to P; a resumed run draws the same replacements."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import tiny_model
from finetune_helpers import chat_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from decoderlm.errors import DecoderLMError
from decoderlm.finetune.objectives import SFTObjective
from decoderlm.finetune.sft import batch_logits, encode_chat, sft_loss
from decoderlm.model.transformer import IGNORE_INDEX, lm_loss
from decoderlm.train import LMObjective, TrainConfig, train
from decoderlm.train.distributed import World
from decoderlm.train.scheduled_sampling import ScheduledSampling, replace_tokens

CPU = torch.device("cpu")


def lm_setup(p: float):
    data = [np.random.default_rng(0).integers(0, 37, 2000).astype(np.uint16)]
    cfg = TrainConfig(batch_size=4, context=16, seed=3, grad_accum=1, decay_steps=10, scheduled_sampling=p)
    model = tiny_model(dropout=0.1).train()  # dropout on: the torch RNG stream must be untouched too
    return LMObjective(data, data, cfg, World(), CPU), model


def test_p_zero_is_teacher_forcing_exactly():
    objective, model = lm_setup(0.0)
    (x, y), = objective.batches()
    torch.manual_seed(5)
    loss, n = objective.loss(model, (x, y))
    torch.manual_seed(5)
    assert torch.equal(loss, lm_loss(model(x).logits, y)) and n == x.numel()
    assert objective.rng_state().keys() == {"batch"}  # a pretraining checkpoint is unchanged


def test_p_above_zero_changes_the_inputs_only_after_the_ramp_starts():
    objective, model = lm_setup(1.0)
    (x, y), = objective.batches()  # step 0: probability 0
    torch.manual_seed(5)
    loss, _ = objective.loss(model, (x, y))
    torch.manual_seed(5)
    assert torch.equal(loss, lm_loss(model(x).logits, y))
    model.eval()  # evaluation stays teacher-forced whatever the step
    for _ in range(10):
        (x, y), = objective.batches()
    assert objective.sampling.now == 1.0
    with torch.no_grad():
        assert torch.equal(objective.loss(model, (x, y))[0], lm_loss(model(x).logits, y))
        model.train()
        assert not torch.equal(objective.loss(model, (x, y))[0], lm_loss(model(x).logits, y))


def test_the_probability_ramps_from_zero_to_p_over_the_horizon():
    sampling = ScheduledSampling(0.4, horizon=10, seed=0)
    seen = []
    for _ in range(13):
        sampling.start_step()
        seen.append(sampling.now)
    assert seen == pytest.approx([0.04 * s for s in range(10)] + [0.4] * 3)


@settings(max_examples=25, deadline=None)
@given(p=st.floats(0.05, 0.95), seed=st.integers(0, 2**31))
def test_the_expected_share_of_replaceable_tokens_is_replaced_by_the_prediction(p, seed):
    """Inputs in [0, 50), predictions input + 50: every changed token is visibly a replacement, and it is
    the prediction made at the slot before it."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 50, (8, 64), generator=g)
    targets = torch.where(torch.rand(8, 64, generator=g) < 0.3, IGNORE_INDEX, torch.randint(0, 50, (8, 64), generator=g))
    logits_of = lambda ids: torch.nn.functional.one_hot(ids + 50, 100).float()
    mixed = replace_tokens(inputs, targets, logits_of, p, torch.Generator().manual_seed(seed))
    changed = mixed != inputs
    replaceable = torch.zeros_like(changed)
    replaceable[:, 1:] = targets[:, :-1] != IGNORE_INDEX
    assert not changed[~replaceable].any()  # the first token and tokens after an ignored target: never
    assert torch.equal(mixed[:, 1:][changed[:, 1:]], inputs[:, :-1][changed[:, 1:]] + 50)
    n = int(replaceable.sum())
    share = int(changed.sum()) / n
    assert abs(share - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_sft_trains_on_its_own_predictions_of_reply_tokens_only():
    """At probability 1 every reply token (after the first slot) is the model's prediction; prompt tokens stay."""
    tok = chat_tokenizer()
    conv = [{"role": "user", "content": "Say the word fox twice"}, {"role": "assistant", "content": "fox fox, as asked"}]
    cfg = TrainConfig(batch_size=1, context=128, seed=0, grad_accum=1, decay_steps=1, scheduled_sampling=1.0)
    objective = SFTObjective([encode_chat(tok, conv)], [], cfg, 0, False, CPU)
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=128).train()
    objective.batches()  # step 0: probability 0
    batch, = objective.batches()  # step 1: probability 1
    with torch.no_grad():
        predicted = batch_logits(model, batch)[:, :-1].argmax(-1)  # (1, T-1)
        reply = batch.targets[:, :-1] != IGNORE_INDEX
        expected = batch.input_ids.clone()
        expected[:, 1:][reply] = predicted[reply]
        assert not torch.equal(expected, batch.input_ids) and reply.any() and (~reply).any()
        loss, n = objective.loss(model, batch)
        assert torch.equal(loss, sft_loss(model, dataclasses.replace(batch, input_ids=expected)))
        assert n == int(reply.sum())  # the targets are unchanged


def test_a_killed_scheduled_sampling_run_resumes_exactly(corpus, tmp_path):
    small = dict(batch_size=4, context=16, eval_interval=4, log_interval=2, sample_chars=0, warmup=1, scheduled_sampling=0.5)
    whole = train(TrainConfig(data=str(corpus), out=str(tmp_path / "whole"), max_steps=8, **small))
    train(TrainConfig(data=str(corpus), out=str(tmp_path / "cut"), max_steps=8, stop_after=4, **small))
    resumed = train(TrainConfig(out=str(tmp_path / "cut"), resume=True))
    plain = train(TrainConfig(data=str(corpus), out=str(tmp_path / "plain"), max_steps=8, **dict(small, scheduled_sampling=0.0)))
    sa, sb, sp = (r["model"].state_dict() for r in (whole, resumed, plain))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sp[k]) for k in sa)  # it did change what was trained on


def test_a_probability_outside_0_1_is_refused(corpus, tmp_path, cli, capsys):
    with pytest.raises(DecoderLMError, match="--scheduled-sampling must be in \\[0, 1\\], got 1.5"):
        train(TrainConfig(data=str(corpus), out=str(tmp_path / "run"), scheduled_sampling=1.5))
    assert cli(["sft", "--model", "x", "--data", str(corpus), "--out", str(tmp_path / "r"), "--scheduled-sampling", "-0.5"]) == 2
    assert capsys.readouterr().err.startswith("error: --scheduled-sampling must be in [0, 1], got -0.5")
