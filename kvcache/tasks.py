"""Training and evaluation sequences: plain corpus text and synthetic long-context retrieval.

Retrieval tasks hide needles in corpus text and ask for them at the end, so the answer depends
on attention to tokens far back:
    passkey   "The pass key is 48213. Remember it. 48213 is the pass key." at some depth;
              the sequence ends with "What is the pass key? The pass key is 48213."
    lookup    several "The code for Harriet is 5124." lines; the question names one of them.
Pieces are tokenized separately and concatenated, the same way evaluation builds its prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

NAMES = ("Harriet", "Edmund", "Marianne", "Darcy", "Fanny", "Willoughby", "Emma", "Elinor",
         "Henry", "Catherine", "Anne", "Frederick", "Lydia", "Jane", "Thomas", "Mary")
ANSWER_WEIGHT = 10.0


def read_texts(directory: str | Path, tokenizer) -> torch.Tensor:
    """Every ``*.txt`` file of ``directory`` tokenized, each followed by end-of-text: (N,) long."""
    texts = [p.read_text() for p in sorted(Path(directory).glob("*.txt"))]
    if not texts:
        raise ValueError(f"no .txt files in {directory}")
    ids: list[int] = []
    for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


class TaskMaker:
    """Builds task sequences from a token stream of filler text (``read_texts``)."""

    def __init__(self, stream: torch.Tensor, tokenizer, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.stream = stream
        # Sequences start with the tokenizer's beginning-of-text token, if it has one.
        self.start = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def filler(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.stream) - n - 1)
        return self.stream[start : start + n].tolist()

    def passkey(self, length: int, depth: float | None = None, key: int | None = None):
        """(tokens, answer) of about ``length`` tokens with the needle at ``depth`` in [0, 1]."""
        key = self.rng.randrange(10000, 100000) if key is None else key
        depth = self.rng.random() if depth is None else depth
        needle = self.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        question = self.encode(" What is the pass key? The pass key is")
        answer = self.encode(f" {key}.")
        fill = self.filler(max(0, length - len(needle) - len(question) - len(answer) - len(self.start)))
        at = int(depth * len(fill))
        return self.start + fill[:at] + needle + fill[at:] + question, answer

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

    def batch(self, rows: int, length: int, retrieval_share: float) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (rows, length + 1) and per-token loss weights (answers weigh ANSWER_WEIGHT)."""
        ids = torch.empty(rows, length + 1, dtype=torch.long)
        weights = torch.ones(rows, length + 1)
        for r in range(rows):
            if self.rng.random() >= retrieval_share:
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
