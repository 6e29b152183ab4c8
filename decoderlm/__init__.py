"""decoderlm: decoder-only Transformer language models, from one config, in plain PyTorch."""

from decoderlm.config import PRESETS, ModelConfig
from decoderlm.errors import DecoderLMError
from decoderlm.generate import generate, stream
from decoderlm.kv_cache import KVCache
from decoderlm.loader import load
from decoderlm.model import Transformer
from decoderlm.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["PRESETS", "DecoderLMError", "KVCache", "ModelConfig", "SamplingParams", "Transformer", "generate", "load", "stream"]
