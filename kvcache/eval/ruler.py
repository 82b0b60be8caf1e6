"""RULER's 13 tasks (Hsieh et al. 2024), generated offline under any tokenizer.

    niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery
        needles "One of the special magic {type} for {key} is: {value}." (keys: adjective-noun
        words or uuid4s; values: 7-digit numbers or uuid4s) in a haystack of noise sentences,
        essay text (needles between sentences, at depths drawn from 40 evenly spaced points) or
        other needles; the question asks for the values of one or more keys.
    vt      variable tracking: a chain "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE ", ... hidden
            in noise, after one worked example; the answer is every variable of the chain.
    cwe     common words: a numbered list in which ten words recur more often than the rest,
            after one worked example; the answer is those ten.
    fwe     frequent words: coded words drawn from a zeta distribution; the answer is the three
            most frequent (the most frequent of all is the noise '...').
    qa_1, qa_2
            question answering over documents (SQuAD-like, HotpotQA-like): the gold documents of
            a question among other questions' documents. They need a data file (``qa_records``);
            without one they are skipped.

RULER's templates, answer prefixes, generation lengths and metrics are kept as RULER defines them.
A sample is a pure function of (task, seed, index, haystack size): ``build`` makes the sample of
a given size and ``make`` finds, by binary search, the largest size whose prompt plus the task's
generation length fits the target length in the model's own tokens (RULER's rule). Same seed,
same prompts, on any machine.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from . import haystack as hs
from .sample import Sample, encode

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
QA_TASKS = ("qa_1", "qa_2")

# RULER's 40 needle depths, percent: round(linspace(0, 100, 40)).
DEPTHS = tuple(round(100 * i / 39) for i in range(40))

# (template with {context} and {query}, answer prefix, tokens to generate, metric): RULER's.
NIAH = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_v} afterwards.\n{context}\n",
        "What are all the special magic {type_v} for {query} mentioned in the provided text?",
        " The special magic {type_v} for {query} mentioned in the provided text are", 128)
VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n",
      "Question: Find all variables that are assigned the value {query} in the text above.",
      " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
      "are assigned the value {query}, they are: ", 30)
CWE = ("Below is a numbered list of words. In these words, some appear more often than others. "
       "Memorize the ones that appear most often.\n{context}\n",
       "Question: What are the 10 most common words in the above list?",
       " Answer: The top 10 words that appear most often in the list are:", 120)
FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
       "frequently appeared coded words. {context}\n",
       "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
       "frequently appeared words in the above coded text?",
       " Answer: According to the coded text above, the three most frequently appeared words are:", 50)
QA = ("Answer the question based on the given documents. Only give me the answer and do not output any "
      "other words.\n\nThe following are given documents.\n\n{context}\n\n",
      "Answer the question based on the given documents. Only give me the answer and do not output any "
      "other words.\n\nQuestion: {query}",
      " Answer:", 32)
# The fewest noise sentences a vt context has: room for the chain's five lines between its lines.
VT_LEAST = 20
# Lengths below this build cwe at RULER's short-context frequencies.
CWE_LONG = 4096


@dataclass(frozen=True)
class Niah:
    haystack: str     # noise | essay | needle
    key: str          # words | numbers | uuids
    value: str
    keys: int = 1
    values: int = 1
    queries: int = 1


CONFIGS = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", queries=4),
}


@dataclass(frozen=True)
class QARecord:
    """One question of a qa data file: its gold documents and accepted answers."""

    question: str
    documents: tuple[str, ...]
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Source:
    """What tasks are built from besides the tokenizer: essay texts (None: the packaged ones) and
    the qa records of each qa task (a task without records is skipped)."""

    texts: str | None = None
    qa: tuple[tuple[str, tuple[QARecord, ...]], ...] = ()

    def qa_records(self, task: str) -> tuple[QARecord, ...]:
        return dict(self.qa).get(task, ())


def skipped(task: str, source: Source) -> str | None:
    """Why ``task`` cannot run with ``source``, or None."""
    if task in QA_TASKS and not source.qa_records(task):
        return ("needs question-answering data: pass --dataset FILE.jsonl with records whose task is "
                f"{task} (or no task, for both qa tasks)")
    return None


def _random(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return hs.key_word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _singular(text: str) -> str:
    """RULER's rewording of the niah template for a single answer."""
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _niah(cfg: Niah, rng: random.Random, size: int, texts: str | None) -> tuple[str, str, str, tuple[str, ...], dict]:
    needle = "One of the special magic {type_v} for {key} is: {value}."
    n_keys = max(cfg.keys, cfg.queries)
    keys, values, needles = [], [], []
    for _ in range(n_keys):
        keys.append(_random(rng, cfg.key))
        values.append([_random(rng, cfg.value) for _ in range(cfg.values)])
        needles += [needle.format(type_v=cfg.value, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    info: dict = {}
    if cfg.haystack == "essay":
        sents = hs.sentences(hs.essay(hs.essay_words(texts), size))
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        cuts = [0] + [int(len(sents) * d / 100) for d in depths] + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(p for p in parts if p)
        info["depths"] = depths
    else:
        if cfg.haystack == "noise":
            lines = hs.noise_lines(size)
        else:
            lines = [needle.format(type_v=cfg.value, key=_random(rng, cfg.key), value=_random(rng, cfg.value))
                     for _ in range(size)]
        at = sorted(rng.sample(range(len(lines) + 1), len(needles)), reverse=True)
        for index, n in zip(at, needles):
            lines.insert(index, n)
        context = "\n".join(lines)
        info["depths"] = sorted(round(100 * i / max(1, len(lines) - 1)) for i in at)
    picked = rng.sample(range(n_keys), cfg.queries)
    queries = [keys[i] for i in picked]
    answers = tuple(v for i in picked for v in values[i])
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    head, question, prefix, _ = NIAH
    type_v = cfg.value
    if cfg.queries * cfg.values == 1:
        head, question, prefix = _singular(head), _singular(question), _singular(prefix)
        type_v = type_v[:-1]
    return (head.format(type_v=type_v, context=context), question.format(type_v=type_v, query=query),
            prefix.format(type_v=type_v, query=query), answers, info)


def _chain(rng: random.Random, hops: int, letters: int, value: str | None) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999)) if value is None else value
    return names, [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]


