"""The prefix store and prompt reuse: exactness with and without ``aligned``, rows that reuse
different lengths, the boundary trap, LRU by bytes, saving and loading, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, atol
from policy_util import build_tiny  # noqa: E402

import kvcache
from kvcache.cli import main
from kvcache.generation.prefill import prefill
from kvcache.prefix.store import INDEX, PrefixStore, PrefixStoreError

VOCAB = 64
CHUNK = 32
# Budgets below the prompts, so that every evicting policy evicts during the prefill.
BUDGET = 48
POLICIES = list(kvcache.policies())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("prefix_model"), layers=2, vocab=VOCAB)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("prefix_other"), layers=2, vocab=VOCAB, seed=7)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _ids(150, seed=1)
# Three questions after a shared prefix (the first is stored, the others reuse), of unequal lengths.
PROMPTS = [PREFIX + _ids(n, seed=10 + n) for n in (21, 40, 9)]


def _options(policy: str) -> dict:
    return {} if policy == "dense" else kvcache.cache.budget_options(policy, BUDGET)


def _cache(model, policy: str, batch: int, storage: str = "full"):
    length = 400 if policy == "dense" else BUDGET
    return kvcache.make_cache(model, f"{policy}:{storage}", cache_length=length, batch_size=batch, options=_options(policy))


def _prefill(model, policy, prompts, store=None, aligned=False, storage="full"):
    cache = _cache(model, policy, len(prompts), storage)
    with torch.inference_mode():
        logits = prefill(model, cache, prompts, chunk=CHUNK, store=store, aligned=aligned)
    return logits, cache


def _same_state(a, b) -> bool:
    x, y = a.snapshot().tensors(), b.snapshot().tensors()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# ----- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_aligned_reuse_is_bitwise_equal(model, policy):
    """The store is filled by another prompt with the same prefix, in another batch and another
    cache size; reusing it gives bitwise the logits and cache state of a run without the store."""
    store = PrefixStore(model)
    _prefill(model, policy, [PREFIX + [5, 6, 7]], store, aligned=True)
    assert all(store.reusable(p) == len(PREFIX) // CHUNK * CHUNK for p in PROMPTS)
    ref, ref_cache = _prefill(model, policy, PROMPTS, aligned=True)
    got, got_cache = _prefill(model, policy, PROMPTS, store, aligned=True)
    assert torch.equal(ref, got)
    assert _same_state(ref_cache, got_cache)


@pytest.mark.parametrize("storage", ["int8", "kivi4"])  # ("int4" holds full precision on a cache this small)
@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_aligned_reuse_is_bitwise_equal_quantized(model, policy, storage):
    store = PrefixStore(model)
    _prefill(model, policy, PROMPTS[:1], store, aligned=True, storage=storage)
    assert all(store.reusable(p) == len(PREFIX) // CHUNK * CHUNK for p in PROMPTS[1:])
    ref, _ = _prefill(model, policy, PROMPTS, aligned=True, storage=storage)
    got, _ = _prefill(model, policy, PROMPTS, store, aligned=True, storage=storage)
    assert torch.equal(ref, got)


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_aligned_with_and_without_the_store(model, policy):
    kw = dict(max_new_tokens=6, prefill_chunk=CHUNK, aligned=True, policy=policy,
              cache_length=None if policy == "dense" else BUDGET, policy_options=_options(policy) or None)
    store = PrefixStore(model)
    first = kvcache.generate(model, PROMPTS[:1], prefix_store=store, **kw)
    assert all(store.reusable(p) == len(PREFIX) // CHUNK * CHUNK for p in PROMPTS[1:])
    ref = kvcache.generate(model, PROMPTS, **kw)
    assert kvcache.generate(model, PROMPTS, prefix_store=store, **kw) == ref
    assert first == ref[:1]


@pytest.mark.parametrize("policy", POLICIES)
def test_default_reuse_gives_the_same_tokens(model, policy):
    """Without aligned: the same greedy tokens, and for a dense cache (any prefix) logits within 1e-5."""
    kw = dict(max_new_tokens=6, prefill_chunk=CHUNK, policy=policy,
              cache_length=None if policy == "dense" else BUDGET, policy_options=_options(policy) or None)
    store = PrefixStore(model)
    kvcache.generate(model, PROMPTS[:1], prefix_store=store, **kw)
    assert all(store.reusable(p) >= len(PREFIX) // CHUNK * CHUNK for p in PROMPTS[1:])
    ref = kvcache.generate(model, PROMPTS, **kw)
    assert kvcache.generate(model, PROMPTS, prefix_store=store, **kw) == ref
    store = PrefixStore(model)
    _prefill(model, policy, PROMPTS[:1], store)
    assert all(store.reusable(p) >= len(PREFIX) // CHUNK * CHUNK for p in PROMPTS[1:])
    a, _ = _prefill(model, policy, PROMPTS)
    b, _ = _prefill(model, policy, PROMPTS, store)
    assert (a - b).abs().max().item() <= atol("cache")


def test_a_dense_prefix_past_the_first_slots_reuses_bitwise(model):
    """A dense cache allocates its slots as it fills: a stored prefix longer than the slots a cache
    starts with is restored into a cache allowed a million tokens (allocating what it restores),
    and the run gives bitwise the logits of one without the store, holding little more."""
    long = _ids(300, seed=5)
    prompts = [long + _ids(n, seed=20 + n) for n in (7, 33)]
    store = PrefixStore(model)
    with torch.inference_mode():
        prefill(model, kvcache.make_cache(model, cache_length=400), [long + [5]], chunk=CHUNK, store=store,
                aligned=True)
    assert store.reusable(prompts[0]) == 300 // CHUNK * CHUNK

    def run(store):
        cache = kvcache.make_cache(model, cache_length=10**6, batch_size=2)
        with torch.inference_mode():
            return prefill(model, cache, prompts, chunk=CHUNK, store=store, aligned=True), cache

    (ref, _), (got, cache) = run(None), run(store)
    assert torch.equal(ref, got)
    assert cache.allocated_tokens < 2 * 333


def test_dense_rows_reuse_different_lengths(model):
    """One batch: a row with nothing stored, one reusing part of a stored prompt, one reusing a
    whole stored prompt and the generated tokens after it."""
    store = PrefixStore(model)
    stored = kvcache.generate(model, PROMPTS[0], max_new_tokens=5, prefix_store=store, prefill_chunk=CHUNK)
    rows = [_ids(70, seed=3), PROMPTS[0][:100] + _ids(30, seed=4), PROMPTS[0] + stored[:4] + [9, 9]]
    assert [store.reusable(r) for r in rows] == [0, 100, len(PROMPTS[0]) + 4]
    ref, _ = _prefill(model, "dense", rows)
    got, _ = _prefill(model, "dense", rows, store)
    assert (ref - got).abs().max().item() <= atol("cache")
    kw = dict(max_new_tokens=8, prefill_chunk=CHUNK)
    assert kvcache.generate(model, rows, prefix_store=store, **kw) == kvcache.generate(model, rows, **kw)


@pytest.mark.parametrize("policy", ["dense", "h2o", "sink"])
def test_rows_of_one_batch_share_a_new_prefix(model, policy):
    """A prefix that several rows start with and the store lacks is computed once, not per row."""
    fed = []

    def count(layer, hidden):
        if layer == 0:
            fed.append(hidden.shape[0] * hidden.shape[1])

    ref, _ = _prefill(model, policy, PROMPTS)
    model.layer_hook = count
    try:
        store = PrefixStore(model)
        got, _ = _prefill(model, policy, PROMPTS, store)
    finally:
        model.layer_hook = None
    # Once the shared prefix (or its grid part), then each row's rest in one padded batch.
    shared = store.boundary(len(PREFIX))
    assert sum(fed) <= shared + len(PROMPTS) * (max(map(len, PROMPTS)) - shared)
    assert (ref - got).abs().max().item() <= atol("cache")


def test_evicting_rows_reuse_grid_boundaries_only(model):
    store = PrefixStore(model)
    _prefill(model, "h2o", PROMPTS[:1], store)
    # Snapshots at multiples of the chunk below each prompt's last token; nothing in between.
    assert [store.reusable(p) for p in PROMPTS] == [160, 128, 128]
    assert store.reusable(PREFIX[:140]) == 128
    assert store.reusable(_ids(100, seed=5)) == 0


def test_the_last_prompt_token_is_always_computed(model):
    store = PrefixStore(model)
    kvcache.generate(model, PROMPTS[0], max_new_tokens=1, prefix_store=store)
    assert store.reusable(PROMPTS[0]) == len(PROMPTS[0]) - 1
    assert store.reusable(PROMPTS[0][:1]) == 0
    # The same prompt again: its last token's logits come from a computed chunk.
    assert kvcache.generate(model, PROMPTS[0], max_new_tokens=4, prefix_store=store) == \
        kvcache.generate(model, PROMPTS[0], max_new_tokens=4)


def test_the_boundary_trap():
    """A system prompt tokenized alone is not a prefix of system + question tokenized together;
    only the tokens that match are reused, and the answer is the one without the store."""
    model, tok = kvcache.load(dtype=torch.float32, device=DEVICE), kvcache.load_tokenizer()
    system, question = "You are a helpful assistant. ", "What is the capital of France?"
    alone, whole = tok.encode(system), tok.encode(system + question)
    assert whole[: len(alone)] != alone  # " " then "What" alone; " What" together
    store = PrefixStore(model)
    kvcache.generate(model, alone, max_new_tokens=1, prefix_store=store)
    assert store.reusable(whole) == len(alone) - 1
    kw = dict(max_new_tokens=12)
    assert kvcache.generate(model, whole, prefix_store=store, **kw) == kvcache.generate(model, whole, **kw)


# ----- the store --------------------------------------------------------------------------------


def test_lru_eviction_by_bytes(model):
    store = PrefixStore(model)
    _prefill(model, "dense", [PROMPTS[0]], store)
    per_prompt = store.nbytes
    small = PrefixStore(model, max_bytes=per_prompt + per_prompt // 8)
    for p in PROMPTS:
        _prefill(model, "dense", [p], small)
        assert small.nbytes <= small.max_bytes
    # The newest prompt is whole; the oldest lost (some of) its tail, never the shared prefix.
    assert small.reusable(PROMPTS[2]) == len(PROMPTS[2]) - 1
    assert len(PREFIX) <= small.reusable(PROMPTS[0]) < len(PROMPTS[0]) - 1


def test_max_bytes_below_one_entry_warns(model):
    tiny = PrefixStore(model, max_bytes=1000)
    with pytest.warns(UserWarning, match="max_bytes=1000 holds"):
        _prefill(model, "dense", [PROMPTS[0]], tiny)
    assert tiny.nbytes <= 1000 and 0 < tiny.reusable(PROMPTS[0]) < len(PREFIX)
    snapshots = PrefixStore(model, max_bytes=1000)
    with pytest.warns(UserWarning, match="more than max_bytes=1000"):
        _prefill(model, "h2o", [PROMPTS[0]], snapshots)
    assert len(snapshots) == 0 and snapshots.nbytes == 0
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            PrefixStore(model, max_bytes=bad)


def test_a_store_serves_one_cache_configuration(model):
    store = PrefixStore(model)
    kvcache.generate(model, PROMPTS[0], max_new_tokens=2, prefix_store=store, prefill_chunk=CHUNK)
    cache = kvcache.make_cache(model, "h2o", cache_length=BUDGET, options=_options("h2o"))
    with torch.inference_mode():
        model(torch.tensor([PROMPTS[1][:40]], device=DEVICE), cache)
    before = cache.snapshot().tensors()
    with pytest.raises(ValueError, match="holds dense caches .* but this call uses h2o"):
        kvcache.generate(model, PROMPTS[1], max_new_tokens=2, cache=cache, prefix_store=store)
    # Rejected before the cache was reset.
    assert all(torch.equal(before[k], t) for k, t in cache.snapshot().tensors().items())
    with pytest.raises(ValueError, match="aligned"):
        kvcache.generate(model, PROMPTS[1], max_new_tokens=2, prefix_store=store, aligned=True)
    with pytest.raises(ValueError, match="dtype"):
        kvcache.generate(model.to(torch.float64), PROMPTS[1], max_new_tokens=2, prefix_store=store)
    model.to(torch.float32)


def test_another_model_is_rejected(model, other_model, tmp_path):
    store = PrefixStore(model)
    kvcache.generate(model, PROMPTS[0], max_new_tokens=2, prefix_store=store)
    with pytest.raises(ValueError, match="another model"):
        kvcache.generate(other_model, PROMPTS[0], max_new_tokens=2, prefix_store=store)
    store.save(tmp_path / "store")
    with pytest.raises(PrefixStoreError, match="another model"):
        PrefixStore.load(tmp_path / "store", other_model)


# ----- saving and loading -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["dense", "snapkv", "expected_attention"])
def test_save_and_load(model, policy, tmp_path):
    store = PrefixStore(model)
    _prefill(model, policy, PROMPTS[:2], store, aligned=True)
    store.save(tmp_path)
    loaded = PrefixStore.load(tmp_path, model)
    assert len(loaded) == len(store) and loaded.nbytes == store.nbytes and loaded.binding == store.binding
    assert all(loaded.reusable(p) == store.reusable(p) >= len(PREFIX) // CHUNK * CHUNK for p in PROMPTS)
    ref, _ = _prefill(model, policy, PROMPTS, aligned=True)
    got, _ = _prefill(model, policy, PROMPTS, loaded, aligned=True)
    assert torch.equal(ref, got)
    # Saving again rewrites only new entries and removes the ones no longer named.
    files = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("entry-*")}
    loaded.save(tmp_path)
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("entry-*")}
    assert all(after.get(name) == t for name, t in files.items() if name in after)
    names = {e["file"] for e in json.loads((tmp_path / INDEX).read_text())["entries"] if "file" in e}
    assert names == set(after)


@pytest.mark.parametrize("policy,storage", [("snapkv", "full"), ("dense", "kivi4"), ("window", "kivi2")])
def test_a_store_saved_with_int64_positions_loads(model, policy, storage, tmp_path, monkeypatch):
    """A store whose snapshots hold int64 positions (as kvcache once stored them) loads, and
    reusing it gives the logits of a run without the store."""
    from kvcache.cache import positions

    monkeypatch.setattr(positions, "position_dtype", lambda limit=None: torch.long)
    store = PrefixStore(model)
    _prefill(model, policy, PROMPTS[:2], store, aligned=True, storage=storage)
    store.save(tmp_path)
    monkeypatch.undo()
    saved = [t for e in json.loads((tmp_path / INDEX).read_text())["entries"] if "file" in e
             for k, t in _entry_tensors(tmp_path / e["file"]).items() if k.endswith("storage.pos")]
    assert saved and all(t.dtype == torch.long for t in saved)
    loaded = PrefixStore.load(tmp_path, model)
    ref, ref_cache = _prefill(model, policy, PROMPTS, aligned=True, storage=storage)
    got, got_cache = _prefill(model, policy, PROMPTS, loaded, aligned=True, storage=storage)
    assert torch.equal(ref, got) and _same_state(ref_cache, got_cache)
    assert ref_cache.layers[0].storage.pos.dtype != torch.long


def _entry_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _saved(model, path: Path) -> Path:
    store = PrefixStore(model)
    _prefill(model, "dense", PROMPTS[:2], store)
    store.save(path)
    return path


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing", "index", "not_json", "version", "tokens"])
def test_damaged_stores_do_not_load(model, tmp_path, damage):
    path = _saved(model, tmp_path)
    entry = sorted(path.glob("entry-*"))[0]
    index = json.loads((path / INDEX).read_text())
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:-100])
    elif damage == "flipped":
        data = bytearray(entry.read_bytes())
        data[-5] ^= 0xFF
        entry.write_bytes(bytes(data))
    elif damage == "missing":
        entry.unlink()
    elif damage == "index":
        (path / INDEX).unlink()
    elif damage == "not_json":
        (path / INDEX).write_text('{"format": "kvcache-prefix-store", "version": 1, "mod')
    elif damage == "version":
        (path / INDEX).write_text(json.dumps({**index, "version": 99}))
    else:
        index["entries"][0]["tokens"] = [VOCAB + 5]
        (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(PrefixStoreError) as info:
        PrefixStore.load(path, model)
    message = str(info.value)
    assert str(path) in message or entry.name in message


def test_load_with_a_smaller_max_bytes_keeps_recent_entries(model, tmp_path):
    store = PrefixStore(model)
    for p in PROMPTS:
        _prefill(model, "dense", [p], store)
    store.save(tmp_path)
    limit = store.nbytes * 4 // 5  # room for the newest prompt, not for all
    with pytest.warns(UserWarning, match="do not fit max_bytes"):
        small = PrefixStore.load(tmp_path, model, max_bytes=limit)
    assert small.nbytes <= limit < store.nbytes
    assert small.reusable(PROMPTS[2]) == len(PROMPTS[2]) - 1


def test_a_loaded_store_of_another_layout_is_rejected_at_first_use(model, tmp_path):
    """A binding that claims a cache the entries do not fit fails before any row is restored."""
    path = _saved(model, tmp_path)
    index = json.loads((path / INDEX).read_text())
    index["binding"]["layers"] = [{**c, "storage": "int8"} for c in index["binding"]["layers"]]
    (path / INDEX).write_text(json.dumps(index))
    store = PrefixStore.load(path, model)
    with pytest.raises(ValueError, match="storage|slots"):
        kvcache.generate(model, PROMPTS[0], max_new_tokens=1, policy="dense:int8", prefix_store=store)


# ----- the command line ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from text_checkpoint import build_text_checkpoint

    return build_text_checkpoint(tmp_path_factory.mktemp("prefix_cli") / "model", max_position_embeddings=512)


def test_cli_prompt_cache_reuses_across_runs(text_model, tmp_path, capsys):
    prompt = "the cat sat on the mat. " * 6
    args = ["generate", prompt, "--model", str(text_model), "--max-new-tokens", "5", "--json",
            "--prompt-cache", str(tmp_path / "pc"), "--prefill-chunk", "16"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["reused_tokens"] == 0 and (tmp_path / "pc" / INDEX).exists()
    assert main(args) == 0
    out, err = capsys.readouterr()
    second = json.loads(out)
    assert second["tokens"] == first["tokens"]
    assert second["reused_tokens"] == first["prompt_tokens"] - 1
    reused = second["reused_tokens"]
    assert f"prompt cache {tmp_path / 'pc'}: reused {reused} of {first['prompt_tokens']} prompt tokens" in err
    assert main(args + ["--policy", "window", "--cache-length", "32"]) == 2
    err = capsys.readouterr().err
    assert "--prompt-cache" in err and "holds dense caches" in err and "window" in err


def test_cli_prompt_cache_errors(text_model, tmp_path, capsys):
    bad = tmp_path / "pc"
    bad.mkdir()
    (bad / INDEX).write_text("not json")
    assert main(["generate", "the cat", "--model", str(text_model), "--max-new-tokens", "1",
                 "--prompt-cache", str(bad)]) == 2
    assert "is not a readable prefix-store index" in capsys.readouterr().err
    afile = tmp_path / "file"
    afile.write_text("x")
    assert main(["generate", "the cat", "--model", str(text_model), "--max-new-tokens", "1",
                 "--prompt-cache", str(afile)]) == 2
    assert "is a file" in capsys.readouterr().err
