"""Character-level tokenizer: one id per distinct character of the training corpus."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from decoderlm.errors import DecoderLMError
from decoderlm.tokenizer.chat import Message

if TYPE_CHECKING:
    from decoderlm.tokenizer.bpe import HFTokenizer


class CharTokenizer:
    """No special tokens (so no BOS and no end-of-turn ids) and no chat template."""

    bos_token_id = None
    chat_template = None

    def __init__(self, chars: list[str]) -> None:
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        self.eos_token_ids: list[int] = []

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        if not text:
            raise DecoderLMError("the corpus is empty; give a text file with some content")
        return cls(sorted(set(text)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One id per character (add_special_tokens: there are none to add)."""
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise DecoderLMError(f"character {e.args[0]!r} never appeared in the training corpus; remove it from the prompt") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        raise DecoderLMError("a character-level model has no chat template; use `decoderlm generate --prompt` for plain text")

    def get_vocab(self) -> dict[str, int]:
        return dict(self.stoi)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CharTokenizer":
        return cls(data["chars"])

    def to_hf_tokenizer(self) -> "HFTokenizer":
        """The same ids as a `tokenizers` tokenizer (a word-level vocabulary of single characters, every
        character its own word), so a char model can be saved as an HF folder that transformers loads."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        from decoderlm.tokenizer.bpe import HFTokenizer

        tokenizer = Tokenizer(models.WordLevel(self.stoi, unk_token="[UNK]"))  # no [UNK] in the vocabulary: unknown characters fail
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()  # join characters without the spaces word-level decoding adds
        return HFTokenizer(tokenizer)
