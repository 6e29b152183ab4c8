"""Fine-tuning on the training loop: supervised (chat data, loss on assistant replies), LoRA adapters, DPO.

What changes from pretraining is only what a batch is and how its loss is computed: the `Objective`s in
`objectives` (SFTObjective, DPOObjective); the loop is pretraining's, `decoderlm.train.trainer.fit`.
"""

from decoderlm.finetune.run import FinetuneConfig, finetune
from decoderlm.model.lora import apply_lora, merge_lora

__all__ = ["FinetuneConfig", "apply_lora", "finetune", "merge_lora"]
