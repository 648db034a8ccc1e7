"""The forms of a text that the screens read: evasions (zero-width characters, confusables,
stacked combining marks, base64 blobs, and the encodings of decoders.py) are undone so that they
score like the plain text they hide.

Every view is screened and the highest score counts, so a view can only add risk: decoding a
blob that turns out to be noise costs a little latency, never a missed block.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import html
import itertools
import re
import unicodedata
from dataclasses import dataclass, field
from typing import NamedTuple

from services.safety import check_cache
from services.safety.decoders import hidden_texts, text_of


def _code_points(category: str) -> list[int]:
    """The code points of a general category, as this Python's unicodedata has them. Planes 0, 1
    and 14 hold every format character, control and enclosing mark; the rest hold ideographs and
    private use (a scan of all 17 planes took 0.25 s at import)."""
    return _by_category().get(category, [])


@functools.cache
def _by_category() -> dict[str, list[int]]:
    """Every code point of planes 0, 1 and 14 by general category: one scan for all callers."""
    found: dict[str, list[int]] = {}
    for c in itertools.chain(range(0x20000), range(0xE0000, 0xF0000)):
        found.setdefault(unicodedata.category(chr(c)), []).append(c)
    return found


# Characters that render as nothing and are used to split a word past a screen: every Unicode
# Default_Ignorable_Code_Point (zero-width spaces and joiners, the bidirectional marks and controls,
# variation selectors, Mongolian free variation selectors, the Hangul fillers, the soft hyphen,
# ...) but the tag characters (_TAGS: decoders.smuggled_tags reads them), and the interlinear
# annotation marks U+FFF9-FFFB, format characters that draw nothing either. "bo\ufe0fmb" shows as
# "bomb".
_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFFB), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0080, 0xE0FFF),
)  # fmt: skip
_ZERO_WIDTH = dict.fromkeys(c for first, last in _DEFAULT_IGNORABLE for c in range(first, last + 1))
# C0 and C1 control characters but the tab and the line breaks: a screen shows none of them, the
# encoder's tokenizer drops them (BertNormalizer's clean_text), and left in, "p\x00i\x00p\x00e" passed
# the deny patterns, which read the text as it is. The vertical tab, form feed, the information
# separators U+001C-001F and NEL (U+0085) are dropped too, though Python counts them as whitespace:
# the tokenizer drops them, so "b\x0comb" reads as "bomb" to the encoder, and it has to read so here.
_CONTROLS = dict.fromkeys(c for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\t\n\r")
# Every format character (general category Cf) but the tags: the default-ignorable ones above and
# the rest, which draw a sign over a number or an ayah (U+0600-0605, 06DD, 08E2, 0890-0891, 110BD),
# mark a Syriac abbreviation (U+070F) or set Egyptian hieroglyphs in a block (U+13430-13438). Left
# in, one per word split it past the deny patterns, and the tokenizer read it as an unknown token
# ("b\u0890omb" did not read as "bomb" to either screen). No format character changes which word a
# text spells: the joiners (U+200C, 200D) choose how an Indic or Arabic word or an emoji sequence is
# drawn, and the tokenizer drops them anyway, so none is kept. The tags stay for
# decoders.smuggled_tags and are dropped by _cleaned.
_FORMAT = dict.fromkeys(c for c in _code_points("Cf") if not 0xE0000 <= c < 0xE0080)
_INVISIBLE = {**_ZERO_WIDTH, **_CONTROLS, **_FORMAT}
# The braille blank (U+2800) draws a space-wide nothing: outside braille it is dropped like the
# Hangul fillers; between braille cells it is the space of a braille text (decoders.braille).
_BRAILLE_BLANK = re.compile("(?<![\u2801-\u28ff])\u2800+(?![\u2801-\u28ff])")
# Combining marks that NFKC left on their own (it composes the ones that make an accented letter):
# stacked over each letter ("Zalgo" text) or a strikethrough, they split a word past a pattern.
_LOOSE_MARKS = re.compile("[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]+")
# Any other nonspacing mark (general category Mn) left after a Latin letter: the encoder's tokenizer
# strips the marks of its own, older table only, and kept about 360 newer ones (U+07FD, U+0898, ...)
# as unknown pieces, so "b\u0898omb" did not read as "bomb" to the classifier. Latin text has none
# after NFKC (it composes the accented letters that exist); other scripts keep their vowel signs.
_LATIN_MARKS = re.compile(
    "(?<=[A-Za-z\u00c0-\u024f\u1e00-\u1eff])[" + "".join(re.escape(chr(c)) for c in _code_points("Mn")) + "]+"
)
# Unicode tag characters: invisible, dropped from the text (decoders.smuggled_tags reads them); and
# every enclosing mark (general category Me), which draws a circle, a keycap or a Cyrillic
# hundred-thousands sign round the letter before it: NFKC leaves them, and the tokenizer read
# "b\u0489omb" as an unknown token, so the word did not read as "bomb" to the classifier or the rules.
_TAGS = dict.fromkeys(range(0xE0000, 0xE0080))
_TAGS_AND_ENCLOSING_MARKS = {**_TAGS, **dict.fromkeys(_code_points("Me"))}
_WHITESPACE = re.compile(r"\s+")
# A whitespace run past this many characters is cut to its first MAX_WHITESPACE_RUN before any
# decoder reads the text: no encoding needs a longer one, and a pattern that retries a run from each
# of its positions costs the square of the run's length (1,000,000 spaces never finished).
MAX_WHITESPACE_RUN = 64
_LONG_WHITESPACE = re.compile(rf"(\s{{{MAX_WHITESPACE_RUN}}})\s+")
# ANSI escape sequences (colours, cursor moves, window titles): a terminal shows none of them, and
# left in, "\x1b[31mHow" reads as one word.
_TERMINAL_ESCAPE = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]{0,200}(?:\x07|\x1b\\)|[ -/]+[0-~]|[@-Z\\-_])"
)
# Letters of other scripts that look like Latin ones (NFKC leaves them alone): Cyrillic, Greek,
# Armenian, and Latin's own dotless i and j, alpha and iota, a hand-made subset of the lookalikes
# that matter for English text (a wider one would fold letters common in Russian or Greek prose,
# "г", "σ", "γ"); then every other single letter that Unicode's confusables.txt (version 14, as
# confusable-homoglyphs 3.3.1 ships it) gives as a confusable of a Latin letter and NFKC leaves
# alone: Cherokee, Lisu, Coptic, Canadian syllabics, Warang Citi, Carian, Lycian, Deseret, Osage,
# Tifinagh, IPA and the like; last, the five it gives as a Latin letter and an apostrophe ("Ꭴ" as
# "O'"), as the letter. Folded only where the text reads as Latin (_reads_as_latin).
_LOOKALIKES_FROM = (
    "аеорсухіјѕԁһӏԛԝɡАВЕКМНОРСТХЅІЈԜοινκρτυχαΑΒΕΖΗΙΚΜΝΟΡΤΥΧϲϳɑɩıȷօսհոνԍ"
    "ƄƍƖƦƽǀɣɯʋଠഠဝყჿሀዐᎠᎡᎢᎥᎩᎪᎫᎬᎳᎷᎻᎽᏀᏂᏃᏏᏒᏔᏕᏙᏚᏞᏟᏢᏦᏧᏳᏴᐯᑌᑭᑯᑲᒍᒪᕁᕼᕽᖇᖯᖴᗅᗞᗪᗰᗷᚷᛁᛕᛖᴑᶃᶌẝỿⲅⲎⲒⲔⲘⲚⲞⲟⲢⲣⲤⲥⲦⲨⲬⳐⴸⴹⵏⵔⵕⵝꓐꓑꓒꓓꓔꓖꓗꓙꓚꓜꓝꓟꓠꓡꓢꓣꓦꓧꓪꓫꓬꓮꓰꓲꓳꓴꛟꞘꞙꞟꞲꞳꞴꬲꬵꬽꭇꭈꭎꭒꭚꭵꮁꮃꮓꮩꮪꮯ𐊂𐊆𐊇𐊊𐊐𐊒𐊕𐊖𐊗𐊠𐊡𐊢𐊥𐊫𐊰𐊱𐊲𐊴𐋏𐌁𐌂𐌉𐌑𐌕𐌗𐐄𐐕𐐛𐐠𐐬𐐽𐑈𐒴𐓂𐓎𐓪𐓶𐔓𐔖𐔘𐔜𐔝𐔥𐔦𐔧𑜆𑜊𑜎𑜏𑢠𑢢𑢣𑢤𑢦𑢩𑢮𑢲𑢵𑢸𑢼𑣀𑣁𑣂𑣃𑣄𑣈𑣗𑣘𑣜𖼈𖼊𖼖𖼨𖼵𖼺𖽀𖽂𖽃ᒈᒇᎤᒆᑧ"
)
_LOOKALIKES_TO = (
    "aeopcyxijsdhlqwgABEKMHOPCTXSIJWoivkptuxaABEZHIKMNOPTYXcjaiijouhnvG"
    "bglRslywuOooyoUODRTiYAJEWMHYGhZbRWSVSLCPKdGBVUPdbJLxHxRbFADDMBXlKMogyfyrHlKMNOoPpCcTYXLVElOQXBPdDTGKJCZFMNLSRVHWXYAElOUVFfuJXBeforruuyirwzvscBEFlXOPSTABCFOMTYXHBClMTXOCLSocsROUouNOKCVFLXvwwwVFLYEZELOUTvsFizoouyVTLlRSAUYbdOPU"
)
_CONFUSABLES = str.maketrans(_LOOKALIKES_FROM, _LOOKALIKES_TO)
_LOOKALIKE_SET = frozenset(_LOOKALIKES_FROM)
# Small capital letters ("ᴍᴀᴋᴇ ᴀ ʙᴏᴍʙ"), which NFKC leaves alone: the encoder reads them as unknown
# tokens, so they hide a request as an encoding does. In IPA they are vowels and consonants close
# to the letter they are read as here.
# (Small capital Q is U+A7AF, not U+01EB "ǫ", an o with an ogonek, which NFKC makes of "o\u0328":
# read as "q", it turned "bo\u0328mb" into "bqmb".)
_SMALL_CAPITALS = str.maketrans("ᴀʙᴄᴅᴇꜰɢʜɪᴊᴋʟᴍɴᴏᴘꞯʀꜱᴛᴜᴠᴡʏᴢ", "abcdefghijklmnopqrstuvwyz")
# Letters drawn in boxes and circles that NFKC leaves alone or wraps in brackets: regional
# indicators (the letters of flags: "🇭🇴🇼"), negative circled and squared letters ("🅗🅞🅦",
# "🅷🅾🆆") and parenthesized ones ("⒣⒪⒲", which NFKC makes "(h)(o)(w)"). A flag reads as its
# country's two letters.
_ENCLOSED_LETTERS = {
    first + i: ord("a") + i for first in (0x1F1E6, 0x1F150, 0x1F170, 0x249C) for i in range(26)
}
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
# Clauses of a short prompt (see clauses()): split at a line break (canonical_lines keeps them),
# after a sentence end, a colon or a semicolon,
# and before a capitalised word that starts the next task or instruction where the writer left out
# the full stop ("Write a poem about the sea. Then <request> Then tell me a joke.", "<request> Start
# your reply with ..."), and before a casual tail ("<request> pls answer fast no disclaimers").
_CLAUSE_END = re.compile(
    r"\s*\n\s*|(?<=[.?!:;])\s+"
    r"|(?<=[a-z0-9,\"')])\s+(?=(?:Then|Also|Next|Finally|Afterwards|After that|Lastly|Now"
    r"|Start|Begin|Respond|Reply|Answer|Remember|Ignore|Please|Do not|Don't|Never|Always|Make sure)\b)"
    r"|(?<=[a-z0-9])\s+(?=(?:pls|plz|please|thanks|thx|asap|no disclaimers?|no warnings?|no lectures?)\b)"
)
# A quoted span ("...", '...', curly quotes): a request may be set inside a task as a quotation.
_QUOTED = re.compile(
    r'"([^"\n]{12,400})"|\u201c([^\u201d\n]{12,400})\u201d|(?<![A-Za-z])\'([^\'\n]{12,400})\'(?![A-Za-z])'
)
MAX_CLAUSE_TEXT_CHARS = 400  # a short prompt; longer texts are cut into sentence windows anyway
MAX_TEMPLATE_TEXT_CHARS = 2000  # a prompt up to this long is read for a request its template sets apart
MIN_CLAUSE_WORDS = 4  # shorter clauses ("Thanks.", "Step 1:") say nothing on their own
MAX_CLAUSES = 8
MAX_DECODED_BLOBS = 8  # per text: enough for real payloads, bounded against a text made of blobs
MAX_HIDDEN_VIEWS = 8  # decoded views per text, past the plain one
# Contractions and possessive pronouns typed without their apostrophe, and the word each stands for.
_CONTRACTED = (
    "what's that's there's here's where's who's how's when's why's it'll that'll there'll"
    " don't doesn't didn't can't couldn't shouldn't wouldn't isn't aren't wasn't weren't"
    " haven't hasn't hadn't mustn't needn't ain't i'm i've i'd you're you've you'll you'd"
    " they're they've they'll they'd we've we'd he's she's she'd he'd he'll she'll"
    " someone's somebody's anyone's anybody's everyone's everybody's nobody's ex's"
)
_ALSO_WORDS = ("well", "ill", "wont", "shell", "hell", "id", "were", "wed", "its", "lets", "shed", "hed")
_CONTRACTIONS = {
    bare: full for full in _CONTRACTED.split() if (bare := full.replace("'", "")) not in _ALSO_WORDS
}
_LETTER_RUN = re.compile(r"(?<!['\u2019])\b[A-Za-z]{2,10}\b(?!['\u2019])")
# Bumped whenever views() changes what it returns for some text: training and evaluation tools key
# their cached embeddings by it.
VIEWS_VERSION = 19


def _visible(text: str) -> str:
    """NFKC with zero-width and control characters and terminal escape sequences dropped and small
    capitals and enclosed letters read as letters: what a reader sees, tags as sent and whitespace
    (tabs and line breaks) as sent but for runs past MAX_WHITESPACE_RUN, which are cut."""
    return _LONG_WHITESPACE.sub(r"\1", _shown(text))


def _shown(text: str) -> str:
    """_visible(text) with its whitespace runs as sent."""
    lettered = _TERMINAL_ESCAPE.sub("", text).translate(_ENCLOSED_LETTERS)
    shown = unicodedata.normalize("NFKC", lettered).translate(_INVISIBLE).translate(_SMALL_CAPITALS)
    return _BRAILLE_BLANK.sub("", shown) if "\u2800" in shown else shown


def _cleaned(visible: str) -> str:
    """A _visible text with tag characters, enclosing marks and loose combining marks dropped,
    whitespace collapsed."""
    return _WHITESPACE.sub(" ", _unmarked(visible)).strip()


def _unmarked(visible: str) -> str:
    """A _visible text with tag characters, enclosing marks and loose combining marks dropped."""
    unmarked = _LOOSE_MARKS.sub("", visible.translate(_TAGS_AND_ENCLOSING_MARKS))
    return unmarked if unmarked.isascii() else _LATIN_MARKS.sub("", unmarked)


def normalize(text: str) -> str:
    """NFKC, zero-width, control, format and tag characters and enclosing and loose combining marks
    dropped, whitespace collapsed: the deny patterns' view (views() starts from it)."""
    return _cleaned(_visible(text))


