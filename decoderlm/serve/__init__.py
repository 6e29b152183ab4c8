"""Serving: a continuous-batching engine over a paged KV cache (the HTTP API is a thin layer on it)."""

from decoderlm.serve.engine import Engine, RequestStream, TokenOutput

__all__ = ["Engine", "RequestStream", "TokenOutput"]
