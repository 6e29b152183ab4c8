"""What a run has done so far, beside its weights and optimizer: `TrainState` (step, tokens seen, best val
loss, the log and the loss window being averaged) and the RNG streams training draws from. Both go into
every checkpoint, so a resumed run continues exactly where the saved one stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from decoderlm.train import distributed
from decoderlm.train.distributed import World
from decoderlm.train.objective import Objective


@dataclass
class TrainState:
    """The loop's counters. `state_dict()` holds them under the checkpoint's own keys."""

    step: int = 0
    tokens_seen: int = 0  # targets trained on, over all processes
    best_val: float = float("inf")
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per logged step
    window_loss: float = 0.0  # summed train loss of the steps since the last logged row
    window_steps: int = 0

    def record(self, loss: float, tokens: int) -> None:
        """One optimizer step done: `loss` its mean train loss, `tokens` the targets it trained on."""
        self.step += 1
        self.tokens_seen += tokens
        self.window_loss += loss
        self.window_steps += 1

    def take_window(self) -> float:
        """The mean train loss since the last logged row; starts the next window."""
        mean = self.window_loss / self.window_steps
        self.window_loss, self.window_steps = 0.0, 0
        return mean

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "best_val": self.best_val, "history": self.history,
                "window": (self.window_loss, self.window_steps)}

    def describe(self, max_steps: int) -> str:
        """What a user asks of a run first: how far it got, how good it is, how much it has read."""
        best = "none yet" if self.best_val == float("inf") else f"{self.best_val:.4f}"
        return f"step {self.step:,} of {max_steps:,}, best val loss {best}, {self.tokens_seen:,} tokens seen"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From a checkpoint; one written before tokens_seen and best_val were kept starts them afresh."""
        self.step, self.history = state["step"], state["history"]
        self.window_loss, self.window_steps = state["window"]
        self.tokens_seen, self.best_val = state.get("tokens_seen", 0), state.get("best_val", float("inf"))


def rng_states(objective: Objective, device: torch.device, world: World) -> dict[str, Any]:
    """Every random stream training draws from: the objective's (batches), and dropout's on the CPU or
    the GPU; under torchrun each process's dropout stream too. (Nothing uses python's or numpy's RNG.)"""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), **objective.rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if device.type == "mps":
        states["mps"] = torch.mps.get_rng_state()
    if world.distributed:
        states["ranks"] = distributed.all_gather({k: v for k, v in states.items() if k in ("torch", "cuda")}, world)
    return states


def set_rng_states(states: dict[str, Any], objective: Objective, device: torch.device, world: World) -> None:
    """Restore `rng_states`; a GPU stream saved on another device type is left as seeded."""
    objective.set_rng_state(states)
    own = states["ranks"][world.rank] if "ranks" in states else states
    torch.set_rng_state(own["torch"])
    if device.type == "cuda" and "cuda" in own:
        torch.cuda.set_rng_state(own["cuda"], device)
    if device.type == "mps" and "mps" in states:
        torch.mps.set_rng_state(states["mps"])
