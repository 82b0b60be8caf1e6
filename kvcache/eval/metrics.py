"""Scores of a prediction against its reference answers, in [0, 100].

    string_match_all   RULER's metric for niah, vt, cwe, fwe: the share of the references that
                       occur (case-insensitive) in the prediction.
    string_match_part  RULER's metric for qa: 100 if any reference occurs in the prediction.
    exact_match        100 if the normalised prediction equals a normalised reference (SQuAD's
                       normalisation: lower case, no punctuation, no articles, single spaces).
    f1                 the best token-level F1 against a reference, after the same normalisation
                       (SQuAD's and LongBench's qa_f1).

A task's score is the mean of its samples' scores. Predictions are cleaned first as kvpress
cleans them: stripped, control characters removed.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_CONTROL = re.compile(r"[\x00-\x1f]")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def clean(prediction: str) -> str:
    return _CONTROL.sub("", prediction.strip()).strip()


def string_match_all(prediction: str, answers: tuple[str, ...]) -> float:
    low = prediction.lower()
    return 100.0 * sum(a.lower() in low for a in answers) / len(answers)


def string_match_part(prediction: str, answers: tuple[str, ...]) -> float:
    low = prediction.lower()
    return 100.0 * any(a.lower() in low for a in answers)


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: tuple[str, ...]) -> float:
    return 100.0 * any(normalize(prediction) == normalize(a) for a in answers)


def f1(prediction: str, answers: tuple[str, ...]) -> float:
    def one(answer: str) -> float:
        pred, ref = normalize(prediction).split(), normalize(answer).split()
        common = sum((Counter(pred) & Counter(ref)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(pred), common / len(ref)
        return 2 * precision * recall / (precision + recall)

    return 100.0 * max(one(a) for a in answers)


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part,
           "exact_match": exact_match, "f1": f1}


def score(metric: str, prediction: str, answers: tuple[str, ...]) -> float:
    """The sample's score in [0, 100] under ``metric`` (one of ``SCORERS``)."""
    if metric not in SCORERS:
        raise ValueError(f"unknown metric {metric!r}; available: {', '.join(SCORERS)}")
    return SCORERS[metric](clean(prediction), tuple(answers))
