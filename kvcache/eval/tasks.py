"""Training and evaluation sequences: plain corpus text and synthetic long-context retrieval.

Retrieval tasks hide needles in corpus text and ask for them at the end, so the answer depends
on attention to tokens far back:
    passkey   "The pass key is 48213. Remember it. 48213 is the pass key." at some depth;
              the sequence ends with "What is the pass key? The pass key is 48213."
              For an instruction-tuned model, ``chat`` writes it as a conversation: a user
              message that says what to look for, holds the text and asks; the assistant's
              answer starts "The pass key is".
    lookup    several "The code for Harriet is 5124." lines; the question names one of them.
    repeat    (training only) a span of the text copied verbatim further on; every token of the
              copy after its first is predictable by attending back, a dense signal for the
              induction mechanism that retrieval needs.
Pieces are tokenized separately and concatenated, the same way evaluation builds its prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

NAMES = ("Harriet", "Edmund", "Marianne", "Darcy", "Fanny", "Willoughby", "Emma", "Elinor",
         "Henry", "Catherine", "Anne", "Frederick", "Lydia", "Jane", "Thomas", "Mary")
ANSWER_WEIGHT = 10.0
# The question that ends every passkey prompt; the answer (" 48213.") follows it.
PASSKEY_QUESTION = " What is the pass key? The pass key is"
# In a conversation: what the user's message starts with, what it ends with, and what the
# assistant's turn starts with (the answer follows it, as above).
PASSKEY_INSTRUCTION = ("There is a pass key hidden in the text below. Find it and memorize it: "
                       "I will ask you for it afterwards.\n")
PASSKEY_ASK = "\nWhat is the pass key?"
PASSKEY_ANSWER_PREFIX = "The pass key is"

# The held-out public-domain texts shipped with the package (sources and licences in LICENSES.md
# there), so that evaluation works from any directory.
DEFAULT_TEXTS = Path(__file__).resolve().parent.parent / "data" / "texts"


def read_texts(directory: str | Path | None, tokenizer) -> torch.Tensor:
    """Every ``*.txt`` file of ``directory`` (None: the packaged held-out texts, ``DEFAULT_TEXTS``)
    tokenized, each followed by end-of-text: (N,) long."""
    directory = DEFAULT_TEXTS if directory is None else Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; pass a directory of .txt files")
    texts = [p.read_text() for p in sorted(directory.glob("*.txt"))]
    if not texts:
        raise ValueError(f"no .txt files in {directory}")
    ids: list[int] = []
    for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def start_ids(tokenizer, opening: str = "") -> list[int]:
    """What a prompt starts with before its text: the tokenizer's beginning-of-text token, if it
    has one and ``opening`` (a chat template's text before the user's message, or "") does not
    write it itself."""
    if tokenizer.bos_token_id is None:
        return []
    bos_text = tokenizer.special_tokens.get("bos_token") if opening else None
    return [] if bos_text and opening.startswith(bos_text) else [tokenizer.bos_token_id]


class TaskMaker:
    """Builds task sequences from a token stream of filler text (``read_texts``)."""

    def __init__(self, stream: torch.Tensor, tokenizer, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.stream = stream
        self.start = start_ids(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def filler(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.stream) - n - 1)
        return self.stream[start : start + n].tolist()

    def passkey(self, length: int, depth: float | None = None, key: int | None = None,
                chat: tuple[str, str] | None = None):
        """(tokens, answer) of about ``length`` tokens with the needle at ``depth`` in [0, 1].
        ``chat``: the chat template's text before and after a user message (with the generation
        prompt), to write the prompt as a conversation; the prompt then ends with
        ``passkey_question(chat)`` as it otherwise ends with ``PASSKEY_QUESTION``."""
        key = self.rng.randrange(10000, 100000) if key is None else key
        depth = self.rng.random() if depth is None else depth
        head = self.start if chat is None else start_ids(self.tok, chat[0]) + self.encode(chat[0] + PASSKEY_INSTRUCTION)
        needle = self.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        question = self.passkey_question(chat)
        answer = self.encode(f" {key}.")
        fill = self.filler(max(0, length - len(needle) - len(question) - len(answer) - len(head)))
        at = int(depth * len(fill))
        return head + fill[:at] + needle + fill[at:] + question, answer

    def passkey_question(self, chat: tuple[str, str] | None = None) -> list[int]:
        """The ids a passkey prompt ends with, after its context: the question, and with ``chat``
        the end of the user's message and the start of the assistant's answer."""
        if chat is None:
            return self.encode(PASSKEY_QUESTION)
        return self.encode(PASSKEY_ASK + chat[1] + PASSKEY_ANSWER_PREFIX)

    def lookup(self, length: int, needles: int = 3):
        names = self.rng.sample(NAMES, needles)
        codes = [self.rng.randrange(1000, 10000) for _ in names]
        lines = [self.encode(f" The code for {n} is {c}. ") for n, c in zip(names, codes)]
        pick = self.rng.randrange(needles)
        question = self.encode(f" What is the code for {names[pick]}? The code for {names[pick]} is")
        answer = self.encode(f" {codes[pick]}.")
        fill = self.filler(max(0, length - sum(map(len, lines)) - len(question) - len(answer) - len(self.start)))
        cuts = sorted(self.rng.randrange(len(fill) + 1) for _ in lines)
        out, prev = list(self.start), 0
        for cut, line in zip(cuts, lines):
            out += fill[prev:cut] + line
            prev = cut
        return out + fill[prev:] + question, answer

    def repeat(self, length: int, random_span: bool = False) -> tuple[list[int], int, int]:
        """(tokens of ``length``, start, end): tokens[start:end] copies an earlier span.

        With ``random_span`` the copied span is random token ids planted in the text, so nothing
        but the earlier copy predicts it (as with a passkey's digits)."""
        if length < 32:
            raise ValueError(f"repeat needs length >= 32 (two spans of at least 8 tokens and text), got {length}")
        span = self.rng.randrange(8, max(9, length // 4))
        fill = self.filler(length - (2 if random_span else 1) * span - len(self.start))
        if random_span:
            at = self.rng.randrange(0, len(fill) + 1)
            planted = [self.rng.randrange(3, self.tok.vocab_size) for _ in range(span)]
            fill = fill[:at] + planted + fill[at:]
            src = at
        else:
            src = self.rng.randrange(0, len(fill) - span)
        at = self.rng.randrange(src + span, len(fill) + 1)
        seq = self.start + fill[:at] + fill[src : src + span] + fill[at:]
        start = len(self.start) + at
        return seq, start, start + span

    def batch(self, rows: int, length: int, retrieval_share: float,
              repeat_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (rows, length + 1) and per-token loss weights (answers weigh ANSWER_WEIGHT).

        A ``retrieval_share`` of the rows are passkey or lookup tasks, a ``repeat_share`` are
        repeat tasks (the copy weighs ANSWER_WEIGHT), the rest plain text.
        """
        if min(retrieval_share, repeat_share) < 0 or retrieval_share + repeat_share > 1:
            raise ValueError(
                f"retrieval_share ({retrieval_share}) and repeat_share ({repeat_share}) must be "
                "non-negative and sum to at most 1"
            )
        ids = torch.empty(rows, length + 1, dtype=torch.long)
        weights = torch.ones(rows, length + 1)
        for r in range(rows):
            draw = self.rng.random()
            if draw < repeat_share:
                seq, start, end = self.repeat(length + 1, random_span=self.rng.random() < 0.5)
                ids[r] = torch.tensor(seq)
                weights[r, start + 1 : end] = ANSWER_WEIGHT
                continue
            if draw >= repeat_share + retrieval_share:
                ids[r] = self.stream[self._start(length + 1) :][: length + 1]
                continue
            make = self.passkey if self.rng.random() < 0.5 else self.lookup
            prompt, answer = make(length + 1)
            seq = (prompt + answer)[-(length + 1):]
            seq = seq + self.filler(length + 1 - len(seq))
            ids[r] = torch.tensor(seq)
            end = min(len(prompt) + len(answer), length + 1)
            weights[r, end - len(answer) : end] = ANSWER_WEIGHT
        return ids, weights

    def _start(self, n: int) -> int:
        return self.rng.randrange(0, len(self.stream) - n)
