"""Explain a model's architecture: what it costs (arch, accounting, report), whether it behaves (checks), how it works (explain)."""
