"""Fine-tuning rows from text files or JSONL: every document is tokenized (with the tokenizer's
beginning-of-text token, followed by end-of-text), the documents are concatenated into one token
stream, and the stream is cut into rows of ``seq_len`` tokens (the remainder is dropped)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch


def read_documents(paths: Sequence[str | Path], field: str = "text") -> Iterator[str]:
    """The documents of ``paths``: a ``.jsonl`` file gives one per line (the string in ``field``
    of each JSON object; blank lines are skipped), any other file is one document of plain text."""
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"data file {path} does not exist (or is not a file)")
        if path.suffix != ".jsonl":
            yield path.read_text()
            continue
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {number} of {path} is not valid JSON ({e})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"line {number} of {path} is not a JSON object: {line.strip()[:60]}")
                if field not in record:
                    raise ValueError(
                        f"line {number} of {path} has no field {field!r} (its fields: {', '.join(map(str, record)) or 'none'}); "
                        "name the text field with --field"
                    )
                if not isinstance(record[field], str):
                    raise ValueError(f"field {field!r} on line {number} of {path} is a {type(record[field]).__name__}, not text")
                yield record[field]


def token_rows(paths: Sequence[str | Path], tokenizer, seq_len: int, field: str = "text") -> torch.Tensor:
    """(N, seq_len) long: the documents of ``paths`` as one token stream cut into rows.

    Raises ValueError when the data holds no document, or too few tokens for one row."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (a token to predict from and one to predict), got {seq_len}")
    stream: list[int] = []
    documents = 0
    for text in read_documents(paths, field):
        documents += 1
        stream.extend(tokenizer.encode(text, add_special_tokens=True))
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    names = ", ".join(map(str, paths))
    if not documents:
        raise ValueError(f"the dataset is empty: {names} holds no document")
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(
            f"the dataset is too small: {documents} documents, {len(stream)} tokens in all, fewer than one row of "
            f"--seq-len {seq_len} tokens; add data or shorten the rows"
        )
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
