"""The drift report (``kvcache drift``): how far the logits of one model move between ways of
computing the same thing that should agree, per dtype, for kvcache and (when installed) for
transformers on the same weights.

Each comparison feeds the same tokens two ways and reports the largest absolute logit
difference over the positions compared, and how often the two agree on the most likely token:

    cached vs uncached              the prompt's first half in one call, the rest one token at
                                    a time through a cache, against the plain forward
    chunked vs one pass             the prompt in chunks of ``chunk`` tokens against one call,
                                    both through a cache
    batched with padding vs alone   three prompts of unequal length in one padded batch (right
                                    padding for kvcache, left padding with an attention mask for
                                    transformers), each against itself alone
    reused prefix vs fresh          the cache of the prompt's first ``prefix`` tokens, computed
                                    for another prompt and reused (kvcache: a prefix store;
                                    transformers: a deep copy of a DynamicCache), then the rest,
                                    against the prompt from scratch: its last logits and
                                    ``steps`` teacher-forced decode steps
    reused prefix vs fresh, aligned the same with ``aligned=True`` (kvcache only): the prefix
                                    ends on the grid and both runs make the same calls

Every comparison uses a dense cache: drift is about arithmetic, not about eviction.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cache.registry import make_cache
from ..checkpoints.load import _resolve, load, load_tokenizer
from ..errors import CheckpointError
from ..generation.generate import decode_loop
from ..generation.prefill import prefill
from ..prefix.store import PrefixStore
from .tasks import DEFAULT_TEXTS

COMPARISONS = (
    "cached vs uncached",
    "chunked vs one pass",
    "batched with padding vs alone",
    "reused prefix vs fresh",
    "reused prefix vs fresh, aligned",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Setup:
    """What the report feeds: a ``tokens``-token prompt (and two shorter ones for the batch),
    chunks of ``chunk`` tokens, a reused prefix of ``prefix`` tokens (off the grid on purpose;
    aligned reuse takes the grid boundary below it) and ``steps`` decode steps after it."""

    tokens: int = 512
    chunk: int = 128
    prefix: int = 300
    steps: int = 32


@dataclass(frozen=True)
class Drift:
    """One cell: ``max_abs`` and ``top1`` over ``positions`` compared logits (None: not applicable)."""

    comparison: str
    engine: str
    dtype: str
    max_abs: float | None
    top1: float | None
    positions: int


def texts(model_dir: str | Path | None, setup: Setup, vocab_size: int) -> list[list[int]]:
    """Three prompts of ``setup.tokens``, 3/4 and 1/2 as many tokens: held-out text through the
    checkpoint's tokenizer, or random ids (seeded) for a checkpoint without one."""
    lengths = (setup.tokens, setup.tokens * 3 // 4, setup.tokens // 2)
    try:
        tokenizer = load_tokenizer(model_dir)
    except CheckpointError:
        tokenizer = None
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
    sources = sorted(DEFAULT_TEXTS.glob("*.txt"))
    prompts = []
    for i, n in enumerate(lengths):
        # Text from the middle of a book: no title page, the same in every run.
        text = sources[i % len(sources)].read_text()
        ids = tokenizer.encode(text[len(text) // 2 : len(text) // 2 + 20 * n], add_special_tokens=False)
        if len(ids) < n:
            raise ValueError(f"{sources[i % len(sources)].name} gave {len(ids)} tokens, fewer than {n}")
        prompts.append(ids[:n])
    return prompts


def _cell(comparison: str, engine: str, dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> Drift:
    """a, b: (N, vocab) logits of the same N positions."""
    a, b = a.float(), b.float()
    return Drift(comparison, engine, str(dtype).removeprefix("torch."), (a - b).abs().max().item(),
                 (a.argmax(-1) == b.argmax(-1)).float().mean().item(), a.shape[0])


# ----- kvcache ----------------------------------------------------------------------------------


@torch.inference_mode()
def kvcache_drift(model, prompts: list[list[int]], setup: Setup) -> list[Drift]:
    """The five comparisons for a kvcache ``Transformer`` at its own dtype and device."""
    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    ids = torch.tensor([prompts[0]], device=device)
    T = ids.shape[1]

    def cache(batch: int = 1):
        return make_cache(model, "dense", cache_length=T + setup.steps + 1, batch_size=batch)

    out = []
    plain = model(ids)[0]
    c = cache()
    half = T // 2
    parts = [model(ids[:, :half], c)[0]] + [model(ids[:, t : t + 1], c)[0] for t in range(half, T)]
    out.append(_cell(COMPARISONS[0], "kvcache", dtype, torch.cat(parts), plain))

    one = model(ids, cache())[0]
    c = cache()
    chunked = torch.cat([model(ids[:, t : t + setup.chunk], c)[0] for t in range(0, T, setup.chunk)])
    out.append(_cell(COMPARISONS[1], "kvcache", dtype, chunked, one))

    lengths = [len(p) for p in prompts]
    padded = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.tensor(p)
    batched = model(padded, cache(len(prompts)), n_tokens=lengths)
    alone = [model(torch.tensor([p], device=device), cache())[0] for p in prompts]
    out.append(_cell(COMPARISONS[2], "kvcache", dtype, torch.cat([batched[b, :n] for b, n in enumerate(lengths)]),
                     torch.cat(alone)))

    for aligned, name in ((False, COMPARISONS[3]), (True, COMPARISONS[4])):
        store = PrefixStore(model)
        # Another prompt with the same first ``prefix`` tokens fills the store.
        other = prompts[0][: setup.prefix] + prompts[1][: setup.chunk]
        prefill(model, cache(), [other], chunk=setup.chunk, store=store, aligned=aligned)
        fresh, tokens = _continue(model, cache(), prompts[0], setup, None, aligned)
        reused, _ = _continue(model, cache(), prompts[0], setup, store, aligned, tokens)
        out.append(_cell(name, "kvcache", dtype, reused, fresh))
    return out


def _continue(model, cache, prompt: list[int], setup: Setup, store, aligned: bool,
              feed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``prompt`` (through ``store``), then ``setup.steps`` decode steps fed ``feed``
    (steps, 1, 1) or, without it, the greedy tokens, which are returned: both runs of a comparison
    see the same tokens. Returns (1 + steps, vocab) logits and the tokens fed."""
    logits = [prefill(model, cache, [prompt], chunk=setup.chunk, store=store, aligned=aligned)]
    fed: list[torch.Tensor] = []

    def pick(last: torch.Tensor) -> torch.Tensor:
        # (The loop picks once more after the last step; that token is not fed.)
        i = len(fed)
        fed.append(last.argmax(-1, keepdim=True) if feed is None or i >= len(feed) else feed[i])  # (1, 1)
        return fed[-1].view(1)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        logits.append(model(tokens, cache)[:, -1])
        return logits[-1]

    decode_loop([[]], logits[0], step, setup.steps + 1, pick, lambda row, tokens: False)
    return torch.cat(logits), torch.stack(fed[: setup.steps])


# ----- transformers -----------------------------------------------------------------------------


@torch.inference_mode()
def transformers_drift(hf, prompts: list[list[int]], setup: Setup, dtype: torch.dtype) -> list[Drift]:
    """The comparisons for a transformers causal LM (its default attention), with DynamicCache."""
    from transformers import DynamicCache

    from ..hf import cache_kwargs

    device = hf.device
    ids = torch.tensor([prompts[0]], device=device)
    T = ids.shape[1]
    out = []
    plain = hf(ids, use_cache=False).logits[0]
    cache = DynamicCache()
    half = T // 2
    parts = [hf(ids[:, :half], **cache_kwargs(cache), use_cache=True).logits[0]]
    for t in range(half, T):
        parts.append(hf(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True).logits[0])
    out.append(_cell(COMPARISONS[0], "transformers", dtype, torch.cat(parts), plain))

    one = hf(ids, **cache_kwargs(DynamicCache()), use_cache=True).logits[0]
    cache = DynamicCache()
    chunked = [hf(ids[:, t : t + setup.chunk], **cache_kwargs(cache), use_cache=True).logits[0]
               for t in range(0, T, setup.chunk)]
    out.append(_cell(COMPARISONS[1], "transformers", dtype, torch.cat(chunked), one))

    # Left padding with an attention mask and positions counted from each row's first token, as
    # transformers' generate() batches prompts.
    lengths = [len(p) for p in prompts]
    padded = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
    mask = torch.zeros_like(padded)
    for b, p in enumerate(prompts):
        padded[b, T - len(p) :] = torch.tensor(p)
        mask[b, T - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = hf(padded, attention_mask=mask, position_ids=positions, use_cache=False).logits
    alone = [hf(torch.tensor([p], device=device), use_cache=False).logits[0] for p in prompts]
    out.append(_cell(COMPARISONS[2], "transformers", dtype,
                     torch.cat([batched[b, T - n :] for b, n in enumerate(lengths)]), torch.cat(alone)))

    prefix_cache = DynamicCache()
    hf(ids[:, : setup.prefix], **cache_kwargs(prefix_cache), use_cache=True)
    fresh, tokens = _hf_continue(hf, ids, DynamicCache(), 0, setup)
    reused, _ = _hf_continue(hf, ids, copy.deepcopy(prefix_cache), setup.prefix, setup, tokens)
    out.append(_cell(COMPARISONS[3], "transformers", dtype, reused, fresh))
    out.append(Drift(COMPARISONS[4], "transformers", str(dtype).removeprefix("torch."), None, None, 0))
    return out


def _hf_continue(hf, ids: torch.Tensor, cache, start: int, setup: Setup,
                 feed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids[:, start:] in one call after a cache holding ids[:, :start], then decode steps, as
    ``_continue`` does."""
    from ..hf import cache_kwargs

    logits = [hf(ids[:, start:], **cache_kwargs(cache), use_cache=True).logits[:, -1]]
    fed = []
    for i in range(setup.steps):
        fed.append(logits[-1].argmax(-1, keepdim=True) if feed is None else feed[i])
        logits.append(hf(fed[-1], **cache_kwargs(cache), use_cache=True).logits[:, -1])
    return torch.cat(logits), torch.stack(fed)


# ----- the report ---------------------------------------------------------------------------------


def report(model_dir: str | Path | None, dtypes: list[str], device: str | torch.device = "cpu",
           setup: Setup = Setup(), with_transformers: bool = True) -> dict:
    """Every comparison for every dtype: {"model", "device", "setup", "transformers", "results"}."""
    path = _resolve(model_dir)
    hf_version = None
    if with_transformers:
        try:
            import transformers

            hf_version = transformers.__version__
        except ImportError:
            pass
    results: list[Drift] = []
    prompts = None
    for name in dtypes:
        dtype = DTYPES[name]
        model = load(path, dtype=dtype, device=device)
        if prompts is None:
            prompts = texts(model_dir, setup, model.config.vocab_size)
        results += kvcache_drift(model, prompts, setup)
        del model
        if hf_version is not None:
            from transformers import AutoModelForCausalLM

            # A GGUF file: transformers dequantizes it itself (from_pretrained(dir, gguf_file=name)).
            where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if path.is_file() else \
                dict(pretrained_model_name_or_path=path)
            hf = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).to(device).eval()
            results += transformers_drift(hf, prompts, setup, dtype)
            del hf
    # The contract of the report: the same weights, so the cached-vs-uncached figures of both
    # engines measure arithmetic alone.
    return {"model": str(path), "device": str(device), "setup": asdict(setup), "transformers": hf_version,
            "results": [asdict(r) for r in results]}


def table(data: dict) -> str:
    """The report as a fixed-width text table: one row per comparison and engine, two columns
    (max |logit difference|, top-1 agreement) per dtype."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in data["results"]))
    engines = list(dict.fromkeys(r["engine"] for r in data["results"]))
    cells = {(r["comparison"], r["engine"], r["dtype"]): r for r in data["results"]}
    setup = data["setup"]
    lines = [
        f"drift: {data['model']} on {data['device']}; {setup['tokens']}-token prompt, chunks of {setup['chunk']}, "
        f"reused prefix {setup['prefix']} tokens, {setup['steps']} decode steps"
        + (f"; transformers {data['transformers']}" if data["transformers"] else ""),
        f"{'':33}{'':14}" + "".join(f"{d:>20}" for d in dtypes),
        f"{'comparison':33}{'engine':14}" + "".join(f"{'max|d|':>11}{'top-1':>9}" for _ in dtypes),
    ]
    for comparison in COMPARISONS:
        for i, engine in enumerate(engines):
            row = f"{comparison if i == 0 else '':33}{engine:14}"
            for d in dtypes:
                r = cells.get((comparison, engine, d))
                if r is None or r["max_abs"] is None:
                    row += f"{'-':>11}{'-':>9}"
                else:
                    row += f"{r['max_abs']:>11.2e}{100 * r['top1']:>8.1f}%"
            lines.append(row.rstrip())
    return "\n".join(lines) + "\n"
