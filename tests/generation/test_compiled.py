"""The captured decode step (kvcache/generation/compiled.py) against the eager one: the same logits and the
same kept tokens for every policy and storage, one capture for every step, and generate with
compile=True gives the tokens of generate without it.

Most cases compile with the "aot_eager" backend, which traces the step exactly as inductor
does (fullgraph, no recompilation) in a second; a few run inductor itself."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE, atol, max_diff, random_ids
from policy_util import cache_args
from torch._dynamo.backends.common import aot_autograd

import kvcache
import kvcache.generation.compiled
from kvcache.generation.compiled import CompiledDecode

VOCAB = 128  # the conftest llama

CASES = (
    [(name, {}) for name in kvcache.policies() if name != "sink"]
    + [("sink", {"sinks": 2, "positions": "absolute"}), ("sink", {"sinks": 2, "positions": "renumbered"}),
       ("dense:int8", {}), ("h2o:kivi4", {"recent": 2}), ("window:int8", {}), ("tova:kivi4", {}),
       ("h2o:kivis4", {"recent": 2}), ("h2o:rtoken4", {"recent": 2}), ("dense:kivis3", {})]
)


@pytest.fixture
def tiny(llama):
    return llama


def ids_for(n: int, batch: int = 1, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return random_ids(n, batch=batch, seed=seed)


def kept(layer, b: int) -> list[list[int]]:
    """Sorted positions held in slots [0, C) of row ``b``, per slot group."""
    pos = layer.storage.pos[b, :, : layer.spec.cache_length]
    return [sorted(p[p >= 0].tolist()) for p in pos]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: captures of earlier tests must not count as recompilations."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(model, name, options, decode, steps=10, batch=2):
    """A ragged prefill (10 and 7 tokens), then ``steps`` decode steps through ``decode(cache)``:
    the logits (steps, B, vocab) and each layer's kept positions after every step."""
    C = 24 if name.startswith("dense") else 9
    ids = ids_for(10 + steps, batch=batch, seed=3, vocab=VOCAB)
    cache = kvcache.make_cache(model, name, cache_length=C, batch_size=batch, **cache_args(options))
    with torch.inference_mode():
        model(ids[:, :10], cache, n_tokens=[10, 7][:batch])
        step = decode(cache)
        logits, held = [], []
        for i in range(steps):
            logits.append(step(ids[:, 10 + i : 11 + i]))
            held.append([[kept(layer, b) for b in range(batch)] for layer in _leaves(cache)])
    return torch.stack(logits), held


def _leaves(cache):
    for layer in cache.layers:
        yield from getattr(layer, "heads", [layer])


def eager(model):
    return lambda cache: (lambda tokens: model(tokens, cache)[:, -1])


@pytest.mark.parametrize("name,options", CASES, ids=lambda x: str(x))
def test_captured_step_matches_eager_and_never_recompiles(tiny, name, options):
    def captured(cache):
        decoder = CompiledDecode(tiny, cache, backend="aot_eager")

        def step(tokens):
            out = decoder(tokens)
            # The first call captured the step; any later capture is an error.
            torch._dynamo.config.error_on_recompile = True
            return out

        return step

    try:
        want, want_held = _run(tiny, name, options, eager(tiny))
        got, got_held = _run(tiny, name, options, captured)
    finally:
        torch._dynamo.config.error_on_recompile = False
    policy, _, storage = name.partition(":")
    if not storage:
        assert max_diff(got, want) <= atol("compiled")
        assert got_held == want_held
        return
    # A quantized storage rounds: a key that differs by 1e-7 between the two steps' kernels may
    # round to another code. The captured step must then stay as close to the eager one as the
    # quantization itself is to full precision.
    full, _ = _run(tiny, policy, options, eager(tiny))
    assert max_diff(got, want) <= max(atol("compiled"), max_diff(want, full))


