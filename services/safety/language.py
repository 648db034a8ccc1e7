"""How much of a text is written in a language other than English: the share the gate cannot read.

The gate's encoder (all-MiniLM-L6-v2, an English WordPiece vocabulary) and every head on it were
trained on English. A request in another language scores as noise there: before this screen, none
of 16 plain requests for bombs, poison, ransomware or murder in French, Spanish, German and Chinese
was blocked (bench/results/safety_language_2026-12-06.md). A text the gate cannot read is not a
text it has found safe, so the screen scores each view's foreign share as a category of its own,
`unscreened_language`, which blocks by default. A tenant whose users write other languages turns it
off (or raises its threshold) in the gateway's tenants file; the audit event records the waiver.

The score weighs evidence, not characters:
- English function words ("the", "what", "how", "please", ...) are evidence of English;
- distinctive function words of about 40 other languages written in Latin letters, words in other
  scripts, French and Italian elisions (l', d', qu'), Vietnamese letters and Spanish inverted
  marks are evidence of another language; other accented Latin letters count half;
- everything else (names, technical terms, code, numbers) is no evidence either way.

A view's score is foreign / (foreign + English) once there is at least MIN_EVIDENCE of both
together, else 0 (too little to tell: the English screen applies). A long text also scores each
sentence with at least MIN_SENTENCE_EVIDENCE of its own, and the highest counts, so an English
template around a translated request is caught without a foreign word in an English essay tipping
it. Words shared by English and a common other language ("die", "also", "no", "per", "con") are on
neither list.
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

LANGUAGE_CATEGORY = "unscreened_language"
# The gate blocks a view at least this foreign: more foreign than English evidence, with a margin
# (a French title in an English question is one word against one).
LANGUAGE_THRESHOLD = 0.6
MIN_EVIDENCE = 2.0
MIN_SENTENCE_EVIDENCE = 4.0
# Letters of scripts written without spaces between words: each letter is about half a word.
_UNSPACED_WEIGHT = 0.5
_ACCENT_WEIGHT = 0.5

_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
_SENTENCE_END = re.compile(r"(?<=[.?!;:。？！；])\s*|\n+")


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_ELISION = re.compile(r"^(?:l|d|j|qu|c|n|s|m|t|dell|nell|dall|sull|all|un)['’][^\W\d_]")

ENGLISH = _words(
    """
    the and of to in is are was were be been being have had do does did can could would should shall
    may might must not this that these those what which who whom whose when where why how it its you
    your yours he him his she her we our they them their my mine there here with from for about into
    onto than then if or but because as at by on any every each all some just very more most other
    such only own same too out up down again once please write tell give explain want need know help
    use using should make how's what's it's i'm i've i'll i'd you're you've don't doesn't didn't can't
    won't isn't aren't wasn't weren't let's that's there's could've would've
    """
)

# Distinctive function words of other languages written in Latin letters. A word here is one an
# English text rarely holds; see the module docstring for the ones left out on purpose.
FOREIGN_WORDS: dict[str, frozenset[str]] = {
    lang: _words(words)
    for lang, words in {
        "fr": "le les des une sont pas pour dans qui que avec sur cette mais nous vous je il elle ils "
        "elles aux ces leur leurs quel quelle quels quelles être faire très où ça c'est peux puis "
        "pourquoi quoi mes tes notre votre avoir fait tout tous toutes chez même ou suis "
        "quelqu'un voudrais peut sont j'ai n'est qu'il ne comme aussi alors donc peu beaucoup "
        "rien personne quelque veux veut dois doit pouvez pouvons avez avons êtes sommes était "
        "été fais faites merci bonjour svp moi toi lui eux cela ceci voici depuis après",
        "es": "el los las una por para como qué cómo cuál cuáles dónde cuándo quién porque pero más muy "
        "yo tengo puedo puede está están esto esta este eso lo sus mi tu también sobre hacer ser "
        "estar tiene es ella ellos usted quiero necesito cual donde cuando entonces ahora siempre "
        "nunca nada alguien cosa quisiera gustaría podría puedes eres estoy tienes hacia desde "
        "hasta entre cada otro otra mismo bien aquí así mucho mucha muchos poco hola gracias usar",
        "pt": "não uma você vocês isso isto são também ele ela eles meu minha seu sua das ao aos pelo "
        "pela muito mais fazer posso qual quais onde quando é como então ainda depois antes mesmo "
        "aqui agora tudo todos alguém coisa gostaria preciso quero tem ter foi estou estão nós "
        "lhe seus suas deles dela nem",
        "it": "il della delle dello degli che è sono gli alla alle questo questa questi anche perché "
        "più cosa essere dei nel nella sul sulla mio tuo tua suo voglio puoi può ciao grazie "
        "molto di ho sei hai fatto qualcuno quale quali modo farlo persone loro tutto tutti senza "
        "sempre niente dopo prima ecco nostro vostro bene ancora allora però oppure stato altro "
        "altri ogni perchè qualche posso",
        "de": "der das und ist nicht ich du wir ein eine einen einem einer auf für zu wie wo wer auch "
        "dem es sich werden wird kann können bitte mein meine haben oder aber ihr sind nach bei "
        "warum welche welcher mich mir dich diese dieser dieses noch schon sehr gibt wenn dass "
        "kein keine habe hatte wurde worden sein seine ihre ihnen uns unser euch etwas nichts "
        "alles viel viele mehr immer jetzt hier dort heute machen möchte soll sollte muss müssen "
        "wurden zwischen ohne gegen durch zum zur beim",
        "nl": "het een niet ik wat hoe zijn voor deze maar ook naar wij jij mijn hebben wordt kunnen "
        "kun je waarom welke zo bij uit nog geen dit heb hebt heeft werd moet moeten willen wil "
        "kunt zou jullie iets niets veel meer altijd daar waar wanneer omdat alsjeblieft bedankt "
        "graag maken doen gaan mij zich",
        "sv": "och är att det som jag inte för på hur vad varför ni",
        "da-no": "og jeg ikke hvordan hva hvad hvorfor ikkje meg deg",
        "fi": "ja ei että kuinka miten mitä mikä minä sinä hän ovat olen voi kanssa mutta",
        "pl": "nie się jest że jak czy mnie jestem może są dla tak jaki jakie który która które przez",
        "cs-sk": "není jsem jsou jako který která které proč mě si sa ako som",
        "ro": "și în este nu că să sunt pentru mai asta acest aceasta",
        "hu": "és az hogy nem egy hogyan vagy csak ez azt ami amely kell lehet nekem miért",
        "tr": "bir ve bu için ile nasıl ne çok daha olarak değil yok gibi veya şey bana beni nedir mı "
        "mu mü bunu şu neden niçin hangi kim nerede zaman lütfen teşekkürler yapmak istiyorum "
        "nasil bilgi olan kadar sonra önce hiç bütün tüm",
        "id-ms": "yang itu tidak saya untuk dengan ke akan bisa bagaimana cara membuat aku kamu anda dia "
        "mereka kami kita atau juga sudah belum adalah dalam pada bagi boleh tak nak mengapa "
        "kenapa dimana kapan siapa berapa harus ingin mau perlu seperti karena jika kalau agar "
        "supaya lebih sangat semua banyak beberapa orang tentang tanpa sebagai oleh telah sedang "
        "masih hanya bukan punya memiliki menggunakan mendapatkan apakah tolong bantu buat",
        "jv": "kowe iki kuwi karo ing ora piye carane gawe opo wong arep kanggo saka marang wis durung "
        "kudu apik iku kabeh akeh banget uga nanging amarga dadi nalika kepiye ngapa endi sapa "
        "ngendi njaluk ngerti sampeyan panjenengan dheweke mung",
        "vi": "và của là không có cho được một những các này người làm thế nào tôi bạn với để như khi "
        "trong đã sẽ cách gì sao hãy",
        "tl": "ang ng mga ay ko mo paano ano ako ikaw siya kami tayo sila ito iyan gumawa naman rin "
        "kasi dahil kapag nang niya nila namin natin ninyo akin iyo kanya yung yun dito doon saan "
        "sino bakit kailan gaano magkano gusto kailangan pwede puwede paki salamat opo wala meron "
        "mayroon",
        "sw": "wa kwa ni za kama hii jinsi gani nini mimi wewe yeye sisi nyinyi wao katika kutoka "
        "kuhusu lakini pia sana tafadhali nawezaje naweza kufanya kutengeneza ili hivyo kuna "
        "hakuna yangu yako wetu wenu huyo hiyo hilo hizi watu mtu kitu vitu nani wapi lini "
        "kwanini ndiyo hapana baada kabla bila kila sasa pamoja zaidi kwenye kutumia kupata kuwa "
        "unaweza ninaweza nataka ninataka ambayo ambao ambaye wakati siku jambo mambo habari "
        "asante",
        "zu-xh": "ukuthi kanjani ngiyacela ngicela umuntu yini kodwa futhi kanye noma ngoba ukwenza "
        "ngingakwazi kakhulu lokhu loku",
        "gd-ga": "agus tha ciamar bho gu cha dè ri conas tá níl cén ach bhí",
        "hmn": "yuav ua cas kuv koj thiab rau nyob tsis ntawm ib tus txoj hauv peb lawv nws",
        "gn": "mba'éichapa upe ndaipóri ikatu ha'e che nde ñande ndive rehe mba'e",
        "ht": "kijan mwen nou yo pou ki fè kapab kòman",
        "ca": "amb els és perquè què aquest aquesta",
        "hr-sr-bs": "kako što šta za koji koja koje smo ste",
        "cy": "yn sut ydy ydw gyda hefyd dw",
        "eu": "ez zer hau dut",
        "so": "iyo waa ku sidee maxaa aan ayaa",
        "yo": "ati ti naa bawo kini mo iwo",
        "ha": "yaya ina shi ita wannan amma kuma",
        "lt-lv": "ir kaip kad yra kas aš kā ka kāpēc",
        "et": "kuidas mis kas",
        "is": "að ekki hvernig hvað ég það",
        "sq": "dhe në është një për që nuk unë",
        # Hindi and Urdu written in Latin letters ("Hinglish"), as chat users often type them.
        "hi-latn": "kaise kya hai hain mein aur nahi nahin kaun kahan kyun kyu mujhe aap kuch bahut bhai "
        "ghar banaye banate banana karna karo kare sakta sakte chahiye batao bataiye",
    }.items()
}
_FOREIGN_LANGUAGE = {word: lang for lang, words in FOREIGN_WORDS.items() for word in words}
# English words written with accents, which count as no evidence.
_ENGLISH_LOANS = _words(
    "café cafés naïve résumé résumés cliché fiancé fiancée façade déjà entrée rosé soufflé crème "
    "brûlée piñata jalapeño jalapeños señor über doppelgänger protégé exposé sauté touché éclair "
    "décor débris élite rôle coördinate naïveté pokémon"
)
_VIETNAMESE_LETTERS = frozenset("ăâđêôơưĂÂĐÊÔƠƯ")


@dataclass(frozen=True)
class LanguageScore:
    """A text's foreign share (0 to 1) and what the foreign evidence most looks like."""

    share: float
    guess: str  # a language code of FOREIGN_WORDS or a script name ("CJK", "CYRILLIC"); "" for none