def _reads_as_latin(text: str) -> bool:
    """Whether the text's letters are Latin or look-alikes of Latin ones, but for a fifth at most.

    A text written in look-alikes alone ("Ноԝ ԁо І...") is English in disguise. Russian, Greek or
    Armenian prose keeps many letters that have no Latin twin (б, д, л, λ, π, ...), and a Latin text
    with a Cyrillic word or two in it is mostly Latin anyway.
    """
    if text.isascii():  # most texts: every letter is Latin (a megabyte took 1.1 s letter by letter)
        return any(map(str.isalpha, text))
    letters = [c for c in text if c.isalpha()]
    other = sum(1 for c in letters if c >= "\u0250" and c not in _LOOKALIKE_SET)
    return bool(letters) and other * 5 <= len(letters)


def fold_confusables(text: str) -> str:
    """Look-alike letters of other scripts as Latin, when the text reads as Latin.

    A Russian or Greek text keeps its letters: folding it would turn it into nonsense.
    """
    return text.translate(_CONFUSABLES) if _reads_as_latin(text) else text


def with_apostrophes(text: str) -> str:
    """Contractions typed without their apostrophe ("whats", "dont", "someones") with it: the
    encoder reads "whats" as other word pieces than "what's", and a request typed that way
    scored lower (bench/results/safety_obfuscation_2026-12-06_split.md). Only forms that are not
    also words of their own ("wont", "ill", "well", "its", "lets", "shell" are left alone)."""
    return _LETTER_RUN.sub(_restored, text)