def test_headwise_budgets_are_captured_too(tiny):
    budgets = [[6, 10], [8, 8]]
    options = {"head_budgets": budgets, "recent": 2}
    want, want_held = _run(tiny, "h2o", options, eager(tiny))
    got, got_held = _run(tiny, "h2o", options, lambda cache: CompiledDecode(tiny, cache, backend="aot_eager"))
    assert max_diff(got, want) <= atol("compiled") and got_held == want_held


@pytest.mark.parametrize("policy,options", [("dense", {}), ("h2o", {"recent": 2})])
def test_generate_with_inductor_gives_the_eager_tokens(tiny, policy, options):
    prompts = [ids_for(L, seed=10 + L, vocab=VOCAB)[0].tolist() for L in (11, 6)]
    kwargs = dict(max_new_tokens=12, policy=policy, policy_options=options or None, stop_tokens=(),
                  cache_length=None if policy == "dense" else 8)
    assert kvcache.generate(tiny, prompts, compile=True, **kwargs) == kvcache.generate(tiny, prompts, **kwargs)


def test_a_cache_keeps_its_capture_across_generations(tiny, monkeypatch):
    # Traced as inductor traces (aot_eager), without inductor's code generation: what is kept is
    # the capture, whichever backend made it (test_generate_with_inductor_... runs inductor).
    monkeypatch.setattr(kvcache.generation.compiled, "CompiledDecode", functools.partial(CompiledDecode, backend="aot_eager"))
    cache = kvcache.make_cache(tiny, "window", cache_length=8, batch_size=1)
    prompt = ids_for(12, seed=4, vocab=VOCAB)[0].tolist()
    first = kvcache.generate(tiny, prompt, max_new_tokens=6, cache=cache, compile=True, stop_tokens=())
    capture = cache.captured
    torch._dynamo.config.error_on_recompile = True
    try:
        again = kvcache.generate(tiny, prompt, max_new_tokens=6, cache=cache, compile=True, stop_tokens=())
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert again == first and cache.captured is capture


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_captured_step_is_within_the_dtype_tolerance_of_float32(tiny, dtype):
    """In 16 bits, the captured step (inductor), the eager cached step and the plain forward are
    each within the dtype's tolerance of the float32 logits (TOLERANCES' "precision" kind).

    Each is compared with the float32 reference, not with the others: how two 16-bit rounding
    errors compare depends on the CPU's vector width (inductor accumulates in float32 and rounds
    where the eager kernels do not, differently per instruction set), their bound does not."""
    ids = ids_for(24, seed=6, vocab=VOCAB)

    def decode_logits(model, make_step):
        """Logits (8, vocab) at positions 16..23, decoded one token at a time after a prefill."""
        cache = kvcache.make_cache(model, "dense", cache_length=24)
        model(ids[:, :16], cache)
        step = make_step(cache, model)
        return torch.stack([step(ids[:, t : t + 1])[0].float() for t in range(16, 24)])

    def eager_step(cache, model):
        return lambda tokens: model(tokens, cache)[:, -1]

    half = kvcache.Transformer(tiny.config)
    half.load_state_dict(tiny.state_dict())
    half = half.to(DEVICE, dtype).eval()
    with torch.inference_mode():
        reference = decode_logits(tiny, eager_step)
        plain = half(ids)[0, 16:].float()
        cached = decode_logits(half, eager_step)
        captured = decode_logits(half, lambda cache, model: CompiledDecode(model, cache))
    tolerance = atol("precision", dtype)
    errors = {"plain": max_diff(plain, reference), "cached": max_diff(cached, reference),
              "captured": max_diff(captured, reference)}
    assert max(errors.values()) <= tolerance, (errors, tolerance)


def test_reserve_is_rejected(tiny):
    cache = kvcache.make_cache(tiny, "tova", cache_length=8, reserve=3)
    with pytest.raises(ValueError, match="does not support reserve"):
        CompiledDecode(tiny, cache)


