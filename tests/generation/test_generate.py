"""Batched, ragged, chunked generation and sampling."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from conftest import DEVICE, VOCAB, random_ids

import kvcache
from kvcache.errors import GenerationError
from kvcache.generation.generate import penalize_repetition, sample

PROMPT_LENGTHS = (1, 6, 11, 4)


def _prompts(seed=0, lengths=PROMPT_LENGTHS):
    return [random_ids(n, seed=seed + i)[0].tolist() for i, n in enumerate(lengths)]


def _greedy_reference(model, prompt, n):
    """Greedy continuation by repeated full forwards, without any cache."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=DEVICE))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral_window"])
def test_single_prompt_greedy_equals_uncached_greedy(model_factory, family):
    model = model_factory(family)
    prompt = _prompts()[2]
    out = kvcache.generate(model, prompt, max_new_tokens=12, stop_tokens=())
    assert out == _greedy_reference(model, prompt, 12)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral_window"])
@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_ragged_batch_equals_each_prompt_alone(model_factory, family, prefill_chunk):
    model = model_factory(family)
    prompts = _prompts(seed=1)
    batch = kvcache.generate(model, prompts, max_new_tokens=10, stop_tokens=(), prefill_chunk=prefill_chunk)
    assert len(batch) == len(prompts)
    for p, got in zip(prompts, batch):
        alone = kvcache.generate(model, p, max_new_tokens=10, stop_tokens=())
        assert got == alone
        assert len(got) == 10


@pytest.mark.parametrize("prefill_chunk", [1, 2, 5, 11, 64])
def test_prefill_chunk_gives_same_tokens(llama, prefill_chunk):
    prompts = _prompts(seed=2)
    ref = kvcache.generate(llama, prompts, max_new_tokens=8, stop_tokens=())
    got = kvcache.generate(llama, prompts, max_new_tokens=8, stop_tokens=(), prefill_chunk=prefill_chunk)
    assert got == ref


def test_on_prefill_reports_progress(llama):
    prompts = _prompts(seed=3)  # lengths 1, 6, 11, 4: total 22, longest 11
    calls = []
    kvcache.generate(llama, prompts, max_new_tokens=1, prefill_chunk=4, on_prefill=lambda d, t: calls.append((d, t)))
    # chunks [0,4), [4,8), [8,11): tokens processed 1+4+4+4, then 1+6+8+4, then 1+6+11+4
    assert calls == [(13, 22), (19, 22), (22, 22)]


def test_prompt_forms(llama):
    prompts = _prompts(seed=4, lengths=(5, 5))
    as_lists = kvcache.generate(llama, prompts, max_new_tokens=4, stop_tokens=())
    as_tensor = kvcache.generate(llama, torch.tensor(prompts, device=DEVICE), max_new_tokens=4, stop_tokens=())
    single = kvcache.generate(llama, prompts[0], max_new_tokens=4, stop_tokens=())
    single_tensor = kvcache.generate(llama, torch.tensor(prompts[1], device=DEVICE), max_new_tokens=4, stop_tokens=())
    assert as_tensor == as_lists
    assert single == as_lists[0] and single_tensor == as_lists[1]
    assert all(isinstance(t, int) for t in single)
    assert kvcache.generate(llama, prompts, max_new_tokens=0) == [[], []]


def test_given_cache_is_reset_and_reused(llama):
    prompts = _prompts(seed=5, lengths=(3, 7))
    ref = kvcache.generate(llama, prompts, max_new_tokens=6, stop_tokens=())
    cache = kvcache.make_cache(llama, cache_length=20, batch_size=2)
    assert kvcache.generate(llama, prompts, max_new_tokens=6, stop_tokens=(), cache=cache) == ref
    assert cache.lengths.tolist() == [3 + 5, 7 + 5]
    # reused: reset first, so the stale tokens do not leak in
    assert kvcache.generate(llama, prompts, max_new_tokens=6, stop_tokens=(), cache=cache) == ref


def test_given_cache_wrong_batch_or_too_small(llama):
    prompts = _prompts(seed=5, lengths=(3, 7))
    with pytest.raises(ValueError, match="batch_size"):
        kvcache.generate(llama, prompts, max_new_tokens=2, cache=kvcache.make_cache(llama, cache_length=20, batch_size=3))
    with pytest.raises(kvcache.CapacityError):
        kvcache.generate(llama, prompts, max_new_tokens=2, cache=kvcache.make_cache(llama, cache_length=5, batch_size=2))
    with pytest.raises(kvcache.CapacityError):
        kvcache.generate(llama, prompts, max_new_tokens=8, stop_tokens=(), cache_length=10)
    with pytest.raises(ValueError, match="unknown policy"):
        kvcache.generate(llama, prompts, max_new_tokens=2, policy="bogus")


