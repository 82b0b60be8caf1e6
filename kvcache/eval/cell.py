"""One cell of a sweep (policy, ratio, task, length, protocol), run by a pure function.

``run_cell(model, tokenizer, cell, bench)`` builds the cell's samples, runs each through a fresh
cache and returns a JSON-able dict; it reads no global state and writes nothing, so a process
pool or a Ray task can run cells anywhere (sweep.py is the driver that lists, skips and saves them).

The protocol is kvpress's:
    ratio           the fraction of the compressed part REMOVED (kvpress's ``compression_ratio``);
                    ``int((1 - ratio) * n)`` of its n tokens are kept (kvpress's count). A budget
                    b (the fraction kept, ``--budgets``) is the ratio 1 - b.
    query_agnostic  the context alone is the first prefill chunk, compressed before the question
                    is seen; the question and answer prefix come after.
    query_aware     the context and the question are the first chunk, compressed together; the
                    answer prefix comes after.
Scoring policies (``supports_reserve``) compress the first chunk once and then grow by the tokens
that follow (``reserve``), as kvpress's cache grows; ring policies (window, sink) keep the kept
count and evict as tokens arrive. Dense is the reference: it keeps everything (ratio 0).
Policies get the options their paper sets at the kept count (``budget_options``).
A policy that scores the context by reconstructing it (kvzip) compresses the first chunk through
``kvcache.kvzip``'s pass (the whole chunk in one pass, repeated after KVzip's prompt), then takes
the rest and decodes greedily, as ``generate`` does.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from ..cache.registry import budget_options, make_cache, policy_class
from ..generate import generate
from ..kvzip import generate as generate_after_reconstruction
from ..kvzip import repeat_ids
from . import dataset as ds
from . import ruler
from .sample import Sample, chat_parts, encode
from .scoring import score

PROTOCOLS = ("query_agnostic", "query_aware")
# (passkey: the grid of kvcache/evaluate.py, whose cells eval/passkey.py runs.)
BENCHMARKS = ("ruler", "dataset", "passkey")


@dataclass(frozen=True)
class Bench:
    """What every cell of a sweep shares: the benchmark, its data and how prompts are written.

    texts:    essay haystack directory, or the passkey grid's texts (None: the packaged texts).
    dataset:  a JSON-lines file: the tasks of ``benchmark="dataset"``, or ruler's qa data.
    metric:   overrides every sample's metric (None: the task's own, or the record's).
    chat:     wrap prompts in the checkpoint's chat template.
    """

    benchmark: str = "ruler"
    texts: str | None = None
    dataset: str | None = None
    metric: str | None = None
    chat: bool = False
    # Content hash of ``dataset``, so that a changed file is not mistaken for a finished one.
    dataset_hash: str = field(default="", compare=True)

    def __post_init__(self) -> None:
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.benchmark!r}; available: {', '.join(BENCHMARKS)}")
        if self.benchmark == "dataset" and self.dataset is None:
            raise ValueError("benchmark 'dataset' needs a dataset file (--dataset FILE.jsonl)")

    @classmethod
    def make(cls, benchmark: str = "ruler", texts: str | None = None, dataset: str | None = None,
             metric: str | None = None, chat: bool = False) -> "Bench":
        digest = ds.file_hash(dataset) if dataset is not None else ""
        return cls(benchmark, texts, dataset, metric, chat, digest)


@dataclass(frozen=True)
class Cell:
    policy: str       # a registered policy[:storage]; "dense" is the reference
    ratio: float      # fraction of the compressed part removed; 0 for dense
    task: str
    length: int       # RULER's target tokens (prompt + generation); 0 for a dataset's own lengths
    protocol: str
    samples: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; available: {', '.join(PROTOCOLS)}")
        if not 0 <= self.ratio < 1:
            raise ValueError(f"a ratio is the fraction of the context removed, in [0, 1), got {self.ratio}")
        if self.samples <= 0:
            raise ValueError(f"samples must be positive, got {self.samples}")

    def key(self, bench: Bench) -> str:
        """A file name that identifies the cell and everything its result depends on."""
        spec = json.dumps([asdict(self), asdict(bench)], sort_keys=True)
        digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
        policy = self.policy.replace(":", "-")
        return f"{self.task}-{self.length}-{self.protocol}-{policy}-{self.ratio:g}-{digest}"

    def label(self) -> str:
        """What the progress bar shows while the cell runs."""
        return f"{self.task} {self.length} {self.policy} {self.ratio:g} {self.protocol}"


def keeps_all(policy: str) -> bool:
    return not policy_class(policy).evicts


def reconstructs(policy: str) -> bool:
    """Whether the policy scores a context by a reconstruction pass (kvcache.kvzip)."""
    return getattr(policy_class(policy), "reconstructs", False)


def cell_samples(tokenizer, cell: Cell, bench: Bench) -> list[Sample]:
    if bench.benchmark == "dataset":
        records = [s for s in ds.read(bench.dataset) if s.task == cell.task]
        found = records[: cell.samples]
    else:
        source = ruler.Source(bench.texts, ds.qa_source(bench.dataset) if bench.dataset else ())
        found = ruler.samples(cell.task, tokenizer, cell.length, cell.samples, cell.seed, source, bench.chat)
    if bench.metric is not None:
        found = [Sample(**{**s.__dict__, "metric": bench.metric}) for s in found]
    return found


def make_cell_cache(model, policy: str, ratio: float, first: int, total: int):
    """A cache that keeps ``int((1 - ratio) * first)`` of the first ``first`` tokens, for ``total``."""
    if keeps_all(policy) or ratio == 0:
        return make_cache(model, policy, cache_length=total)
    kept = max(1, int(first * (1 - ratio)))
    options = budget_options(policy, kept)
    if policy_class(policy).supports_reserve:
        # Capped so that the first chunk still overflows (at kvpress's ratios it never binds).
        reserve = max(0, min(total - first, first - kept - 1))
        return make_cache(model, policy, cache_length=kept + reserve, reserve=reserve, **options)
    return make_cache(model, policy, cache_length=kept, **options)


@torch.inference_mode()
def run_sample(model, tokenizer, sample: Sample, policy: str, ratio: float, protocol: str,
               chat: bool = False) -> dict:
    enc = encode(tokenizer, sample, chat)
    first = len(enc.context) + (len(enc.question) if protocol == "query_aware" else 0)
    total = len(enc) + sample.max_new_tokens
    cache = make_cell_cache(model, policy, ratio, first, total)
    if ratio > 0 and reconstructs(policy):
        ids = enc.ids
        closing = chat_parts(tokenizer)[1] if chat else "\n"
        new = generate_after_reconstruction(
            model, cache, ids[:first], ids[first:] or None, repeat=repeat_ids(tokenizer, closing),
            max_new_tokens=sample.max_new_tokens, chunk=None)[0]
    else:
        new = generate(model, enc.ids, max_new_tokens=sample.max_new_tokens, cache=cache, prefill_chunk=first)
    prediction = tokenizer.decode(new)
    return {"index": sample.index, "tokens": len(enc), "compressed": first, "generated": len(new),
            "prediction": prediction, "answers": list(sample.answers), "metric": sample.metric,
            "score": score(sample.metric, prediction, sample.answers), "info": sample.info}


def run_cell(model, tokenizer, cell: Cell, bench: Bench) -> dict:
    """The cell's result: its spec, the mean score in [0, 100], every sample's outcome, seconds."""
    if bench.benchmark == "passkey":
        raise ValueError("a passkey cell is run by kvcache.eval.passkey.Runner, not run_cell")
    start = time.perf_counter()
    skip = ruler.skipped(cell.task, ruler.Source(qa=ds.qa_source(bench.dataset) if bench.dataset else ())) \
        if bench.benchmark == "ruler" else None
    if skip is not None:
        return {"cell": asdict(cell), "bench": asdict(bench), "skipped": skip, "score": None, "samples": []}
    outcomes = [run_sample(model, tokenizer, s, cell.policy, cell.ratio, cell.protocol, bench.chat)
                for s in cell_samples(tokenizer, cell, bench)]
    if not outcomes:
        raise ValueError(f"no samples for task {cell.task!r} in {bench.dataset}")
    return {"cell": asdict(cell), "bench": asdict(bench), "skipped": None,
            "score": sum(o["score"] for o in outcomes) / len(outcomes), "samples": outcomes,
            "seconds": time.perf_counter() - start}