def test_a_full_dense_cache_is_rejected_before_running(tiny):
    cache = kvcache.make_cache(tiny, "dense", cache_length=5)
    decode = CompiledDecode(tiny, cache, backend="aot_eager")
    with torch.inference_mode():
        tiny(ids_for(5, vocab=VOCAB), cache)
        before = cache.layers[0].storage.k.clone()
        with pytest.raises(kvcache.CapacityError, match="full"):
            decode(ids_for(1, vocab=VOCAB))
    assert cache.lengths.tolist() == [5] and torch.equal(cache.layers[0].storage.k, before)


def test_a_dense_cache_has_every_slot_allocated_for_its_capture(tiny):
    """A dense cache allocates as it fills; a captured step's buffers keep their size, so the
    capture allocates them all first, and then computes what eager steps over the grown cache do."""
    ids = ids_for(300 + 3, seed=7, vocab=VOCAB)
    caches = [kvcache.make_cache(tiny, "dense", cache_length=600) for _ in range(2)]
    assert [c.allocated_tokens for c in caches] == [256, 256]
    decode = CompiledDecode(tiny, caches[0], backend="aot_eager")
    assert caches[0].allocated_tokens == 600
    with torch.inference_mode():
        for cache in caches:
            tiny(ids[:, :300], cache)
        assert caches[1].allocated_tokens < 600  # grown as it filled, not to its cache_length
        for i in range(3):
            token = ids[:, 300 + i : 301 + i]
            assert max_diff(decode(token), tiny.decode(token, caches[1])) <= atol("cache")


def test_compile_refuses_a_cache_past_the_memory_available_up_front(tiny, monkeypatch):
    """compile=True allocates the whole dense cache before the prefill: one that does not fit is
    refused then, with what was asked, what it needs, what is available and what to lower."""
    import kvcache.runtime.memory

    monkeypatch.setattr(kvcache.runtime.memory, "available_bytes", lambda device: 2**20)
    prefilled = []
    with pytest.raises(kvcache.MemoryBudgetError) as caught:
        kvcache.generate(tiny, ids_for(5)[0].tolist(), max_new_tokens=10**6, compile=True, stop_tokens=(),
                         on_prefill=lambda done, total: prefilled.append(done))
    message = str(caught.value)
    assert f"to {5 + 10**6} tokens per row" in message and "1.0 MiB available" in message
    assert "compile=True" in message and "max_new_tokens" in message
    assert prefilled == []


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs KVCACHE_TEST_DEVICE=cuda")
@pytest.mark.parametrize("name", ["dense", "window", "sink", "h2o", "tova", "snapkv", "dense:int8"])
def test_decode_steps_do_not_synchronise_with_the_host_on_cuda(tiny, name):
    """Neither the eager nor the captured decode step of sampled tokens (``Transformer.decode``,
    ``CompiledDecode.step``) waits for the GPU: under ``torch.cuda.set_sync_debug_mode("error")``
    any synchronising call raises. (Ids from elsewhere are checked on the host, which waits.)"""
    model = kvcache.Transformer(tiny.config)
    model.load_state_dict(tiny.state_dict())
    model = model.to(DEVICE).eval()
    ids = ids_for(20, batch=2, seed=8)
    for captured in (False, True):
        cache = kvcache.make_cache(model, name, cache_length=24 if name.startswith("dense") else 8, batch_size=2)
        with torch.inference_mode():
            model(ids[:, :10], cache, n_tokens=[10, 7])
            step = CompiledDecode(model, cache).step if captured else (lambda tokens: model.decode(tokens, cache))
            step(ids[:, 10:11])  # the first call may compile, which synchronises
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for t in range(11, 16):
                    step(ids[:, t : t + 1])
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_bad_tokens_are_rejected_before_the_step(tiny):
    cache = kvcache.make_cache(tiny, "h2o", cache_length=8, options={"recent": 2})
    decode = CompiledDecode(tiny, cache, backend="aot_eager")
    with torch.inference_mode():
        tiny(ids_for(10), cache)
        before = cache.layers[0].storage.pos.clone()
        with pytest.raises(ValueError, match="outside"):
            decode(torch.tensor([[VOCAB + 5]], device=DEVICE))
        with pytest.raises(ValueError, match="shape"):
            decode(ids_for(2))
    assert cache.lengths.tolist() == [10] and torch.equal(cache.layers[0].storage.pos, before)


