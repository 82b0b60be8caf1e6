"""Quality of cache policies against dense: streaming perplexity, agreement, passkey retrieval.

Budgets are fractions of the context length, so one grid applies to every task and length.
    streaming   held-out text fed through the bounded cache ``chunk`` tokens at a time (the
                StreamingLLM protocol): perplexity, and against dense on the same text the top-1
                agreement and mean KL(dense || policy) of next-token distributions.
    passkey     a key hidden at a depth of a context; accuracy of the greedy answer, in two
                protocols: ``query_aware`` (the question is part of the prompt the cache sees)
                and ``query_agnostic`` (the context is compressed first, the question comes after).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..cache.names import CacheName
from ..cache.registry import budget_options, check_names, make_cache, reconstructs
from ..cache.registry import policies as registered_policies
from ..generation.generate import generate
from .tasks import TaskMaker

# The order of protocols everywhere (reports, plots): the context compressed first, then with the question.
PROTOCOLS = ("query_agnostic", "query_aware")


@dataclass
class Grid:
    # Every registered policy the grid runs, dense (the reference) first: not one that scores a
    # context by reconstructing it (kvzip), which needs a pass this grid's prompts do not make.
    policies: list[str] = field(default_factory=lambda: sorted(
        (p for p in registered_policies() if not reconstructs(p)), key=lambda name: name != "dense"))
    budgets: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5])
    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 4
    stream_tokens: int = 2048
    chunk: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_names(self.policies)  # every policy and storage, before any cell runs
        if not all(0 < b <= 1 for b in self.budgets):
            raise ValueError(f"budgets are fractions of the context in (0, 1], got {self.budgets}")
        if not all(0 <= d <= 1 for d in self.depths):
            raise ValueError(f"depths must lie in [0, 1], got {self.depths}")
        if self.trials <= 0 or self.chunk <= 0 or self.stream_tokens < 2:
            raise ValueError("trials and chunk must be positive and stream_tokens at least 2")


def _cells(grid: Grid) -> list[tuple[str, float]]:
    """(policy, budget) pairs; dense is the reference and runs once, at full budget."""
    return [(p, 1.0) if _keeps_all(p) else (p, b) for p in grid.policies for b in
            ([1.0] if _keeps_all(p) else grid.budgets)]


def _keeps_all(policy: str) -> bool:
    """Dense at any storage (``dense:int4``): it has no budget, it holds the whole context."""
    return CacheName.parse(policy).policy == "dense"


@torch.inference_mode()
def streaming(model, ids: torch.Tensor, policy: str, cache_length: int, chunk: int,
              reference: torch.Tensor) -> dict[str, float]:
    """ids: (1, N). reference: (N - 1, vocab) dense log-probabilities of the next tokens.

    ``bits_per_element``: the cache's size after the stream (``nbytes``: codes, scales, positions,
    statistics, every full-precision token) in bits per element of the keys and values it would
    hold at full length, 2 x K/V heads x head_dim x N over its layers: a float32 dense cache
    of the whole stream is just above 32."""
    cache = make_cache(model, policy, cache_length=cache_length, options=budget_options(policy, cache_length))
    logits = torch.cat([model(ids[:, i : i + chunk], cache)[0] for i in range(0, ids.shape[1], chunk)])
    elements = sum(2 * layer.spec.num_kv_heads * layer.spec.head_dim for layer in cache.layers) * ids.shape[1]
    logp = F.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(1, ids[0, 1:, None]).mean().item()
    # KL is non-negative; rounding leaves about -1e-9 where the distributions are the same.
    kl = max(0.0, (reference.exp() * (reference - logp)).sum(-1).mean().item())
    agree = (logp.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return {"perplexity": math.exp(nll), "top1_agreement": agree, "kl": kl,
            "bits_per_element": 8 * cache.nbytes() / elements}


@torch.inference_mode()
def passkey(model, tasks: TaskMaker, policy: str, budget: float, length: int, depth: float,
            trials: int, protocol: str, chat: tuple[str, str] | None = None) -> float:
    """Fraction of ``trials`` answered exactly (greedy) at this length and depth. ``chat``: the
    chat template's text around a user message, to ask as a conversation (``TaskMaker.passkey``)."""
    correct = 0
    question = len(tasks.passkey_question(chat))
    for _ in range(trials):
        prompt, answer = tasks.passkey(length, depth=depth, chat=chat)
        context = len(prompt) - question
        cache_length = len(prompt) + len(answer) if _keeps_all(policy) else max(8, round(budget * context))
        cache = make_cache(model, policy, cache_length=cache_length, options=budget_options(policy, cache_length))
        # query_agnostic: the first chunk is the context alone, so the cache is compressed
        # before the question arrives.
        chunk = context if protocol == "query_agnostic" else None
        out = generate(model, prompt, max_new_tokens=len(answer), cache=cache, stop_tokens=(),
                       prefill_chunk=chunk)
        correct += out == answer
    return correct / trials


@dataclass(frozen=True)
class Unit:
    """One piece of the grid, computed on its own (by ``run_unit``) from the model, the tokenizer,
    the token streams and the grid's settings alone: the streaming run of a (policy, budget),
    or one passkey point of it (a protocol, length and depth: ``trials`` prompts). ``kvcache
    eval`` runs each as a resumable cell, serially or on Ray (kvcache/eval/passkey.py)."""

    kind: str  # "streaming" or "passkey"
    policy: str
    budget: float
    protocol: str | None = None
    length: int | None = None
    depth: float | None = None


