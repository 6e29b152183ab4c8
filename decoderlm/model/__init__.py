"""The decoder-only Transformer, one module per mechanism."""

from decoderlm.model.transformer import ModelOutput, Transformer

__all__ = ["ModelOutput", "Transformer"]