class Recorder:
    """A ``torch.compile`` backend that runs each graph as traced and records its inputs: the name
    of each, whether dynamo passes it as a static address (parameters and buffers are; so must
    every tensor the cache holds), which inputs a call mutated (by their version counters: run
    the step outside inference mode), and which inputs overlap another input in memory where
    one of the two was mutated. AOTAutograd replaces inputs that alias a mutated one by one
    "synthetic base" of its own making, which is no static address, so inductor skips CUDA
    graphs for the whole step ("mutated inputs") although dynamo marked each of them static."""

    def __init__(self) -> None:
        self.static: dict[str, bool] = {}
        self.mutated: set[str] = set()
        self.aliased: set[str] = set()

    def __call__(self, gm, example_inputs):
        names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                self.static[node.name] = bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))

        def run(*args):
            before = [a._version for a in args]
            out = gm(*args)
            mutated = {name for name, a, v in zip(names, args, before) if a._version != v}
            self.mutated |= mutated
            self.aliased |= overlapping_mutated(dict(zip(names, args)), mutated)
            return out

        return run


def prefilled(model, name, options, backend):
    """A two-row cache of ``name`` after a ragged prefill of 10 and 7 tokens, its decode step
    captured through ``backend``, and the ids (2, 16) whose tokens 10 on the step takes."""
    C = 24 if name.startswith("dense") else 9
    ids = ids_for(16, batch=2, seed=3)
    cache = kvcache.make_cache(model, name, cache_length=C, batch_size=2, **cache_args(options))
    decode = CompiledDecode(model, cache, backend=backend)
    with torch.no_grad():
        model(ids[:, :10], cache, n_tokens=[10, 7])
    return cache, decode, ids


@pytest.mark.parametrize("name,options", CASES + [("h2o", {"head_budgets": [[6, 10], [8, 8]], "recent": 2})],
                         ids=lambda x: str(x))
def test_captured_step_reads_and_writes_static_addresses_only(tiny, name, options):
    """What a CUDA graph needs of the step, checked on any device: every graph input but the
    tokens is a static address, the tokens are not written, and the step advances the cache's
    device lengths itself. (Inductor skips CUDA graphs for a step that mutates a non-static
    input, and copies every non-static input into the graph's memory on each replay.)"""
    recorder = Recorder()
    cache, decode, ids = prefilled(tiny, name, options, recorder)
    with torch.no_grad():
        for t in range(10, 16):
            decode(ids[:, t : t + 1])
    others = {input_name for input_name, static in recorder.static.items() if not static}
    assert others == {"l_tokens_"}, others
    assert not recorder.mutated & others
    assert recorder.aliased == set(), recorder.aliased
    assert any("device_lengths" in input_name for input_name in recorder.mutated), recorder.mutated
    assert cache.lengths.tolist() == [16, 13] and cache.device_lengths.tolist() == [16, 13]


# One case per path a captured step writes the cache through: the dense append, the ring, the
# evicting cache's victim slot (every scoring policy writes through it, so h2o and snapkv stand
# for the rest), and each storage's writes (full, token8, KIVI's groups and residual).
WRITE_PATHS = [("dense", {}), ("window", {}), ("sink", {"sinks": 2, "positions": "absolute"}), ("h2o", {}),
               ("snapkv", {}), ("dense:int8", {}), ("window:int8", {}), ("h2o:kivi4", {"recent": 2})]