# --- stop tokens and callbacks -----------------------------------------------------------------


def _stop_case(llama):
    """Prompts, their unconstrained continuations, and a token that ends row 0 early only."""
    prompts = _prompts(seed=6, lengths=(4, 9, 2))
    free = kvcache.generate(llama, prompts, max_new_tokens=12, stop_tokens=())
    for k in range(1, 8):
        tok = free[0][k]
        if tok not in free[0][:k] and tok not in free[1] and tok not in free[2]:
            return prompts, free, k, tok
    pytest.fail(f"no usable stop token in {free}")  # the fixture model changed: pick other prompts


def test_stop_token_ends_one_row_only(llama):
    prompts, free, k, tok = _stop_case(llama)
    out = kvcache.generate(llama, prompts, max_new_tokens=12, stop_tokens=[tok])
    assert out[0] == free[0][: k + 1]
    assert out[0][-1] == tok
    assert out[1] == free[1] and out[2] == free[2]


def test_default_stop_tokens_come_from_config(llama_ckpt, tmp_path, llama):
    prompts, free, k, tok = _stop_case(llama)
    for eos in (tok, [127, tok]):
        path = tmp_path / f"eos{len(str(eos))}"
        shutil.copytree(llama_ckpt.path, path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["eos_token_id"] = eos
        (path / "config.json").write_text(json.dumps(cfg))
        model = kvcache.load(path, device=DEVICE)
        out = kvcache.generate(model, prompts, max_new_tokens=12)
        assert out[0] == free[0][: k + 1]
        assert out[1] == free[1]
        # an explicit empty list disables the config's eos
        assert kvcache.generate(model, prompts, max_new_tokens=12, stop_tokens=()) == free


def test_on_token_receives_every_token(llama):
    prompts, free, k, tok = _stop_case(llama)
    calls = []
    out = kvcache.generate(llama, prompts, max_new_tokens=12, stop_tokens=[tok], on_token=lambda r, t: calls.append((r, t)))
    for row in range(len(prompts)):
        assert [t for r, t in calls if r == row] == out[row]
    assert len(calls) == sum(len(o) for o in out)
    # tokens arrive step by step: row 0's stop token comes before row 1's later tokens
    assert calls.index((0, tok)) < len(calls) - 1


# --- sampling ----------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(llama):
    prompts = _prompts(seed=7)
    kw = dict(max_new_tokens=16, stop_tokens=(), temperature=1.5)
    a = kvcache.generate(llama, prompts, seed=123, **kw)
    b = kvcache.generate(llama, prompts, seed=123, **kw)
    c = kvcache.generate(llama, prompts, seed=124, **kw)
    greedy = kvcache.generate(llama, prompts, max_new_tokens=16, stop_tokens=())
    assert a == b
    assert a != c
    assert a != greedy
    assert all(0 <= t < VOCAB for row in a for t in row)


def test_top_k_1_and_tiny_top_p_are_greedy(llama):
    prompts = _prompts(seed=8)
    greedy = kvcache.generate(llama, prompts, max_new_tokens=10, stop_tokens=())
    kw = dict(max_new_tokens=10, stop_tokens=(), temperature=2.0, seed=0)
    assert kvcache.generate(llama, prompts, top_k=1, **kw) == greedy
    assert kvcache.generate(llama, prompts, top_p=1e-6, **kw) == greedy


def test_sample_top_k_keeps_the_k_best():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0, 2.5]], device=DEVICE).repeat(500, 1)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    drawn = sample(logits, 1.0, 3, None, g)
    assert set(drawn.tolist()) == {1, 2, 5}


def test_sample_top_p_keeps_the_nucleus():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3], device=DEVICE)
    logits = probs.log().repeat(2000, 1)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    # 0.4 alone is below 0.5, so 0.3 joins; 0.4 + 0.3 covers 0.5, so nothing else does.
    assert set(sample(logits, 1.0, None, 0.5, g).tolist()) == {1, 3}
    assert set(sample(logits, 1.0, None, 0.4, g).tolist()) == {1}
    assert set(sample(logits, 1.0, None, 1.0, g).tolist()) == {0, 1, 2, 3}


