"""Supervised fine-tuning data: a conversation laid out by the model's own chat template, labels only
on the assistant's replies, and several conversations packed into one row without seeing each other.

A reply's span is found by rendering the conversation up to it twice: with the generation prompt
(everything before the reply, role header included) and with the reply itself. The difference is the
reply, and the span ends with its end-of-turn token; the template's separator after it (a newline) is
not the model's to predict. This needs no {% generation %} tags, so every template works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoderlm.errors import DecoderLMError
from decoderlm.model.transformer import IGNORE_INDEX, Transformer, lm_loss
from decoderlm.tokenizer import Tokenizer
from decoderlm.tokenizer.chat import Message


@dataclass
class Example:
    ids: list[int]
    labels: list[int]  # ids inside assistant replies, IGNORE_INDEX elsewhere (not shifted)


def check_chat_tokenizer(tokenizer: Tokenizer) -> None:
    if tokenizer.chat_template is None:
        raise DecoderLMError("this model's tokenizer has no chat template, so conversations cannot be laid out; "
                             "fine-tune an instruct model, or add chat_template to its tokenizer_config.json")


def assistant_spans(tokenizer, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans (start, end) of each assistant reply."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    end_markers = [m for m in (tokenizer.tokenizer.id_to_token(i) for i in tokenizer.eos_token_ids) if m]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise DecoderLMError("this chat template renders earlier turns differently once later ones follow, so reply spans "
                                 "cannot be found; fine-tune with single-turn {\"prompt\", \"completion\"} records")
        reply = through[len(before):]
        spans.append((len(before), len(before) + reply_end(reply, m["content"], end_markers)))
    return text, spans


def reply_end(reply: str, content: str, end_markers: list[str]) -> int:
    """Where a rendered reply ends: after the first end-of-turn token following its content, else at its end."""
    at = reply.find(content)
    after = at + len(content) if at >= 0 else 0
    ends = [reply.find(marker, after) + len(marker) for marker in end_markers if marker in reply[after:]]
    return min(ends) if ends else len(reply)


def encode_chat(tokenizer, messages: list[Message], max_length: int | None = None) -> Example:
    """Token ids of the rendered conversation and labels: a token is the model's to learn if it overlaps a reply."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer.tokenizer.encode(text, add_special_tokens=False)  # the template writes its own BOS
    labels = [tok if any(s < end and start < e for s, e in spans) else IGNORE_INDEX
              for tok, (start, end) in zip(enc.ids, enc.offsets)]
    ids = list(enc.ids)
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return Example(ids, labels)


# --- rows and batches --------------------------------------------------------------------------

def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Example indices per row, first-fit over lengths in decreasing order: few rows, little padding."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([i])
            room.append(max_length - lengths[i])
        else:
            rows[slot].append(i)
            room[slot] -= lengths[i]
    return rows


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T): the next token's label within the same conversation, or IGNORE_INDEX
    segments: torch.Tensor  # (B, T): which conversation of the row each slot holds; -1 for padding
    positions: torch.Tensor  # (B, T): restart at 0 in each conversation

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device) for t in (self.input_ids, self.targets, self.segments, self.positions)))


def collate(examples: list[Example], rows: list[list[int]], pad_id: int = 0) -> Batch:
    """One row per entry of `rows` (indices into examples), right-padded to the longest row."""
    T = max(sum(len(examples[i].ids) for i in row) for row in rows)
    shape = (len(rows), T)
    ids, targets = torch.full(shape, pad_id), torch.full(shape, IGNORE_INDEX)
    segments, positions = torch.full(shape, -1), torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for s, i in enumerate(row):
            ex, n = examples[i], len(examples[i].ids)
            ids[r, at : at + n] = torch.tensor(ex.ids)
            targets[r, at : at + n - 1] = torch.tensor(ex.labels[1:])  # the last token predicts nothing here
            segments[r, at : at + n] = s
            positions[r, at : at + n] = torch.arange(n)
            at += n
    return Batch(ids, targets, segments, positions)


class Segments:
    """The model's `Cache` contract used for layout, not storage: positions restart in each packed
    conversation and attention stays inside it (a block-diagonal causal mask); padding is seen by no one.
    Nothing is cached, so the model's forward runs unchanged."""

    def __init__(self, segments: torch.Tensor, positions: torch.Tensor) -> None:
        self.segments, self.pos = segments, positions  # (B, T) each

    def positions(self, T: int, attention_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        return self.pos

    def mask(self, T: int, attention_mask: torch.Tensor | None, window: int | None, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        seg_q, seg_k = self.segments[:, :, None], self.segments[:, None, :]  # (B, T, 1), (B, 1, T)
        q, k = self.pos[:, :, None], self.pos[:, None, :]
        allowed = (seg_q == seg_k) & (seg_k >= 0) & (k <= q)  # same conversation: positions order the slots
        if window is not None:
            allowed = allowed & (q - k < window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)  # (B, 1, T, T)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def advance(self, n: int) -> None:
        pass


def batch_logits(model: Transformer, batch: Batch) -> torch.Tensor:
    """Logits (B, T, V) of a batch of padded or packed rows."""
    return model(batch.input_ids, cache=Segments(batch.segments, batch.positions)).logits


def sft_loss(model: Transformer, batch: Batch) -> torch.Tensor:
    """Mean next-token loss over the tokens of assistant replies."""
    return lm_loss(batch_logits(model, batch), batch.targets)
