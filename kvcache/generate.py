"""Batched generation over ragged prompts: chunked prefill, then one token per row per step."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from .cache.base import KVCache
from .cache.registry import make_cache
from .model import Transformer

# on_token(row, token): called for every new token of every row still generating.
TokenCallback = Callable[[int, int], None]
# on_prefill(done, total): called after each prefill chunk with prompt tokens processed so far.
ProgressCallback = Callable[[int, int], None]


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next tokens (B,) from logits (B, vocab): greedy at temperature 0, else filtered sampling."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the tokens before it already cover top_p; the most likely always stays.
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _validate(prompts, max_new_tokens, temperature, top_k, top_p, prefill_chunk, vocab_size) -> None:
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if prefill_chunk is not None and prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]] | Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    policy: str = "dense",
    cache_length: int | float | None = None,
    policy_options: Mapping[str, object] | None = None,
    cache: KVCache | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    prefill_chunk: int | None = None,
    on_token: TokenCallback | None = None,
    on_prefill: ProgressCallback | None = None,
) -> list[list[int]] | list[int]:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    ``prompts`` is a list of token-id lists of any lengths (one batch), or a single list / 1-D
    tensor. Returns the new tokens of each prompt (a single list for a single prompt); a row that
    produces a stop token ends there, the stop token included. ``stop_tokens`` defaults to the
    model's ``eos_token_id``; pass ``()`` to generate exactly ``max_new_tokens``.

    The cache is made with ``policy``, its ``policy_options`` and ``cache_length`` (default:
    longest prompt plus ``max_new_tokens``; a float in (0, 1) is a fraction of the longest
    prompt), or passed ready-made as ``cache`` (it is reset first). Prompts are
    prefilled ``prefill_chunk`` tokens at a time (default: all at once).
    """
    single = isinstance(prompts, torch.Tensor) and prompts.dim() == 1 or (
        len(prompts) > 0 and isinstance(prompts[0], int)
    )
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    rows = [list(prompts)] if single else [list(p) for p in prompts]
    cfg = model.config
    _validate(rows, max_new_tokens, temperature, top_k, top_p, prefill_chunk, cfg.vocab_size)
    if stop_tokens is None:
        eos = cfg.eos_token_id
        stop_tokens = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    stops = set(stop_tokens)

    B = len(rows)
    lengths = [len(p) for p in rows]
    longest = max(lengths)
    if cache is None:
        cache = make_cache(
            model,
            policy,
            cache_length=cache_length or longest + max_new_tokens,
            batch_size=B,
            prompt_length=longest,
            **(policy_options or {}),
        )
    elif cache.batch_size != B:
        raise ValueError(f"the cache was made for batch_size={cache.batch_size}, but there are {B} prompts")
    cache.reset()
    device = model.embed_tokens.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    # Prefill: chunk c holds tokens [c*step, (c+1)*step) of every row, right-padded.
    chunk = prefill_chunk or longest
    padded = torch.zeros(B, longest, dtype=torch.long)
    for b, p in enumerate(rows):
        padded[b, : len(p)] = torch.tensor(p)
    padded = padded.to(device)
    lengths_t = torch.tensor(lengths)
    next_logits = torch.empty(B, cfg.vocab_size, device=device)
    for begin in range(0, longest, chunk):
        n = (lengths_t - begin).clamp(0, chunk)
        logits = model(padded[:, begin : begin + chunk], cache, n_tokens=n, last_only=True)[:, 0]
        # Rows whose prompt ends inside this chunk take their next-token logits from it.
        ends_here = ((lengths_t > begin) & (lengths_t <= begin + chunk)).to(device)
        next_logits = torch.where(ends_here[:, None], logits.to(next_logits.dtype), next_logits)
        if on_prefill is not None:
            on_prefill(int(lengths_t.clamp(max=begin + chunk).sum()), sum(lengths))

    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for i in range(max_new_tokens):
        tokens = sample(next_logits, temperature, top_k, top_p, generator)
        host = tokens.tolist()
        for b in range(B):
            if done[b]:
                continue
            out[b].append(host[b])
            if on_token is not None:
                on_token(b, host[b])
            if host[b] in stops:
                done[b] = True
        if all(done) or i == max_new_tokens - 1:
            break
        # Finished rows keep stepping (their tokens are discarded) so every step has the same shape.
        next_logits = model(tokens[:, None], cache)[:, -1]
    return out[0] if single else out