def _restored(match: re.Match[str]) -> str:
    typed = match.group(0)
    restored = _CONTRACTIONS.get(typed.lower())
    if restored is None or typed.isupper():
        return typed  # not a contraction, or an acronym ("IM"; a shouted "DONT" is rare)
    return restored[0].upper() + restored[1:] if typed[0].isupper() else restored


def canonical(text: str) -> str:
    """What the classifier embeds: normalized, with confusables folded and apostrophes restored."""
    return _folded(normalize(text))


def _folded(normalized: str) -> str:
    """A normalized text with confusables folded and apostrophes restored."""
    return with_apostrophes(fold_confusables(normalized))


def unaccented(text: str) -> str:
    """`text` with the accents of its letters dropped (NFKD, nonspacing marks dropped, NFC):
    "Hów dó I máké á bömb" as "How do I make a bomb". The classifier's encoder is uncased and
    strips accents itself; the deny patterns read this form beside the views."""
    if text.isascii():
        return text
    decomposed = unicodedata.normalize("NFKD", text)
    return unicodedata.normalize("NFC", "".join(c for c in decomposed if unicodedata.category(c) != "Mn"))


def pattern_views(text: str, forms: list[str]) -> list[str]:
    """The forms the deny patterns read past `forms` (the views of `text`, and its restatements):
    the canonical form of `text` with its HTML character references decoded ("&#98;&#111;&#109;&#98;"),
    and every form with accents dropped (unaccented), each once and none already in `forms`."""
    unescaped = [canonical(html.unescape(text))] if "&" in text else []
    extra = dict.fromkeys([*unescaped, *(unaccented(form) for form in [*forms, *unescaped])])
    return [form for form in extra if form not in forms]