def _vt_text(rng: random.Random, size: int, hops: int, letters: int, value: str | None):
    names, chain = _chain(rng, hops, letters, value)
    lines = hs.noise_lines(size)
    at = sorted(rng.sample(range(len(lines) + 1), len(chain)))
    for i, (pos, link) in enumerate(zip(at, chain)):
        lines.insert(pos + i, link)
    context = "\n".join(lines).replace(". \n", ".\n")
    query = chain[0].split("=")[-1].strip()
    head, question, prefix, _ = VT
    return (head.format(context=context), question.format(query=query),
            prefix.format(query=query, num_v=hops + 1), names)


def _vt_example(rng: random.Random, tokenizer, hops: int) -> str:
    """RULER's worked example: a 500-token chain task with 3-letter names and the value 12345,
    answered; then renamed and revalued at random for each sample (RULER's randomize_icl)."""
    def text(size: int) -> tuple[str, list[str]]:
        head, question, prefix, names = _vt_text(random.Random(0), size, hops, 3, "12345")
        return head + question + prefix + " " + " ".join(names) + "\n", names

    size = _largest(lambda n: len(tokenizer.encode(text(n)[0], add_special_tokens=False)) <= 500, VT_LEAST)
    example, names = text(size)
    for name in names:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(rng.randint(10000, 99999)))


def _cwe_list(rng: random.Random, n: int, common: int, freq_common: int, freq_rare: int, seed: int):
    vocab = hs.common_words()
    if n > len(vocab):
        raise ValueError(f"cwe needs {n} distinct words and its list has {len(vocab)}; use a shorter length")
    chosen = rng.sample(vocab, n)
    top, rest = chosen[:common], chosen[common:]
    listed = top * freq_common + rest * freq_rare
    random.Random(seed).shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), top


def _cwe(rng: random.Random, size: int, length: int, seed: int):
    head, question, prefix, _ = CWE
    if length < CWE_LONG:
        shot, main = (20, 3, 1), (size, 6, 1)
    else:
        shot, main = (40, 10, 3), (size, 30, 3)
    shot_list, shot_top = _cwe_list(rng, shot[0], 10, shot[1], shot[2], seed)
    example = (head.format(context=shot_list) + question + prefix + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_top)))
    listed, top = _cwe_list(rng, main[0], 10, main[1], main[2], seed)
    return example + "\n" + head.format(context=listed), question, prefix, tuple(top)