def units(grid: Grid, protocols: tuple[str, ...] = PROTOCOLS) -> list[Unit]:
    """The grid's units in report order: per (policy, budget), streaming, then every passkey
    point by protocol, length and depth."""
    found = []
    for policy, budget in _cells(grid):
        found.append(Unit("streaming", policy, budget))
        found += [Unit("passkey", policy, budget, protocol, n, depth)
                  for protocol in protocols for n in grid.lengths for depth in grid.depths]
    return found


def reference_logprobs(model, held_out: torch.Tensor, stream_tokens: int) -> torch.Tensor:
    """Dense log-probabilities of the next tokens of ``held_out[:stream_tokens]``: (N - 1, vocab)."""
    ids = held_out[None, :stream_tokens].to(model.embed_tokens.weight.device)
    with torch.inference_mode():
        return F.log_softmax(model(ids)[0, :-1].float(), dim=-1)


def run_unit(model, tokenizer, unit: Unit, filler: torch.Tensor, held_out: torch.Tensor, *, trials: int,
             stream_tokens: int, chunk: int, seed: int, reference: torch.Tensor | None = None,
             chat: tuple[str, str] | None = None) -> dict:
    """The report row of ``unit``. filler: token stream for passkey contexts; held_out: (N,) text
    for streaming; ``reference``: ``reference_logprobs`` of held_out, computed here if None;
    ``chat``: passkey prompts as a conversation (``passkey``)."""
    if unit.kind == "streaming":
        # Token streams are read on the CPU (read_texts); the model may be elsewhere.
        ids = held_out[None, :stream_tokens].to(model.embed_tokens.weight.device)
        if reference is None:
            reference = reference_logprobs(model, held_out, stream_tokens)
        length = max(8, round(unit.budget * ids.shape[1]))
        return {"policy": unit.policy, "budget": unit.budget, "cache_length": length,
                **streaming(model, ids, unit.policy, length, chunk, reference)}
    if unit.kind != "passkey":
        raise ValueError(f"unknown unit kind {unit.kind!r}; the grid has streaming and passkey units")
    tasks = TaskMaker(filler, tokenizer, seed=seed + unit.length)  # same keys for every policy
    acc = passkey(model, tasks, unit.policy, unit.budget, unit.length, unit.depth, trials, unit.protocol, chat)
    return {"policy": unit.policy, "budget": unit.budget, "protocol": unit.protocol, "length": unit.length,
            "depth": unit.depth, "accuracy": acc}


def report(grid: Grid, done: list[tuple[Unit, dict]]) -> dict:
    """The grid's report from its units and their rows (``run_unit``), in report order."""
    return {"grid": grid.__dict__, "streaming": [row for unit, row in done if unit.kind == "streaming"],
            "passkey": [row for unit, row in done if unit.kind == "passkey"]}


def evaluate(model, tokenizer, filler: torch.Tensor, held_out: torch.Tensor, grid: Grid,
             protocols: tuple[str, ...] = PROTOCOLS, progress: bool = True,
             chat: tuple[str, str] | None = None) -> dict:
    """Run the grid in this process. filler: token stream for passkey contexts; held_out: (N,)
    text for streaming; ``chat``: passkey prompts as a conversation (``passkey``)."""
    todo = units(grid, protocols)
    reference = reference_logprobs(model, held_out, grid.stream_tokens)
    settings = dict(trials=grid.trials, stream_tokens=grid.stream_tokens, chunk=grid.chunk, seed=grid.seed,
                    chat=chat)
    done = []
    for unit in tqdm(todo, desc="eval", unit="cell", disable=not progress):
        done.append((unit, run_unit(model, tokenizer, unit, filler, held_out, reference=reference, **settings)))
    return report(grid, done)


def markdown(report: dict) -> str:
    """A header naming the model, lengths and trials (``report["header"]``, when there), then one
    table: per policy and budget, streaming quality and mean passkey accuracy per protocol."""
    protocols = [p for p in PROTOCOLS if any(r["protocol"] == p for r in report["passkey"])]
    lines = []
    if "header" in report:
        lines += ["# kvcache eval: streaming perplexity and passkey retrieval", ""]
        lines += [f"- {name}: {value}" for name, value in report["header"].items()] + [""]
    head = "| policy | budget | perplexity | top-1 agreement | KL | " + " | ".join(
        f"passkey {p.replace('_', '-')}" for p in protocols) + " |"
    lines += [head, "|" + "---|" * (5 + len(protocols))]
    for s in report["streaming"]:
        accs = []
        for p in protocols:
            rows = [r["accuracy"] for r in report["passkey"]
                    if r["policy"] == s["policy"] and r["budget"] == s["budget"] and r["protocol"] == p]
            accs.append(f"{100 * sum(rows) / len(rows):.0f}%" if rows else "-")
        lines.append(f"| {s['policy']} | {s['budget']:g} | {s['perplexity']:.2f} | "
                     f"{100 * s['top1_agreement']:.1f}% | {s['kl']:.3f} | " + " | ".join(accs) + " |")
    return "\n".join(lines) + "\n"