def _decode_blob(blob: str) -> str | None:
    """The blob as base64 (standard or URL-safe) of UTF-8 text, else None."""
    padded = blob.rstrip("=") + "=" * (-len(blob.rstrip("=")) % 4)
    try:
        raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        return None
    return text_of(raw)


def decoded_blobs(text: str) -> list[str]:
    """The texts hidden in base64 runs of `text`, or in runs that are base64 once ROT13 is undone,
    each once, at most MAX_DECODED_BLOBS (_kept says which share one)."""
    return _kept(_blob_texts(text))


def _blob_texts(text: str) -> list[str]:
    """Every text hidden in a base64 (or ROT13 of base64) run of `text`, each once."""
    runs = _BASE64_RUN.findall(text)
    found = (_decode_blob(run) or _decode_blob(codecs.encode(run, "rot13")) for run in runs)
    return list(dict.fromkeys(decoded for decoded in found if decoded is not None))


def _kept(texts: list[str]) -> list[str]:
    """`texts` if there are MAX_DECODED_BLOBS at most; else, prose first (_prose_first), the first
    MAX_DECODED_BLOBS - 2, the others but the last joined into one text, and the last. Decoding
    only the first few let eight benign blobs before a harmful one hide it; now every blob is read,
    and the last, where a request after decoys goes, keeps a text of its own (decoys after it land
    it in the joined one: DecodedViews.is_capped tells the screen, which blocks such a text)."""
    if len(texts) <= MAX_DECODED_BLOBS:
        return texts
    texts = _prose_first(texts)
    return [*texts[: MAX_DECODED_BLOBS - 2], "\n".join(texts[MAX_DECODED_BLOBS - 2 : -1]), texts[-1]]


