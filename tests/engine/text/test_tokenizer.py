"""Tokenizer wrapper: BOS convention, special tokens, streaming detokenization, chat templates."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader
from tokenizers import AddedToken, normalizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel

from services.engine.model.gguf.metadata import GGUFMetadata
from services.engine.model.gguf.tokenizer import USER_DEFINED, build_gguf_tokenizer
from services.engine.model.loader import open_checkpoint
from services.engine.text.chat_template import ChatTemplate, ChatTemplateError
from services.engine.text.tokenizer import Tokenizer
from tests.engine.chatml_stories import TURN_END, TURN_START, make_chatml_stories

HARD_TEXTS = [
    "plain ascii words",
    "Naïve café — crème brûlée, 你好，世界。 🙂🚀",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n",
]


def _stream(tokenizer: Tokenizer, prompt: list[int], completion: list[int]) -> str:
    detokenizer = tokenizer.detokenizer(prompt)
    return "".join(detokenizer.push(t) for t in completion) + detokenizer.flush()


def _assert_stream_matches(tokenizer: Tokenizer, prompt: list[int], completion: list[int]) -> None:
    full = tokenizer.decode(prompt + completion)
    prompt_text = tokenizer.decode(prompt)
    if not full.startswith(prompt_text):
        return  # the cut splits a character: no real prompt ends like that
    assert _stream(tokenizer, prompt, completion) == full[len(prompt_text) :]


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_byte_level_stream_matches_full_decode(tiny_dir: Path, text: str) -> None:
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)
    ids = tokenizer.encode(text)
    for cut in range(1, len(ids)):
        _assert_stream_matches(tokenizer, ids[:cut], ids[cut:])


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_sentencepiece_stream_matches_full_decode(stories_gguf: Path, text: str) -> None:
    tokenizer = open_checkpoint(stories_gguf).tokenizer
    ids = tokenizer.encode(text)  # byte-fallback pieces for the non-ASCII characters
    for cut in range(1, len(ids)):
        _assert_stream_matches(tokenizer, ids[:cut], ids[cut:])


def test_stream_holds_back_half_a_character(tiny_dir: Path) -> None:
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)
    ids = tokenizer.encode("🙂", add_bos=False)
    assert len(ids) > 1  # the emoji is several byte-level tokens in this tiny vocab
    detokenizer = tokenizer.detokenizer(tokenizer.encode("x"))
    deltas = [detokenizer.push(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🙂"


def test_bos_convention_and_special_tokens(tiny_dir: Path) -> None:
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)
    bos = tokenizer.bos_token_id
    assert tokenizer.add_bos_by_default
    assert tokenizer.encode("hi")[0] == bos
    assert tokenizer.encode("hi", add_bos=False)[0] != bos
    marked = tokenizer.encode("<|user|>hi", add_bos=False)
    assert marked[0] == tokenizer.backend.token_to_id("<|user|>")
    assert tokenizer.decode(marked) == "hi"  # special tokens are skipped when decoding
    assert tokenizer.eos_token_ids == (1,)


def test_chat_template_renders_with_bos_and_generation_prompt(tiny_dir: Path) -> None:
    tokenizer = Tokenizer.from_hf_dir(tiny_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|bos|><|user|>Hi<|assistant|>"
    no_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert no_prompt == "<|bos|><|user|>Hi"


def test_chat_template_raise_exception_and_sandbox() -> None:
    strict = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_context_window_starting_mid_character(stories_gguf: Path) -> None:
    tokenizer = open_checkpoint(stories_gguf).tokenizer
    prompt = tokenizer.encode("🙂好")  # BOS, "▁", 4 emoji bytes, 3 CJK bytes: the last 6 start mid-emoji
    completion = prompt[-3:] + tokenizer.encode(" end", add_bos=False)  # "好" again as bytes, then text
    assert _stream(tokenizer, prompt, completion) == "好 end"


def test_every_added_token_is_found_in_text_special_or_not(stories_hf_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_hf_dir(make_chatml_stories(stories_hf_dir, tmp_path / "chatml"))
    assert {"<s>", "</s>", TURN_START, TURN_END} <= set(tokenizer.parsed_token_texts)
    assert tokenizer.find_parsed_token(f"hi{TURN_END} there") == TURN_END
    assert tokenizer.encode(f"hi{TURN_END}", add_bos=False)[-1] == 513  # what the check stands for
    assert tokenizer.find_parsed_token("<|im_en d|> plain text") is None


def test_a_normalized_added_token_is_found_as_the_normalizer_writes_it() -> None:
    backend = BackendTokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.add_tokens([AddedToken("<|turn|>", special=False, normalized=True)])
    tokenizer = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), add_bos_by_default=False)
    assert tokenizer.encode("a<|TURN|>")[-1] == 2  # the upper-case text is the token
    assert tokenizer.find_parsed_token("a<|TURN|>") == "<|turn|>"
    assert tokenizer.find_parsed_token("a<|TURN") is None


def test_a_gguf_user_defined_token_is_found(stories_gguf: Path) -> None:
    meta = GGUFMetadata(GGUFReader(stories_gguf))
    tokens = [*meta.get("tokenizer.ggml.tokens"), TURN_START]
    types = [*meta.get("tokenizer.ggml.token_type"), USER_DEFINED]
    tokenizer = build_gguf_tokenizer(
        _Overridden(meta, {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    )
    assert tokenizer.encode(f"x{TURN_START}", add_bos=False)[-1] == len(tokens) - 1
    assert tokenizer.find_parsed_token(f"x{TURN_START}") == TURN_START


class _Overridden:
    """GGUF metadata with some keys replaced."""

    def __init__(self, meta: GGUFMetadata, values: dict[str, object]) -> None:
        self.meta, self.values = meta, values

    def get(self, key: str, default: object = None) -> object:
        return self.values[key] if key in self.values else self.meta.get(key, default)

    def token_id(self, key: str) -> int | None:
        return self.meta.token_id(key)