@dataclass
class _Evidence:
    english: float = 0.0
    foreign: float = 0.0

    def share(self, min_evidence: float) -> float:
        total = self.english + self.foreign
        return self.foreign / total if total >= min_evidence and total > 0 else 0.0


def _is_latin(char: str) -> bool:
    return char < "\u0250" or "\u1e00" <= char <= "\u1eff"


def _script(char: str) -> str:
    name = unicodedata.name(char, "")
    return name.split(" ", 1)[0] if name else "UNKNOWN"


_UNSPACED = frozenset({"CJK", "HIRAGANA", "KATAKANA", "THAI", "LAO", "KHMER", "MYANMAR", "TIBETAN"})


def _word_evidence(word: str, evidence: _Evidence, guesses: defaultdict[str, float]) -> None:
    other = [c for c in word if not _is_latin(c)]
    if other:
        if len(other) < 2:
            return  # a lone Greek or other letter: a symbol in an English text
        script = _script(other[0])
        weight = len(other) * _UNSPACED_WEIGHT if script in _UNSPACED else 1.0
        evidence.foreign += weight
        guesses[script] += weight
        return
    lower = word.lower().replace("’", "'")
    if lower in ENGLISH:
        evidence.english += 1.0
    elif (lang := _FOREIGN_LANGUAGE.get(lower)) is not None:
        evidence.foreign += 1.0
        guesses[lang] += 1.0
    elif _ELISION.match(lower):
        evidence.foreign += 1.0
        guesses["fr"] += 1.0
    elif any(c in _VIETNAMESE_LETTERS or "\u1e00" <= c <= "\u1eff" for c in word):
        evidence.foreign += 1.0
        guesses["vi"] += 1.0
    elif not word.isascii() and lower not in _ENGLISH_LOANS:
        evidence.foreign += _ACCENT_WEIGHT


