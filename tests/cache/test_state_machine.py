"""Random sequences of cache calls, checked after every call (hypothesis ``RuleBasedStateMachine``).

A machine drives up to three caches of one policy x storage in lockstep over two ragged rows:

* ``cache``: the policy at a small budget (it evicts), the cache under test;
* ``dense``: a dense full-precision cache, checked against the plain forward of each row's tokens;
* ``covering`` (full precision): the policy at a budget that covers every sequence the machine
  feeds, checked against ``dense`` (nothing is evicted, so they agree within float rounding);
* for a dense policy, ``cache`` itself holds every token and is the one that runs out of room.

Rules: prefill chunks of random sizes with ragged rows and extra padding, decode steps, snapshots
(of all rows or one) restored later into any row, forks, resets, and calls that must be rejected
(wrong shapes, dtypes, devices, token ids, n_tokens, too many tokens for dense, snapshots of
another configuration, bad rows). Invariants after every rule: every row holds only positions it
has seen, each at most once, as many as the budget allows; ``nbytes()`` never changes from what
the cache allocated (expected_attention: from what its first call allocated); every logit is
finite. A rejected call leaves the cache bitwise as an untouched fork of it; a restored snapshot
continues bitwise as the cache it was taken from.

In CI a few policy x storage pairs run a few dozen examples each; ``KVCACHE_STATEFUL_FULL=1`` runs
every pair, ``KVCACHE_STATEFUL_EXAMPLES=N`` sets the examples per pair (and draws new ones).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICE
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test
from policy_util import EXACT_ATOL, build_tiny, check_storage, max_diff

import kvcache
from kvcache.errors import CapacityError

VOCAB = 64
ROWS = 2
MAXLEN = 40  # tokens a row may see before the machine must reset or restore
SMALL = 8  # the budget of the evicting cache under test
MAX_CHUNK = 12

FULL = bool(os.environ.get("KVCACHE_STATEFUL_FULL"))
EXAMPLES = int(os.environ.get("KVCACHE_STATEFUL_EXAMPLES", "0"))

# A budgeted sample in CI: every policy family's machinery (append-only, ring, scoring, snapkv's
# prompt vote, expected_attention's own state) and every storage layout (full, token, kivi).
SAMPLE = [("dense", "full"), ("dense", "int8"), ("window", "token4"), ("sink", "full"), ("h2o", "int8"),
          ("snapkv", "kivi4"), ("expected_attention", "full"), ("tova", "token2")]
PAIRS = [(p, s) for p in sorted(kvcache.policies()) for s in kvcache.storages()] if FULL else SAMPLE


def _state(cache) -> dict[str, torch.Tensor]:
    """Every layer's state and the row lengths, as copies."""
    flat = {"lengths": cache.lengths.clone()}
    for i, layer in enumerate(cache.layers):
        flat.update({f"layer{i}.{k}": t.clone() for k, t in layer.state().items()})
    return flat


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        # Bitwise: a NaN in both counts as the same (torch.equal alone says NaN != NaN).
        same = torch.equal(a[k], b[k]) or (a[k].is_floating_point()
                                           and torch.equal(a[k].nan_to_num(7.0), b[k].nan_to_num(7.0)))
        assert same, f"{what}: {k} differs"


def _row_state(state: dict, b: int) -> dict[str, torch.Tensor]:
    return {k: t[b : b + 1] for k, t in state.items()}