_WORD = re.compile(r"[^\W\d_][^\W\d_'’]*[.,;:!?]?")
MIN_PROSE_WORDS = 3


def is_prose(text: str) -> bool:
    """Whether a decoded text holds a sentence: MIN_PROSE_WORDS or more white-space-separated plain
    words. A JWT's JSON, a key, a password or a hash holds none, and a request must; so only prose
    counts toward the cap, and a Kubernetes secret or a few tokens in a debugging question (many
    blobs, none of them prose) are read, not blocked."""
    return sum(1 for token in text.split() if _WORD.fullmatch(token)) >= MIN_PROSE_WORDS


def _prose_first(texts: list[str]) -> list[str]:
    """Prose before the rest, each kept in its order: blobs that hold no sentence cannot push one
    that does into the shared text. The last prose text goes last, where _kept gives it a view."""
    prose = [t for t in texts if is_prose(t)]
    rest = [t for t in texts if not is_prose(t)]
    return [*prose[:-1], *rest, *prose[-1:]] if prose else rest


def _is_capped(texts: list[str]) -> bool:
    """More prose than the views read alone (MAX_DECODED_BLOBS): some sentence shares a view."""
    return sum(map(is_prose, texts)) > MAX_DECODED_BLOBS


# A text whose decoded sentences (is_prose) outnumbered its views (DecodedViews.is_capped) is blocked,
# as a category of its own: some of its texts were read only joined with others, diluted, and a harmful
# request amid 30 benign base64 notes passed for 8 of the 10 requests tried. No text of the benign
# code and long-document sources gets there (0 of 835: the stdlib's code, the PEPs, HumanEval, the
# project's docs). A tenant whose users send texts of many encoded parts turns it off.
ENCODINGS_CATEGORY = "unscreened_encodings"
ENCODINGS_THRESHOLD = 1.0  # its score is 1.0 for a capped text, else 0.0