def test_sample_refuses_a_generator_on_another_device():
    """A generator drives sampling on its own device only (a CPU generator fails on CUDA logits):
    the mismatch is named before anything is drawn. On the CPU, a meta generator stands in."""
    logits = torch.zeros(2, 5, device="meta" if DEVICE.type == "cpu" else DEVICE)
    with pytest.raises(ValueError, match="generator is on cpu but the logits are on"):
        sample(logits, 1.0, None, None, torch.Generator())


def test_sample_temperature_zero_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(sample(logits, 0.0, 5, 0.9, None), logits.argmax(-1))


def test_sample_temperature_sharpens():
    logits = torch.tensor([[0.0, 1.0]], device=DEVICE).repeat(4000, 1)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hot = sample(logits, 4.0, None, None, g).float().mean()
    cold = sample(logits, 0.25, None, None, g).float().mean()
    # P(token 1): sigmoid(1/4) = 0.56 hot, sigmoid(4) = 0.98 cold
    assert 0.5 < hot < 0.62
    assert cold > 0.95


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([], {}, "prompts is empty"),
        ([[]], {}, "prompt 0 is empty"),
        ([[5, 6], []], {}, "prompt 1 is empty"),
        ([[5, VOCAB]], {}, "outside"),
        ([[5, -1]], {}, "outside"),
        ([5, 6], {"max_new_tokens": -1}, "max_new_tokens"),
        ([5, 6], {"temperature": -0.5}, "temperature"),
        ([5, 6], {"temperature": 1.0, "top_k": 0}, "top_k"),
        ([5, 6], {"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ([5, 6], {"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ([5, 6], {"prefill_chunk": 0}, "prefill_chunk"),
        ("hello", {}, r"token ids \(use tokenizer.encode\)"),
        (["hello", "world"], {}, r"token ids \(use tokenizer.encode\)"),
        ([5, 6.5], {}, "int token ids, got 6.5"),
        ([[5, 6], [7.0]], {}, "prompt 1 must hold int token ids"),
        ([5, True], {}, "got True"),
        (torch.tensor([5.0, 6.0], device=DEVICE), {}, "integer token ids"),
        (torch.tensor([True, False], device=DEVICE), {}, "integer token ids"),
        (torch.ones(1, 2, 2, dtype=torch.long, device=DEVICE), {}, "1-D"),
        ([5, 6], {"max_new_tokens": 1.5}, "max_new_tokens must be an int"),
        ([5, 6], {"max_new_tokens": True}, "max_new_tokens must be an int"),
        ([5, 6], {"cache_length": 0}, "cache_length"),
        ([5, 6], {"top_p": 0.5}, "need temperature > 0"),
        ([5, 6], {"top_k": 3}, "need temperature > 0"),
        ([5, 6], {"repetition_penalty": 0.0}, "repetition_penalty"),
        ([5, 6], {"temperature": float("nan")}, "temperature"),
        ([5, 6], {"stop_strings": ["x"]}, "tokenizer"),
    ],
)
def test_bad_arguments_rejected(llama, prompts, kwargs, match):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        kvcache.generate(llama, prompts, **kwargs)


def test_numpy_prompts_are_token_ids(llama):
    np = pytest.importorskip("numpy")
    prompts = _prompts(seed=9, lengths=(4, 4))
    ref = kvcache.generate(llama, prompts, max_new_tokens=3, stop_tokens=())
    assert kvcache.generate(llama, np.array(prompts), max_new_tokens=3, stop_tokens=()) == ref
    assert kvcache.generate(llama, np.array(prompts[0]), max_new_tokens=3, stop_tokens=()) == ref[0]


def test_cache_and_cache_arguments_are_exclusive(llama):
    cache = kvcache.make_cache(llama, cache_length=20)
    with pytest.raises(ValueError, match="either cache= or"):
        kvcache.generate(llama, [5, 6], max_new_tokens=2, cache=cache, cache_length=10)


# --- failing early, and late -------------------------------------------------------------------


