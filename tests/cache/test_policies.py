"""Properties every eviction policy must have, whatever the chunking, batch and budget.

For every registered evicting policy (a new one joins by being registered), over random ragged schedules (multi-token chunks with
right padding, rows sitting out, one-token decode steps) and budgets:
  * a budget that covers the whole sequence gives the plain forward's logits;
  * after every call each row and head holds min(C, length) distinct past positions, the scratch
    slot is empty, and no padding or future token is held;
  * every query sees exactly the keys its policy promises, none with a larger position (for sink
    renumbered: none with a larger *assigned* position, and the assigned positions are 0..n-1).
window and sink are defined per query, so they are also independent of the chunking. A ragged
batch evicts per row exactly as each row alone would.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import DEVICE, atol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_util import (
    EXACT_ATOL,
    AttentionRecorder,
    cache_args,
    check_storage,
    expected_sink_positions,
    feed,
    feed_alone,
    ids_for,
    kept,
    max_diff,
    visible_sets,
)

import kvcache

ATOL = EXACT_ATOL[torch.float32]
VOCAB = 128  # the conftest llama
# Every registered policy that evicts; sink runs in each position mode.
EVICTING = [name for name in kvcache.policies() if name != "dense"]
# ":reserve" cases evict in batches: an overflowing row keeps C - reserve tokens.
POLICY_CASES = (
    [case for name in EVICTING for case in (["sink:absolute", "sink:renumbered"] if name == "sink" else [name])]
    + [f"{name}:reserve" for name in EVICTING if name not in ("window", "sink")]
)


def _name(case: str) -> str:
    return case.split(":")[0]


def simple_options(name: str, C: int) -> dict:
    """Options that fit a budget of C slots: the policy's settings for that budget."""
    return kvcache.cache.budget_options(name, C)


def draw_options(draw, case: str, C: int) -> dict:
    """Valid options of ``case`` for budget C (C >= 2), with ``reserve`` for the ":reserve" cases.

    h2o, snapkv and sink have their integer options drawn too; any other policy gets its boolean
    and string options drawn and its integer ones from ``make_cache`` (defaults that fit C)."""
    if case.startswith("sink"):
        return dict(sinks=draw(st.integers(0, min(4, C - 1))), positions=case.split(":")[1])
    # SnapKV's window needs one kept slot besides itself.
    most = C - 2 if case.startswith("snapkv") else C - 1
    reserve = draw(st.integers(1, most)) if case.endswith(":reserve") and most >= 1 else 0
    extra = dict(reserve=reserve) if reserve else {}
    room = C - reserve  # what an overflowing row keeps
    if case.startswith("h2o"):
        recent = draw(st.integers(0, room - 1))
        return dict(recent=recent, sinks=draw(st.integers(0, min(3, room - 1 - recent))),
                    normalize=draw(st.booleans()), value_norm=draw(st.booleans()), **extra)
    if case.startswith("snapkv"):
        return dict(window=draw(st.integers(1, room - 1)), kernel=draw(st.sampled_from([1, 3, 5])),
                    pooling=draw(st.sampled_from(["avg", "max"])),
                    fallback=draw(st.sampled_from(["window", "tova"])), **extra)
    drawn = {}
    for info in kvcache.option_info(_name(case)):
        if info.choices is not None:
            drawn[info.name] = draw(st.sampled_from(info.choices))
        elif info.type is bool:
            drawn[info.name] = draw(st.booleans())
        elif info.name in ("recent", "sinks"):
            # Tokens always kept: leave at least one slot of what an overflowing row keeps to choose.
            drawn[info.name] = draw(st.integers(0, max(0, (room - 1) // 2)))
    return {**drawn, **extra}


@st.composite
def scenarios(draw, case: str):
    B = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 28)) for _ in range(B)]
    remaining = list(lengths)
    schedule = []
    while any(remaining):
        if all(remaining) and draw(st.booleans()):
            n = [1] * B  # a decode step: the scratch-slot path
        else:
            width = draw(st.integers(1, 10))
            n = [draw(st.integers(0, min(width, r))) for r in remaining]
            if not any(n):
                n[remaining.index(max(remaining))] = min(width, max(remaining))
        remaining = [r - k for r, k in zip(remaining, n)]
        schedule.append(n)
    longest = max(lengths)
    covers = draw(st.booleans())
    if covers:
        C = draw(st.integers(max(2, longest), longest + 4))
    else:
        C = draw(st.integers(2, max(2, longest - 1)))
    return lengths, schedule, C, draw_options(draw, case, C), draw(st.integers(0, 2**16))