@pytest.mark.parametrize("name,options", WRITE_PATHS, ids=lambda x: str(x))
def test_captured_step_writes_no_cache_buffer_through_a_scatter(tiny, name, options):
    """The step's writes into the cache are ones inductor makes in place (kvcache/cache/slots.py).
    In the graph inductor receives (functionalized, a written input copied back at the end), a
    write whose new value comes from a scatter costs a copy of the whole buffer and a copy back
    each step: every layer's keys and values twice over, for one token."""
    written: set[str] = set()
    scattered: set[str] = set()

    def inspect(gm, example_inputs):
        w, sc = inputs_written(gm)
        written.update(w)
        scattered.update(sc)
        return gm

    backend = aot_autograd(fw_compiler=inspect, keep_inference_input_mutations=True)
    cache, decode, ids = prefilled(tiny, name, options, backend)
    with torch.no_grad():
        got = decode(ids[:, 10:11])
    assert got.shape == (2, VOCAB) and cache.lengths.tolist() == [11, 8]
    # The graph was inspected and writes the cache (its lengths, its buffers) ...
    assert len(written) >= 2, written
    # ... and none of those writes comes from a scatter.
    assert scattered == set(), scattered


def inputs_written(gm) -> tuple[set[str], set[str]]:
    """The placeholders of a functionalized graph that a ``copy_`` writes, and those of them
    written from a value made, at any step of its chain of self arguments, by ``aten.scatter``:
    each as its name and shape."""
    written, scattered = set(), set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.copy_.default:
            continue
        dst, src = node.args[:2]
        if dst.op != "placeholder":
            continue
        name = f"{dst.name} {tuple(dst.meta['val'].shape)}"
        written.add(name)
        while isinstance(src, torch.fx.Node) and src.op == "call_function":
            if getattr(src.target, "overloadpacket", None) is torch.ops.aten.scatter:
                scattered.add(name)
                break
            src = src.args[0] if src.args and isinstance(src.args[0], torch.fx.Node) else None
    return written, scattered


def overlapping_mutated(inputs: dict[str, torch.Tensor], mutated: set[str]) -> set[str]:
    """Names of the inputs that share memory with another input where one of the two is in
    ``mutated`` (byte ranges of one storage that overlap)."""

    def span(t: torch.Tensor) -> tuple[int, int, int]:
        last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
        size = t.element_size()
        return t.untyped_storage().data_ptr(), t.storage_offset() * size, (last + 1) * size

    found: set[str] = set()
    items = [(name, span(t)) for name, t in inputs.items() if isinstance(t, torch.Tensor) and t.numel()]
    for i, (a, (pa, sa, ea)) in enumerate(items):
        for b, (pb, sb, eb) in items[i + 1 :]:
            if pa == pb and sa < eb and sb < ea and (a in mutated or b in mutated):
                found |= {a, b}
    return found


class HostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every copy of a CPU tensor to another device made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default:
            source, target = args[0], kwargs.get("device") or args[0].device
        elif func is torch.ops.aten.copy_.default:
            source, target = args[1], args[0].device
        else:
            return func(*args, **kwargs)
        if isinstance(source, torch.Tensor) and source.device.type == "cpu" and torch.device(target).type != "cpu":
            self.copies.append(f"{func}: {tuple(source.shape)} {source.dtype}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("name,options", CASES, ids=lambda x: str(x))
def test_eager_decode_steps_make_nothing_on_the_host(tiny, name, options):
    """A decode step copies nothing from the host and reads nothing back, checked on the CPU by
    running the model and its cache on the meta device: there a host read (``.item()``,
    ``int()``, ``.tolist()``) of a device tensor fails, a CPU tensor mixed into device work
    fails, and a host-to-device copy is recorded (a GPU would pay a transfer for each, per step).
    The steps run past cache_length, so evicting policies evict."""
    with torch.device("meta"):
        model = kvcache.Transformer(tiny.config)
    model.eval()
    C = 12 if name.startswith("dense") else 6
    cache = kvcache.make_cache(model, name, cache_length=C, batch_size=2, **cache_args(options))
    tokens = torch.zeros(2, 1, dtype=torch.long, device="meta")
    with torch.inference_mode(), HostCopies() as recorded:
        for _ in range(C):
            logits = model.decode(tokens, cache)
    assert recorded.copies == [] and logits.shape == (2, VOCAB)
    assert cache.lengths.tolist() == [C, C]
