"""`decoderlm sft` and `decoderlm dpo`: fine-tune a model on chat data or preference pairs (see decoderlm.finetune)."""

from __future__ import annotations

import argparse

from decoderlm.cli.common import MODEL_HELP, add_device_flags, add_model_source, add_seed_flag
from decoderlm.finetune.run import FinetuneConfig, finetune
from decoderlm.train.config import TRAIN_SEED

SFT_DATA = ('JSONL, one conversation a line: {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]} '
            'or {"prompt": ..., "completion": ...}; the loss is on the assistant\'s replies only')
DPO_DATA = 'JSONL, one preference a line: {"prompt": ..., "chosen": ..., "rejected": ...}'


def register(sub: argparse._SubParsersAction) -> None:
    for method, help, data in (("sft", "supervised fine-tuning on conversations (full or LoRA)", SFT_DATA),
                               ("dpo", "preference tuning (DPO) against a frozen reference", DPO_DATA)):
        p = sub.add_parser(method, help=help, description=help)
        add_model_source(p, help=f"model to start from: {MODEL_HELP} (not needed with --resume)")
        p.add_argument("--data", help=data + " (not needed with --resume)")
        p.add_argument("--out", required=True, help="run folder (new or empty); chat/generate/serve/convert load it as a model")
        p.add_argument("--resume", action="store_true", help="continue the stopped run in --out exactly where it was saved; "
                       "its setup cannot change, --max-steps may extend it, intervals, --device, --threads may change")
        p.add_argument("--epochs", type=int, help="passes over the train split (default: 1)")
        p.add_argument("--max-steps", type=int, help="optimizer steps (default: epochs × batches per epoch); with --resume a larger value extends the run")
        p.add_argument("--stop-after", type=int, help="stop after this step with the run saved, to --resume later; the schedule is unchanged (default: at --max-steps)")
        p.add_argument("--lr", type=float, help="peak learning rate (default: 2e-5 full, 2e-4 LoRA; a tenth for DPO)")
        p.add_argument("--batch-size", type=int, help="rows per step (default: 8)")
        p.add_argument("--max-length", type=int, help="tokens per conversation (longer ones are cut) and per packed row (default: 512)")
        p.add_argument("--warmup", type=int, help="steps of linear warmup (default: a tenth of the steps, at most 100)")
        p.add_argument("--eval-fraction", type=float, help="share of records held out for eval (default: 0.1)")
        p.add_argument("--eval-interval", type=int, help="evaluate and save every this many steps (default: each epoch)")
        p.add_argument("--log-interval", type=int, help="log the train loss every this many steps (default: 10)")
        p.add_argument("--lora-rank", type=int, help="train rank-r LoRA adapters instead of all weights (default: 0, full fine-tuning)")
        p.add_argument("--lora-alpha", type=float, help="LoRA scale alpha (the update is alpha/r · B A; default: 2 × rank)")
        p.add_argument("--lora-targets", help="linear layers to adapt, comma-separated (default: q_proj,v_proj)")
        p.add_argument("--lora-dropout", type=float, help="dropout on the adapters' input (default: 0)")
        if method == "sft":
            p.add_argument("--packing", action="store_true", help="pack several conversations per row (attention stays within each)")
            p.add_argument("--scheduled-sampling", type=float, metavar="P",
                           help="replace reply tokens by the model's own predictions, with a probability ramping from 0 to P (default: 0, off)")
        else:
            p.add_argument("--beta", type=float, help="DPO's beta: how far the policy may move from the reference (default: 0.1)")
        p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines with a warning instead of stopping")
        add_seed_flag(p, help=f"seed for the split, the order of batches and the adapters' init (default: {TRAIN_SEED}, as train)")
        add_device_flags(p)
        p.set_defaults(func=cmd_finetune, method=method)


def cmd_finetune(args: argparse.Namespace) -> int:
    fields = {f for f in FinetuneConfig.__dataclass_fields__}
    result = finetune(FinetuneConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    if result["step"] < result["settings"]["max_steps"]:
        print(f"stopped after step {result['step']}; continue with: decoderlm {args.method} --out {result['out']} --resume")
        return 0
    evaluated = result["val_loss"] == result["val_loss"]  # NaN without an eval split
    change = f"eval loss {result['eval_loss_before']:.4f} -> {result['val_loss']:.4f} after" if evaluated else "trained"
    print(f"{change} {result['step']} steps; the model is in {result['out']} "
          f"(load it like any model: decoderlm chat --model {result['out']})")
    return 0
