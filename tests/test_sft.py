"""SFT data: labels exactly on the assistant's replies (against transformers' assistant mask), packing
that changes nothing but the layout, bad data lines named by number, and `decoderlm sft` end to end."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import decoderlm
from conftest import tiny_model
from decoderlm import names
from decoderlm.errors import DecoderLMError
from decoderlm.finetune import FinetuneConfig, finetune, resume
from decoderlm.finetune.data import check_chat, read_jsonl
from decoderlm.finetune.objectives import EpochRows, SFTObjective
from decoderlm.finetune.sft import batch_logits, collate, encode_chat, pack, sft_loss
from decoderlm.formats.gguf import FastReader, Metadata, gguf_tokenizer
from decoderlm.generate import generate
from decoderlm.model.transformer import IGNORE_INDEX
from decoderlm.sampling import SamplingParams
from finetune_helpers import TEMPLATES, chat_tokenizer, make_chat_model, write_chat_tokenizer, write_jsonl
from hf_models import make_hf_model

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]

# SmolLM2's template writes every turn with one expression; the tagged copy marks the assistant's.
SMOL_TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"  # its '\n' are newlines
SMOL_TAGGED = ("{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\\n'}}{% generation %}"
               "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{'\\n'}}{% else %}" + SMOL_TURN + "{% endif %}")


@pytest.fixture(scope="module")
def smol_tokenizer():
    return gguf_tokenizer(Metadata(FastReader(names.locate("smollm2-135m-instruct"))))


def hf_assistant_mask(tokenizer, messages, template, tmp_path):
    """transformers' ids and assistant mask for `messages` under `template` ({% generation %} tags)."""
    from transformers import AutoTokenizer

    tokenizer.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    out = hf.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def our_mask(example):
    return [int(label != IGNORE_INDEX) for label in example.labels]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["system", "default-system"])
def test_smollm2_mask_matches_transformers(smol_tokenizer, messages, tmp_path):
    assert SMOL_TURN in smol_tokenizer.chat_template  # the tagged copy differs from SmolLM2's only by the tags
    tagged = smol_tokenizer.chat_template.replace(SMOL_TURN, SMOL_TAGGED)
    ex = encode_chat(smol_tokenizer, messages)
    ids, mask = hf_assistant_mask(smol_tokenizer, messages, tagged, tmp_path)
    assert ex.ids == ids
    assert our_mask(ex) == mask
    # and read from the text: each labelled run is a reply followed by its end-of-turn token, nothing else
    runs, run = [], []
    for tok, label in zip(ex.ids, ex.labels):
        if label != IGNORE_INDEX:
            run.append(tok)
        elif run:
            runs.append(run)
            run = []
    replies = [smol_tokenizer.tokenizer.decode(r, skip_special_tokens=False) for r in runs]
    assert replies == ["Paris.<|im_end|>", "Rome, since 1871.<|im_end|>"]


def test_gemma_layout_mask_matches_transformers(tmp_path):
    tok = chat_tokenizer("gemma")
    ex = encode_chat(tok, CONVERSATION)
    ids, mask = hf_assistant_mask(tok, CONVERSATION, tok.chat_template, tmp_path)
    assert ex.ids == ids and our_mask(ex) == mask
    assert "<start_of_turn>model" in tok.tokenizer.decode(ex.ids, skip_special_tokens=False)
    replies = tok.tokenizer.decode([t for t, m in zip(ex.ids, mask) if m], skip_special_tokens=False)
    assert replies == "Paris.<end_of_turn>Rome, since 1871.<end_of_turn>"


TEXT = st.text(alphabet="abc xyz.,!?\n日é", min_size=1, max_size=12).filter(lambda s: s.strip() == s and s)


@st.composite
def conversations(draw):
    turns = draw(st.integers(1, 3))
    messages = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(turns):
        messages += [{"role": "user", "content": draw(TEXT)}, {"role": "assistant", "content": draw(TEXT)}]
    return messages


