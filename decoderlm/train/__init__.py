"""Training: prepared token shards or a text file, settings, the loop (one process or torchrun), checkpoints.
Fine-tuning plugs its own `Objective` (what a batch is, how its loss is computed) into `fit`."""

from decoderlm.train.config import TrainConfig
from decoderlm.train.objective import LMObjective, Objective
from decoderlm.train.trainer import fit, train

__all__ = ["LMObjective", "Objective", "TrainConfig", "fit", "train"]
