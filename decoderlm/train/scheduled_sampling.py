"""Scheduled sampling (Bengio et al., 2015): during training, some input tokens are replaced by the
model's own predictions, so it learns to continue from its own mistakes (the inputs it meets when it
generates) and not only from the reference text. Targets are unchanged.

The replacement probability ramps linearly from 0 at the first step to P at the schedule's horizon
(decay_steps) and stays there. A token is replaceable when the slot before it predicts it (its label is
that slot's target): in a pretraining window every token but the first, in SFT the tokens of the
assistant's replies. The predictions are the argmax of a first, gradient-free pass over the true inputs.
With P = 0 nothing is drawn and no extra pass runs, so training is exactly plain teacher forcing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decoderlm.model.transformer import IGNORE_INDEX


class ScheduledSampling:
    """Owned by an objective: `start_step` once per optimizer step, `mix` on each training micro-batch.
    Its state (steps so far and the draw generator) is checkpointed so a resumed run draws alike."""

    def __init__(self, p: float, horizon: int, seed: int) -> None:
        self.p, self.horizon = p, horizon
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.now = 0.0  # this step's probability

    def probability(self, step: int) -> float:
        return self.p * min(1.0, step / self.horizon)

    def start_step(self) -> None:
        self.now = self.probability(self.steps)
        self.steps += 1

    def mix(self, inputs: torch.Tensor, targets: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """inputs, targets (B, T); logits_of(inputs) -> (B, T, V). The inputs with replaceable tokens
        swapped, each with this step's probability, for the model's prediction of them."""
        if self.now == 0.0:
            return inputs
        return replace_tokens(inputs, targets, logits_of, self.now, self.generator)

    def state(self) -> dict[str, torch.Tensor]:
        return {"scheduled_sampling": self.generator.get_state(), "scheduled_sampling_steps": torch.tensor(self.steps)}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        if "scheduled_sampling" in state:  # runs saved before scheduled sampling existed never used it
            self.generator.set_state(state["scheduled_sampling"])
            self.steps = int(state["scheduled_sampling_steps"])


@torch.no_grad()
def replace_tokens(inputs: torch.Tensor, targets: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor], p: float,
                   generator: torch.Generator) -> torch.Tensor:
    """Token t (t >= 1) becomes argmax logits[t-1] with probability p where targets[t-1] is a label."""
    predicted = logits_of(inputs)[:, :-1].argmax(-1)  # (B, T-1): the model's guess for tokens 1..T-1
    draw = torch.rand(predicted.shape, generator=generator).to(inputs.device) < p  # (B, T-1)
    replace = draw & (targets[:, :-1] != IGNORE_INDEX)
    mixed = inputs.clone()
    mixed[:, 1:] = torch.where(replace, predicted, inputs[:, 1:])
    return mixed
