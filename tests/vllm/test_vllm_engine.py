"""kvcache's policies inside a vLLM engine (CPU), against kvcache's own model.

One engine per (model, policy), in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), fp32, vLLM
blocks of 32 tokens, prompts of several lengths batched together and prefilled in chunks of at
most 64 tokens:
  * greedy tokens equal kvcache's own model with the same policy and block=32, prompt by prompt,
    fed the calls the plugin means (window and sink: one token per call; scoring policies: the
    prompt chunks vLLM computed, then one token per call);
  * after every step, prompt chunks included, a request holds at most its budget of blocks, one
    being filled and the blocks its step touched; a prompt four times the KV pool is served;
  * an engine without a kvcache configuration is plain vLLM (kvcache's dense tokens);
  * a bad configuration, or prefix caching, fails at engine start with a message saying why.
Skipped where vLLM is not installed (.ci/run runs these in an environment of their own).
"""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch

# vllm.v1, not vllm: without vLLM installed, this folder itself would be imported as "vllm".
pytest.importorskip("vllm.v1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm_models import (  # noqa: E402
    BLOCK,
    BLOCK_BYTES,
    NEW_TOKENS,
    POLICIES,
    PROMPT_LENGTHS,
    VOCAB,
    build,
    kvcache_tokens,
    prompts,
)

from kvcache.vllm.config import ConfigError  # noqa: E402
from kvcache.vllm.manager import KVCacheBlockManager  # noqa: E402

pytestmark = pytest.mark.cpu_only("vLLM's CPU build")

# gemma3: sliding layers (vLLM's own sliding-window manager) around a global one (the policy).
MODELS = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module", params=MODELS)
def checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