class DecodedViews(NamedTuple):
    """The views of a text (views()), and whether its decoded texts outnumbered the views a text
    may have: MAX_DECODED_BLOBS blobs, MAX_HIDDEN_VIEWS views. When `is_capped`, some decoded
    texts share a view with others (the deny patterns read them all; the classifier reads them
    diluted) and texts past the views were not decoded again: the text is not fully read, and the
    screen blocks it as ENCODINGS_CATEGORY."""

    forms: tuple[str, ...]
    is_capped: bool


def views(text: str) -> list[str]:
    """Every form of `text` to screen: its canonical form, then each decoded blob's and each text
    decoders.py finds hidden in it (at most MAX_HIDDEN_VIEWS, each once; decoded_views says whether
    some had to share one)."""
    return list(decoded_views(text).forms)


def decoded_views(text: str) -> DecodedViews:
    """views(text), and whether they are capped (DecodedViews).

    One check reads a text's views twice (the classifier, then the deny patterns): inside a check
    they are computed once (check_cache.py); outside one, the last few short texts' views are kept."""
    if (cache := check_cache.current()) is not None:
        return cache.views(text, _decoded_views)
    if len(text) > MAX_REMEMBERED_CHARS:
        return _decoded_views(text)
    return _remembered_views(text)


MAX_REMEMBERED_CHARS = 20_000  # texts whose views are kept: a few per check, a few MB in all
_REMEMBERED = 64


