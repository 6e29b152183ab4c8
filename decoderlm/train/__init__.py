"""Training from a text file: data preparation, schedule, loop, checkpoints."""

from decoderlm.train.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