def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha), alpha > 1: a partial sum and the Euler-Maclaurin tail."""
    n = 1000
    return sum(k**-alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + n**-alpha / 2


def _fwe(rng: random.Random, size: int, length: int, seed: int, alpha: float = 2.0, word_len: int = 6):
    vocab_size = max(4, (length - FWE[3]) // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    words = sorted(vocab)
    random.Random(seed).shuffle(words)
    words[0] = "..."  # the most frequent word is noise
    z = _zeta(alpha)
    text = [w for k, w in enumerate(words, 1) for _ in range(int(size * k**-alpha / z))]
    random.Random(seed).shuffle(text)
    head, question, prefix, _ = FWE
    return head.format(context=" ".join(text)), question, prefix, tuple(words[1:4])


def _qa(records: tuple[QARecord, ...], index: int, rng: random.Random, size: int):
    record = records[index % len(records)]
    gold = list(dict.fromkeys(record.documents))
    others = list(dict.fromkeys(d for r in records for d in r.documents if d not in gold))
    docs = gold + (rng.sample(others, min(len(others), max(0, size - len(gold)))) if size > len(gold) else [])
    if size > len(gold) + len(others):  # too few documents: repeat them, as RULER does
        pool = gold + others
        docs = (pool * -(-size // len(pool)))[:size]
        if not set(gold) <= set(docs):
            docs = gold + docs[len(gold):]
    random.Random(index).shuffle(docs)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    head, question, prefix, _ = QA
    return head.format(context=context), question.format(query=record.question), prefix, record.answers


def _largest(fits: Callable[[int], bool], low: int) -> int:
    """The largest n >= low with fits(n) (fits is monotone), or low if none fits."""
    if not fits(low):
        return low
    high = low * 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def generation_length(task: str) -> int:
    if task.startswith("niah"):
        return NIAH[3]
    return {"vt": VT[3], "cwe": CWE[3], "fwe": FWE[3], "qa_1": QA[3], "qa_2": QA[3]}[task]


def builder(task: str, tokenizer, length: int, seed: int, index: int, source: Source, variant: int = 0):
    """size -> (context, question, answer_prefix, answers, info) for one sample of ``task``;
    ``variant`` > 0 draws the sample from another stream of the same seed (see ``make``)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; the tasks are {', '.join(TASKS)}")
    tag = f"{seed}/{task}/{index}" + (f"/{variant}" if variant else "")
    if task in CONFIGS:
        return lambda size: _niah(CONFIGS[task], random.Random(tag), size, source.texts)
    if task == "vt":
        example = _vt_example(random.Random(tag + "/example"), tokenizer, hops=4)

        def vt(size):
            head, question, prefix, names = _vt_text(random.Random(tag), size, 4, 5, None)
            return example + head, question, prefix, tuple(names), {}
        return vt
    if task == "cwe":
        return lambda size: (*_cwe(random.Random(tag), size, length, seed), {})
    if task == "fwe":
        return lambda size: (*_fwe(random.Random(tag), size, length, seed), {})
    records = source.qa_records(task)
    if not records:
        raise ValueError(f"{task} {skipped(task, source)}")
    return lambda size: (*_qa(records, index, random.Random(tag), size), {})


# How many other draws ``make`` tries when a haystack's unit is too coarse to meet the length.
VARIANTS = 16


def make(task: str, tokenizer, length: int, seed: int = 0, index: int = 0, source: Source = Source(),
         chat: bool = False) -> Sample:
    """Sample ``index`` of ``task`` whose prompt plus the task's generation length is the largest
    that fits ``length`` tokens under ``tokenizer`` (with the chat template's tokens if ``chat``).

    Where one unit of haystack is coarse (a whole distractor needle, a document) the best fit
    can fall short of ``length`` by more than 2%; the sample is then drawn again from other
    streams of the same seed (up to ``VARIANTS``) and the first that comes within 2% is taken
    (else the closest), so the length is met without cutting a unit short."""
    new = generation_length(task)
    metric = "string_match_part" if task in QA_TASKS else "string_match_all"
    best = None
    for variant in range(VARIANTS + 1):
        build = builder(task, tokenizer, length, seed, index, source, variant)

        def sample(size: int) -> Sample:
            context, question, prefix, answers, info = build(size)
            return Sample(task, index, context, question, prefix, tuple(answers), new, metric, {**info, "size": size})

        found = sample(_largest(lambda n: len(encode(tokenizer, sample(n), chat)) + new <= length,
                                VT_LEAST if task == "vt" else 1))
        tokens = len(encode(tokenizer, found, chat)) + new
        if tokens <= length and (best is None or tokens > best[0]):
            best = (tokens, found)
        if best is not None and within(best[0], length):
            break
    if best is None:
        raise ValueError(f"{task} does not fit {length} tokens even at its smallest ({tokens} tokens with "
                         f"{new} to generate); use a longer length")
    tokens, found = best
    return Sample(**{**found.__dict__, "info": {**found.info, "tokens": tokens}})


def check_fits(task: str, tokenizer, length: int, source: Source = Source(), chat: bool = False) -> None:
    """Raise the ValueError ``make`` would when even the smallest sample of ``task`` (and the
    task's generation) takes more than ``length`` tokens, without building the full-size one: a
    sweep checks its grid so before it writes anything. A task that is ``skipped`` passes (its
    cells record why)."""
    if skipped(task, source) is not None:
        return
    new = generation_length(task)
    context, question, prefix, answers, info = builder(task, tokenizer, length, 0, 0, source, 0)(
        VT_LEAST if task == "vt" else 1)
    metric = "string_match_part" if task in QA_TASKS else "string_match_all"
    smallest = Sample(task, 0, context, question, prefix, tuple(answers), new, metric, info)
    tokens = len(encode(tokenizer, smallest, chat)) + new
    if tokens > length:
        raise ValueError(f"{task} does not fit {length} tokens even at its smallest ({tokens} tokens with "
                         f"{new} to generate); use a longer length")


def samples(task: str, tokenizer, length: int, count: int, seed: int = 0, source: Source = Source(),
            chat: bool = False) -> list[Sample]:
    return [make(task, tokenizer, length, seed, i, source, chat) for i in range(count)]


def within(tokens: int, length: int, tolerance: float = 0.02) -> bool:
    """Whether a prompt plus generation of ``tokens`` meets ``length`` within ``tolerance``."""
    return math.floor(length * (1 - tolerance)) <= tokens <= length
