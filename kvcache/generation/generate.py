"""Batched generation over ragged prompts: chunked prefill, then one token per row per step."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import torch

from ..cache.base import KVCache
from ..cache.registry import make_cache
from ..checkpoints.load import Tokenizer
from ..errors import CapacityError, GenerationError
from ..model.transformer import Transformer
from ..prefix.store import PrefixStore
from ..runtime import devices
from .compiled import allocate_for_capture, captured_decode, check_capturable
from .prefill import prefill

# on_token(row, token): called for every new token of every row still generating.
TokenCallback = Callable[[int, int], None]
# on_prefill(done, total): called after each prefill chunk with prompt tokens processed so far.
ProgressCallback = Callable[[int, int], None]

# Prompt tokens per forward pass during prefill, for ``generate`` and ``kvcache generate`` alike:
# small enough that a progress bar moves on a long prompt and that a chunk's activations stay
# small, large enough that per-chunk overhead is negligible next to the matmuls.
DEFAULT_PREFILL_CHUNK = 512

# New tokens a dense cache is allocated for with the prompt, before it allocates as it fills.
AHEAD = 256


# decode_loop's hooks: pick(logits (B, vocab)) -> tokens (B,); stopped(row, the row's tokens so far).
Pick = Callable[[torch.Tensor], torch.Tensor]
Stopped = Callable[[int, list[int]], bool]


def decode_loop(out: list[list[int]], next_logits: torch.Tensor, decode: Callable[..., torch.Tensor],
                max_new_tokens: int, pick: Pick, stopped: Stopped, *, drop_ended: bool = False) -> list[list[int]]:
    """The package's one loop over a model's logits, one token per row per step, into ``out`` (B
    empty lists, the caller's: they hold the tokens made so far if a step raises): ``generate``,
    kvzip's generation and the answers of ``kvcache eval`` run it.

    next_logits: (B, vocab) after each row's last prompt token. Each step ``pick``s a token per
    row, appends it to each row still going, ends a row once ``stopped(row, its tokens)`` (the
    token is kept), and feeds the tokens back through ``decode`` until every row has ended or
    holds ``max_new_tokens``. By default ended rows keep stepping (their tokens are discarded), so
    every step has the same shape: ``decode`` takes (B, 1) tokens to (B, vocab). With
    ``drop_ended`` a row leaves the batch once it ends: ``decode(tokens, rows)`` takes the (R, 1)
    tokens of the R rows still going and their indices, to their (R, vocab) logits."""
    done = [False] * len(out)
    rows = list(range(len(out)))
    for i in range(max_new_tokens):
        tokens = pick(next_logits)
        for b, token in zip(rows, tokens.tolist()):
            if not done[b]:
                out[b].append(token)
                done[b] = stopped(b, out[b])
        if all(done) or i == max_new_tokens - 1:
            break
        if drop_ended:
            going = [j for j, b in enumerate(rows) if not done[b]]
            rows = [rows[j] for j in going]
            next_logits = decode(tokens[going, None], rows)
        else:
            next_logits = decode(tokens[:, None])
    return out


def _longrope_recompute(model: Transformer, cache: KVCache, rows: list[list[int]], out: list[list[int]],
                        chunk: int | None, decode: Callable[[torch.Tensor], torch.Tensor]):
    """(prefill chunk, decode step) for a model whose rotary changes past its original context
    (longrope): there, as transformers' Phi-3 generates, every key of a sequence longer than the
    original context has the long rotation. A prompt longer than it is prefilled in one pass, and
    when decoding takes a row past it, every row is prefilled again (its prompt and the tokens
    made so far) instead of the step. Other models: the arguments unchanged."""
    rope = model.config.rope
    if not rope.length_dependent:
        return chunk, decode
    limit = rope.original_max_position_embeddings
    if max(map(len, rows)) > limit:
        chunk = None
    steps = [0]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        steps[0] += 1
        if not any(len(p) + steps[0] == limit + 1 for p in rows):
            return decode(tokens)
        cache.reset()
        return prefill(model, cache, [p + o for p, o in zip(rows, out)], chunk=None)

    return chunk, step


def stop_string_in_tail(tokenizer: Tokenizer, tokens: list[int], strings: Sequence[str]) -> bool:
    """Whether the text of ``tokens`` ends a stop string with its newest token, read from the
    newest tokens only, so that checking every step costs the same however long the answer is.
    (An earlier occurrence would have stopped the row earlier.) Every character takes at most
    four tokens (a character split into UTF-8 bytes), so 4 (L + 2) tokens hold the newest token's
    text and the L + 1 characters before it, L the longest string's length."""
    longest = max(map(len, strings))
    text = tokenizer.decode(tokens[-4 * (longest + 2):])
    return any(s in text for s in strings)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row: logits (B, vocab) -> (B,)."""
    return logits.argmax(-1)


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next tokens (B,) from logits (B, vocab): greedy at temperature 0, else filtered sampling
    with ``generator``, which must be on the logits' device (``torch.Generator(device=...)``)."""
    if generator is not None and not devices.same(generator.device, logits.device):
        raise ValueError(f"the generator is on {generator.device} but the logits are on {logits.device}: make it "
                         f"there (torch.Generator(device={str(logits.device)!r}))")
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


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al., 2019), as transformers applies it.

    logits: (B, vocab); seen: (B, vocab) bool, True for tokens already in a row's prompt or
    output. A seen token's logit is divided by ``penalty`` if positive and multiplied by it if
    negative, so a penalty > 1 always makes it less likely. Returns new (B, vocab) logits.
    """
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stop_strings`` (all of it if none occurs)."""
    found = [i for s in stop_strings if (i := text.find(s)) >= 0]
    return text[: min(found)] if found else text


