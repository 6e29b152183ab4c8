"""Tokenizers of pretrained checkpoints: a `tokenizers.Tokenizer` (BPE, Unigram, ...) plus what the
checkpoint says around it — special tokens, whether to add BOS, which ids end a turn, the chat template.

The same wrapper serves HF folders (tokenizer.json + tokenizer_config.json) and GGUF files (whose
reader builds the `tokenizers.Tokenizer` from metadata), so the rest of decoderlm sees one interface.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

from decoderlm.errors import DecoderLMError
from decoderlm.jsonio import read_json
from decoderlm.tokenizer.chat import Message, render_chat
from decoderlm.tools.prompt import template_messages

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class HFTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        eos_token_ids: list[int] | None = None,
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> None:
        """add_bos_token/add_eos_token: None keeps the tokenizer's post-processor; a bool replaces it
        (a GGUF states these flags in its metadata)."""
        self.tokenizer = tokenizer
        self.special_tokens = {name: (special_tokens or {}).get(name) for name in SPECIAL_NAMES}
        self.chat_template = chat_template
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        eos = self.token_id(self.special_tokens["eos_token"])
        ids = ([eos] if eos is not None else []) + list(eos_token_ids or [])
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))  # EOS first, then end-of-turn ids

    def _set_post_processor(self, bos: bool, eos: bool) -> None:
        bos_token, eos_token = self.special_tokens["bos_token"], self.special_tokens["eos_token"]
        bos = bos and self.token_id(bos_token) is not None
        eos = eos and self.token_id(eos_token) is not None
        single = ([f"{bos_token}:0"] if bos else []) + ["$A:0"] + ([f"{eos_token}:0"] if eos else [])
        used = dict([(bos_token, self.token_id(bos_token))] * bos + [(eos_token, self.token_id(eos_token))] * eos)
        self.tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(single + ["$B:1"]), special_tokens=list(used.items()))

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "HFTokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise DecoderLMError(f"{path} has no tokenizer.json; save the tokenizer there (in transformers: AutoTokenizer.from_pretrained(...).save_pretrained('{path}'))")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise DecoderLMError(f"cannot read {file}: {e}; re-save it with a current tokenizers/transformers") from None
        config = read_json(path / "tokenizer_config.json", "tokenizer_config.json", "fix or delete it", missing_ok=True)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        specials = {name: _content(config.get(name)) for name in SPECIAL_NAMES}
        # BOS/EOS come from tokenizer.json's post-processor: transformers ignores add_bos_token here too.
        return cls(tokenizer, special_tokens=specials, eos_token_ids=generation_eos_ids(path), chat_template=template)

    def save(self, out_dir: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json, loadable by `from_hf_folder` and by transformers."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(out / "tokenizer.json"))
        # Whether BOS/EOS are added lives in tokenizer.json's post-processor.
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in self.special_tokens.items() if v is not None}}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    # --- text <-> ids -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id(self.special_tokens["bos_token"])

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids as transformers' tokenizer(text) gives them: BOS (and EOS) added when the checkpoint says so.
        Pass add_special_tokens=False for a rendered chat template, which writes its own BOS."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text; `tools` and tool turns as transformers passes them (a template without a
        tool section gets them through `decoderlm.tools.prompt`'s generic system turn)."""
        if self.chat_template is None:
            raise DecoderLMError("this tokenizer has no chat template; use `decoderlm generate --prompt` for plain text, or a chat (instruct) model")
        messages, tools = template_messages(self.chat_template, messages, tools)
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        return render_chat(self.chat_template, messages, add_generation_prompt, tools=tools, **specials)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def generation_eos_ids(folder: str | Path) -> list[int]:
    """The ids that end generation, from generation_config.json's eos_token_id (an int or a list)."""
    eos = read_json(Path(folder) / "generation_config.json", "generation_config.json", "fix or delete it", missing_ok=True).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


class IdsOnly:
    """An HF folder without tokenizer files, driven by token ids (`generate --prompt-ids`): its end-of-text
    ids and no text; whatever needs text raises one clear line."""

    chat_template = None
    bos_token_id = None

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.eos_token_ids = generation_eos_ids(folder)

    def _no_text(self) -> DecoderLMError:
        return DecoderLMError(f"{self.folder} has no tokenizer.json, so decoderlm cannot turn text into ids; drive it "
                              "with token ids (generate --prompt-ids 1,2,3) or copy the tokenizer files into it")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise self._no_text()

    def decode(self, ids: list[int]) -> str:
        raise self._no_text()

    def get_vocab(self) -> dict[str, int]:
        raise self._no_text()


def generation_defaults(folder: str | Path) -> dict[str, Any]:
    """generation_config.json → SamplingParams fields. Greedy unless do_sample is set, as in transformers
    (whose sampling defaults, e.g. top_k=50, also apply when a field is absent)."""
    config = read_json(Path(folder) / "generation_config.json", "generation_config.json", "fix or delete it", missing_ok=True)
    if not config:
        return {}
    if not config.get("do_sample", False):
        return {"temperature": 0.0, "repetition_penalty": float(config.get("repetition_penalty") or 1.0)}
    return {
        "temperature": float(config.get("temperature", 1.0) if config.get("temperature") is not None else 1.0),
        "top_k": int(config.get("top_k", 50) or 0),
        "top_p": float(config.get("top_p") or 1.0),
        "min_p": float(config.get("min_p") or 0.0),
        "repetition_penalty": float(config.get("repetition_penalty") or 1.0),
    }
