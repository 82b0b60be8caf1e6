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
``kvcache.generation.reconstruction``'s pass (the whole chunk in one pass, repeated after KVzip's prompt; one pass
for all the ratios of a sample, shared.py), then takes the rest and decodes as every cell does.

Decoding is greedy, as ``generate``'s, and stops early in one case only: under a metric that more
text cannot lower (``MONOTONE``), once the prediction scores 100, the score the whole generation
would get. ``run_cells`` runs the cells that share their samples sample by sample, so that each
sample's first chunk is prefilled once for every policy that computes it alike (shared.py), and
decodes the cells' answers to a sample as the rows of one batch, each row attending its own
cache (``kvcache.cache.Rows``): a small model's decode step is bound by reading its weights, which
a batch reads once for all its rows. A row's tokens are those of its cell run alone up to the
rounding of the batched matmuls, as a change of thread count changes it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..cache.base import KVCache
from ..cache.registry import budget_options, make_cache, policy_class, reconstructs
from ..cache.rows import Rows
from ..checkpoints.load import WEIGHTS
from ..generation.generate import decode_loop, greedy
from ..generation.reconstruction import prefill as reconstruct_context
from ..generation.reconstruction import repeat_ids
from . import dataset as ds
from . import ruler
from .metrics import score
from .sample import Encoded, Sample, chat_parts, encode
from .shared import SharedPrefill

PROTOCOLS = ("query_agnostic", "query_aware")
# (passkey: the grid of kvcache/eval/quality.py, whose cells eval/passkey.py runs.)
BENCHMARKS = ("ruler", "dataset", "passkey")


@dataclass(frozen=True)
class Bench:
    """What every cell of a sweep shares: the benchmark, its data and how prompts are written.

    texts:    essay haystack directory, or the passkey grid's texts (None: the packaged texts).
    dataset:  a JSON-lines file: the tasks of ``benchmark="dataset"``, or ruler's qa data.
    metric:   overrides every sample's metric (None: the task's own, or the record's).
    chat:     wrap prompts in the checkpoint's chat template.
    weights:  how the model holds its projections (``kvcache.load``'s ``weights``: full, int4).
    """

    benchmark: str = "ruler"
    texts: str | None = None
    dataset: str | None = None
    metric: str | None = None
    chat: bool = False
    # Content hash of ``dataset``, so that a changed file is not mistaken for a finished one.
    dataset_hash: str = field(default="", compare=True)
    weights: str = "full"

    def __post_init__(self) -> None:
        if self.benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {self.benchmark!r}; available: {', '.join(BENCHMARKS)}")
        if self.benchmark == "dataset" and self.dataset is None:
            raise ValueError("benchmark 'dataset' needs a dataset file (--dataset FILE.jsonl)")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights={self.weights!r}: choose one of {', '.join(map(repr, WEIGHTS))}")

    @classmethod
    def make(cls, benchmark: str = "ruler", texts: str | None = None, dataset: str | None = None,
             metric: str | None = None, chat: bool = False, weights: str = "full") -> Bench:
        digest = ds.file_hash(dataset) if dataset is not None else ""
        return cls(benchmark, texts, dataset, metric, chat, digest, weights)

    def spec(self) -> dict:
        """The settings a result depends on, as cell keys hash them and result files are matched
        by (``Bench.spec_of``)."""
        return Bench.spec_of(asdict(self))

    @staticmethod
    def spec_of(written: dict) -> dict:
        """A result file's ``bench`` as ``spec`` gives it: ``weights`` only where it is not
        "full", so that the results written before weights were a setting keep their keys and
        are still found."""
        return {k: v for k, v in written.items() if not (k == "weights" and v == "full")}


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
        spec = json.dumps([asdict(self), bench.spec()], sort_keys=True)
        digest = hashlib.sha256(spec.encode()).hexdigest()[:10]
        # "h2o:int4" -> "h2o-int4"; a variant's options, "snapkv(window=64)", -> "snapkv-window-64".
        policy = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.policy).strip("-")
        return f"{self.task}-{self.length}-{self.protocol}-{policy}-{self.ratio:g}-{digest}"

    def label(self) -> str:
        """What the progress bar shows while the cell runs."""
        return f"{self.task} {self.length} {self.policy} {self.ratio:g} {self.protocol}"


