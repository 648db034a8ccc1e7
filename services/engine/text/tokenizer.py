"""The engine's tokenizer: a `tokenizers.Tokenizer` plus BOS/EOS conventions and the chat template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from services.engine.text.chars_per_token import max_chars_per_token
from services.engine.text.chat_template import ChatTemplate, ChatTemplateError
from services.engine.text.detokenizer import IncrementalDetokenizer

TURN_START_TOKENS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>")  # where a chat turn begins


class Tokenizer:
    """Encodes prompts, decodes completions, and renders chat messages for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        add_bos_by_default: bool,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_by_default = add_bos_by_default
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template or "", self._token_text(bos_token_id), self.eos_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """Most characters of text one token can cover (None: no bound; see `chars_per_token`)."""
        return max_chars_per_token(self.backend)

    @property
    def eos_token(self) -> str:
        """Text of the first EOS token ("" when there is none)."""
        return self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None)

    @cached_property
    def parsed_token_texts(self) -> tuple[str, ...]:
        """Texts of every added token: BOS, EOS, chat-turn markers, and those not marked special
        (the GGUF loader adds USER_DEFINED tokens so). `encode` parses each of them in any text."""
        decoder = self.backend.get_added_tokens_decoder()
        return tuple(token.content for token in decoder.values() if token.content)

    @cached_property
    def parsed_token_ids(self) -> frozenset[int]:
        """Ids of every added token (`parsed_token_texts`): in a chat's ids, only its template's."""
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _normalized_token_texts(self) -> tuple[str, ...]:
        """The added tokens that match normalized text, as the normalizer writes them."""
        normalize = self.backend.normalizer.normalize_str if self.backend.normalizer else str
        decoder = self.backend.get_added_tokens_decoder()
        texts = (normalize(token.content) for token in decoder.values() if token.normalized)
        return tuple(text for text in texts if text)

    def find_parsed_token(self, text: str) -> str | None:
        """The text of an added token that `encode` would parse inside `text`, or None.

        Only a chat template may write these: in a message they would forge a turn. A token marked
        `normalized` matches the normalizer's output, so `text` is checked normalized too (with a
        lowercasing normalizer, "<|IM_START|>" would be the token "<|im_start|>").
        """
        found = next((token for token in self.parsed_token_texts if token in text), None)
        if found is not None or not self._normalized_token_texts:
            return found
        normalized = self.backend.normalizer.normalize_str(text) if self.backend.normalizer else text
        return next((token for token in self._normalized_token_texts if token in normalized), None)

    def turn_start_ids(self) -> tuple[int, ...]:
        """Ids of the chat-turn start tokens this vocabulary has (ChatML, Llama 3, Gemma styles)."""
        found = (self.backend.token_to_id(token) for token in TURN_START_TOKENS)
        return tuple(token_id for token_id in found if token_id is not None)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; `add_bos=None` follows the model's convention. Special tokens are parsed."""
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_bos is None:
            add_bos = self.add_bos_by_default
        if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (BOS, EOS, chat markers) are dropped by default."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        """A streaming decoder for a completion that follows `prompt_ids`."""
        return IncrementalDetokenizer(self.decode, prompt_ids)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render chat `messages` to prompt text with the model's own template."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json, with tokenizer_config.json and generation_config.json when present."""
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        tok_config = _read_json(path / "tokenizer_config.json")
        bos_id = _token_id(backend, tok_config.get("bos_token"))
        eos_ids = _hf_eos_ids(path, backend, tok_config)
        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(backend, bos_id)
        return cls(backend, bos_id, eos_ids, bool(add_bos), _hf_chat_template(path, tok_config))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_id(backend: BackendTokenizer, token: str | dict[str, Any] | None) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _hf_eos_ids(path: Path, backend: BackendTokenizer, tok_config: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what `generate` stops on; config.json and the tokenizer are fallbacks
    for file_name in ("generation_config.json", "config.json"):
        ids = _as_id_tuple(_read_json(path / file_name).get("eos_token_id"))
        if ids:
            return ids
    eos = _token_id(backend, tok_config.get("eos_token"))
    return () if eos is None else (eos,)


def _post_processor_adds(backend: BackendTokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    return backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


def _hf_chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template