def make_machine(model, policy: str, storage: str):
    name = f"{policy}:{storage}"
    is_dense = policy == "dense"

    class CacheMachine(RuleBasedStateMachine):
        snapshots = None

        @initialize()
        def build(self):
            self.gen = torch.Generator().manual_seed(0)
            self.cache = kvcache.make_cache(model, name, cache_length=MAXLEN if is_dense else SMALL, batch_size=ROWS)
            self.dense = kvcache.make_cache(model, "dense", cache_length=MAXLEN, batch_size=ROWS)
            # Checked at full precision only: a quantized storage turns a float rounding difference
            # upstream (1e-6) into a whole code step where a value sits on a rounding boundary, so
            # a covering cache and dense agree there only as often as no value does.
            self.covering = (None if is_dense or storage != "full"
                             else kvcache.make_cache(model, name, cache_length=MAXLEN, batch_size=ROWS))
            self.history = [[] for _ in range(ROWS)]
            self.bound = {id(c): c.nbytes() for c in self._caches()}
            self.grown = set()
            self.saved = []  # (snapshots of every cache, histories, probe logits of ``cache``)

        def _caches(self):
            return [c for c in {id(c): c for c in (self.cache, self.dense, self.covering)
                                if c is not None}.values()]

        def _room(self, b: int) -> int:
            return MAXLEN - len(self.history[b])

        # ----- feeding ------------------------------------------------------------------------
        def _ids(self, n: list[int], T: int) -> torch.Tensor:
            return torch.randint(3, VOCAB, (ROWS, T), generator=self.gen).to(DEVICE)

        def _feed(self, ids: torch.Tensor, n: list[int] | None) -> torch.Tensor:
            """Run ``ids`` through every cache, check the references, extend the histories;
            returns ``cache``'s logits (B, T, vocab)."""
            T = ids.shape[1]
            n = [T] * ROWS if n is None else n
            with torch.inference_mode():
                out = {id(c): model(ids, c, n_tokens=n) for c in self._caches()}
            for b in range(ROWS):
                self.history[b].extend(ids[b, : n[b]].tolist())
            got = out[id(self.cache)]
            assert bool(torch.isfinite(got).all()), "non-finite logits"
            with torch.inference_mode():
                for b in range(ROWS):
                    if not n[b]:
                        continue
                    L = len(self.history[b])
                    ref = model(torch.tensor([self.history[b]], device=DEVICE))[0, L - n[b]:]
                    assert max_diff(out[id(self.dense)][b, : n[b]], ref) <= EXACT_ATOL[torch.float32], (
                        f"dense row {b} differs from the plain forward")
                    if self.covering is not None:
                        d = max_diff(out[id(self.covering)][b, : n[b]], out[id(self.dense)][b, : n[b]])
                        assert d <= EXACT_ATOL[torch.float32], (
                            f"{name} at a covering budget differs from dense by {d} in row {b}")
            return got

        @precondition(lambda self: max(self._room(b) for b in range(ROWS)) > 0)
        @rule(data=st.data())
        def prefill(self, data):
            n = [data.draw(st.integers(0, min(MAX_CHUNK, self._room(b))), label=f"n{b}") for b in range(ROWS)]
            T = max(max(n), 1) + data.draw(st.integers(0, 2), label="padding")
            ragged = data.draw(st.booleans(), label="ragged") or len(set(n)) > 1 or T > max(n)
            ids = self._ids(n, T)
            self._feed(ids, n if ragged else None)

        @precondition(lambda self: min(self._room(b) for b in range(ROWS)) > 0)
        @rule()
        def decode(self):
            self._feed(self._ids([1] * ROWS, 1), None)

        # ----- snapshots, restores, forks, resets --------------------------------------------
        @rule(rows=st.sampled_from([None, [0], [1]]))
        def snapshot(self, rows):
            snaps = {id(c): c.snapshot(rows) for c in self._caches()}
            # What the snapshot must continue as: a probe step through a cache restored from it
            # (a fork for all rows; a batch of one for one row), whose continuation must leave the
            # cache as it was.
            before = _state(self.cache)
            if rows is None:
                twin = self.cache.fork()
            else:
                twin = self.cache.empty_like(1)
                twin.restore(snaps[id(self.cache)])
            _assert_same_state(_state(twin), _state(self.cache) if rows is None else _row_state(before, rows[0]),
                               "a restored snapshot differs from its cache")
            probe = self._ids([1] * ROWS, 1)[: twin.batch_size]
            probe_logits = None
            if min(self._room(b) for b in range(ROWS)) > 0:  # a full dense row takes no probe step
                with torch.inference_mode():
                    probe_logits = model(probe, twin)
            _assert_same_state(_state(self.cache), before, "continuing a restored snapshot changed its cache")
            index = [0, 1] if rows is None else rows
            self.saved.append((snaps, [list(self.history[b]) for b in index], probe, probe_logits))
            if len(self.saved) > 4:
                self.saved.pop(0)

        @precondition(lambda self: self.saved)
        @rule(data=st.data())
        def restore(self, data):
            snaps, histories, probe, probe_logits = data.draw(st.sampled_from(self.saved), label="snapshot")
            if len(histories) == ROWS:
                rows = None
                targets = list(range(ROWS))
            else:
                rows = [data.draw(st.integers(0, ROWS - 1), label="into row")]
                targets = rows
            for c in self._caches():
                c.restore(snaps[id(c)], rows)
            for b, h in zip(targets, histories):
                self.history[b] = list(h)
            # The restored rows continue bitwise as the cache the snapshot was taken from (a row
            # restored alone is probed alone, as it was when the snapshot was taken).
            if rows is None:
                twin = self.cache.fork()
            else:
                twin = self.cache.empty_like(1)
                twin.restore(self.cache.snapshot(rows))
            if probe_logits is not None:
                with torch.inference_mode():
                    assert torch.equal(model(probe, twin), probe_logits), "a restored snapshot continues differently"

        @rule()
        def reset(self):
            for c in self._caches():
                c.reset()
            self.history = [[] for _ in range(ROWS)]
            assert self.cache.lengths.tolist() == [0] * ROWS

        # ----- calls that must be rejected ---------------------------------------------------
        def _rejected(self, call, error=ValueError, match=None):
            twin = self.cache.fork()
            before = _state(self.cache)
            with pytest.raises(error, match=match):
                call()
            _assert_same_state(_state(self.cache), before, "a rejected call changed the cache")
            _assert_same_state(_state(twin), before, "a rejected call changed the cache")
            # Nothing outside the state moved either: the next step gives the twin's logits bit
            # for bit (the references are fed the same step).
            if min(self._room(b) for b in range(ROWS)) > 0:
                ids = self._ids([1] * ROWS, 1)
                with torch.inference_mode():
                    expected = model(ids, twin)
                assert torch.equal(self._feed(ids, None), expected), "a rejected call changed what comes next"

        @rule(kind=st.sampled_from(["3d", "1d", "batch", "float", "empty", "vocab", "negative", "device",
                                    "n_len", "n_over", "n_neg", "n_float"]))
        def rejected_input(self, kind):
            ids = self._ids([2] * ROWS, 2)
            n = None
            if kind == "3d":
                ids = ids[:, :, None]
            elif kind == "1d":
                ids = ids[0]
            elif kind == "batch":
                ids = torch.cat([ids, ids[:1]])
            elif kind == "float":
                ids = ids.float()
            elif kind == "empty":
                ids = ids[:, :0]
            elif kind == "vocab":
                ids[1, 1] = VOCAB
            elif kind == "negative":
                ids[0, 0] = -1
            elif kind == "device":
                ids = ids.to("meta")
            elif kind == "n_len":
                n = [1, 1, 1]
            elif kind == "n_over":
                n = [3, 1]
            elif kind == "n_neg":
                n = [-1, 2]
            elif kind == "n_float":
                n = torch.tensor([1.0, 2.0], device=DEVICE)

            def call():
                with torch.inference_mode():
                    model(ids, self.cache, n_tokens=n)

            self._rejected(call)

        @precondition(lambda self: is_dense)
        @rule(data=st.data())
        def too_many_tokens_for_dense(self, data):
            b = data.draw(st.integers(0, ROWS - 1), label="row")
            T = self._room(b) + data.draw(st.integers(1, 3), label="over")
            n = [min(T, self._room(r)) for r in range(ROWS)]
            n[b] = T
            ids = self._ids(n, T)

            def call():
                with torch.inference_mode():
                    model(ids, self.cache, n_tokens=n)

            self._rejected(call, CapacityError, "cache is full")

        @rule(kind=st.sampled_from(["other config", "rows", "row count", "not a snapshot"]))
        def rejected_restore(self, kind):
            if kind == "other config":
                other = kvcache.make_cache(model, "window" if policy != "window" else "sink",
                                           cache_length=SMALL, batch_size=ROWS)
                self._rejected(lambda: self.cache.restore(other.snapshot()))
            elif kind == "rows":
                self._rejected(lambda: self.cache.restore(self.cache.snapshot([0]), rows=[ROWS]))
            elif kind == "row count":
                self._rejected(lambda: self.cache.restore(self.cache.snapshot([0]), rows=[0, 1]))
            else:
                self._rejected(lambda: self.cache.restore(_state(self.cache)))

        # ----- invariants ----------------------------------------------------------------------
        @invariant()
        def lengths_are_the_histories(self):
            if not hasattr(self, "cache"):
                return
            want = [len(h) for h in self.history]
            for c in self._caches():
                assert c.lengths.tolist() == want

        @invariant()
        def positions_held_are_positions_seen(self):
            if not hasattr(self, "cache"):
                return
            for c in self._caches():
                check_storage(c)

        @invariant()
        def nbytes_within_bound(self):
            if not hasattr(self, "cache"):
                return
            for c in self._caches():
                n = c.nbytes()
                if n != self.bound[id(c)]:
                    # Once: expected_attention allocates its query statistics at its first call
                    # (a CacheSpec does not know the query heads). Never again after that.
                    assert policy == "expected_attention" and id(c) not in self.grown, (
                        f"nbytes went from {self.bound[id(c)]} to {n}")
                    self.grown.add(id(c))
                    self.bound[id(c)] = n

    return CacheMachine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("state_machine"), layers=2, vocab=VOCAB)


@pytest.mark.parametrize("policy,storage", PAIRS, ids=[f"{p}:{s}" for p, s in PAIRS])
def test_random_call_sequences_keep_the_invariants(tiny, policy, storage):
    examples = EXAMPLES or (40 if FULL else 30)
    run_state_machine_as_test(
        make_machine(tiny, policy, storage),
        settings=settings(max_examples=examples, stateful_step_count=12, deadline=None, database=None,
                          derandomize=not EXAMPLES, suppress_health_check=list(HealthCheck),
                          # Shrinking a long failing sequence takes minutes: only when asked to draw.
                          phases=list(Phase) if EXAMPLES else [Phase.explicit, Phase.generate]),
    )
