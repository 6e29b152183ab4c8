"""Learning-rate schedule: linear warmup, then cosine decay to min_lr at step `total`, then min_lr.

Holding min_lr after `total` is what makes extending a finished run (`--resume --max-steps` larger)
continuous: the horizon stays the run's own, so the learning rate never jumps back up.
"""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