class PolicyChecker:
    """Checks the cache and the attention calls of one model call against ``case``'s promises."""

    def __init__(self, case: str, options: dict, C: int, recorder: AttentionRecorder) -> None:
        self.case, self.options, self.C, self.recorder = case, options, C, recorder
        self.before = None  # kept positions per layer, row, head before the call

    def snapshot(self, cache):
        return [[kept(layer, b) for b in range(cache.batch_size)] for layer in cache.layers]

    def __call__(self, cache, n, T) -> None:
        C, opts = self.C, self.options
        lengths = cache.lengths.tolist()
        start = [L - k for L, k in zip(lengths, n)]
        if self.before is None:
            self.before = [[[[] for _ in range(layer.storage.pos.shape[1])] for _ in lengths]
                           for layer in cache.layers]
        check_storage(cache)
        now = self.snapshot(cache)
        for layer_kept in now:
            for b, L in enumerate(lengths):
                for held in layer_kept[b]:
                    if self.case == "window":
                        assert held == list(range(max(0, L - C), L))
                    elif self.case.startswith("sink"):
                        assert held == expected_sink_positions(L, C, opts["sinks"])
                    elif self.case.startswith("snapkv"):
                        if n[b] > 1:
                            # A row adding several tokens keeps its observation window (its last
                            # real tokens); one adding a single token decodes, as it would alone
                            # (the fallback may then evict that token).
                            window = set(range(L - min(opts["window"], n[b]), L))
                            assert window <= set(held), f"row {b}: {held} lacks {sorted(window)}"
                    else:
                        # Tokens a scoring policy promises to keep (h2o, knorm, ...: recent and sinks).
                        settings = cache.layers[0].options
                        recent, sinks = getattr(settings, "recent", 0), getattr(settings, "sinks", 0)
                        protected = set(range(max(0, L - recent), L)) | set(range(min(L, sinks)))
                        assert protected <= set(held), f"row {b}: {held} lacks {sorted(protected)}"

        # A scoring policy that listens to a few queries (TOVA, SnapKV), or to every query of a
        # prompt in an empty cache (h2o), scores them in a call of their own, after the call that
        # attends every query of the chunk; scoring calls must be causal too.
        for call in self.recorder.calls:
            for b in range(len(lengths)):
                for t in range(call["q_pos"].shape[1]):
                    qp = int(call["q_pos"][b, t])
                    assert all(max(seen, default=-1) <= qp for seen in visible_sets(call, b, t))
        calls = [call for call in self.recorder.calls
                 if call["q_pos"].shape[1] == T and not call.get("scores_only", False)]
        assert len(calls) == len(cache.layers), "one attention call per layer and model call"
        for i, (call, layer) in enumerate(zip(calls, cache.layers)):
            assert bool((call["k_pos"] <= torch.tensor(lengths, device=DEVICE)[:, None, None] - 1).all())
            for b in range(len(lengths)):
                for t in range(n[b]):
                    qp = start[b] + t
                    assert int(call["q_pos"][b, t]) == qp
                    for h, seen in enumerate(visible_sets(call, b, t)):
                        assert all(kp <= qp for kp in seen), f"layer {i} query {qp} sees {seen}"
                        if self.case == "window":
                            assert seen == list(range(max(0, qp + 1 - C), qp + 1))
                        elif self.case.startswith("sink"):
                            assert seen == expected_sink_positions(qp + 1, C, opts["sinks"])
                        else:
                            # Attention happens before eviction: everything kept plus the chunk so far.
                            assert seen == sorted(self.before[i][b][h] + list(range(start[b], qp + 1)))
            if self.case == "sink:renumbered":
                self._check_assigned(layer, call, n)
        self.before = now
        self.recorder.clear()

    @staticmethod
    def _check_assigned(layer, call, n) -> None:
        q_pos, k_pos = call["q_pos"], call["k_pos"]
        vis = call["vis"][:, 0]  # (B, T, S)
        aq, ak = layer.assigned_positions(q_pos, k_pos)  # (B, T), (B, 1, T, S)
        ak = ak[:, 0]
        for b in range(q_pos.shape[0]):
            for t in range(n[b]):
                keys = ak[b, t][vis[b, t]]
                assert bool((keys <= aq[b, t]).all()), f"query {int(aq[b, t])} sees assigned keys {keys.tolist()}"
                # The visible keys sit at 0..m-1 and the query at m-1: no gap, no distance >= C.
                m = int(vis[b, t].sum())
                assert sorted(keys.tolist()) == list(range(m))
                assert int(aq[b, t]) == m - 1


