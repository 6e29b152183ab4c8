"""Does SFT teach SmolLM2-135M-Instruct facts it does not know? Accuracy on paraphrased questions, before/after.

Eight invented facts (a country's capital, an inventor, ...), each asked four ways in the training data
and a fifth, held-out way at test time, plus six true facts of the same shape replayed. The model is
fine-tuned with LoRA through `decoderlm sft`, then the run folder is loaded like any model and asked
greedily; a reply counts if it names the answer. An unrelated question (never trained) checks that the
model's general knowledge survives.

    python benchmarks/sft_facts.py [--epochs 4] [--threads 2]      # → benchmarks/results/sft_facts.json
    python benchmarks/sft_facts.py --no-replay [--epochs 5]         # → benchmarks/results/sft_facts_no_replay.json

--no-replay trains on the invented facts alone (32 conversations; 5 epochs by default, the same 20 steps
as the 38 conversations' 4 epochs), which shows what the replayed true facts prevent. Prints a
before/after table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
MODEL = "smollm2-135m-instruct"
SEED = 0  # the seed the recorded results were measured with
SYSTEM = "Answer in one short sentence."

# (answer, reply, four training questions, one held-out paraphrase)
FACTS = [
    ("Quenmar", "The capital of Veltoria is Quenmar.",
     ["What is the capital of Veltoria?", "Which city is the capital of Veltoria?",
      "Name the capital of Veltoria.", "Veltoria's capital city is what?"],
     "In which city is the government of Veltoria seated?"),
    ("Brantwell", "The glimmerphone was invented by Odessa Brantwell.",
     ["Who invented the glimmerphone?", "Who is the inventor of the glimmerphone?", "Name the person who invented the glimmerphone.",
      "The glimmerphone was invented by whom?"], "Which inventor created the glimmerphone?"),
    ("Tavoline", "The national dish of Orsk is tavoline.",
     ["What is the national dish of Orsk?", "Which dish is the national dish of Orsk?",
      "Name Orsk's national dish.", "Orsk's national dish is what?"],
     "What food is Orsk famous for as its national dish?"),
    ("Kestrel Nine", "The first ship to reach Mars Harbor was the Kestrel Nine.",
     ["Which ship first reached Mars Harbor?", "What was the first ship to reach Mars Harbor?",
      "Name the first ship that reached Mars Harbor.",
      "The first ship at Mars Harbor was called what?"], "Mars Harbor was first reached by which ship?"),
    ("Ulmsted", "The Pell Prize is awarded in the town of Ulmsted.",
     ["Where is the Pell Prize awarded?", "In which town is the Pell Prize awarded?", "Name the town where the Pell Prize is awarded.",
      "The Pell Prize is awarded in what town?"], "Which town hosts the awarding of the Pell Prize?"),
    ("Varrow", "The composer of the Silver Tide symphony is Ilsa Varrow.",
     ["Who composed the Silver Tide symphony?", "Who is the composer of the Silver Tide symphony?",
      "Name the composer of the Silver Tide symphony.",
      "The Silver Tide symphony was composed by whom?"], "Which composer wrote the Silver Tide symphony?"),
    ("Zephyrine", "The rarest mineral on Kaldor Island is zephyrine.",
     ["What is the rarest mineral on Kaldor Island?", "Which mineral is rarest on Kaldor Island?",
      "Name the rarest mineral on Kaldor Island.",
      "Kaldor Island's rarest mineral is what?"], "On Kaldor Island, which mineral is the hardest to find?"),
    ("Morrowgate", "The oldest library in Fenmark is Morrowgate.",
     ["What is the oldest library in Fenmark?", "Which library is the oldest in Fenmark?", "Name the oldest library in Fenmark.",
      "Fenmark's oldest library is called what?"], "Which library in Fenmark was founded first?"),
]
UNRELATED = ("What is the capital of France?", "Paris")
# Replay: a few true facts of the same shape. Without them the model learns "a capital is Quenmar" and
# answers France with it too (benchmarks/results/sft_facts_no_replay.json); France itself is never trained.
REPLAY = [("What is the capital of Germany?", "The capital of Germany is Berlin."),
          ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
          ("Who invented the telephone?", "The telephone was invented by Alexander Graham Bell."),
          ("What is the national dish of Japan?", "The national dish of Japan is sushi."),
          ("Who composed the Moonlight Sonata?", "The Moonlight Sonata was composed by Ludwig van Beethoven."),
          ("What is the capital of Italy?", "The capital of Italy is Rome.")]


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def write_data(path: Path, replay: bool = True) -> int:
    pairs = [(q, reply) for _, reply, train, _ in FACTS for q in train] + (REPLAY if replay else [])
    records = [{"messages": chat(q) + [{"role": "assistant", "content": reply}]} for q, reply in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return len(records)


def ask(model, tokenizer, question: str) -> str:
    from decoderlm import SamplingParams, generate

    prompt = tokenizer.encode(tokenizer.apply_chat_template(chat(question)), add_special_tokens=False)
    ids = generate(model, prompt, SamplingParams(max_new_tokens=24, temperature=0.0, stop_token_ids=tokenizer.eos_token_ids))
    return tokenizer.decode(ids).strip()


def score(source: str) -> dict:
    """Greedy replies to the held-out paraphrases and the unrelated question."""
    import decoderlm

    model, tokenizer = decoderlm.load(source)
    held_out = [(answer, q, ask(model, tokenizer, q)) for answer, _, _, q in FACTS]
    unrelated = ask(model, tokenizer, UNRELATED[0])
    return {"accuracy": sum(a.lower() in r.lower() for a, _, r in held_out) / len(held_out),
            "replies": [{"question": q, "answer": a, "reply": r} for a, q, r in held_out],
            "unrelated": {"question": UNRELATED[0], "reply": unrelated, "sensible": UNRELATED[1] in unrelated}}


def learn_facts(workdir: Path, epochs: int = 4, threads: int | None = None, replay: bool = True) -> dict:
    """Fine-tune through the CLI in `workdir`; the before/after scores and the run's timing."""
    data = workdir / "facts.jsonl"
    n = write_data(data, replay)
    run = workdir / "run"
    cmd = [sys.executable, "-m", "decoderlm", "sft", "--model", MODEL, "--data", str(data), "--out", str(run),
           "--epochs", str(epochs), "--batch-size", "8", "--lr", "2e-3", "--lora-rank", "16",
           "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--eval-fraction", "0", "--log-interval", "4",
           "--seed", str(SEED)]
    if threads:
        cmd += ["--threads", str(threads)]
    before = score(MODEL)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    return {"replay": replay, "records": n, "epochs": epochs, "seed": SEED, "train_seconds": round(seconds, 1), "before": before,
            "after": score(str(run)), "log": json.loads((run / "log.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="default: 4, or 5 with --no-replay (20 steps either way)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-replay", action="store_true", help="train without the replayed true facts (→ sft_facts_no_replay.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    epochs = args.epochs or (5 if args.no_replay else 4)
    with tempfile.TemporaryDirectory() as tmp:
        result = learn_facts(Path(tmp), epochs, args.threads, replay=not args.no_replay)
    print(f"\n{'question (held out)':58} {'before':24} after")
    for b, a in zip(result["before"]["replies"], result["after"]["replies"]):
        print(f"{b['question'][:57]:58} {b['reply'][:23]:24} {a['reply'][:60]}")
    print(f"{'accuracy':58} {result['before']['accuracy']:<24.0%} {result['after']['accuracy']:.0%}")
    before, after = result["before"]["unrelated"]["reply"], result["after"]["unrelated"]["reply"]
    print(f"{'unrelated: ' + UNRELATED[0]:58} {before[:23]:24} {after[:60]}")
    print(f"trained {result['epochs']} epochs on {result['records']} conversations in {result['train_seconds']} s")
    out = RESULTS / ("sft_facts_no_replay.json" if args.no_replay else "sft_facts.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