def engine(path, kvcache_config: dict | None, **overrides) -> LLM:
    settings = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=1024, block_size=BLOCK,
                    enable_prefix_caching=False, max_num_batched_tokens=64, max_num_seqs=4,
                    kv_cache_memory_bytes=32 << 20, enforce_eager=True, seed=0,
                    additional_config={} if kvcache_config is None else {"kvcache": kvcache_config})
    return LLM(str(path), **{**settings, **overrides})


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def generate(llm: LLM, prompt_ids: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], greedy(new_tokens),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def close(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@dataclasses.dataclass
class Run:
    """What ``run_stepwise`` saw: each request's tokens, where vLLM's chunks of its prompt ended
    (the first time it computed them), preemptions, and the most blocks a request and the pool
    held between steps, while prompts were computed and afterwards."""

    tokens: list[list[int]]
    chunks: list[list[int]]
    preemptions: int
    peak_request: dict[str, int]
    peak_pool: int


def run_stepwise(llm: LLM, prompt_ids: list[list[int]], options: list[dict | None] | None = None,
                 new_tokens: int = NEW_TOKENS, arrivals: list[tuple[int, int]] | None = None) -> Run:
    """Greedy tokens of each prompt (with its own ``extra_args["kvcache"]`` where ``options``
    gives one), step by step; request i is added before step ``arrivals[i][0]`` with priority
    ``arrivals[i][1]`` (all at once, priority 0, without ``arrivals``).

    After every step, prompt chunks included, each request holds at most its budget of blocks
    (``ceil(cache_length / 32)``), one being filled and the blocks its step touched, and the pool
    no more than the sum of those bounds over the running requests. (A step that recomputes a
    preempted request's tokens holds what it wrote, and under a scoring policy the blocks of the
    prompt chunk it replays, until its next step frees what the rule drops.)"""
    llm_engine = llm.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    # A hybrid model's sliding layers are a KV cache group of their own, under vLLM's manager.
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    [manager] = [m for m in managers if isinstance(m, KVCacheBlockManager)]
    pool = manager.block_pool
    arrivals = arrivals or [(0, 0)] * len(prompt_ids)
    tokens: dict[str, list[int]] = {}
    chunks: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_ids))}
    preemptions: dict[str, int] = {}
    computed: dict[str, int] = {}  # tokens each request had computed after the previous step
    peak = {"prefill": 0, "decode": 0}
    peak_pool = 0
    bound_of: dict[str, int] = {}  # each request's bound after its latest step
    step = 0
    while len(tokens) < len(prompt_ids):
        for i, ids in enumerate(prompt_ids):
            if arrivals[i][0] == step:
                params = greedy(new_tokens)
                if options is not None and options[i] is not None:
                    params.extra_args = {"kvcache": options[i]}
                llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params, priority=arrivals[i][1])
        step += 1
        for out in llm_engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        for request in scheduler.requests.values():
            preemptions[request.request_id] = request.num_preemptions
        bounds = 0
        for request in scheduler.running:
            n, rid = request.num_computed_tokens, request.request_id
            before = computed.get(rid, 0)
            if n < before:
                before = 0  # preempted since its previous step: computed again from the start
            computed[rid] = n
            if n == before:
                bounds += bound_of.get(rid, 0)  # not scheduled in this step: holds what it held
                continue
            # vLLM's own id is the one the request was added with, plus a suffix.
            first = chunks[rid.rsplit("-", 1)[0]]
            if n <= request.num_prompt_tokens and n > (first[-1] if first else 0):
                first.append(n)
            live, budget = manager.live_blocks(rid), manager.budget(rid)
            touched = (n - 1) // BLOCK - before // BLOCK + 1
            bound = budget + 1 + touched
            if request.num_preemptions:
                # A recompute: what it replays of a scoring prompt chunk stays until the chunk ends.
                calls = manager.calls[rid]
                start = manager.rules[rid].call_start(before, request.num_prompt_tokens, calls)
                bound += before // BLOCK - start // BLOCK
            assert live <= bound, f"request {rid} holds {live} blocks after a step [{before}, {n}) (bound {bound})"
            bounds += bound
            bound_of[rid] = bound
            phase = "prefill" if before < request.num_prompt_tokens else "decode"
            peak[phase] = max(peak[phase], live)
        used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block is never free
        # (The sliding layers' blocks, vLLM's to bound, are counted as they stand.)
        used -= sum(not b.is_null for m in managers if m is not manager for blocks in m.req_to_blocks.values()
                    for b in blocks)
        assert used <= bounds or not scheduler.running, f"the pool holds {used} blocks, the running requests' bounds {bounds}"
        peak_pool = max(peak_pool, used)
    assert peak["decode"]
    return Run([tokens[str(i)] for i in range(len(prompt_ids))], [chunks[str(i)] for i in range(len(prompt_ids))],
               sum(preemptions.values()), peak, peak_pool)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tokens_equal_kvcache_and_blocks_stay_within_budget(checkpoint, policy):
    config = POLICIES[policy]
    prompt_ids = prompts()
    llm = engine(checkpoint, config)
    try:
        run = run_stepwise(llm, prompt_ids)
    finally:
        close(llm)
    want = kvcache_tokens(checkpoint, config, prompt_ids, NEW_TOKENS, run.chunks)
    assert run.tokens == want
    # The longest prompt was computed in several chunks and freed blocks before its end.
    assert len(run.chunks[-1]) > 1
    assert run.peak_request["prefill"] < -(-max(PROMPT_LENGTHS) // BLOCK)
    # The policy changed what the longest prompts generate: the comparison is not the dense one.
    assert want != kvcache_tokens(checkpoint, None, prompt_ids, NEW_TOKENS)


@pytest.mark.parametrize("policy", ["window", "snapkv"])
def test_gemma2_soft_caps_give_kvcache_tokens(tmp_path, policy):
    """Gemma 2 in vLLM: its soft caps are vLLM's attention's (the stock kernel caps), the policy
    bounds the global layers, and the tokens are kvcache's own model's."""
    config = POLICIES[policy]
    path = build("gemma2", tmp_path / "gemma2")
    prompt_ids = prompts()
    llm = engine(path, config)
    try:
        run = run_stepwise(llm, prompt_ids)
    finally:
        close(llm)
    assert run.tokens == kvcache_tokens(path, config, prompt_ids, NEW_TOKENS, run.chunks)


# KV memory for 12 blocks (11 usable: vLLM keeps one as its null block), and a prompt four times
# as long as the 12 blocks hold.
POOL_BLOCKS = 12
LONG_PROMPT = 4 * POOL_BLOCKS * BLOCK


@pytest.mark.parametrize("policy", ["window", "sink"])
def test_a_prompt_four_times_the_pool_is_served(tmp_path, policy):
    """A 1,536-token prompt through KV memory for 12 blocks (384 tokens), prefilled in chunks of
    64: under window and sink the engine starts (its start-up check counts a request's bound,
    not max_model_len), admits the request (its admission check too), frees blocks after every
    chunk, and generates kvcache's own tokens. Plain vLLM with the same memory refuses to start:
    one request of max_model_len does not fit."""
    config = POLICIES[policy]
    path = build("llama", tmp_path / "llama")
    prompt_ids = [torch.randint(3, VOCAB, (LONG_PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()]
    settings = dict(max_model_len=LONG_PROMPT + 32, kv_cache_memory_bytes=POOL_BLOCKS * BLOCK_BYTES, max_num_seqs=1)
    with pytest.raises(ValueError, match=r"To serve at least one request with the model's max seq len \(1568\)"):
        engine(path, None, **settings)
    llm = engine(path, config, **settings)
    try:
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        run = run_stepwise(llm, prompt_ids, new_tokens=32)
    finally:
        close(llm)
    assert pool == POOL_BLOCKS
    budget = -(-config["cache_length"] // BLOCK)
    # At most the budget, the block being filled and the two blocks of a 64-token chunk.
    assert run.peak_request["prefill"] <= budget + 1 + 2 < POOL_BLOCKS
    assert run.peak_pool <= budget + 3
    assert run.tokens == kvcache_tokens(path, config, prompt_ids, 32)


# Per-request options over the engine's sink configuration, and the configuration each amounts to.
ENGINE_CONFIG = {"policy": "sink", "cache_length": 96, "sinks": 32}
REQUEST_OPTIONS = [
    (None, ENGINE_CONFIG),
    # As text, as the OpenAI-compatible server's vllm_xargs (flat values only) carries it.
    ('{"cache_length": 64}', {"policy": "sink", "cache_length": 64, "sinks": 32}),
    # A scoring policy beside positional ones in one batch.
    ({"policy": "h2o", "cache_length": 96, "recent": 32}, {"policy": "h2o", "cache_length": 96, "recent": 32}),
    ({"sinks": 64, "cache_length": 160}, {"policy": "sink", "cache_length": 160, "sinks": 64}),
]


def test_per_request_options_equal_kvcache_with_those_options(tmp_path):
    """Four requests batched together, each with its own policy options (or the engine's): each
    one's tokens are kvcache's with its own configuration, and each stays within its own budget.
    Bad options are refused when the request is added, and the engine serves on."""
    path = build("llama", tmp_path / "llama")
    prompt_ids = prompts()
    llm = engine(path, ENGINE_CONFIG)
    try:
        run = run_stepwise(llm, prompt_ids, [options for options, _ in REQUEST_OPTIONS])
        for options, message in [
            ({"sink": 4}, "policy 'sink' has no option 'sink'; valid options: sinks, positions"),
            ({"policy": "window", "cache_length": 16}, "block=32 does not fit the window policy's smallest budget"),
            ({"policy": "lagkv"}, "policy 'lagkv' is not supported in vLLM yet"),
            ("sink", "expected an object such as"),
        ]:
            params = greedy(4)
            params.extra_args = {"kvcache": options}
            with pytest.raises(VLLMValidationError, match=r"SamplingParams.extra_args\['kvcache'\]: .*" + message):
                llm.generate([TokensPrompt(prompt_token_ids=prompt_ids[0])], params, use_tqdm=False)
        again = run_stepwise(llm, prompt_ids[1:3], [options for options, _ in REQUEST_OPTIONS[1:3]])
    finally:
        close(llm)
    want = [kvcache_tokens(path, config, [ids], NEW_TOKENS, [chunks])[0]
            for ids, (_, config), chunks in zip(prompt_ids, REQUEST_OPTIONS, run.chunks)]
    assert run.tokens == want
    assert again.tokens == [kvcache_tokens(path, config, [ids], NEW_TOKENS, [chunks])[0]
                            for ids, (_, config), chunks in zip(prompt_ids[1:3], REQUEST_OPTIONS[1:3], again.chunks)]
    # The options changed what the requests generate: not the engine's configuration for all.
    assert want != kvcache_tokens(path, ENGINE_CONFIG, prompt_ids, NEW_TOKENS)


@pytest.mark.parametrize("policy, blocks", [("sink", 12), ("h2o", 14), ("snapkv-tova", 14)])
def test_a_preempted_request_resumes_with_the_same_tokens(tmp_path, policy, blocks):
    """KV memory for 12 (14) blocks, priority scheduling: two low-priority requests generate past
    their budget, then four high-priority ones arrive and grow; vLLM preempts the low-priority
    ones (recompute) and runs them again later. Every request's tokens are those of kvcache's own
    model, uninterrupted: when a request recomputes its generated tokens, each token reads what it
    read when it was first generated (attending a recomputed chunk as one sequence over the
    blocks kept before it gives other tokens here). Under a scoring policy (h2o: attention summed
    over every step; snapkv then tova: the newest query's attention when a block goes) a
    recompute chunk runs in parts, each one's blocks moved before the next reads them, its
    prompt is scored in the chunks it was first computed in (a chunk computed again in two steps
    keeps its listened queries until its end), and its generated tokens are scored one by one as
    they were first computed. No request exceeds its budget."""
    config = POLICIES[policy]
    path = build("llama", tmp_path / "llama")
    g = torch.Generator().manual_seed(2)
    # The first prompt takes four chunks of its own, three of which evict: recomputed among other
    # requests' decode steps, vLLM's chunks end elsewhere (under h2o and snapkv the calls [64, 128)
    # and [128, 192) are computed again in two parts each, checked by hand).
    prompt_ids = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (200, 90, 40, 44, 48, 52)]
    arrivals = [(0, 1), (0, 1), (60, 0), (60, 0), (60, 0), (60, 0)]
    llm = engine(path, config, max_model_len=320, kv_cache_memory_bytes=blocks * BLOCK_BYTES, max_num_seqs=6,
                 scheduling_policy="priority")
    try:
        run = run_stepwise(llm, prompt_ids, new_tokens=100, arrivals=arrivals)
    finally:
        close(llm)
    assert run.preemptions > 0
    want = kvcache_tokens(path, config, prompt_ids, 100, run.chunks)
    assert run.tokens == want
    assert want != kvcache_tokens(path, None, prompt_ids, 100)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_the_bundled_model_on_real_text_equals_kvcache(policy):
    """kvcache's bundled model (trained, not random) in vLLM, three passages of a held-out text
    of 700 to 1,300 tokens into a budget of 256 tokens, prefilled in chunks of 256: the tokens
    are kvcache's own model's, and the policy changed them (not the dense tokens)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    import kvcache

    path = Path(kvcache.__file__).parent / "reference_model"
    text = (Path(kvcache.__file__).parent / "data" / "texts" / "austen__emma.txt").read_text()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    prompt_ids = [ids[3000 * i: 3000 * i + n] for i, n in enumerate((700, 1000, 1300))]
    config = {"policy": policy, "cache_length": 256}
    llm = engine(path, config, max_model_len=2048, max_num_batched_tokens=256)
    try:
        run = run_stepwise(llm, prompt_ids, new_tokens=48)
    finally:
        close(llm)
    want = kvcache_tokens(path, config, prompt_ids, 48, run.chunks)
    assert run.tokens == want
    assert want != kvcache_tokens(path, None, prompt_ids, 48)


def test_block_contents_read_back_as_the_kernel_wrote_them():
    """The scoring worker reads keys and values in the CPU kernel's own block layout."""
    from vllm import _custom_ops as ops

    from kvcache.vllm.layout import read

    for dtype in (torch.float32, torch.bfloat16):
        blocks, heads, head_dim = 4, 2, 32
        cache = torch.zeros(blocks, heads, BLOCK, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = cache.view(blocks, heads, 2 * BLOCK, head_dim).chunk(2, dim=2)
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(2 * BLOCK, heads, head_dim, generator=g).to(dtype) for _ in range(2))
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.arange(2 * BLOCK) + BLOCK, "vec",
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        blocks = torch.tensor([2, 1])  # tokens 32-63, then 0-31
        keys, values = read(cache, blocks, "vec"), read(cache, blocks, "vec", values=True)
        order = torch.cat((torch.arange(BLOCK, 2 * BLOCK), torch.arange(BLOCK)))
        assert torch.equal(keys, k[order].transpose(0, 1))
        assert torch.equal(values, v[order].transpose(0, 1))


def test_without_configuration_the_engine_is_plain_vllm(tmp_path):
    path = build("llama", tmp_path / "llama")
    prompt_ids = prompts(seed=1)[:2]
    llm = engine(path, None)
    try:
        manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        assert type(manager).__name__ == "FullAttentionManager"
        got = generate(llm, prompt_ids, 8)
    finally:
        close(llm)
    assert got == kvcache_tokens(path, None, prompt_ids, 8)


def test_bad_configurations_fail_at_engine_start(tmp_path):
    path = build("llama", tmp_path / "llama")
    with pytest.raises(ConfigError, match="policy 'sink' has no option 'sink'; valid options: sinks, positions"):
        engine(path, {"policy": "sink", "cache_length": 64, "sink": 4})
    with pytest.raises(ConfigError, match="enable_prefix_caching=False"):
        engine(path, {"policy": "window", "cache_length": 64}, enable_prefix_caching=True)
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8' is not supported"):
        engine(path, {"policy": "snapkv", "cache_length": 64}, kv_cache_dtype="fp8")


def test_a_pool_too_small_for_the_bound_is_refused_saying_what_to_lower(tmp_path):
    """4 blocks of KV memory, and a bound of 2 blocks of cache_length plus 4 of a 128-token step per
    layer: the start fails naming the bound's parts and the option to lower; with steps of 32
    tokens the bound fits and the engine starts."""
    path = build("llama", tmp_path / "llama")
    config = {"policy": "window", "cache_length": 64}
    settings = dict(max_model_len=512, kv_cache_memory_bytes=4 * BLOCK_BYTES, max_num_seqs=1)
    with pytest.raises(ConfigError, match=r"cache_length \(64\) tokens plus the 128 one step may schedule "
                                          r"\(max_num_batched_tokens\).*lower --max-num-batched-tokens"):
        engine(path, config, max_num_batched_tokens=128, **settings)
    close(engine(path, config, max_num_batched_tokens=32, **settings))


def test_request_options_checked_where_the_engine_is_not_known(monkeypatch):
    """An API server's own process has not built the engine's model: there a request's options
    are checked against the policies the plugin runs (a misspelt option suits none); in a process
    whose engine has no kvcache configuration, options are refused."""
    from kvcache.vllm.requests import KVCacheRequests
    from kvcache.vllm.state import ENGINE

    def check(raw):
        KVCacheRequests.validate_params(SamplingParams(extra_args={"kvcache": raw}))

    monkeypatch.setattr(ENGINE, "config", None)
    monkeypatch.setattr(ENGINE, "known", False)
    check({"sinks": 8, "cache_length": 64})
    check({"policy": "window", "cache_length": 64})
    for bad in ({"sink": 4}, '{"sink": 4}'):  # the object or its JSON text
        with pytest.raises(ConfigError, match="as window: policy 'window' has no option 'sink'.*"
                                              "as sink: policy 'sink' has no option 'sink'"):
            check(bad)
    with pytest.raises(ConfigError, match="policy 'lagkv' is not supported in vLLM yet"):
        check({"policy": "lagkv"})
    check({"policy": "snapkv", "window": 16})
    monkeypatch.setattr(ENGINE, "known", True)
    with pytest.raises(ValueError, match="the engine has no kvcache configuration"):
        check({"cache_length": 64})