@functools.lru_cache(maxsize=_REMEMBERED)
def _remembered_views(text: str) -> DecodedViews:
    return _decoded_views(text)


def _decoded_views(text: str) -> DecodedViews:
    visible = _visible(text)
    normalized = _cleaned(visible)
    decoding = _Decoding([_folded(normalized)])  # canonical(text), from the NFKC pass above
    blobs, others = decoding.blobs(normalized), [*_escapes_kept(text), *hidden_texts(visible)]
    for _ in range(MAX_DECODING_DEPTH):
        added = decoding.add(blobs, others)
        if not any(added):
            break
        blobs, others = decoding.decoded_again(added)
    return DecodedViews(tuple(decoding.forms), decoding.is_capped)


MAX_DECODING_DEPTH = 3  # encodings stacked on one another (base64 of ROT13 of base64) read through


def _escapes_kept(text: str) -> list[str]:
    """`text` with its ESC characters dropped but the rest of its terminal escapes kept, if it has
    any. A terminal hides an escape and what it takes with it, so the canonical form drops them,
    but the model reads every character: a request set in a window title ("\\x1b]0;<request>\\x07")
    or a letter taken by the escape before it ("pipe\\x1b bomb" shows as "pipeomb") is read here."""
    return [text.replace("\x1b", "")] if "\x1b" in text else []


@dataclass
class _Decoding:
    """The views of one text as its decoded texts are found; `add` and `blobs` change it."""

    forms: list[str]
    spilled: list[str] = field(default_factory=list)  # forms past MAX_HIDDEN_VIEWS, in the last view
    is_capped: bool = False

    def blobs(self, text: str) -> list[str]:
        """decoded_blobs(text), noting when some had to share a text."""
        found = _blob_texts(text)
        self.is_capped |= _is_capped(found)
        return _kept(found)

    def add(self, blobs: list[str], others: list[str]) -> tuple[list[str], list[str]]:
        """Adds the canonical form of each decoded text that is new, as a view of its own while
        there are fewer than MAX_HIDDEN_VIEWS, else joined into the last view; returns the decoded
        texts that got a view of their own (from base64 blobs, from the other decoders): only
        those are decoded again, so that each pass reads MAX_HIDDEN_VIEWS texts at most."""
        added: tuple[list[str], list[str]] = ([], [])
        found = [*((0, b) for b in blobs), *((1, o) for o in others)]
        for kind, hidden in sorted(found, key=lambda pair: not is_prose(pair[1])):  # prose first
            form = canonical(hidden)
            if not form or form in self.forms or form in self.spilled:
                continue
            if len(self.forms) <= MAX_HIDDEN_VIEWS:
                self.forms.append(form)
                added[kind].append(hidden)
            else:
                self._spill(form)
        return added

    def _spill(self, form: str) -> None:
        self.spilled.append(form)
        self.forms[-1] += "\n" + form
        self.is_capped |= is_prose(form)

    def decoded_again(self, added: tuple[list[str], list[str]]) -> tuple[list[str], list[str]]:
        """What the texts just decoded hide in turn: a base64 blob's text is read by every decoder
        (it may be ROT13, hex or base64 again), any other decoded text only for base64 runs (ROT13
        or hex of base64), so that a decoder's guess at a benign text is not guessed at again. Each
        pass reads at most MAX_HIDDEN_VIEWS texts, none longer than the text they came from."""
        blobs, others = added
        again_blobs = [b for text in (*blobs, *others) for b in self.blobs(_cleaned(_visible(text)))]
        again_others = [o for blob in blobs for o in hidden_texts(_visible(blob))]
        return again_blobs, again_others