def test_dense_cache_too_small_fails_before_any_work(llama):
    prompts = _prompts(seed=10, lengths=(3, 7))
    calls = []
    kw = dict(max_new_tokens=6, stop_tokens=(), on_token=lambda r, t: calls.append(t),
              on_prefill=lambda d, t: calls.append(d))
    # The last new token is never fed back: 7 + 6 - 1 = 12 slots suffice, 11 do not.
    cache = kvcache.make_cache(llama, cache_length=11, batch_size=2)
    with pytest.raises(kvcache.CapacityError, match="at most 11 tokens.*need 12"):
        kvcache.generate(llama, prompts, cache=cache, **kw)
    assert calls == [] and cache.lengths.tolist() == [0, 0]
    with pytest.raises(kvcache.CapacityError, match="need 12"):
        kvcache.generate(llama, prompts, cache_length=11, **kw)
    assert calls == []
    assert len(kvcache.generate(llama, prompts, cache_length=12, **kw)[1]) == 6
    # An evicting cache of the same size takes any length.
    assert len(kvcache.generate(llama, prompts, policy="window", cache_length=4, max_new_tokens=6, stop_tokens=())[1]) == 6


def test_error_after_tokens_keeps_them(llama):
    prompts = _prompts(seed=11, lengths=(3, 5))
    free = kvcache.generate(llama, prompts, max_new_tokens=6, stop_tokens=())
    made = []

    def on_token(row, token):
        if len(made) == 5:
            raise RuntimeError("the consumer went away")
        made.append(token)

    with pytest.raises(GenerationError, match="after 6 new tokens") as caught:
        kvcache.generate(llama, prompts, max_new_tokens=6, stop_tokens=(), on_token=on_token)
    # Tokens arrive row by row within a step; the sixth (row 1's third), whose callback raised, was
    # made and is kept too.
    assert caught.value.tokens == [free[0][:3], free[1][:3]]
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(caught.value, kvcache.KVCacheError)
    # A single prompt gets a single list back, here as there.
    with pytest.raises(GenerationError) as caught:
        made.clear()
        kvcache.generate(llama, prompts[0], max_new_tokens=6, stop_tokens=(), on_token=on_token)
    assert caught.value.tokens == free[0][:6]


def test_positions_past_training_warn_when_reached(llama_ckpt, tmp_path):
    """The warning comes with the step that computes a position past max_position_embeddings,
    not when the cache is made for the most a run may reach: a run that stops before gets none."""
    path = tmp_path / "short"
    shutil.copytree(llama_ckpt.path, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (path / "config.json").write_text(json.dumps(cfg))
    model = kvcache.load(path, device=DEVICE)
    prompt = random_ids(10)[0].tolist()
    free = kvcache.generate(model, prompt, max_new_tokens=7, stop_tokens=())  # 16 positions: fine
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # Stops at free[3]'s first occurrence, at position 13 or before, with room for a million.
        early = kvcache.generate(model, prompt, max_new_tokens=10**6, stop_tokens=(free[3],))
    assert early == free[: free.index(free[3]) + 1]
    assert [w for w in record if "max_position_embeddings" in str(w.message)] == []
    warned_at_token = []
    with pytest.warns(UserWarning, match="position 16, beyond the model's max_position_embeddings=16") as record:
        kvcache.generate(model, prompt, max_new_tokens=8, stop_tokens=(),
                         on_token=lambda row, token: warned_at_token.append(len(record)))
    # The 7th new token is fed back at position 16: the step that makes the 8th warns.
    assert warned_at_token == [0] * 7 + [1]
    assert len(record) == 1


# --- a dense cache allocated as the run reaches it ---------------------------------------------

# Distinct tokens: a repetition penalty this strong makes greedy decoding avoid every token seen,
# so that the token at index k first occurs there and, as a stop token, ends a run at k + 1 tokens.
DISTINCT = 1e4
REACHED = 600  # new tokens of the reference: past the first slots (FIRST_SLOTS) and a growth or two


@pytest.fixture(scope="module")
def grown_reference(tiny):
    """(prompt, tokens) of a run whose dense cache had every slot allocated up front."""
    prompt = random_ids(6, seed=3)[0].tolist()
    cache = kvcache.make_cache(tiny, cache_length=len(prompt) + REACHED)
    cache.allocate()
    tokens = kvcache.generate(tiny, prompt, max_new_tokens=REACHED, cache=cache, stop_tokens=(),
                              repetition_penalty=DISTINCT)
    assert len(set(tokens)) == REACHED
    return prompt, tokens


def _bytes_per_token(model) -> int:
    """A dense cache's bytes per token and row at full precision, positions as int32 (the widest)."""
    cfg = model.config
    return cfg.num_layers * (2 * cfg.num_kv_heads * cfg.head_dim * model.embed_tokens.weight.element_size() + 4)


def test_a_huge_max_new_tokens_allocates_what_the_run_reaches(tiny, grown_reference):
    prompt, reference = grown_reference
    stop = reference[-1]
    cache = kvcache.make_cache(tiny, cache_length=len(prompt) + 10**7)  # what generate makes
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = kvcache.generate(tiny, prompt, max_new_tokens=10**7, cache=cache, stop_tokens=(stop,),
                               repetition_penalty=DISTINCT)
        default = kvcache.generate(tiny, prompt, max_new_tokens=10**7, stop_tokens=(stop,),
                                   repetition_penalty=DISTINCT)
    assert out == default == reference  # bitwise the run whose cache was allocated up front
    # The run held the prompt and all but its last token; the cache grew at most to twice that.
    reached = len(prompt) + REACHED - 1
    assert cache.lengths.tolist() == [reached]
    assert reached <= cache.allocated_tokens < 2 * reached
    assert cache.nbytes() < 2 * reached * _bytes_per_token(tiny)  # 10**7 tokens would take 2.6 GB
    # The model's 4096 positions were never passed: no warning, though 10**7 were allowed for.
    assert [w for w in record if "max_position_embeddings" in str(w.message)] == []


def test_a_growth_past_the_memory_available_is_refused_with_the_tokens_made(tiny, grown_reference, monkeypatch):
    """A growth the device cannot hold raises before allocating; generate's GenerationError keeps
    the tokens made, which are the reference's, and the cache holds what it held."""
    import kvcache.runtime.memory

    prompt, reference = grown_reference
    # Room for the first growths, not for one past about 700 tokens.
    monkeypatch.setattr(kvcache.runtime.memory, "available_bytes", lambda device: 700 * _bytes_per_token(tiny))
    cache = kvcache.make_cache(tiny, cache_length=len(prompt) + 10**7)
    with pytest.raises(GenerationError, match="generation failed after") as caught:
        kvcache.generate(tiny, prompt, max_new_tokens=10**7, cache=cache, stop_tokens=(),
                         repetition_penalty=DISTINCT)
    cause = caught.value.__cause__
    assert isinstance(cause, kvcache.MemoryBudgetError)
    assert "growing the dense cache from" in str(cause) and "available on" in str(cause)
    assert "max_new_tokens" in str(cause)  # what to lower
    made = caught.value.tokens
    assert 0 < len(made) < REACHED and made == reference[: len(made)]
    # The refused step needed one slot more than allocated: the cache holds every token it held.
    assert cache.lengths.tolist() == [cache.allocated_tokens] == [len(prompt) + len(made) - 1]


# --- repetition penalty ------------------------------------------------------------------------


def test_penalize_repetition_is_ctrl():
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0]], device=DEVICE)
    seen = torch.tensor([[True, True, False, False]], device=DEVICE)
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.0, -2.0, 3.0, -4.0]]


