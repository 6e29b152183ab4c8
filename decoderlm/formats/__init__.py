"""Checkpoint formats: HF safetensors folders (`hf`) and GGUF files (`gguf`).

A family is a `ModelConfig` built from the checkpoint's hyper-parameters plus a weight-name table
mapping the checkpoint's tensor names (with an optional transform) to ours.
"""