def _is_token(value: object) -> bool:
    # bool is an int to Python, but True in a prompt is a mistake, not token 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _row(i: int, prompt: object) -> list[int]:
    """One prompt as a list of ints; raises ValueError for text, floats and bools."""
    if hasattr(prompt, "__array__") and not isinstance(prompt, torch.Tensor):
        prompt = torch.as_tensor(prompt)  # a NumPy array
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"prompts must be token ids (use tokenizer.encode), but prompt {i} is text: {prompt[:40]!r}")
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"prompt {i} must hold integer token ids, got a {prompt.dtype} tensor")
        if prompt.dim() != 1:
            raise ValueError(f"prompt {i} must be 1-D, got a tensor of shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if not _is_token(t)]
    if bad:
        raise ValueError(
            f"prompt {i} must hold int token ids, got {bad[0]!r} ({type(bad[0]).__name__}); "
            "token ids are not rounded or cast (use tokenizer.encode for text)"
        )
    return [int(t) for t in prompt]


def _as_rows(prompts: object) -> tuple[list[list[int]], bool]:
    """(rows, single): the prompts as lists of ints, and whether a single prompt was given."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be token ids (use tokenizer.encode), not text")
    if hasattr(prompts, "__array__") and not isinstance(prompts, torch.Tensor):
        prompts = torch.as_tensor(prompts)  # a NumPy array
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [_row(0, prompts)], True
        if prompts.dim() == 2:
            return [_row(i, p) for i, p in enumerate(prompts)], False
        raise ValueError(f"a prompt tensor must be 1-D (one prompt) or 2-D (a batch), got shape {tuple(prompts.shape)}")
    if not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a list of token ids, a list of such lists, or a tensor; got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt")
    if _is_token(prompts[0]):
        return [_row(0, prompts)], True
    return [_row(i, p) for i, p in enumerate(prompts)], False


def _check_int(name: str, value: object, low: int) -> None:
    if not _is_token(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _validate(rows, max_new_tokens, temperature, top_k, top_p, repetition_penalty, prefill_chunk,
              vocab_size) -> None:
    for i, p in enumerate(rows):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")
    _check_int("max_new_tokens", max_new_tokens, 0)
    _check_number("temperature", temperature)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None:
        _check_int("top_k", top_k, 1)
    if top_p is not None:
        _check_number("top_p", top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        raise ValueError(
            "top_k and top_p filter sampling, so they need temperature > 0; temperature 0 (the default) is greedy"
        )
    _check_number("repetition_penalty", repetition_penalty)
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0 is off), got {repetition_penalty}")
    if prefill_chunk is not None:
        _check_int("prefill_chunk", prefill_chunk, 1)


def _stop_strings(stop_strings: str | Sequence[str] | None, tokenizer: Tokenizer | None) -> tuple[str, ...]:
    if stop_strings is None:
        return ()
    strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    if not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {strings!r}")
    if strings and tokenizer is None:
        raise ValueError("stop_strings need tokenizer= (a kvcache.Tokenizer) to read the generated text")
    return strings


def _check_capacity(cache: KVCache, longest: int, max_new_tokens: int) -> None:
    """Raise CapacityError now, not after tokens have been produced, if a cache that cannot evict
    is too small. The last new token is sampled but never fed back, hence the - 1."""
    capacity = cache.max_tokens
    need = longest + max(max_new_tokens - 1, 0)
    if capacity is not None and need > capacity:
        raise CapacityError(
            f"the {cache.policy} cache holds at most {capacity} tokens per row, but the longest prompt "
            f"({longest} tokens) and max_new_tokens={max_new_tokens} need {need} (prompt + max_new_tokens - 1). "
            f"Make the cache with cache_length >= {need}, lower max_new_tokens, or use an evicting policy."
        )


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
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop_tokens: Sequence[int] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: Tokenizer | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    prefix_store: PrefixStore | None = None,
    aligned: bool = False,
    on_token: TokenCallback | None = None,
    on_prefill: ProgressCallback | None = None,
    compile: bool = False,
) -> list[list[int]] | list[int]:
    """Generate up to ``max_new_tokens`` tokens after each prompt; returns the new tokens.

    Prompts and output:
        prompts: token ids (``tokenizer.encode(text)``), never text: a list of ints or a 1-D
            tensor (one prompt; a single list is returned), or a list of such lists or a 2-D
            tensor (a batch, ragged lists allowed; one list per prompt is returned). Ids must
            be ints in [0, vocab_size); floats and bools are rejected, not cast.
        max_new_tokens: the most new tokens per prompt (an int >= 0).

    The cache:
        policy, cache_length, policy_options: how the cache is made when ``cache`` is None.
            ``cache_length`` is a token count, or a float in (0, 1] that is a share of the
            longest prompt (1.0: the whole prompt); default: longest prompt + max_new_tokens.
            ``policy_options`` are the policy's own options (``kvcache.policy_options``).
        cache: a ready cache (``kvcache.make_cache``) with one row per prompt, used instead;
            it is reset first and holds the final state afterwards.
        A cache that cannot evict (dense) must hold the longest prompt + max_new_tokens - 1
        tokens; if it cannot, ``CapacityError`` is raised before anything runs. A dense cache
        allocates the prompt and a few hundred new tokens first, then more as the run reaches
        them (at least doubling each time), each growth checked against the memory available
        (``MemoryBudgetError``): a large max_new_tokens costs only the tokens made.

    Decoding (greedy by default):
        temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: sample among the k most likely tokens only. Needs temperature > 0.
        top_p: sample among the most likely tokens whose probabilities first reach top_p
            (nucleus sampling). Needs temperature > 0.
        repetition_penalty: CTRL's penalty on every token already in a row's prompt or output:
            its logit is divided by the penalty if positive, multiplied by it if negative, before
            temperature and filtering. 1.0 (the default) is off; 1.1-1.3 curbs loops.
        seed: seeds the sampling generator, for reproducible samples.

    Stopping (each row on its own; the other rows go on):
        stop_tokens: a row ends at any of these tokens, which is kept as its last token.
            Default: the model config's ``eos_token_id``; ``()`` generates max_new_tokens.
        stop_strings: a row ends once its generated text (``tokenizer.decode``) contains any of
            these strings; the token that completes it is kept, so cut the text with
            ``truncate_at_stop``. Needs ``tokenizer``.

    Prefill and callbacks:
        prefill_chunk: prompt tokens per forward pass (default ``DEFAULT_PREFILL_CHUNK``, 512);
            None processes each prompt in one pass. Dense and window/sink caches give the same
            tokens for any chunking; h2o, tova and snapkv decide what to evict per chunk.
        prefix_store: a ``kvcache.PrefixStore``: each row takes the longest prefix of its prompt
            that the store holds (never the last token, whose logits start the generation),
            only the rest is prefilled, and what was computed (for a dense cache, the generated
            tokens too) is stored. Only exact token matches are reused. See docs/prefix.md.
        aligned: prefill each prompt alone on a fixed grid of ``prefill_chunk`` positions, and
            store prefixes at grid boundaries only, so that a run reusing a prefix makes the
            same calls as a run without it: bitwise equal logits on one device (for a batch,
            each prompt is prefilled alone, then the batch decodes together).
        on_token(row, token): called with each new token of each row as soon as it is sampled.
        on_prefill(done, total): called after each prefill chunk with the prompt tokens
            processed so far, over all rows, and the total.

    compile: run the decode steps through a captured step (``torch.compile``, CUDA graphs on
        CUDA; see kvcache/generation/compiled.py); prefill stays eager. The capture is made on the first
        call and kept with the cache: pass the same ``cache`` to later calls to reuse it (a
        cache made here is new each call, and so is its capture). Not with ``reserve``. A
        captured step needs every slot of a dense cache allocated, up front.

    Errors: ``ValueError`` for bad arguments (before anything runs), ``CapacityError`` and
    ``MemoryBudgetError`` as above. An error raised after the first new token (an exception from
    a callback, running out of memory, a dense cache that cannot grow) is raised as
    ``GenerationError``, whose ``tokens`` holds the tokens made so far (in the shape this
    function returns) and whose ``__cause__`` is the original error.
    """
    rows, single = _as_rows(prompts)
    cfg = model.config
    _validate(rows, max_new_tokens, temperature, top_k, top_p, repetition_penalty, prefill_chunk, cfg.vocab_size)
    strings = _stop_strings(stop_strings, tokenizer)
    stops = set(cfg.stop_ids() if stop_tokens is None else stop_tokens)
    longest = max(map(len, rows))
    cache = _cache_for(model, rows, max_new_tokens, cache, policy, cache_length, policy_options)
    _check_prefix_store(model, cache, prefix_store, prefill_chunk, aligned)
    decode = _decode_step(model, cache, compile)
    # The prompts and the first new tokens, checked against the memory available before the
    # prefill; a dense cache allocates the rest as the run reaches it.
    cache.allocate(longest + min(max_new_tokens, AHEAD))
    cache.reset()

    out: list[list[int]] = [[] for _ in rows]
    prefill_chunk, decode = _longrope_recompute(model, cache, rows, out, prefill_chunk, decode)
    # Prefill: chunk c holds tokens [c*step, (c+1)*step) of every row, right-padded.
    next_logits = prefill(model, cache, rows, chunk=prefill_chunk, store=prefix_store, aligned=aligned,
                          on_prefill=on_prefill)
    pick = _picker(model, rows, temperature, top_k, top_p, repetition_penalty, seed)

    def stopped(b: int, tokens: list[int]) -> bool:
        if on_token is not None:
            on_token(b, tokens[-1])
        return tokens[-1] in stops or bool(strings and stop_string_in_tail(tokenizer, tokens, strings))

    try:
        decode_loop(out, next_logits, decode, max_new_tokens, pick, stopped)
    except Exception as e:
        made = sum(map(len, out))
        if made == 0:
            raise
        raise GenerationError(
            f"generation failed after {made} new tokens ({type(e).__name__}: {e}); "
            "the exception's .tokens holds them",
            out[0] if single else out,
        ) from e
    if prefix_store is not None:
        # The cache holds each prompt and the new tokens fed back (all but the last one made).
        for b, row in enumerate(rows):
            prefix_store.add(cache, b, row + out[b][:-1], on_grid=False)
    return out[0] if single else out


def _cache_for(model: Transformer, rows: list[list[int]], max_new_tokens: int, cache: KVCache | None, policy: str,
               cache_length: int | float | None, policy_options: Mapping[str, object] | None) -> KVCache:
    """``generate``'s cache: ``cache`` checked against the prompts, or one made from ``policy``,
    ``cache_length`` (default: the longest prompt and the new tokens) and ``policy_options``;
    either must hold what it cannot evict (``_check_capacity``)."""
    longest = max(map(len, rows))
    if cache is None:
        cache = make_cache(model, policy, cache_length=longest + max_new_tokens if cache_length is None else cache_length,
                           batch_size=len(rows), prompt_length=longest, options=policy_options)
    elif cache_length is not None or policy_options is not None or policy != "dense":
        raise ValueError("pass either cache= or policy/cache_length/policy_options (they make a cache), not both")
    elif not isinstance(cache, KVCache):
        raise ValueError(f"cache= takes a kvcache.KVCache (make_cache), got {type(cache).__name__}; several "
                         "caches as one batch (kvcache.cache.Rows) run through model(...) and model.decode")
    elif cache.batch_size != len(rows):
        raise ValueError(f"the cache was made for batch_size={cache.batch_size}, but there are {len(rows)} prompts")
    _check_capacity(cache, longest, max_new_tokens)
    return cache


def _check_prefix_store(model: Transformer, cache: KVCache, store: PrefixStore | None, chunk: int | None,
                        aligned: object) -> None:
    """``prefix_store`` and ``aligned`` as ``generate`` takes them; a store is bound to the model and
    cache here, before the cache is reset, so that one for another model or cache rejects the call."""
    if not isinstance(aligned, bool):
        raise ValueError(f"aligned must be True or False, got {aligned!r}")
    if store is not None:
        if not isinstance(store, PrefixStore):
            raise ValueError(f"prefix_store must be a kvcache.PrefixStore, got {type(store).__name__}")
        store.bind(model, cache, chunk=chunk, aligned=aligned)
    elif aligned and chunk is None:
        raise ValueError("aligned=True prefills on a fixed grid of prefill_chunk tokens: give a prefill_chunk")


def _decode_step(model: Transformer, cache: KVCache, compile: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """One decode step, (B, 1) tokens -> (B, vocab) logits: eager, or the captured step, made on
    the first call so that setting up the compiler does not delay the prefill."""
    if not compile:
        return lambda tokens: model.decode(tokens, cache)
    check_capturable(cache)
    allocate_for_capture(cache)  # up front: the capture itself comes after the prefill
    return lambda tokens: captured_decode(model, cache).step(tokens)


def _picker(model: Transformer, rows: list[list[int]], temperature: float, top_k: int | None, top_p: float | None,
            repetition_penalty: float, seed: int | None) -> Pick:
    """The tokens of a step from its logits (B, vocab) -> (B,): ``sample`` with a generator seeded
    by ``seed``, after the repetition penalty over each row's prompt and output so far."""
    device = model.embed_tokens.weight.device
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    if repetition_penalty == 1.0:
        return lambda logits: sample(logits, temperature, top_k, top_p, generator)
    # seen[b, t]: token t is in row b's prompt or output.
    seen = torch.zeros(len(rows), model.config.vocab_size, dtype=torch.bool, device=device)
    for b, p in enumerate(rows):
        seen[b, torch.tensor(p, device=device)] = True
    every_row = torch.arange(len(rows), device=device)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        tokens = sample(penalize_repetition(logits, seen, repetition_penalty), temperature, top_k, top_p, generator)
        seen[every_row, tokens] = True
        return tokens

    return pick