@pytest.mark.parametrize("case", POLICY_CASES)
def test_policy_properties(llama, case):
    @settings(max_examples=20, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(scenarios(case))
    def check(scenario):
        lengths, schedule, C, options, seed = scenario
        rows = [ids_for(L, seed=seed + b, vocab=VOCAB)[0] for b, L in enumerate(lengths)]
        cache = kvcache.make_cache(llama, _name(case), cache_length=C, batch_size=len(rows), **cache_args(options))
        recorder = AttentionRecorder(cache)
        checker = PolicyChecker(case, options, C, recorder)
        with torch.inference_mode():
            with recorder.patch():
                got = feed(llama, cache, rows, schedule, pad_seed=seed, after_call=checker)
            for b, row in enumerate(rows):
                assert torch.isfinite(got[b]).all()
                if C >= len(row):
                    diff = max_diff(got[b], llama(row[None])[0])
                    assert diff <= ATOL, f"row {b}, {lengths} {schedule} C={C} {options}: {diff:.3g}"

    check()


@pytest.mark.parametrize("case", POLICY_CASES)
def test_queries_never_see_later_tokens_of_their_chunk(llama, case):
    """Changing the tail of a chunk leaves the logits of its head unchanged, cache full or not."""
    if case.startswith("sink"):
        options = dict(sinks=2, positions=case.partition(":")[2])
    else:
        options = dict(recent=2, sinks=1) if _name(case) == "h2o" else simple_options(_name(case), 5)
        if case.endswith(":reserve"):
            options = dict(options, reserve=3)
    ids = ids_for(30, batch=2, seed=5, vocab=VOCAB)
    other = ids_for(30, batch=2, seed=6, vocab=VOCAB)
    with torch.inference_mode():
        for prefix in (0, 3, 17):  # empty, partly filled, overflowing cache (C = 8)
            cache = kvcache.make_cache(llama, _name(case), cache_length=8, batch_size=2, **cache_args(options))
            if prefix:
                llama(ids[:, :prefix], cache, n_tokens=[prefix, prefix - 1])
            twin = copy.deepcopy(cache)
            chunk = ids[:, prefix : prefix + 9]
            changed = chunk.clone()
            changed[:, 4:] = other[:, :5]
            a = llama(chunk, cache, n_tokens=[9, 7])
            b = llama(changed, twin, n_tokens=[9, 7])
            assert max_diff(a[:, :4], b[:, :4]) <= atol("same")
            assert max_diff(a[:, 4:7], b[:, 4:7]) > 1e-3  # the change does matter where visible


# --- window and sink: defined per query, so independent of the chunking --------------------------

CHUNKED_CASES = [("window", {}), ("sink", dict(sinks=3, positions="absolute")),
                 ("sink", dict(sinks=3, positions="renumbered")), ("sink", dict(sinks=0, positions="renumbered"))]


def _cuts_to_schedule(T, cuts, B):
    bounds = [0] + sorted(set(cuts)) + [T]
    return [[hi - lo] * B for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


@pytest.mark.parametrize("policy,options", CHUNKED_CASES, ids=lambda x: str(x))
def test_window_and_sink_are_chunking_independent(llama, policy, options):
    T, C = 64, 10  # the sequence is six times the budget
    rows = list(ids_for(T, batch=2, seed=7, vocab=VOCAB))

    def run(schedule):
        cache = kvcache.make_cache(llama, policy, cache_length=C, batch_size=2, **cache_args(options))
        return feed(llama, cache, rows, schedule), cache

    with torch.inference_mode():
        step_logits, step_cache = run([[1, 1]] * T)
        whole, _ = run([[T, T]])
        for r in range(2):
            assert max_diff(whole[r], step_logits[r]) <= ATOL

        @settings(max_examples=8, deadline=None, derandomize=True)
        @given(st.lists(st.integers(1, T - 1), max_size=12))
        def check(cuts):
            got, cache = run(_cuts_to_schedule(T, cuts, 2))
            for r in range(2):
                assert max_diff(got[r], step_logits[r]) <= ATOL, f"cuts {sorted(cuts)}"
            for layer, ref in zip(cache.layers, step_cache.layers):
                assert [kept(layer, b) for b in range(2)] == [kept(ref, b) for b in range(2)]

        check()


def test_window_equals_model_level_sliding_window(llama):
    """Each query of the window policy sees exactly its C newest positions: the plain forward of the
    same weights with sliding-window attention of width C, in every layer."""
    C = 7
    ref = kvcache.Transformer(dataclasses.replace(llama.config, sliding_window=C))
    ref.load_state_dict(llama.state_dict())
    ref.to(DEVICE).eval()
    ids = ids_for(40, batch=2, seed=8, vocab=VOCAB)
    with torch.inference_mode():
        expected = ref(ids)
        for schedule in ([[40, 40]], [[1, 1]] * 40, [[13, 13], [1, 1], [1, 1], [25, 25]]):
            cache = kvcache.make_cache(llama, "window", cache_length=C, batch_size=2)
            got = feed(llama, cache, list(ids), schedule)
            for r in range(2):
                assert max_diff(got[r], expected[r]) <= ATOL
        # and the window really cuts: the full-attention forward is different
        assert max_diff(llama(ids), expected) > 1e-2


# --- ragged batches evict per row ----------------------------------------------------------------

RAGGED_CASES = [
    ("window", {}),
    ("sink", dict(sinks=2, positions="absolute")),
    ("sink", dict(sinks=2, positions="renumbered")),
    ("h2o", dict(recent=2, sinks=1)),
    ("h2o", dict(recent=2, normalize=True, value_norm=True)),
    ("tova", {}),
    ("snapkv", dict(window=3, kernel=3)),
    ("snapkv", dict(window=2, kernel=5, fallback="tova")),
] + [(name, simple_options(name, 8)) for name in EVICTING if name not in ("window", "sink", "h2o", "tova", "snapkv")]
# Right-padded chunks, rows sitting out (0), then decode steps (the scratch-slot path). No row
# gets a single token in a wider chunk (see SCHEDULE_SINGLES).
SCHEDULE = [[6, 4, 5], [5, 0, 7], [8, 5, 4], [4, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
# Rows also get one token while another row gets several.
SCHEDULE_SINGLES = [[6, 4, 5], [5, 1, 7], [8, 4, 1], [4, 1, 3], [1, 1, 1], [1, 1, 1]]


def _ragged_case(llama, policy, options, schedule):
    C = 8
    lengths = [sum(n[b] for n in schedule) for b in range(3)]
    rows = [ids_for(L, seed=40 + b, vocab=VOCAB)[0] for b, L in enumerate(lengths)]
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, policy, cache_length=C, batch_size=3, **cache_args(options))
        got = feed(llama, cache, rows, schedule, pad_seed=3)
        for b, row in enumerate(rows):
            alone, alone_cache = feed_alone(llama, policy, row, [n[b] for n in schedule], C, **options)
            assert max_diff(got[b], alone) <= ATOL, f"row {b}"
            for i, (layer, ref) in enumerate(zip(cache.layers, alone_cache.layers)):
                assert kept(layer, b) == kept(ref, 0), f"row {b} layer {i}"


@pytest.mark.parametrize("policy,options", RAGGED_CASES + [
    ("snapkv", dict(window=2, kernel=5, pooling="max", fallback="tova")),
], ids=lambda x: str(x))
def test_ragged_batch_evicts_per_row_as_alone(llama, policy, options):
    _ragged_case(llama, policy, options, SCHEDULE)


@pytest.mark.parametrize("policy,options", [
    (p, o) for p, o in RAGGED_CASES
], ids=lambda x: str(x))
def test_ragged_batch_with_single_token_rows_evicts_as_alone(llama, policy, options):
    _ragged_case(llama, policy, options, SCHEDULE_SINGLES)


class RoundOtherwise:
    """A layer hook that moves every hidden state entering a layer one unit in the last place,
    up or down at random, drawn afresh at each call: each chunk's products round otherwise,
    as a GPU's kernels do when the shapes change (a batch against one row)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        up = torch.randint(0, 2, x.shape, generator=self.gen).to(x.device, torch.bool)
        return torch.nextafter(x, torch.where(up, torch.inf, -torch.inf).to(x.dtype))


@pytest.mark.parametrize("policy,options", RAGGED_CASES, ids=lambda x: str(x))
def test_ragged_batch_evicts_as_alone_under_other_rounding(clean_hook, policy, options):
    """Each row alone under ``RoundOtherwise`` keeps what it keeps in the batch. Scores that
    tie exactly are apart by rounding there: a token that comes twice has one key norm in the
    first layer (RoPE only rotates it), which knorm ranks by. Such ties go by the policy's rule
    (the newer is kept) whatever the rounding; the logits stay within the cache tolerance."""
    llama = clean_hook
    C, schedule = 8, SCHEDULE
    lengths = [sum(n[b] for n in schedule) for b in range(3)]
    rows = [ids_for(L, seed=40 + b, vocab=VOCAB)[0] for b, L in enumerate(lengths)]
    with torch.inference_mode():
        cache = kvcache.make_cache(llama, policy, cache_length=C, batch_size=3, **cache_args(options))
        got = feed(llama, cache, rows, schedule, pad_seed=3)
        for seed in range(6):  # draws that set knorm's and critical's ties apart either way
            llama.layer_hook = RoundOtherwise(seed)
            for b, row in enumerate(rows):
                alone, alone_cache = feed_alone(llama, policy, row, [n[b] for n in schedule], C, **options)
                for i, (layer, ref) in enumerate(zip(cache.layers, alone_cache.layers)):
                    assert kept(layer, b) == kept(ref, 0), f"draw {seed} row {b} layer {i}"
                assert max_diff(got[b], alone) <= atol("cache"), f"draw {seed} row {b}"


def test_generate_ragged_prompts_equal_each_prompt_alone(llama):
    prompts = [ids_for(L, seed=50 + L, vocab=VOCAB)[0].tolist() for L in (19, 8, 13)]
    for policy, options in [("sink", dict(sinks=2)), ("h2o", dict(recent=3))] + [
            (name, {}) for name in EVICTING if name not in ("sink", "h2o", "snapkv")]:
        together = kvcache.generate(llama, prompts, max_new_tokens=12, policy=policy, policy_options=options,
                                    cache_length=8, prefill_chunk=4, stop_tokens=())
        alone = [kvcache.generate(llama, p, max_new_tokens=12, policy=policy, policy_options=options,
                                  cache_length=8, prefill_chunk=4, stop_tokens=()) for p in prompts]
        assert together == alone, policy


@pytest.mark.parametrize("policy,options", [("tova", {}), ("snapkv", dict(window=4))])
def test_listening_to_few_queries_scores_them_alone(llama, policy, options):
    """TOVA and SnapKV weigh only a few queries of a chunk: those are scored in a call of their
    own and every output comes from the fused kernel. Outputs and scores equal the single
    explicit-softmax call over the whole chunk."""
    from kvcache.kernels import attention

    cache = kvcache.make_cache(llama, policy, cache_length=8, batch_size=2, **cache_args(options))
    layer = cache.layers[0]
    step = cache.begin(torch.zeros(2, 20, dtype=torch.long, device=DEVICE), [20, 13])
    B, Hkv, D, T = 2, llama.config.num_kv_heads, llama.config.head_dim, 20
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, llama.config.num_heads, T, D, generator=gen).to(DEVICE)
    k, v = torch.randn(B, Hkv, T, D, generator=gen).to(DEVICE), torch.randn(B, Hkv, T, D, generator=gen).to(DEVICE)
    k_pos = torch.where(step.valid, step.positions, -1).unsqueeze(1)
    weight = layer.query_weight(step)
    assert 0 < 2 * int(weight.ne(0).any(0).sum()) <= T  # the split path applies
    out, mass, seen = layer._attend(q, k, v, step.positions, k_pos, step)
    want_out, want_mass, want_seen = attention.masked_with_weights(q, k, v, step.positions, k_pos, weight)
    for b, n in enumerate([20, 13]):
        assert max_diff(out[b, :, :n], want_out[b, :, :n]) <= atol("cache")
    assert max_diff(mass, want_mass) <= atol("same") and torch.equal(seen, want_seen)


@pytest.mark.parametrize("name,options", [("sink", dict(sinks=2)), ("h2o", dict(recent=2)), ("snapkv", dict(window=2)),
                                          ("h2o:int8", dict(recent=2))] + [
    (name, {}) for name in EVICTING if name not in ("sink", "h2o", "snapkv")])
def test_policies_run_with_autograd_enabled(llama, name, options):
    """Outside no_grad / inference_mode (fine-tuning through a bounded cache), every policy
    gives the logits it gives in inference mode: a prompt longer than the cache, decode steps,
    then a chunk."""
    ids = ids_for(24, seed=9, vocab=llama.config.vocab_size)
    schedule = [12, 1, 1, 1, 1, 5, 1, 3]

    def run():
        cache = kvcache.make_cache(llama, name, cache_length=8, **cache_args(options))
        fed, out = 0, []
        for n in schedule:
            out.append(llama(ids[:, fed : fed + n], cache))
            fed += n
        return torch.cat(out, dim=1)

    with torch.enable_grad():
        got = run()
    assert got.requires_grad
    with torch.inference_mode():
        want = run()
    assert max_diff(got.detach(), want) <= atol("cache")


@pytest.mark.parametrize("storage", ["full", "int8"])
@pytest.mark.parametrize("name", list(kvcache.policies()))
def test_fully_padded_rows_give_finite_outputs(llama, name, storage):
    """A row with no real token in a chunk (n_tokens 0) has queries that see no key: its outputs
    are meaningless but finite (no NaN that a later reduction could spread), in every path."""
    ids = ids_for(12, batch=2, seed=1, vocab=VOCAB)
    cache = kvcache.make_cache(llama, f"{name}:{storage}", cache_length=32 if name == "dense" else 6, batch_size=2)
    with torch.inference_mode():
        for lo, hi, n in ((0, 5, [5, 0]), (5, 9, [0, 4]), (9, 12, [3, 0]), (0, 1, [0, 1])):
            assert torch.isfinite(llama(ids[:, lo:hi], cache, n_tokens=n)).all()
