"""User datasets: one JSON object a line, LongBench-style.

    context         text, or a list of documents (joined by blank lines; ruler's qa tasks use
                    them as the question's gold documents)
    question        text; the prompt is context, a newline, question, answer prefix
    answers         accepted answers: a list of strings (or one string)
    max_new_tokens  optional, default 32
    answer_prefix   optional, default ""
    task            optional, default "dataset": rows are scored and reported per task; for
                    ``--benchmark ruler`` a task of qa_1 or qa_2 feeds that task (no task feeds both)
    metric          optional, default string_match_part (see scoring.py)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .metrics import SCORERS
from .ruler import QA_TASKS, QARecord
from .sample import Sample

DEFAULT_TASK = "dataset"
DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_METRIC = "string_match_part"
FIELDS = ("context", "question", "answers", "max_new_tokens", "answer_prefix", "task", "metric")


def file_hash(path: str) -> str:
    return hashlib.sha256(_path(path).read_bytes()).hexdigest()[:16]


def _path(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset {path} is not a file; pass a JSON-lines file (one object a line)")
    return p


def _records(path: str) -> list[dict]:
    rows = []
    for number, line in enumerate(_path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a line must be a JSON object with context, question and answers")
        unknown = set(row) - set(FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; the fields are {', '.join(FIELDS)}")
        for name in ("context", "question", "answers"):
            if name not in row:
                raise ValueError(f"{where}: missing {name!r} (every line needs context, question and answers)")
        context, answers = row["context"], row["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if isinstance(context, str):
            context = [context]
        if not (isinstance(context, list) and context and all(isinstance(c, str) for c in context)):
            raise ValueError(f"{where}: context must be a string or a non-empty list of strings")
        if not (isinstance(answers, list) and answers and all(isinstance(a, str) and a for a in answers)):
            raise ValueError(f"{where}: answers must be a non-empty string or a non-empty list of them")
        if not isinstance(row["question"], str):
            raise ValueError(f"{where}: question must be a string")
        new = row.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if isinstance(new, bool) or not isinstance(new, int) or new <= 0:
            raise ValueError(f"{where}: max_new_tokens must be a positive integer, got {new!r}")
        metric = row.get("metric", DEFAULT_METRIC)
        if metric not in SCORERS:
            raise ValueError(f"{where}: unknown metric {metric!r}; available: {', '.join(SCORERS)}")
        for name in ("answer_prefix", "task"):
            if name in row and not isinstance(row[name], str):
                raise ValueError(f"{where}: {name} must be a string")
        rows.append({"context": context, "question": row["question"], "answers": tuple(answers),
                     "max_new_tokens": new, "answer_prefix": row.get("answer_prefix", ""),
                     "task": row.get("task", DEFAULT_TASK), "metric": metric})
    if not rows:
        raise ValueError(f"dataset {path} has no records")
    return rows


def read(path: str) -> list[Sample]:
    """Every record as a sample, numbered within its task in file order."""
    counts: dict[str, int] = {}
    out = []
    for r in _records(path):
        index = counts.get(r["task"], 0)
        counts[r["task"]] = index + 1
        out.append(Sample(r["task"], index, "\n\n".join(r["context"]), "\n" + r["question"], r["answer_prefix"],
                          r["answers"], r["max_new_tokens"], r["metric"]))
    return out


def tasks(path: str) -> list[str]:
    return list(dict.fromkeys(r["task"] for r in _records(path)))


def qa_source(path: str) -> tuple[tuple[str, tuple[QARecord, ...]], ...]:
    """ruler's qa data from a dataset: records with task qa_1 / qa_2 feed that task, records with
    no task (the default) feed both."""
    found: dict[str, list[QARecord]] = {t: [] for t in QA_TASKS}
    for r in _records(path):
        record = QARecord(r["question"], tuple(r["context"]), r["answers"])
        for task in QA_TASKS:
            if r["task"] in (task, DEFAULT_TASK):
                found[task].append(record)
    return tuple((t, tuple(rs)) for t, rs in found.items() if rs)