def keeps_all(policy: str) -> bool:
    return not policy_class(policy).evicts


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


def make_cell_cache(model, policy: str, ratio: float, first: int, total: int,
                    options: Mapping[str, object] | None = None):
    """A cache that keeps ``int((1 - ratio) * first)`` of the first ``first`` tokens, for ``total``.
    ``options``: the policy's own options, over those its paper sets at that budget."""
    if keeps_all(policy) or ratio == 0:
        return make_cache(model, policy, cache_length=total, options=options)
    kept = max(1, int(first * (1 - ratio)))
    options = {**budget_options(policy, kept), **(options or {})}
    if policy_class(policy).supports_reserve:
        # Capped so that the first chunk still overflows (at kvpress's ratios it never binds).
        reserve = max(0, min(total - first, first - kept - 1))
        return make_cache(model, policy, cache_length=kept + reserve, reserve=reserve, options=options)
    return make_cache(model, policy, cache_length=kept, options=options)


# Cells of a sample whose answers decode as one batch (``run_cells``): a step reads the weights
# once for all of them, and each holds its cache at once (up to BATCH caches of the prompt's size).
BATCH = 8


# Metrics under which a longer prediction never scores less (a reference found stays found), so
# that generation can stop once the prediction scores 100: the rest could not change the score.
MONOTONE = ("string_match_all", "string_match_part")


def saturated(tokenizer, sample: Sample, tokens: list[int]) -> bool:
    """Whether the prediction so far, ``tokens``, already scores 100 under a metric that more
    text cannot lower (``MONOTONE``). Its text is then a prefix of any longer prediction's
    (byte-level decoding; not while it ends inside a character, decoded as U+FFFD)."""
    if sample.metric not in MONOTONE:
        return False
    text = tokenizer.decode(tokens)
    return not text.endswith("\ufffd") and score(sample.metric, text, sample.answers) == 100.0


def stop_ids(model) -> set[int]:
    """The model's eos ids, at which ``generate`` stops by default."""
    return set(model.config.stop_ids())


@torch.inference_mode()
def answer(model, cache, logits: torch.Tensor, rest: list[int], max_new_tokens: int,
           finished: Callable[[list[int]], bool] = lambda tokens: False) -> list[int]:
    """Greedy tokens after a first chunk held by ``cache``, whose last token gave ``logits``
    (1, vocab): ``rest`` (the question and answer prefix; may be empty) in one call, then one
    token at a time as ``generate`` does greedily, up to ``max_new_tokens``, the model's eos
    (kept) or ``finished(tokens so far)``."""
    return answers(model, [cache], logits, rest, max_new_tokens, [finished])[0][0]