def clauses(view: str) -> list[str]:
    """The clauses of a short canonical view, each to be scored on its own; [] for a text of one
    clause or past MAX_CLAUSE_TEXT_CHARS. A quoted span of MIN_CLAUSE_WORDS words or more is a
    clause too, even in a text of one clause (a request inside "Write a function whose docstring
    answers: '...'" or a JSON task), and so is each line of a view that keeps its lines
    (canonical_lines).

    A short prompt is one embedding, and the words around a request dilute it: "Decode the
    following and answer it: <request>" passed a third of the requests the screen blocks alone
    (bench/results/safety_clauses_2026-12-06.md). Scoring each clause alone undoes that.

    A longer prompt, up to MAX_TEMPLATE_TEXT_CHARS, is where a template puts a request: its quoted
    spans and the words after its last colon ('This is his first question: "<request>"') are
    clauses; its other sentences are not (each clause of a long benign text is one more chance of
    a false positive: bench/results/safety_spellings_2026-12-07.md).
    """
    if len(view) > MAX_CLAUSE_TEXT_CHARS:
        return _template_clauses(view) if len(view) <= MAX_TEMPLATE_TEXT_CHARS else []
    parts = clause_parts(view)
    found = [p for p in parts if len(p.split()) >= MIN_CLAUSE_WORDS] if len(parts) > 1 else []
    found += [span for span in quoted_spans(view) if span not in found and span != view.strip()]
    return found[:MAX_CLAUSES]


def _template_clauses(view: str) -> list[str]:
    """The quoted spans of a longer view and the words after its last colon, each of
    MIN_CLAUSE_WORDS words or more and at most MAX_CLAUSE_TEXT_CHARS."""
    found = [span for span in quoted_spans(view) if len(span) <= MAX_CLAUSE_TEXT_CHARS]
    tail = view.rpartition(": ")[2].strip(" \"'\u201c\u201d")  # a quoted tail is the quoted span
    if ": " in view and len(tail.split()) >= MIN_CLAUSE_WORDS and len(tail) <= MAX_CLAUSE_TEXT_CHARS:
        found.append(tail)
    return list(dict.fromkeys(found))[:MAX_CLAUSES]


def clause_parts(view: str) -> list[str]:
    """`view` split at clause ends (_CLAUSE_END), short parts kept."""
    return [p.strip() for p in _CLAUSE_END.split(view) if p and p.strip()]


def quoted_spans(view: str) -> list[str]:
    """The quoted spans of `view` of MIN_CLAUSE_WORDS words or more, without their quotes."""
    spans = (
        next(group for group in match.groups() if group is not None).strip()
        for match in _QUOTED.finditer(view)
    )
    return [span for span in spans if len(span.split()) >= MIN_CLAUSE_WORDS]


def prompt_readings(text: str, canonical_view: str) -> list[str]:
    """The forms a short prompt's clauses and restatements are read from (`canonical_view` is
    canonical(text)): its canonical view and, when it has several lines, canonical_lines(text) as
    well. Both, because a line break may end a request ("Hi,\n<request>\nThanks") or break a
    sentence in two (hard-wrapped text), and only the first reads right by lines."""
    if "\n" in text and len(canonical_view) <= MAX_CLAUSE_TEXT_CHARS:
        return [canonical_view, canonical_lines(text)]
    return [canonical_view]


def prompt_clauses(readings: list[str]) -> list[str]:
    """The clauses of every reading of a prompt (prompt_readings), each once, at most MAX_CLAUSES."""
    return list(dict.fromkeys(c for reading in readings for c in clauses(reading)))[:MAX_CLAUSES]


def canonical_lines(text: str) -> str:
    """The canonical view of each line of `text`, one a line: what clauses() splits, so that a
    request on a line of its own ("Hi,\n\n<request>\n\nThanks,") is a clause even without a
    full stop. (The canonical view collapses line breaks into spaces; the encoder reads both as a
    space, so the two embed alike.)

    The text is normalized whole and only lines with something left to read are folded: canonical()
    per line took 6 s for 1 MB of line breaks."""
    lines = _unmarked(_shown(text)).splitlines()
    return "\n".join(
        _folded(_WHITESPACE.sub(" ", line).strip()) for line in lines if line and not line.isspace()
    )