def _evidence(text: str, guesses: defaultdict[str, float]) -> _Evidence:
    evidence = _Evidence()
    for match in _WORD.finditer(text):
        _word_evidence(match.group(), evidence, guesses)
    inverted = text.count("¿") + text.count("¡")
    evidence.foreign += inverted
    if inverted:
        guesses["es"] += inverted
    return evidence


def foreign_share(text: str, by_sentence: bool = True) -> LanguageScore:
    """The share of `text`'s language evidence that is not English: over the whole text, and when
    `by_sentence` the highest over its sentences with MIN_SENTENCE_EVIDENCE of their own."""
    guesses: defaultdict[str, float] = defaultdict(float)
    share = _evidence(text, guesses).share(MIN_EVIDENCE)
    if by_sentence:
        for sentence in _SENTENCE_END.split(text):
            if sentence and sentence != text:
                share = max(share, _evidence(sentence, defaultdict(float)).share(MIN_SENTENCE_EVIDENCE))
    guess = max(guesses, key=guesses.__getitem__) if guesses and share > 0 else ""
    return LanguageScore(share, guess)


NO_LANGUAGE_EVIDENCE = LanguageScore(0.0, "")


def foreign_share_of_views(views: Iterable[str]) -> LanguageScore:
    """The highest foreign share over a text's views (the plain one and each decoded one)."""
    return max((foreign_share(view) for view in views), key=lambda s: s.share, default=NO_LANGUAGE_EVIDENCE)