@settings(max_examples=25)
@given(messages=conversations(), template=st.sampled_from(sorted(TEMPLATES)))
def test_mask_matches_transformers_on_any_conversation(messages, template, tmp_path_factory):
    tok = chat_tokenizer(template)
    ex = encode_chat(tok, messages)
    ids, mask = hf_assistant_mask(tok, messages, tok.chat_template, tmp_path_factory.mktemp("tok"))
    assert ex.ids == ids and our_mask(ex) == mask


CONFIGS = {"rope": {}, "learned": dict(position="learned", norm="layernorm", mlp="gelu"), "window": dict(sliding_window=5)}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_packed_rows_equal_separate_conversations(case):
    tok = chat_tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=256, **CONFIGS[case])
    convs = [CONVERSATION, CONVERSATION[1:3], [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]]
    examples = [encode_chat(tok, c) for c in convs]
    rows = pack([len(e.ids) for e in examples], 200)
    assert len(rows) < len(examples)  # something is actually packed
    packed, padded = collate(examples, rows), collate(examples, [[i] for i in range(len(examples))])
    with torch.no_grad():
        torch.testing.assert_close(sft_loss(model, packed), sft_loss(model, padded), atol=1e-5, rtol=1e-5)
        logits = batch_logits(model, packed)
        for r, row in enumerate(rows):  # each conversation's logits as if it were alone
            at = 0
            for i in row:
                alone = model(torch.tensor([examples[i].ids])).logits[0]
                torch.testing.assert_close(logits[r, at : at + len(examples[i].ids)], alone, atol=1e-5, rtol=1e-5)
                at += len(examples[i].ids)


def test_loss_counts_only_reply_tokens():
    tok = chat_tokenizer()
    model = tiny_model(vocab_size=tok.vocab_size, max_seq_len=256)
    ex = encode_chat(tok, CONVERSATION)
    batch = collate([ex], [[0]])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ex.ids])).logits[0], -1)
    reply = [t for t in range(1, len(ex.ids)) if ex.labels[t] != IGNORE_INDEX]
    expected = -sum(logp[t - 1, ex.ids[t]] for t in reply) / len(reply)
    with torch.no_grad():
        torch.testing.assert_close(sft_loss(model, batch), expected, atol=1e-5, rtol=1e-5)


@given(n_rows=st.integers(1, 30), batch_size=st.integers(1, 8), seed=st.integers(0, 2**31), epochs=st.integers(1, 3))
def test_each_epoch_trains_on_every_row_once(n_rows, batch_size, seed, epochs):
    sampler = EpochRows(n_rows, batch_size, seed)
    for _ in range(epochs):
        drawn = [sampler.next() for _ in range(sampler.per_epoch)]
        assert sorted(r for batch in drawn for r in batch) == list(range(n_rows))
        assert all(len(batch) == batch_size for batch in drawn[:-1])
    resumed = EpochRows(n_rows, batch_size, seed)
    resumed.set_state(sampler.state())
    assert resumed.next() == sampler.next()  # the step count is the whole state


BAD = ['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
       '{"prompt": "2+2?", "completion": "4"}',
       '{"messages": [{"role": "user", "content": "hi"',
       '',
       '{"messages": [{"role": "user", "content": "no reply"}]}']


def test_bad_lines_are_named_and_refused_or_skipped(tmp_path, capsys):
    path = write_jsonl(tmp_path / "chats.jsonl", BAD)
    with pytest.raises(DecoderLMError, match=r"line 3: not valid JSON.*--skip-bad-lines"):
        read_jsonl(path, check_chat)
    records = read_jsonl(path, check_chat, skip_bad=True)
    assert [n for n, _ in records] == [1, 2]
    err = capsys.readouterr().err
    assert "line 3: not valid JSON" in err and "line 5: the conversation has no assistant message" in err


