"""The learned screen: every view of a text, cut into windows, embedded, scored by the gate's
prompt head; a harm category's score is its highest over views, each view's from its windows by
the gate's window aggregation (window_aggregation.py: a text of one window is scored by it).

Outputs are scored by the gate's output head at its thresholds where the gate has one; otherwise
prompts and outputs share the prompt head but not the thresholds: each is judged against thresholds
calibrated on benign texts of its own kind (the manifest's `thresholds` and `output_thresholds`).
`HarmScreen.of` says which.
Prompts are also scored by the gate's attack heads (attack_head.py: jailbreak, prompt injection),
from the same embeddings, as wholes and as windows; outputs are not (a model's answer is not an
attack on the model).

Prompts are also scored for an adversarial suffix (suffix.py: `adversarial_suffix`, the highest over
turns): a request on a prompt's only or last line followed by optimised noise, read from the
tokens, not embedded.

A short prompt's clauses (normalizer.clauses) are also embedded one by one, and each is a view of its
own for the harm categories: a request inside an instruction ("Decode the following and answer it:
...") scores as the request. The attack heads do not read them: a template's single clause ("You will
respond with one line at a time.") reads as an ordinary instruction, and they judge the whole text.

Every text, prompt or output, is also scored for the share of it the gate cannot read
(language.py: `unscreened_language`, the highest over views): the encoder and heads know English
only, and a text in another language would otherwise score as noise and pass. And for holding more
encoded texts than it has views to read them alone (normalizer.ENCODINGS_CATEGORY,
`unscreened_encodings`: 1.0 when some had to share a view, else 0.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from services.common.gate_file import OUTPUT_HEAD, PROMPT_HEAD, Gate, HeadWeights, gate_scores
from services.safety.attack_head import JAILBREAK, AttackHead
from services.safety.chat import (
    JOIN_MARGIN_LOGITS,
    MAX_TURNS_PER_PACK,
    ROLE_JOIN_MARGIN_LOGITS,
    joins_of,
    packed_turns,
)
from services.safety.embedder import CheckProgress, MiniLMEmbedder
from services.safety.language import (
    LANGUAGE_CATEGORY,
    LANGUAGE_THRESHOLD,
    NO_LANGUAGE_EVIDENCE,
    LanguageScore,
    foreign_share_of_views,
)
from services.safety.normalizer import (
    ENCODINGS_CATEGORY,
    ENCODINGS_THRESHOLD,
    MAX_CLAUSES,
    canonical,
    clauses,
    decoded_views,
    fold_confusables,
    normalize,
    prompt_clauses,
    prompt_readings,
    views,
)
from services.safety.restate import prompt_restatements
from services.safety.suffix import SUFFIX_CATEGORY, SUFFIX_THRESHOLD, suffix_score
from services.safety.window_aggregation import AGGREGATION_KEY, WindowAggregation

TextKind = Literal["prompt", "output"]


class TextTooLong(ValueError):
    """The text needs more embedder windows than the service screens per check."""


@dataclass(frozen=True)
class Scores:
    """Per-category risk of one text, with the thresholds it was judged against."""

    values: dict[str, float]
    thresholds: dict[str, float]
    num_windows: int
    language: LanguageScore = NO_LANGUAGE_EVIDENCE  # what the unscreened_language score saw

    @property
    def triggered(self) -> list[str]:
        """The categories at or above their threshold."""
        return [c for c, v in self.values.items() if v >= self.thresholds[c]]


@dataclass(frozen=True)
class HarmScreen:
    """What scores one kind of text for the harm categories: a head, its thresholds (in
    `head.thresholds`) and a window aggregation."""

    head_name: str
    head: HeadWeights
    aggregation: WindowAggregation
    thresholds: dict[str, float]  # `head.thresholds` by category

    @classmethod
    def of(cls, gate: Gate, kind: TextKind) -> HarmScreen:
        """Prompts: the prompt head at its thresholds. Outputs: the output head at its thresholds
        where the gate has one, else the prompt head at its output thresholds. The aggregation is
        the one the head's manifest entry names; an output head without one takes the prompt
        head's."""
        rule = gate.manifest.raw["heads"][PROMPT_HEAD].get(AGGREGATION_KEY)
        name, head = PROMPT_HEAD, gate.head_weights(PROMPT_HEAD, for_outputs=kind == "output")
        if kind == "output" and OUTPUT_HEAD in gate.manifest.heads:
            rule = gate.manifest.raw["heads"][OUTPUT_HEAD].get(AGGREGATION_KEY, rule)
            name, head = OUTPUT_HEAD, gate.head_weights(OUTPUT_HEAD)
        thresholds = dict(zip(gate.manifest.categories, head.thresholds.tolist(), strict=True))
        return cls(name, head, WindowAggregation.from_manifest(rule), thresholds)

    def text_scores(self, views: Sequence[torch.Tensor]) -> torch.Tensor:
        """Scores `[C]` of one text from its views' window embeddings (each `[W, H]`)."""
        return self.aggregation.text_scores([gate_scores(v, self.head) for v in views])


