"""Adversarial suffixes: a plain request followed by a run of optimised noise.

Attacks that search for a suffix by gradient or at random (GCG and its successors) append to a
request a string that no person writes: word fragments run together, tokens laden with brackets and
symbols, brackets and quotes left open ("... on their appearance Herezak({[HTMLsvg readers | Sure]
Sure,].[ githubrelative{[paper"). The request alone is what the harm head was calibrated on, and it
may score under its threshold; the suffix is the attack, so it is scored here on its own, as the
share of noise in the text's tail after a run of plain words.

The score, `suffix_score`, reads one line: a prompt's only line, or the last line of a prompt of
several, where a template ends in its request and the suffix after it. The line (inline code spans
set aside) must open with at least MIN_REQUEST_WORDS plain words and end in at least
MIN_SUFFIX_TOKENS tokens. Over every place where the plain opening could end (at the first token
with noise marks or before, and after any colon before it, which introduces data), the score is the
tail's share of noise tokens, raised by UNBALANCED_BONUS where the tail leaves two or more brackets
or quotes open or unopened. Other lines are not read: in code, wrapped prose and lists, lines break
where a suffix would not, and give noise shares of their own.
"""

from __future__ import annotations

import re

from services.safety.decoders import is_known_word
from services.safety.normalizer import canonical

SUFFIX_CATEGORY = "adversarial_suffix"
# Chosen on the labelled benign sources (bench/results/safety_suffix_2026-12-07.md): no benign
# text of any source reaches it; the closest are at 0.54 and 0.52.
SUFFIX_THRESHOLD = 0.6
MIN_REQUEST_WORDS = 5
MIN_SUFFIX_TOKENS = 6
MAX_SUFFIX_TEXT_CHARS = 2_000  # a longer last line is not a request and its suffix; bounds the cost
UNBALANCED_BONUS = 0.25
_CLEAN_SHARE_OF_REQUEST = 0.8

# Inline code (`x = a[i]`) is a thing a person quotes, not noise.
_CODE_SPAN = re.compile(r"`[^`\n]{1,200}`")
# Marks a word may carry in prose, before or after it.
_PROSE_MARKS = ".,;:!?'\"“”‘’()"
# A token of these alone is noise ("[", "](", "!!", "|"); dashes, slashes and arithmetic are not.
_NOISE_PUNCTUATION = frozenset("[]{}|\\!<>^~`@")
# A word with one of these inside is noise ("LINQ[{", "${\\", "dearprintln(@").
_SYMBOLS = frozenset('[]{}()<>$@\\|^~`"_=*+#')
_OPENERS = {")": "(", "]": "[", "}": "{"}
_HASHTAG = re.compile(r"#[^\W_]\w*")

_CLEAN, _NAME, _NOISE = 0, 1, 2


def _kind(token: str) -> int:
    if not any(c.isalnum() for c in token):
        return _NOISE if any(c in _NOISE_PUNCTUATION for c in token) else _CLEAN
    core = token.strip(_PROSE_MARKS)
    if _HASHTAG.fullmatch(token.rstrip(_PROSE_MARKS)):
        return _NAME  # "#Solstice": a tag, not noise ("'#cient" is not one)
    if any(c in _SYMBOLS for c in core):
        return _NOISE
    if not core.isalpha() or len(core) <= 3 or is_known_word(core.lower()):
        return _CLEAN
    if core[0].isupper() and core[1:].islower():
        return _NAME  # a name the dictionary lacks: neither plain nor noise
    return _NOISE  # fragments run together ("githubrelative"), or capitals inside ("PseudAnswer")


def _unbalanced_from(tokens: list[str]) -> list[int]:
    """For each start position, how many brackets the tail from there leaves unmatched, plus one
    for an odd number of double quotes and one for an odd number of backticks."""
    counts = [0] * (len(tokens) + 1)
    closers: list[str] = []
    unopened = quotes = backticks = 0
    for at in range(len(tokens) - 1, -1, -1):
        for c in reversed(tokens[at]):
            if c in _OPENERS:
                closers.append(c)
            elif c in "([{":
                if closers and _OPENERS[closers[-1]] == c:
                    closers.pop()
                else:
                    unopened += 1
            elif c == '"':
                quotes += 1
            elif c == "`":
                backticks += 1
        counts[at] = unopened + len(closers) + quotes % 2 + backticks % 2
    return counts


def suffix_score(text: str) -> float:
    """How much the text reads as a request with an adversarial suffix: 0 for no suffix, up to 1."""
    last_line = text.strip().rpartition("\n")[2]
    return _line_score(last_line) if len(last_line) <= MAX_SUFFIX_TEXT_CHARS else 0.0


def _line_score(line: str) -> float:
    tokens = canonical(_CODE_SPAN.sub(" code ", line)).split()
    if len(tokens) < MIN_REQUEST_WORDS + MIN_SUFFIX_TOKENS:
        return 0.0
    kinds = [_kind(t) for t in tokens]
    # noise for its marks, not only for its letters
    symbolic = [
        k == _NOISE and not t.strip(_PROSE_MARKS).isalpha() for t, k in zip(tokens, kinds, strict=True)
    ]
    noise_from = [0] * (len(tokens) + 1)  # noise tokens in each tail
    symbolic_from = [0] * (len(tokens) + 1)
    for at in range(len(tokens) - 1, -1, -1):
        noise_from[at] = noise_from[at + 1] + (kinds[at] == _NOISE)
        symbolic_from[at] = symbolic_from[at + 1] + symbolic[at]
    unbalanced = _unbalanced_from(tokens)
    # The request ends at the first token with noise marks, or before; and after the last colon
    # before that token, which introduces data ("convert these colours: #00aeef, ...").
    first_mark = symbolic.index(True) if any(symbolic) else len(tokens)
    after_colon = max((at + 1 for at in range(first_mark) if tokens[at].endswith(":")), default=0)
    best = 0.0
    first_end = min(after_colon + 1 if after_colon else 0, len(tokens))  # a word after the colon
    clean = sum(kinds[at] == _CLEAN for at in range(first_end))
    for end in range(first_end, min(first_mark, len(tokens) - MIN_SUFFIX_TOKENS) + 1):
        # tokens[:end] is the request: plain words; a suffix carries marks (a tail of rare words
        # alone is prose)
        if end >= MIN_REQUEST_WORDS and clean >= _CLEAN_SHARE_OF_REQUEST * end and symbolic_from[end] >= 2:
            share = noise_from[end] / (len(tokens) - end)
            if unbalanced[end] >= 2:
                share += UNBALANCED_BONUS
            best = max(best, min(1.0, share))
        if end < len(tokens):
            clean += kinds[end] == _CLEAN
    return best
