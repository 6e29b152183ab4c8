"""Direct preference optimization (Rafailov et al., 2023): raise the likelihood of the chosen reply over
the rejected one, measured against a frozen reference so the policy cannot drift far for free.

    loss = -log σ(β · [(log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))])

log π(y) is the summed log-probability of the reply's tokens given the prompt. β · (log π - log π_ref)
is each reply's implicit reward; their difference (the margin) is what training pushes up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decoderlm.finetune.sft import Batch, Example, batch_logits, collate, encode_chat
from decoderlm.model.transformer import IGNORE_INDEX, Transformer


@dataclass
class Pair:
    chosen: Example
    rejected: Example
    prompt: str  # what the held-out split keeps apart: no held-out pair shares its prompt with a trained one


def encode_pair(tokenizer, record: dict, max_length: int | None = None) -> Pair:
    """Prompt as a user turn, each reply as the assistant's: labels mark the reply tokens to score."""
    user = {"role": "user", "content": record["prompt"]}
    chosen, rejected = (encode_chat(tokenizer, [user, {"role": "assistant", "content": record[k]}], max_length)
                        for k in ("chosen", "rejected"))
    return Pair(chosen, rejected, record["prompt"])


def pair_batch(pairs: list[Pair], pad_id: int = 0) -> Batch:
    """Rows 0..B-1 the chosen replies, rows B..2B-1 the rejected ones, right-padded."""
    examples = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    return collate(examples, [[i] for i in range(len(examples))], pad_id)


def sequence_logprobs(model: Transformer, batch: Batch) -> torch.Tensor:
    """Summed log-probability of each row's labelled tokens (B,)."""
    logits = batch_logits(model, batch).float()  # (B, T, V)
    mask = batch.targets != IGNORE_INDEX
    token_logp = torch.log_softmax(logits, -1).gather(-1, batch.targets.clamp(min=0)[..., None])[..., 0]  # (B, T)
    return (token_logp * mask).sum(-1)


@dataclass
class DPOStats:
    loss: torch.Tensor  # scalar, with grad
    chosen_reward: float
    rejected_reward: float
    margin: float
    accuracy: float  # fraction of pairs whose chosen reward is the higher


def dpo_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, beta: float) -> DPOStats:
    """policy_logps, reference_logps: (2B,) sequence log-probs, chosen rows first (as `pair_batch`)."""
    B = policy_logps.shape[0] // 2
    rewards = beta * (policy_logps - reference_logps.detach())  # (2B,)
    chosen, rejected = rewards[:B], rewards[B:]
    loss = -F.logsigmoid(chosen - rejected).mean()
    margin = chosen - rejected
    return DPOStats(loss, chosen.mean().item(), rejected.mean().item(), margin.mean().item(), (margin > 0).float().mean().item())