class TextClassifier:
    """Scores texts with all-MiniLM-L6-v2 embeddings and the gate's prompt head."""

    def __init__(self, gate: Gate, embedder: MiniLMEmbedder, max_windows: int) -> None:
        self.embedder = embedder
        self.max_windows = max_windows
        self.categories = gate.manifest.categories
        self.screens: dict[TextKind, HarmScreen] = {
            kind: HarmScreen.of(gate, kind) for kind in ("prompt", "output")
        }
        self.attack_heads = AttackHead.all_from_gate(gate)
        self.thresholds = {kind: screen.thresholds for kind, screen in self.screens.items()}

    @property
    def attack_head(self) -> AttackHead | None:
        """The jailbreak head, or None when the gate has none."""
        return next((head for head in self.attack_heads if head.name == JAILBREAK), None)

    def windows_of(self, text: str) -> list[list[int]]:
        """Every window of every view of `text`; TextTooLong past `max_windows`."""
        return [row for view_rows in self.view_windows_of(text) for row in view_rows]

    def view_windows_of(self, text: str) -> list[list[list[int]]]:
        """The windows of each view of `text`; TextTooLong past `max_windows` in all."""
        return self._windows_of_views(views(text))

    def _windows_of_views(self, forms: list[str]) -> list[list[list[int]]]:
        per_view = [self.embedder.text_windows(form) for form in forms]
        self._check_size(sum(len(rows) for rows in per_view))
        return per_view

    def _check_size(self, num_rows: int, is_chat: bool = False) -> None:
        if num_rows > self.max_windows:
            raise self._too_long(str(num_rows), is_chat)

    def _screened_turns(
        self, turns: Sequence[str], roles: Sequence[str] | None, joins: list[str]
    ) -> list[str]:
        """The texts a chat's turns are screened as: the turns, while they and their joins need at
        most `max_windows` rows; else consecutive turns packed (chat.packed_turns), the fewest to a
        text that fits, so that a chat of hundreds of short messages is read, every message of it.
        TextTooLong when MAX_TURNS_PER_PACK to a text do not fit. Counted on the plain views,
        before any decoder runs or any window is embedded: a text that NFKC makes 18 times longer
        ("\ufdfa" * 55000) cost seconds of views before its refusal."""
        num_free = self.max_windows - self._num_rows(joins, self.max_windows)
        num_texts = 0
        for per_pack in range(1, MAX_TURNS_PER_PACK + 1):
            packed = packed_turns(turns, roles, per_pack)
            if num_free >= 0 and self._num_rows(packed, num_free) <= num_free:
                return packed
            if len(packed) == num_texts:
                break  # no pack took another turn: a bigger one would not either
            num_texts = len(packed)
        raise self._too_long(f"more than {self.max_windows}", is_chat=len(turns) > 1)

    def _harm_scores(
        self,
        kind: TextKind,
        harm_views: list[list[torch.Tensor]],
        lowered: Sequence[tuple[range, float]] = (),
    ) -> torch.Tensor:
        """Scores `[C]` from each text's harm views (each `[W, H]`): the highest over them, where the
        texts numbered in each range of `lowered` (windows across whole turns) count its margin, in
        logits, lower."""
        screen = self.screens[kind]
        joined_at = {at for numbers, _ in lowered for at in numbers}
        plain = [v for at, text_views in enumerate(harm_views) if at not in joined_at for v in text_views]
        harm = screen.text_scores(plain)
        for numbers, margin in lowered:
            joined = [v for at in numbers for v in harm_views[at]]
            if joined:
                scores = torch.sigmoid(torch.logit(screen.text_scores(joined), eps=1e-7) - margin)
                harm = torch.maximum(harm, scores)
        return harm

    def _num_rows(self, texts: Sequence[str], limit: int) -> int:
        """The rows of the texts' plain views; once past `limit`, some count past it (the count
        stops there)."""
        num_rows = 0
        for text in texts:
            num_rows += self.embedder.count_windows(canonical(text), limit - num_rows)
            if num_rows > limit:
                break
        return num_rows

    def _too_long(self, num_rows: str, is_chat: bool = False) -> TextTooLong:
        if is_chat:
            return TextTooLong(
                f"chat needs {num_rows} screening windows (one per message, short messages up to "
                f"{MAX_TURNS_PER_PACK} to a window, one per sentence of a long message, and the "
                f"joins of short messages); the limit is {self.max_windows}: send fewer or shorter "
                "messages, or raise THERMOCLINE_SAFETY_MAX_WINDOWS"
            )
        return TextTooLong(
            f"text needs {num_rows} screening windows (one per sentence of a long text); "
            f"the limit is {self.max_windows}: shorten it or send it in several requests"
        )

    def score(self, text: str, kind: TextKind = "prompt", progress: CheckProgress | None = None) -> Scores:
        """The text's per-category scores (harm: the window aggregation, highest over views;
        the attack heads, for prompts: see attack_head.py), with the thresholds for its kind."""
        return self.score_turns([text], kind, progress=progress)

    def score_turns(
        self,
        turns: Sequence[str],
        kind: TextKind = "prompt",
        whole: str | None = None,
        progress: CheckProgress | None = None,
        roles: Sequence[str] | None = None,
    ) -> Scores:
        """The scores of several texts read as one, a chat's turns: each turn is scored as `score`
        scores a text of its own (in a chat past `max_windows` rows, consecutive turns in packs:
        _screened_turns), and each category takes its highest over the turns; so are their joins
        (joined_turns, by `roles`, one per turn; None: every turn a user's). With
        `whole` (the conversation as one text), its decoded views (normalizer.views past the plain
        one) are views too, so that an encoding or a payload split across turns is read whole; its
        plain view is not, because a system prompt or a role label beside a question moves the
        question's score away from where the thresholds were calibrated. TextTooLong past
        `max_windows` windows in all. With `progress`, CheckCancelled between stages and embedding
        batches once the check's call is done."""
        stage_done = progress.raise_if_cancelled if progress is not None else _no_check
        joins = joins_of(turns, roles)
        screened = self._screened_turns(turns, roles, joins.texts)  # the turns, or packs of them
        scored = [*screened, *joins.texts]  # the windows across whole turns last
        stage_done()
        decoded = [decoded_views(text) for text in [*scored, *([whole] if whole is not None else [])]]
        texts = [list(text_views.forms) for text_views in decoded[: len(scored)]]
        decoded_whole = list(decoded[-1].forms[1:]) if whole is not None else []
        forms_of = texts + ([decoded_whole] if decoded_whole else [])  # the whole's decoded views last
        stage_done()
        per_text = [[self.embedder.text_windows(form) for form in forms] for forms in forms_of]
        self._check_size(sum(len(rows) for per_view in per_text for rows in per_view), len(turns) > 1)
        stage_done()
        # a turn's clauses and restatements (extra_rows); the whole's decoded views have none
        extras = [
            extra_rows(self.embedder, text, forms) if kind == "prompt" else []
            for text, forms in zip(scored, texts, strict=True)
        ]
        stage_done()
        rows = [row for per_view in per_text for view_rows in per_view for row in view_rows]
        num_view_rows = len(rows)
        rows += [row for extra in extras for row in extra]
        # [N, H]: every view's windows, then the extras
        embeddings = self.embedder.embed_windows(rows, progress=progress)
        view_part, extra_part = embeddings.split([num_view_rows, len(rows) - num_view_rows])
        attack_views: list[list[torch.Tensor]] = []  # per text, its views' window embeddings
        per_text_rows = [sum(len(view_rows) for view_rows in per_view) for per_view in per_text]
        for per_view, text_embeddings in zip(per_text, view_part.split(per_text_rows), strict=True):
            attack_views.append(list(text_embeddings.split([len(view_rows) for view_rows in per_view])))
        harm_views = [list(text_views) for text_views in attack_views]  # then each text's extra rows
        for text_views, extra in zip(harm_views, extra_part.split([len(e) for e in extras]), strict=False):
            text_views += list(extra.split(1)) if len(extra) else []
        role_start = len(scored) - len(joins.role_windows)
        across = [
            (range(role_start - len(joins.windows), role_start), JOIN_MARGIN_LOGITS),
            (range(role_start, len(scored)), ROLE_JOIN_MARGIN_LOGITS),
        ]
        harm = self._harm_scores(kind, harm_views, across)  # [C]
        values = dict(zip(self.categories, harm.tolist(), strict=True))
        thresholds = self.thresholds[kind]
        if kind == "prompt":
            # the attack heads judge what was sent; a join of fragments is for the harm categories
            del attack_views[len(screened) : len(scored)]
            for head in self.attack_heads:
                values[head.name] = max(head.score(text_views) for text_views in attack_views)
                thresholds = thresholds | {head.name: head.threshold}
            values[SUFFIX_CATEGORY] = max(suffix_score(turn) for turn in turns)
            thresholds = thresholds | {SUFFIX_CATEGORY: SUFFIX_THRESHOLD}
        # The language screen also reads a turn as written where look-alike letters of another
        # script were folded into Latin ones: a request in Cyrillic look-alikes is read in Latin
        # letters by the heads, and refused as a script the gate does not read where most of it is.
        unfolded = [_unfolded(text) for text in screened] + [[]] * (len(forms_of) - len(screened))
        read = zip(unfolded, forms_of, strict=True)
        shares = (foreign_share_of_views([*raw, *forms]) for raw, forms in read)
        language = max(shares, key=lambda share: share.share, default=NO_LANGUAGE_EVIDENCE)
        values[LANGUAGE_CATEGORY] = language.share
        values[ENCODINGS_CATEGORY] = float(any(text_views.is_capped for text_views in decoded))
        thresholds = thresholds | {
            LANGUAGE_CATEGORY: LANGUAGE_THRESHOLD,
            ENCODINGS_CATEGORY: ENCODINGS_THRESHOLD,
        }
        return Scores(values=values, thresholds=thresholds, num_windows=len(embeddings), language=language)


