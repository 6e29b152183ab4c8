"""DPO: the loss and rewards against values worked out by hand, sequence log-probs against a token-by-token
sum, and a small run that raises the reward margin on held-out pairs (full and LoRA)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import tiny_model
from decoderlm.finetune import FinetuneConfig, finetune, resume, run
from decoderlm.finetune.dpo import dpo_loss, encode_pair, pair_batch, sequence_logprobs
from decoderlm.model.transformer import IGNORE_INDEX
from finetune_helpers import chat_tokenizer, make_chat_model, write_jsonl


def test_loss_and_rewards_equal_hand_computed_values():
    # two pairs; chosen rows first. Pair 1: the policy gained 1 nat on chosen, 0 on rejected
    # (margin 0.1 · 1 = 0.1); pair 2: lost 1 on chosen, gained 1 on rejected (margin 0.1 · -2 = -0.2).
    policy = torch.tensor([-10.0, -12.0, -11.0, -10.0], requires_grad=True)
    reference = torch.tensor([-11.0, -11.0, -11.0, -11.0])
    stats = dpo_loss(policy, reference, beta=0.1)
    expected = (math.log(1 + math.exp(-0.1)) + math.log(1 + math.exp(0.2))) / 2  # -log σ(m) = log(1 + e^-m)
    assert stats.loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats.chosen_reward == pytest.approx((0.1 - 0.1) / 2)
    assert stats.rejected_reward == pytest.approx((0.0 + 0.1) / 2)
    assert stats.margin == pytest.approx((0.1 - 0.2) / 2)
    assert stats.accuracy == 0.5
    stats.loss.backward()
    assert policy.grad[0] < 0 and policy.grad[2] > 0  # descent raises chosen, lowers rejected


def test_sequence_logprobs_sum_the_reply_tokens():
    tok = chat_tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=128)
    pairs = [encode_pair(tok, {"prompt": "Is the fox quick?", "chosen": "Yes, very.", "rejected": "No"}),
             encode_pair(tok, {"prompt": "Hi", "chosen": "Hello there, friend.", "rejected": "Go away."})]
    with torch.no_grad():
        got = sequence_logprobs(model, pair_batch(pairs))
        expected = []
        for ex in [p.chosen for p in pairs] + [p.rejected for p in pairs]:
            logp = torch.log_softmax(model(torch.tensor([ex.ids])).logits[0], -1)
            expected.append(sum(logp[t - 1, ex.ids[t]] for t in range(1, len(ex.ids)) if ex.labels[t] != IGNORE_INDEX))
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-4, rtol=1e-5)


SUBJECTS = ["fox", "dog", "cache", "token", "question", "transformer", "value", "key", "cafe", "word", "brown", "lazy",
            "river", "lamp", "garden", "engine", "window", "pencil", "cloud", "bridge", "apple", "harbor", "violin", "mountain"]


def preference_pairs(n: int) -> list[dict]:
    """Chosen replies are polite and end with a period; rejected ones shout. Each pair has its own subject, so
    held-out pairs are about subjects no trained pair mentions."""
    return [{"prompt": f"Tell me about the {s}.", "chosen": f"The {s} is quick and brown.", "rejected": f"NO! {s.upper()}!!!"}
            for s in SUBJECTS[:n]]


def test_held_out_pairs_share_no_prompt_with_the_training_pairs(tmp_path, monkeypatch):
    """Two pairs per prompt: the eval split takes whole prompts, so the held-out margin is measured on
    prompts training never saw, and every pair is on exactly one side."""
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    pairs = preference_pairs(12)
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs + [p | {"chosen": f"Gladly: {p['chosen']}"} for p in pairs])
    seen: dict[str, list] = {}

    class Recorded(run.DPOObjective):
        def __init__(self, train, held_out, *args, **kwargs):
            seen.update(train=train, held_out=held_out)
            super().__init__(train, held_out, *args, **kwargs)

    monkeypatch.setattr(run, "DPOObjective", Recorded)
    finetune(FinetuneConfig(model=str(base), data=str(data), out=str(tmp_path / "run"), method="dpo", max_steps=1, batch_size=2,
                            eval_fraction=0.25, lora_rank=2))
    train, held_out = ({p.prompt for p in seen[side]} for side in ("train", "held_out"))
    assert len(seen["held_out"]) == 6 and len(held_out) == 3 and not train & held_out
    assert len(seen["train"]) + len(seen["held_out"]) == 24 and train | held_out == {p["prompt"] for p in pairs}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reward_margin_rises_on_held_out_pairs(tmp_path, lora):
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_pairs(24))
    cfg = FinetuneConfig(model=str(base), data=str(data), out=str(tmp_path / "run"), method="dpo", epochs=4, batch_size=4,
                         lr=2e-3, eval_fraction=0.25, beta=0.5, lora_rank=8 if lora else 0, lora_targets="q_proj,v_proj,up_proj,down_proj")
    result = finetune(cfg)
    evals = result["eval"]
    assert evals[0]["margin"] == pytest.approx(0.0, abs=1e-5)  # before training the policy is the reference
    assert evals[-1]["margin"] > 1.0 and evals[-1]["accuracy"] == 1.0
    assert evals[-1]["loss"] < evals[0]["loss"]
    logged = json.loads((tmp_path / "run" / "finetune.json").read_text())["eval"]
    assert logged[-1]["chosen_reward"] == pytest.approx(evals[-1]["chosen_reward"])
    last = json.loads((tmp_path / "run" / "log.json").read_text())[-1]  # the loop's log carries the objective's metrics
    assert last["val_loss"] == pytest.approx(evals[-1]["loss"]) and last["margin"] == pytest.approx(evals[-1]["margin"])


def test_dpo_cli_logs_rewards(tmp_path, cli, capsys):
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_pairs(8))
    code = cli(["dpo", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "run"), "--max-steps", "2",
                "--batch-size", "2", "--lora-rank", "2", "--eval-fraction", "0.25"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "eval: loss 0.6931, chosen_reward 0.0000, rejected_reward 0.0000, margin 0.0000" in captured.err  # log σ(0) before training
    assert captured.err.count("eval: loss") == 2
    assert (tmp_path / "run" / "adapter_config.json").is_file()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_stopped_dpo_run_resumed_equals_an_uninterrupted_one(tmp_path, lora):
    """Stopped after step 3 and resumed: the same losses, held-out rewards and weights. With full
    fine-tuning the reference stays the starting model, not the weights the run resumed from."""
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_pairs(16))

    def config(out: str, **extra) -> FinetuneConfig:
        return FinetuneConfig(model=str(base), data=str(data), out=str(tmp_path / out), method="dpo", epochs=2, batch_size=4,
                              lr=2e-3, eval_fraction=0.25, beta=0.5, eval_interval=2, log_interval=1,
                              lora_rank=4 if lora else 0, lora_dropout=0.1 if lora else 0.0, **extra)

    whole = finetune(config("whole"))
    stopped = finetune(config("stopped", stop_after=3))
    assert stopped["step"] == 3 and whole["step"] == 6
    resumed = finetune(FinetuneConfig(out=str(tmp_path / "stopped"), method="dpo", resume=True))
    assert resumed["eval"] == whole["eval"]  # before training, then steps 2, 4, 6
    rows = [[(r["step"], r["train_loss"], r["val_loss"], r.get("margin")) for r in json.loads((tmp_path / name / "log.json").read_text())]
            for name in ("whole", "stopped")]
    assert rows[0] == rows[1]
    a, b = (torch.load(tmp_path / name / resume.STATE_NAME, weights_only=True)["trainable"] for name in ("whole", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