def _penalized_greedy_reference(model, prompt, n, penalty):
    """Greedy decoding by full forwards, applying the penalty to every token seen so far."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=DEVICE))[0, -1]
            seen = torch.tensor(sorted(set(ids)), device=DEVICE)
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_repetition_penalty_is_applied_to_each_rows_tokens(llama):
    prompt = [5, 6, 7]
    free = kvcache.generate(llama, prompt, max_new_tokens=24, stop_tokens=())
    got = kvcache.generate(llama, prompt, max_new_tokens=24, stop_tokens=(), repetition_penalty=1.8)
    assert got == _penalized_greedy_reference(llama, prompt, 24, 1.8)
    assert got != free
    # Batched and ragged, each row penalizes its own tokens only.
    prompts = _prompts(seed=12, lengths=(3, 8))
    batch = kvcache.generate(llama, prompts, max_new_tokens=10, stop_tokens=(), repetition_penalty=1.8)
    assert batch == [_penalized_greedy_reference(llama, p, 10, 1.8) for p in prompts]


@pytest.mark.parametrize("stop", ["wife", " a single", "é —", "“q", "\n\n"])
def test_a_stop_string_is_found_at_the_token_that_completes_it(stop):
    """Reading the newest tokens only, the stop check fires at the first token whose text completes
    the string, as reading the whole text would (multi-byte characters included)."""
    from kvcache.generation.generate import stop_string_in_tail

    tokenizer = kvcache.load_tokenizer()
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
            "in want of a wife. naïve café — “quoted”\n\n  end")
    tokens = tokenizer.encode(text, add_special_tokens=False)
    full = next(n for n in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:n]))
    tail = next(n for n in range(1, len(tokens) + 1) if stop_string_in_tail(tokenizer, tokens[:n], [stop]))
    assert tail == full