def _no_check() -> None:
    """A stage boundary of a check that cannot be cancelled."""


def _unfolded(text: str) -> list[str]:
    """The text as written, NFKC-normalized, where folding look-alike letters changes it; else none
    (at once for ASCII, which holds no look-alike letters, before or after NFKC)."""
    if text.isascii():
        return []
    normalized = normalize(text)
    return [normalized] if fold_confusables(normalized) != normalized else []


def view_rows(embedder: MiniLMEmbedder, text: str) -> list[list[list[int]]]:
    """The windows of each view of `text` (training reuses it)."""
    return [embedder.text_windows(view) for view in views(text)]


def screen_rows(embedder: MiniLMEmbedder, text: str) -> list[list[int]]:
    """Every window of every view of `text`: the rows one check embeds (training reuses it)."""
    return [window for rows in view_rows(embedder, text) for window in rows]


def extra_rows(embedder: MiniLMEmbedder, text: str, forms: list[str]) -> list[list[int]]:
    """One window per clause (normalizer.prompt_clauses; a decoded view's clauses too, at most
    MAX_CLAUSES of them) and per restatement (restate.prompt_restatements) of a prompt whose views
    are `forms`: its harm views past its views. A decoded view that holds a harmless sentence
    beside the request is diluted as a plain one would be."""
    readings = prompt_readings(text, forms[0])
    decoded = [c for form in forms[1:] for c in clauses(form)][:MAX_CLAUSES]
    texts = prompt_clauses(readings) + decoded + prompt_restatements(readings)
    return [embedder.text_windows(t)[0] for t in dict.fromkeys(texts)]
