"""What RULER's tasks are built from: essay text, noise sentences, word lists.

    essay   the packaged public-domain texts (kvcache/data/texts, or a directory of .txt files),
            whitespace-normalised into one word stream, read from its start (RULER reads its
            Paul Graham essays the same way) and repeated if a context needs more words.
    noise   RULER's five sentences, "The grass is green. ... There and back again."
    words   RULER's word lists, those of the ``wonderwords`` package, packaged with their licence
            in kvcache/data/words.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache
from pathlib import Path

from .tasks import DEFAULT_TEXTS

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
WORDS_DIR = Path(__file__).resolve().parent.parent / "data" / "words"

# A sentence ends at ., ! or ? (optionally closed by a quote or bracket) before a space; nltk's
# punkt, which RULER uses, also knows abbreviations, which matter little for where a needle goes.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]?\s+")


@lru_cache(maxsize=4)
def essay_words(directory: str | None = None) -> tuple[str, ...]:
    """Every ``*.txt`` of ``directory`` (None: the packaged texts) in name order, as one stream
    of words."""
    root = DEFAULT_TEXTS if directory is None else Path(directory)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass a directory of .txt files for the essay haystack")
    files = sorted(root.glob("*.txt"))
    if not files:
        raise ValueError(f"no .txt files in {root} for the essay haystack")
    return tuple(word for f in files for word in f.read_text(encoding="utf-8").split())


def essay(words: tuple[str, ...], n: int) -> str:
    """The first ``n`` words of the stream (repeated as often as needed) as text."""
    if n <= len(words):
        return " ".join(words[:n])
    repeats = -(-n // len(words))
    return " ".join((words * repeats)[:n])


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def noise_lines(n: int) -> list[str]:
    """``n`` noise sentences as RULER's lines of five (the last line may be shorter, so that a
    context can be sized a sentence at a time)."""
    full, rest = divmod(n, len(NOISE))
    lines = [" ".join(NOISE)] * full
    if rest:
        lines.append(" ".join(NOISE[:rest]))
    return lines


@cache
def word_list(kind: str) -> tuple[str, ...]:
    """``nouns``, ``adjectives`` or ``verbs``: one word a line, as packaged."""
    path = WORDS_DIR / f"{kind}.txt"
    return tuple(w.strip() for w in path.read_text(encoding="utf-8").splitlines() if w.strip())


def key_word(rng) -> str:
    """A needle key as RULER draws one: an adjective-noun pair, uniform over all pairs (drawn as
    one index, not as two words, so that the pair is a single draw of ``rng``)."""
    adjectives, nouns = word_list("adjectives"), word_list("nouns")
    a, n = divmod(rng.randrange(len(adjectives) * len(nouns)), len(nouns))
    return f"{adjectives[a]}-{nouns[n]}"


@cache
def common_words() -> tuple[str, ...]:
    """RULER's cwe vocabulary: nouns, adjectives and verbs, sorted, without repeats."""
    return tuple(sorted(set(word_list("nouns") + word_list("adjectives") + word_list("verbs"))))