@torch.inference_mode()
def answers(model, caches: Sequence, logits: torch.Tensor, rest: list[int], max_new_tokens: int,
            finished: Sequence[Callable[[list[int]], bool]]) -> tuple[list[list[int]], list[float]]:
    """``answer`` for several one-row caches at once, each after the same first chunk held its
    own way (the cells of one sample), decoded as the rows of one batch (``kvcache.cache.Rows``):
    the weights are read once a step for all of them. logits: (N, vocab), row i after
    ``caches[i]``'s chunk; ``finished[i]`` ends row i, which then leaves the batch.

    Returns each row's tokens and its share of the time: each call's seconds split evenly over
    the rows it ran. Each row's tokens are those ``answer`` gives it alone, up to the rounding of
    the batched matmuls (one row: the same call, bit for bit)."""
    if not len(caches) == logits.shape[0] == len(finished):
        raise ValueError(f"answers takes one row of logits and one finished test per cache: {len(caches)} "
                         f"caches, logits {tuple(logits.shape)}, {len(finished)} tests")
    device = model.embed_tokens.weight.device
    out: list[list[int]] = [[] for _ in caches]
    seconds = [0.0] * len(caches)
    active = list(range(len(caches)))

    def timed(call):
        start = time.perf_counter()
        result = call()
        for b in active:
            seconds[b] += (time.perf_counter() - start) / len(active)
        return result

    if rest:
        ids = torch.tensor([rest] * len(caches), device=device)
        logits = timed(lambda: model(ids, Rows(caches), last_only=True)[:, 0])
    stops = stop_ids(model)

    def decode(tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        active[:] = rows  # the rows this call's time is shared by
        return timed(lambda: model.decode(tokens, Rows([caches[b] for b in rows])))

    decode_loop(out, logits, decode, max_new_tokens, greedy, lambda b, tokens: tokens[-1] in stops or finished[b](tokens),
                drop_ended=True)
    return out, seconds


@dataclass
class Prefilled:
    """A sample's first chunk in a cell's fresh cache: the answer starts from here. logits:
    (1, vocab) of the chunk's last token; how: "own" (the cell's prefill) or "shared" (replayed,
    or taken from a pass shared with other cells: shared.py)."""

    cache: KVCache
    logits: torch.Tensor
    how: str


@torch.inference_mode()
def prefill(model, tokenizer, enc: Encoded, first: int, total: int, policy: str, ratio: float,
            chat: bool = False, shared: SharedPrefill | None = None) -> Prefilled:
    """The first ``first`` ids of ``enc`` through a fresh cache of ``policy`` at ``ratio``, for
    ``total`` tokens in all. ``shared``: take the prefill from there when the policy computes it
    as dense does (shared.py); the cache and logits are the same either way."""
    cache = make_cell_cache(model, policy, ratio, first, total)
    replays = shared.replays if shared is not None else 0
    ids = enc.ids[:first]
    if ratio > 0 and reconstructs(policy):
        closing = chat_parts(tokenizer)[1] if chat else "\n"
        repeat = repeat_ids(tokenizer, closing)
        if shared is None:
            logits = reconstruct_context(model, cache, [ids], repeat=repeat, chunk=None)
        else:
            cache, logits = shared.reconstructed(model, cache, ids, policy, repeat)
    elif shared is None:
        device = model.embed_tokens.weight.device
        logits = model(torch.tensor([ids], device=device), cache, last_only=True)[:, 0]
    else:
        cache, logits = shared.prefill(model, cache, ids, f"{policy} {ratio:g}",
                                       fresh=lambda: make_cell_cache(model, policy, ratio, first, total))
    return Prefilled(cache, logits, "shared" if shared is not None and shared.replays > replays else "own")


def first_chunk(enc: Encoded, protocol: str) -> int:
    """How many of a sample's ids the first chunk takes: the context, and under query_aware the
    question too."""
    return len(enc.context) + (len(enc.question) if protocol == "query_aware" else 0)


def run_samples(model, tokenizer, sample: Sample, cells: Sequence[Cell], chat: bool = False,
                shared: SharedPrefill | None = None) -> list[dict]:
    """One sample through a fresh cache for each of ``cells`` (which share their samples): each
    cell's first chunk, then their answers as one batch (``answers``). Returns each cell's
    outcome, with the seconds spent on it (its prefill and its share of the answers')."""
    enc = encode(tokenizer, sample, chat)
    first = first_chunk(enc, cells[0].protocol)
    total = len(enc) + sample.max_new_tokens
    prefilled, seconds = [], []
    for c in cells:
        start = time.perf_counter()
        prefilled.append(prefill(model, tokenizer, enc, first, total, c.policy, c.ratio, chat, shared))
        seconds.append(time.perf_counter() - start)
    new, shares = answers(model, [p.cache for p in prefilled], torch.cat([p.logits for p in prefilled]),
                          enc.ids[first:], sample.max_new_tokens,
                          [lambda tokens: saturated(tokenizer, sample, tokens)] * len(cells))
    outcomes = []
    for p, tokens, s, share in zip(prefilled, new, seconds, shares):
        prediction = tokenizer.decode(tokens)
        outcomes.append({"index": sample.index, "tokens": len(enc), "compressed": first, "generated": len(tokens),
                         "prediction": prediction, "answers": list(sample.answers), "metric": sample.metric,
                         "score": score(sample.metric, prediction, sample.answers), "prefill": p.how,
                         "info": sample.info, "seconds": s + share})
    return outcomes


def run_cell(model, tokenizer, cell: Cell, bench: Bench) -> dict:
    """The cell's result: its spec, the mean score in [0, 100], every sample's outcome, seconds."""
    return run_cells(model, tokenizer, [cell], bench)[0]


def sample_group(cell: Cell) -> tuple:
    """What decides a cell's samples: cells alike in it run the same prompts (``run_cells``)."""
    return (cell.task, cell.length, cell.protocol, cell.samples, cell.seed)


# What ``run_cells`` hands back after each sample: the results so far, one a cell (no "score" yet).
Progress = Callable[[list[dict]], None]


def run_cells(model, tokenizer, cells: Sequence[Cell], bench: Bench,
              known: Sequence[Sequence[dict]] | None = None, progress: Progress | None = None,
              shared: SharedPrefill | None = None, batch: int = BATCH) -> list[dict]:
    """The results of ``cells``, which must share their samples (``sample_group``), as
    ``run_cell`` gives them one by one: the samples are built once and run one after another
    through every cell, so that each sample's first chunk is prefilled once for all the
    policies that compute it alike (shared.py), and the answers of up to ``batch`` cells are
    decoded as one batch (``answers``; 1: one cell at a time, as ``run_cell``).

    known:    for each cell, outcomes already computed (a sweep's earlier, shorter or
              interrupted run of it: same settings, same samples); a sample found there is not
              run again for that cell. Each outcome's "seconds" is the time its cell spent on
              it (the shared prefill counted in the cell that first asked for it).
    progress: called after each sample with every cell's partial result (``partial``), so
              that an interrupted run loses at most the sample in flight.
    shared:   the ``SharedPrefill`` of ``model`` to prefill through (None: a new one). A sweep
              passes one to all its groups of cells, so that a cache configuration is checked
              once for the sweep rather than once a task (a check computes the attention that a
              replay of a configuration already checked skips).
    """
    if bench.benchmark == "passkey":
        raise ValueError("a passkey cell is run by kvcache.eval.passkey.Runner, not run_cell")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch is the number of cells whose answers decode together, at least 1; got {batch!r}")
    if len({sample_group(c) for c in cells}) > 1:
        raise ValueError("run_cells runs cells with the same samples (task, length, protocol, samples, seed)")
    if known is not None and len(known) != len(cells):
        raise ValueError(f"known has {len(known)} entries for {len(cells)} cells; give one list a cell")
    skip = ruler.skipped(cells[0].task, ruler.Source(qa=ds.qa_source(bench.dataset) if bench.dataset else ())) \
        if bench.benchmark == "ruler" else None
    if skip is not None:
        return [{"cell": asdict(c), "bench": asdict(bench), "skipped": skip, "score": None, "samples": []}
                for c in cells]
    start = time.perf_counter()
    samples = cell_samples(tokenizer, cells[0], bench)
    if not samples:
        raise ValueError(f"no samples for task {cells[0].task!r} in {bench.dataset}")
    # Building the samples: counted in each cell's first sample run, a share per cell.
    setup = [(time.perf_counter() - start) / len(cells)] * len(cells)
    found = [{o["index"]: o for o in outcomes} for outcomes in (known or [[]] * len(cells))]
    outcomes: list[list[dict]] = [[] for _ in cells]
    if shared is None and len(cells) > 1:
        shared = SharedPrefill()
    if shared is not None:
        shared.check_model(model)
    for sample in samples:
        todo = [i for i in range(len(cells)) if sample.index not in found[i]]
        for i in range(len(cells)):
            if sample.index in found[i]:
                outcomes[i].append(found[i][sample.index])
        for at in range(0, len(todo), batch):
            rows = todo[at:at + batch]
            for i, outcome in zip(rows, run_samples(model, tokenizer, sample, [cells[i] for i in rows],
                                                     bench.chat, shared)):
                outcome["seconds"] += setup[i]
                setup[i] = 0.0
                outcomes[i].append(outcome)
        if todo and progress is not None and len(outcomes[0]) < len(samples):
            progress([partial(c, bench, o) for c, o in zip(cells, outcomes)])
    return [finished(c, bench, o) for c, o in zip(cells, outcomes)]


def partial(cell: Cell, bench: Bench, outcomes: list[dict]) -> dict:
    """A cell's result before its last sample: its outcomes so far, no score."""
    return {"cell": asdict(cell), "bench": asdict(bench), "skipped": None, "samples": list(outcomes),
            "seconds": sum(o.get("seconds", 0.0) for o in outcomes)}


def finished(cell: Cell, bench: Bench, outcomes: list[dict]) -> dict:
    """A cell's result: its spec, the mean score in [0, 100], every sample's outcome, seconds."""
    return {**partial(cell, bench, outcomes), "score": sum(o["score"] for o in outcomes) / len(outcomes)}
