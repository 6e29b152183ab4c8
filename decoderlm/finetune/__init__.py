"""Fine-tuning on the training loop: supervised (chat data, loss on assistant replies), LoRA adapters
(the layers: `decoderlm.model.lora`), DPO.

What changes from pretraining is only what a batch is and how its loss is computed: the `Objective`s in
`objectives` (SFTObjective, DPOObjective); the loop is pretraining's, `decoderlm.train.trainer.fit`.
"""

from decoderlm.finetune.run import FinetuneConfig, finetune

__all__ = ["FinetuneConfig", "finetune"]
