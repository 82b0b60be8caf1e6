"""One evaluation example and how it becomes token ids.

A ``Sample`` is text in three parts, split where kvpress splits RULER's prompts: the ``context``
(what a query-agnostic run compresses before anything else is seen), the ``question`` and the
``answer_prefix`` (the start of the answer, which the model continues). ``encode`` turns it into
the three id lists that are fed, in order, to the model; their lengths are what RULER's target
lengths count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import SCORERS
from .tasks import start_ids


@dataclass(frozen=True)
class Sample:
    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    metric: str = "string_match_all"
    # Whatever the builder wants recorded with the result (haystack size, needle depths, ...).
    info: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.metric not in SCORERS:
            raise ValueError(f"unknown metric {self.metric!r}; available: {', '.join(SCORERS)}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not self.answers:
            raise ValueError(f"sample {self.index} of {self.task} has no answers")


@dataclass(frozen=True)
class Encoded:
    """Token ids of a sample as fed: context (with the tokenizer's bos, and the chat template's
    opening when ``chat``), question (with the chat template's closing), answer prefix."""

    context: list[int]
    question: list[int]
    prefix: list[int]

    @property
    def ids(self) -> list[int]:
        return self.context + self.question + self.prefix

    def __len__(self) -> int:
        return len(self.context) + len(self.question) + len(self.prefix)


# Stands for the question while the chat template is rendered, so that the template's text before
# and after the user's message can be told apart (the message itself is context + question).
_SPLIT = "\x00KVCACHE-QUESTION\x00"


def chat_parts(tokenizer) -> tuple[str, str]:
    """(opening, closing): the chat template's text around one user message, with the
    generation prompt. The answer prefix follows ``closing``, as kvpress's pipeline does."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SPLIT}], add_generation_prompt=True,
                                         tokenize=False)
    if text.count(_SPLIT) != 1:
        raise ValueError("the chat template does not render the user's message verbatim; evaluate without chat")
    opening, closing = text.split(_SPLIT)
    return opening, closing


def encode(tokenizer, sample: Sample, chat: bool = False) -> Encoded:
    """The ids a run feeds. Each part is tokenized on its own so that the boundary between the
    part that is compressed first and the rest is exact in tokens."""
    opening, closing = chat_parts(tokenizer) if chat else ("", "")
    context = start_ids(tokenizer, opening) + tokenizer.encode(opening + sample.context, add_special_tokens=False)
    question = tokenizer.encode(sample.question + closing, add_special_tokens=False)
    prefix = tokenizer.encode(sample.answer_prefix, add_special_tokens=False)
    return Encoded(context, question, prefix)
