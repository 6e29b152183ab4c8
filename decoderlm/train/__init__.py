"""Training from a text file: settings, data preparation, schedule, loop, checkpoints."""

from decoderlm.train.config import TrainConfig
from decoderlm.train.trainer import train

__all__ = ["TrainConfig", "train"]