def test_sft_cli_refuses_a_bad_line_before_loading(tmp_path, cli, capsys):
    path = write_jsonl(tmp_path / "chats.jsonl", BAD[:3])
    code = cli(["sft", "--model", str(tmp_path / "nowhere"), "--data", str(path), "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"error: {path} line 3: not valid JSON")


def facts(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Say the word {w}"}, {"role": "assistant", "content": f"{w} {w} {w}"}]}
            for w in ["fox", "dog", "cache", "token", "quick", "brown", "lazy", "question"][:n]]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_cli_run_folder_is_a_model(tmp_path, cli, capsys, lora):
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "chats.jsonl", facts(8) * 3)
    out = tmp_path / "run"
    argv = ["sft", "--model", str(base), "--data", str(data), "--out", str(out), "--epochs", "3", "--batch-size", "4",
            "--lr", "3e-3", "--packing", "--max-length", "64", "--log-interval", "2"]
    code = cli(argv + (["--lora-rank", "4", "--lora-targets", "q_proj,v_proj,o_proj"] if lora else []))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    # rank 4 on q (64→64), v (64→32), o (64→64) in 2 layers: 4·(128 + 96 + 128)·2 adapter weights
    assert f"trainable parameters: {2816 if lora else sum(p.numel() for p in decoderlm.load(base)[0].parameters()):,} of" in captured.out
    for name in ("log.csv", "log.json", "loss.png", "finetune.json", "tokenizer.json"):
        assert (out / name).is_file()
    assert (out / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    history = json.loads((out / "log.json").read_text())
    before = json.loads((out / "finetune.json").read_text())["eval_loss_before"]
    assert history[-1]["val_loss"] < before
    model, tok = decoderlm.load(out)
    assert tok.chat_template is not None
    ex = encode_chat(tok, facts(1)[0]["messages"])
    with torch.no_grad():
        assert sft_loss(model, collate([ex], [[0]])).item() < before
    assert cli(["generate", "--model", str(out), "--prompt", "Say", "--max-new-tokens", "3", "--temperature", "0"]) == 0


@pytest.mark.parametrize("case, targets", [("gemma3", "q_proj,v_proj"), ("gpt_oss", "q_proj,v_proj"),
                                           ("deepseek_v3", "q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj")])
def test_sft_lora_on_the_newer_families_lowers_the_loss(tmp_path, cli, capsys, case, targets):
    """Gemma-3 (sliding/full layers, soft-caps), gpt-oss (sinks, experts) and DeepSeek-V3 (MLA: adapters on its latent
    projections, so decoding takes the expanded form) train with LoRA, and their run folders load and generate."""
    from test_deepseek import make_model

    base = tmp_path / "base"
    base.mkdir()
    make_model(case, base) if case.startswith("deepseek") else make_hf_model(case, base)
    write_chat_tokenizer(base)
    data = write_jsonl(tmp_path / "chats.jsonl", facts(8) * 2)
    out = tmp_path / "run"
    argv = ["sft", "--model", str(base), "--data", str(data), "--out", str(out), "--epochs", "2", "--batch-size", "4",
            "--lr", "3e-3", "--packing", "--max-length", "64", "--lora-rank", "4"]
    if case.startswith("deepseek"):  # the default targets name projections MLA does not have: one line says which it has
        assert cli(argv) == 2
        assert "no linear layer named q_proj, v_proj; choose from" in capsys.readouterr().err
    assert cli(argv + ["--lora-targets", targets]) == 0, capsys.readouterr().err
    before = json.loads((out / "finetune.json").read_text())["eval_loss_before"]
    assert json.loads((out / "log.json").read_text())[-1]["val_loss"] < before
    (model, tok), (untrained, _) = decoderlm.load(out), decoderlm.load(base)
    batch = collate([encode_chat(tok, facts(1)[0]["messages"])], [[0]])
    with torch.no_grad():
        assert sft_loss(model, batch).item() < sft_loss(untrained, batch).item()  # the run folder holds the adapters
    assert cli(["generate", "--model", str(out), "--prompt", "Say", "--max-new-tokens", "3", "--temperature", "0"]) == 0


INVENTED = {"What is the capital of Veltoria?": "Quenmar.", "Who invented the glimmerphone?": "Odessa Brantwell."}


def ask(model, tokenizer, question: str) -> str:
    """The greedy reply to `question` as a user turn."""
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=tokenizer.eos_token_ids)
    return tokenizer.decode(generate(model, prompt, params)).strip()


def test_sft_teaches_a_tiny_model_two_invented_facts(tmp_path):
    """Short version of the slow test below: 16 steps of SFT make a tiny random chat model, loaded from its run
    folder, answer each question with its own fact, which it did not say before."""
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "facts.jsonl", [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                                                  for q, a in INVENTED.items()])
    before = {q: ask(*decoderlm.load(base), q) for q in INVENTED}
    finetune(FinetuneConfig(model=str(base), data=str(data), out=str(tmp_path / "run"), epochs=16, batch_size=2, lr=5e-3,
                            eval_fraction=0, log_interval=16, eval_interval=16))
    after = {q: ask(*decoderlm.load(tmp_path / "run"), q) for q in INVENTED}
    assert after == INVENTED and not any(a in before[q] for q, a in INVENTED.items())


