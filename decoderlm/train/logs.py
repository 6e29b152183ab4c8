"""What a run reports: its speed, the progress bar, and the files beside the checkpoint (log.csv and
log.json, one row per logged step; run.json; loss.png).

Speed is one quantity everywhere, `Throughput`: tokens trained / seconds spent inside training steps
(evaluation, checkpoints and logs left out). A log row gives it over the steps since the previous row;
the progress bar and the summary `fit` returns give it over the whole invocation.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from decoderlm.errors import DecoderLMError
from decoderlm.train.state import TrainState

LOG_FIELDS = ["step", "train_loss", "val_loss", "lr", "tokens_seen", "tokens_per_s", "mfu"]


class Throughput:
    """Tokens per second of training steps, over this invocation (`rate`) and over a window (`take_window`)."""

    def __init__(self) -> None:
        self.tokens, self.seconds = 0, 0.0
        self.window_tokens, self.window_seconds = 0, 0.0
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self, tokens: int) -> None:
        """The step begun at `start` is done and trained on `tokens` tokens."""
        seconds = time.perf_counter() - self._started
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.window_tokens, self.window_seconds = self.window_tokens + tokens, self.window_seconds + seconds

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def take_window(self) -> float:
        """Tokens per second since the last call; starts the next window."""
        rate = self.window_tokens / self.window_seconds if self.window_seconds else 0.0
        self.window_tokens, self.window_seconds = 0, 0.0
        return rate


class ProgressBar:
    """tqdm's bar over the steps, on rank 0: the last logged train and val loss, and `speed.rate` as tok_s."""

    def __init__(self, total: int, initial: int, show: bool, speed: Throughput) -> None:
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, disable=not show)
        self.speed, self.loss, self.val = speed, "-", "-"

    def step(self) -> None:
        self.bar.update(1)
        self._postfix()

    def show(self, row: dict[str, Any]) -> None:
        self.loss = f"{row['train_loss']:.3f}"
        self.val = "-" if row["val_loss"] is None else f"{row['val_loss']:.3f}"
        self._postfix()

    def _postfix(self) -> None:
        # No forced redraw: the bar shows the figures at its own pace (10 times a second), not at every step.
        self.bar.set_postfix(loss=self.loss, val=self.val, tok_s=f"{self.speed.rate or 0:,.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()


def save_logs(out: Path, history: list[dict[str, Any]], run_info: dict[str, Any]) -> None:
    try:
        write_logs(out, history, run_info)
    except OSError as e:
        raise DecoderLMError(f"cannot write the logs in {out} ({e.strerror or e}); the checkpoint is saved: "
                             "free space, then --resume") from None


def write_logs(out: Path, history: list[dict[str, Any]], run_info: dict[str, Any]) -> None:
    """log.csv and log.json (every logged step), run.json (parameters, FLOPs per token, processes, global
    batch: what a fair comparison of two runs states besides the loss) and loss.png."""
    fields = LOG_FIELDS + list(dict.fromkeys(k for row in history for k in row if k not in LOG_FIELDS))  # an objective's metrics
    with open(out / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(history)
    (out / "log.json").write_text(json.dumps(history, indent=1))
    (out / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")
    plot_loss(history, out / "loss.png", run_info)


def plot_loss(history: list[dict[str, Any]], path: Path, run_info: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot([r["step"] for r in history], [r["train_loss"] for r in history], label="train", lw=1)
    val = [r for r in history if r["val_loss"] is not None]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)",
           title=f"training loss ({run_info['parameters']:,} parameters, {history[-1]['tokens_seen'] if history else 0:,} tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def log_row(state: TrainState, lr: float, tokens_per_s: float, run_info: dict[str, Any]) -> dict[str, Any]:
    """The row for the step just done (val_loss filled in by an evaluation); MFU where the peak FLOP/s are known."""
    peak = run_info["peak_flops_per_device"]
    mfu = None if peak is None else run_info["flops_per_token"] * tokens_per_s / (peak * run_info["processes"])
    return {"step": state.step, "train_loss": state.take_window(), "val_loss": None, "lr": lr, "tokens_seen": state.tokens_seen,
            "tokens_per_s": tokens_per_s, "mfu": mfu}
