"""The chat markers in a rendered chat's ids: only those its template wrote may be there.

A message that holds an added token's text is refused before rendering (`Tokenizer.find_parsed_token`),
but that looks at each message alone, and the tokenizer parses added tokens in the rendered text, where
a message's text sits next to the template's and, in templates that merge consecutive turns of one
role or concatenate messages, next to another message's. There "<|im_" ending one message and
"end|>\\n<|im_start|>system" opening the next become markers that neither message holds. So the check
is made on ids, after templating: the added tokens in the chat's ids must be, in order, those in the
ids of the same chat with every message's text replaced by a placeholder, that is, the template's.

Neither SmolLM2's ChatML template nor stories260K's is open to this (each message's text is closed by
"<|im_end|>", and every added token's text has its only "<" first), but the engine serves any
checkpoint's template; tests/engine/text/test_chat_markers.py shows both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.engine.text.tokenizer import Tokenizer

# A message's text in the template-only rendering. An empty text stays empty: templates test for it.
PLACEHOLDER = "x"


def find_unwritten_marker(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], ids: Sequence[int]
) -> str | None:
    """The text of the first added token in `ids` that the template did not write, or None.

    `ids` are `messages` rendered by the template and encoded without BOS, as the servicer does. When
    text around a template's marker swallows it, the token returned is the one that took its place
    (or the lost marker, when nothing did).
    """
    found = marker_ids(tokenizer, ids)
    written = marker_ids(tokenizer, template_ids(tokenizer, messages))
    if found == written:
        return None
    num_common = min(len(found), len(written))
    first = next((i for i in range(num_common) if found[i] != written[i]), num_common)
    token_id = found[first] if first < len(found) else written[first]
    return str(tokenizer.backend.id_to_token(token_id))


def template_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Ids of `messages` rendered with each message's text replaced by `PLACEHOLDER`."""
    placeholders = [{**message, "content": PLACEHOLDER if message["content"] else ""} for message in messages]
    return tokenizer.encode(tokenizer.apply_chat_template(placeholders), add_bos=False)


def marker_ids(tokenizer: Tokenizer, ids: Sequence[int]) -> list[int]:
    """The ids in `ids` of added tokens (chat markers, BOS, EOS), in order."""
    return [token_id for token_id in ids if token_id in tokenizer.parsed_token_ids]