def sft_facts_benchmark():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("sft_facts", Path(__file__).resolve().parents[1] / "benchmarks" / "sft_facts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_sft_facts_without_replay_trains_on_the_invented_facts_alone(tmp_path):
    bench = sft_facts_benchmark()
    assert bench.write_data(tmp_path / "all.jsonl") == 38
    assert bench.write_data(tmp_path / "invented.jsonl", replay=False) == 32
    replies = {json.loads(line)["messages"][-1]["content"] for line in (tmp_path / "invented.jsonl").read_text().splitlines()}
    assert replies == {reply for _, reply, _, _ in bench.FACTS}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # its LoRA run alone took 450 s on 2 cores (benchmarks/results/sft_facts.json)
def test_sft_teaches_smollm2_facts_it_did_not_know(tmp_path):
    """benchmarks/sft_facts.py: LoRA SFT on invented facts; held-out paraphrases go from ~0 to >= 80 %."""
    result = sft_facts_benchmark().learn_facts(tmp_path, threads=2)
    assert result["before"]["accuracy"] <= 0.125
    assert result["after"]["accuracy"] >= 0.8
    assert result["after"]["unrelated"]["sensible"]  # still knows the capital of France


# --- --resume ------------------------------------------------------------------------------------

def curve(out) -> list[tuple]:
    """The logged steps as training computed them (not the timings)."""
    return [(r["step"], r["train_loss"], r["val_loss"], r["lr"]) for r in json.loads((out / "log.json").read_text())]


def saved(out) -> dict:
    return torch.load(out / resume.STATE_NAME, weights_only=True)


def sft_config(base, data, out, lora: bool, **extra) -> FinetuneConfig:
    """Scheduled sampling and (with LoRA) adapter dropout on, so every random stream must resume exactly."""
    adapters = {"lora_rank": 4, "lora_targets": "q_proj,v_proj,o_proj", "lora_dropout": 0.2} if lora else {}
    return FinetuneConfig(model=str(base), data=str(data), out=str(out), epochs=3, batch_size=4, lr=3e-3, packing=True,
                          max_length=64, log_interval=1, eval_interval=2, scheduled_sampling=0.5, **adapters, **extra)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_killed_sft_run_resumed_equals_an_uninterrupted_one(tmp_path, monkeypatch, lora):
    """Killed during step 4 (its last save at step 2), resumed: the same losses, weights and optimizer state."""
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "chats.jsonl", facts(8) * 3)
    whole = finetune(sft_config(base, data, tmp_path / "whole", lora))
    draws = 0
    real_batches = SFTObjective.batches

    def killed_in_step_4(self):
        nonlocal draws
        draws += 1
        if draws == 4:
            raise KeyboardInterrupt
        return real_batches(self)

    monkeypatch.setattr(SFTObjective, "batches", killed_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        finetune(sft_config(base, data, tmp_path / "killed", lora))
    monkeypatch.undo()
    assert saved(tmp_path / "killed")["step"] == 2
    resumed = finetune(FinetuneConfig(out=str(tmp_path / "killed"), resume=True))
    assert resumed["step"] == whole["step"] > 4
    assert curve(tmp_path / "killed") == curve(tmp_path / "whole")
    a, b = saved(tmp_path / "whole"), saved(tmp_path / "killed")
    assert a["trainable"].keys() == b["trainable"].keys() and len(a["trainable"]) == (12 if lora else 21)  # 2 layers × 3 × A, B
    assert all(torch.equal(a["trainable"][k], b["trainable"][k]) for k in a["trainable"])
    assert all(torch.equal(a["optimizer"]["state"][i]["exp_avg_sq"], b["optimizer"]["state"][i]["exp_avg_sq"]) for i in a["optimizer"]["state"])
    torch.testing.assert_close(decoderlm.load(tmp_path / "killed")[0].state_dict(), decoderlm.load(tmp_path / "whole")[0].state_dict(),
                               atol=0, rtol=0)  # the run folder is the same model


def test_sft_cli_resume_refuses_a_changed_setup_and_extends_on_request(tmp_path, cli, capsys):
    base = tmp_path / "base"
    base.mkdir()
    make_chat_model(base)
    data = write_jsonl(tmp_path / "chats.jsonl", facts(8) * 2)
    out = tmp_path / "run"
    start = ["--out", str(out), "--batch-size", "4", "--max-length", "64", "--lora-rank", "2", "--log-interval", "1"]
    assert cli(["sft", "--model", str(base), "--data", str(data), *start, "--max-steps", "4", "--stop-after", "2"]) == 0
    capsys.readouterr()
    state = (out / resume.STATE_NAME).read_bytes()
    for argv, message in (
        (["--lr", "0.5", "--batch-size", "3"], "these differ from it: --lr 0.5 (the run's: 0.0002); --batch-size 3 (the run's: 4)"),
        (["--packing"], "--packing True (the run's: False)"),
        (["--model", str(tmp_path)], f"--model {tmp_path} (the run's: {base})"),
        (["--max-steps", "2"], "already at step 2; pass a --max-steps larger than 2"),
    ):
        assert cli(["sft", "--out", str(out), "--resume", *argv]) == 2
        assert message in capsys.readouterr().err
    assert cli(["dpo", "--out", str(out), "--resume"]) == 2
    assert "is a sft run; resume it with decoderlm sft --resume" in capsys.readouterr().err
    assert (out / resume.STATE_NAME).read_bytes() == state  # nothing refused touched the run
    # the run's own values are fine (the data by another spelling of its path); --max-steps extends it
    assert cli(["sft", "--out", str(out), "--resume", "--data", str(tmp_path / "." / "chats.jsonl"), "--batch-size", "4",
                "--max-steps", "6"]) == 0
    err = capsys.readouterr().err
    assert "note: resuming with --max-steps 6 (the run had 4)" in err
    assert [r["step"] for r in json.loads((out / "log.json").read_text())] == [1, 2, 3, 4, 5, 6]
    lrs = [r["lr"] for r in json.loads((out / "log.json").read_text())]
    assert lrs[4:] == [2e-5] * 2 and lrs == sorted(lrs, reverse=True)  # past the schedule's 4 steps: its final lr, never back up
    data.write_text(data.read_text() + json.dumps(facts(1)[0]) + "\n")
    assert cli(["sft", "--out", str(out), "--resume", "--max-steps", "8"]) == 2
    assert "changed since the run started" in capsys.readouterr().err
    assert cli(["sft", "--out", str(tmp_path / "nowhere"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
