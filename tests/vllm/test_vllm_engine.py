"""kvcache's policies inside a vLLM engine (CPU), against kvcache's own model.

One engine per (model, policy), in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), fp32, vLLM
blocks of 32 tokens, prompts of several lengths batched together and prefilled in chunks of at
most 64 tokens:
  * greedy tokens equal kvcache's own model with the same policy and block=32, prompt by prompt;
  * every request past its prompt holds at most its budget of blocks, plus one being filled;
  * an engine without a kvcache configuration is plain vLLM (kvcache's dense tokens);
  * a bad configuration, or prefix caching, fails at engine start with a message saying why.
Skipped where vLLM is not installed (.ci/run runs these in an environment of their own).
"""

from __future__ import annotations

import gc
import os

import pytest

# vllm.v1, not vllm: without vLLM installed, this folder itself would be imported as "vllm".
pytest.importorskip("vllm.v1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from kvcache.vllm.config import ConfigError  # noqa: E402
from vllm_models import BLOCK, NEW_TOKENS, POLICIES, build, kvcache_tokens, prompts  # noqa: E402

pytestmark = pytest.mark.cpu_only("vLLM's CPU build")

MODELS = ["llama", "qwen2", "qwen3"]


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


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_tokens_equal_kvcache_and_blocks_stay_within_budget(checkpoint, policy):
    config = POLICIES[policy]
    prompt_ids = prompts()
    llm = engine(checkpoint, config)
    try:
        # Step by step, to look at every request's blocks between steps.
        llm_engine = llm.llm_engine
        scheduler = llm_engine.engine_core.engine_core.scheduler
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        for i, ids in enumerate(prompt_ids):
            llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), greedy(NEW_TOKENS))
        budget = -(-config["cache_length"] // BLOCK)
        tokens: dict[str, list[int]] = {}
        decoding_seen = 0
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            for request in scheduler.running:
                if request.num_computed_tokens > request.num_prompt_tokens:
                    decoding_seen += 1
                    live = manager.live_blocks(request.request_id)
                    assert live <= budget + 1, f"request with {request.num_computed_tokens} tokens holds {live} blocks"
        assert decoding_seen
        got = [tokens[str(i)] for i in range(len(prompt_ids))]
    finally:
        close(llm)
    want = kvcache_tokens(checkpoint, config, prompt_ids, NEW_TOKENS)
    assert got == want
    # The policy changed what the longest prompts generate: the comparison is not the dense one.
    assert want != kvcache_tokens(checkpoint, None, prompt_ids, NEW_TOKENS)


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
