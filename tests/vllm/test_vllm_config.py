"""The plugin's configuration and block rule, without vLLM (kvcache.vllm.config and .rule do not
import it): bad configurations fail with kvcache's messages, and the blocks the rule keeps, from
token counts alone, are those kvcache's own cache keeps."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.vllm.config import ConfigError, for_request, parse
from kvcache.vllm.rule import BlockRule

BLOCK = 32


def test_a_good_configuration_is_kept_as_given():
    config = parse({"policy": "sink", "cache_length": 1024, "sinks": 64}, BLOCK)
    assert (config.policy, config.cache_length, config.block) == ("sink", 1024, BLOCK)
    # vLLM stores keys at their true positions: sink positions default to absolute.
    assert dict(config.options) == {"sinks": 64, "positions": "absolute"}
    assert parse({"policy": "window", "cache_length": 64, "block": BLOCK}, BLOCK).options == ()
    # Options may come in the policy's name, as everywhere a policy is named.
    assert parse({"policy": "sink(sinks=64)", "cache_length": 1024}, BLOCK) == config


@pytest.mark.parametrize("raw, message", [
    ("sink", "expected an object such as"),
    ({"cache_length": 64}, "'policy' .* is required"),
    ({"policy": "nope", "cache_length": 64}, "unknown policy 'nope'; available: .*sink"),
    ({"policy": "sink:int8", "cache_length": 64},
     "'sink:int8': vLLM keeps keys and values in its own format; name the policy alone"),
    ({"policy": "lagkv", "cache_length": 64}, "policy 'lagkv' is not supported in vLLM yet \\(supported: window, sink, "
     "snapkv, tova, knorm, keydiff, h2o, expected_attention\\)"),
    ({"policy": "window"}, "'cache_length' .* is required"),
    ({"policy": "window", "cache_length": 0.5}, "'cache_length' .* got 0.5"),
    ({"policy": "window", "cache_length": True}, "'cache_length' .* got True"),
    ({"policy": "sink", "cache_length": 64, "sink": 4}, "policy 'sink' has no option 'sink'; valid options: sinks, positions"),
    ({"policy": "sink", "cache_length": 64, "sinks": "4"}, "option 'sinks' of policy 'sink' must be int"),
    ({"policy": "sink", "cache_length": 64, "positions": "shifted"}, "must be one of absolute, renumbered"),
    ({"policy": "sink", "cache_length": 64, "positions": "renumbered"}, "positions='absolute'"),
    ({"policy": "sink", "cache_length": 64, "sinks": 64}, "sinks \\(64\\) must be smaller than cache_length \\(64\\)"),
    ({"policy": "window", "cache_length": 16}, "block=32 does not fit the window policy's smallest budget"),
    ({"policy": "window", "cache_length": 64, "block": 16}, "block is vLLM's block size here \\(32\\)"),
    ({"policy": "window", "cache_length": 64, "reserve": 8}, "'reserve' is not set through the plugin"),
    ({"policy": "sink(sinks=4)", "cache_length": 64, "sinks": 8}, "sets sinks in its name.*set each option once"),
    ({"policy": "sink(cache_length=64)"}, "'cache_length' .* is required"),  # a name sets options only
])
def test_a_bad_configuration_says_what_is_wrong(raw, message):
    with pytest.raises(ConfigError, match=r"kvcache vLLM plugin, additional_config\['kvcache'\]: .*" + message):
        parse(raw, BLOCK)


@pytest.mark.parametrize("raw", [
    {"policy": "snapkv", "cache_length": 96, "window": 16},
    {"policy": "h2o", "cache_length": 100, "recent": 32},
    {"policy": "knorm", "cache_length": 96},
    {"policy": "tova", "cache_length": 70},
    {"policy": "expected_attention", "cache_length": 96},
])
def test_a_scoring_policy_keeps_as_many_blocks_as_the_rule(llama, raw):
    """Scoring requests are freed as window frees them, and each layer moves the blocks its
    policy keeps into window's columns: that needs kvcache's cache under the policy to hold, in
    every head and after every call, as many blocks as the rule keeps, all full but the newest."""
    config = parse(raw, BLOCK)
    rule = BlockRule(config)
    cache = kvcache.make_cache(llama, config.policy, cache_length=config.cache_length, block=BLOCK, options=dict(config.options))
    ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0)).to(llama.embed_tokens.weight.device)
    prompt = 130
    llama(ids[:, :prompt], cache)
    for n in range(prompt, 300):
        if n > prompt:
            llama(ids[:, n - 1 : n], cache)
        for layer in cache.layers:
            for pos in layer.storage.pos[0, :, : layer.spec.cache_length]:
                pos = pos[pos >= 0]
                blocks = pos // BLOCK
                assert len(set(blocks.tolist())) == len(rule.kept_blocks(n)), f"after {n} tokens"
                newest = (n - 1) // BLOCK
                assert int((blocks == newest).sum()) == n - newest * BLOCK
                assert all(int((blocks == b).sum()) == BLOCK for b in set(blocks.tolist()) - {newest})


@pytest.mark.parametrize("raw", [
    {"policy": "window", "cache_length": 64},
    {"policy": "sink", "cache_length": 96, "sinks": 32},
    {"policy": "sink", "cache_length": 100, "sinks": 20},  # neither a multiple of the block
    {"policy": "sink", "cache_length": 100, "sinks": 40},  # sinks over more than one block
])
def test_rule_keeps_the_blocks_kvcache_keeps(llama, raw):
    """One token per call through kvcache's cache with block=BLOCK, from the first: after each
    call the rule, given the token count alone, names the blocks the cache holds."""
    config = parse(raw, BLOCK)
    rule = BlockRule(config)
    options = dict(config.options)
    cache = kvcache.make_cache(llama, config.policy, cache_length=config.cache_length, block=BLOCK, options=options)
    ids = torch.randint(3, 100, (1, 300), generator=torch.Generator().manual_seed(0)).to(llama.embed_tokens.weight.device)
    for n in range(1, 300):
        llama(ids[:, n - 1 : n], cache)
        layer = cache.layers[0]
        pos = layer.storage.pos[0, 0, : layer.spec.cache_length]
        held = sorted({int(p) // BLOCK for p in pos[pos >= 0]})
        assert list(rule.kept_blocks(n)) == held, f"after {n} tokens"
    assert rule.kept_blocks(50) == (0, 1)  # within the budget nothing is evicted


@pytest.mark.parametrize("raw", [
    {"policy": "window", "cache_length": 70},
    {"policy": "sink", "cache_length": 512, "sinks": 64},
    {"policy": "sink", "cache_length": 100, "sinks": 40},
    {"policy": "h2o", "cache_length": 96},
])
def test_the_rule_far_from_the_sinks_is_the_rule_moved(raw):
    """Past a few budgets the rule is computed once per offset within a block and moved: the
    same blocks as kvcache's rule applied at every count."""
    rule, direct = BlockRule(parse(raw, BLOCK)), BlockRule(parse(raw, BLOCK))
    direct._far = 1 << 30  # never moved: kvcache's rule at every count
    assert all(rule.kept_blocks(n) == direct.kept_blocks(n) for n in range(1, 3000))


def test_vllm_versions_outside_the_range_are_refused():
    pytest.importorskip("packaging")
    from kvcache.vllm import version

    for good in ("0.32.0", "0.32.3", "0.32.0+cpu"):
        version.check(good)
    for bad in ("0.31.9", "0.33.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=f"supports vLLM >= 0.32.0, < 0.33 .* this is vLLM {bad}"):
            version.check(bad)


ENGINE = {"policy": "sink", "cache_length": 96, "sinks": 32}


@pytest.mark.parametrize("raw, want", [
    ({}, ("sink", 96, {"sinks": 32, "positions": "absolute"})),
    ({"cache_length": 64}, ("sink", 64, {"sinks": 32, "positions": "absolute"})),
    ('{"cache_length": 64}', ("sink", 64, {"sinks": 32, "positions": "absolute"})),
    ({"sinks": 64, "cache_length": 160}, ("sink", 160, {"sinks": 64, "positions": "absolute"})),
    # Another policy starts from its own defaults and the engine's budget.
    ({"policy": "window"}, ("window", 96, {})),
    ({"policy": "sink", "cache_length": 128}, ("sink", 128, {"sinks": 32, "positions": "absolute"})),
])
def test_request_options_override_the_engine_configuration(raw, want):
    config = for_request(parse(ENGINE, BLOCK), raw)
    assert (config.policy, config.cache_length, dict(config.options)) == want
    assert config.block == BLOCK


@pytest.mark.parametrize("raw, message", [
    ("sink", "expected an object such as"),
    ("[1]", "expected an object such as .* got \\[1\\]"),
    ({"sink": 4}, "policy 'sink' has no option 'sink'; valid options: sinks, positions"),
    ({"cache_length": 32}, "sinks \\(32\\) must be smaller than cache_length \\(32\\)"),
    ({"policy": "window", "cache_length": 16}, "block=32 does not fit the window policy's smallest budget"),
    ({"policy": "window", "sinks": 4}, "policy 'window' has no option 'sinks'"),
    ({"policy": "lagkv"}, "policy 'lagkv' is not supported in vLLM yet"),
    ({"block": 64}, "block is vLLM's block size here \\(32\\)"),
])
def test_bad_request_options_say_what_is_wrong(raw, message):
    with pytest.raises(ConfigError, match=r"kvcache vLLM plugin, SamplingParams.extra_args\['kvcache'\]: .*" + message):
        for_request(parse(ENGINE, BLOCK), raw)


@pytest.mark.parametrize("raw", [ENGINE, {"policy": "window", "cache_length": 64}, {"policy": "h2o", "cache_length": 96}])
@pytest.mark.parametrize("seen, total, prompt, calls", [
    (0, 64, 200, [64]), (200, 201, 150, [64, 150]), (64, 300, 70, [64, 70]), (100, 260, 130, [100, 130]),
    # A recompute after a preemption: the prompt's calls ended at 64, 100 and 170 when first computed.
    (0, 230, 170, [64, 100, 170]), (80, 120, 170, [64, 100, 170]),
])
def test_segments_give_each_query_what_it_reads(raw, seen, total, prompt, calls):
    """A step's queries, split into segments: each segment is contiguous, and within it query t
    reads the segment's kept columns before it plus the blocks from the segment's start to its own,
    which is what ``read_by`` says it read in its call: under window and sink every token is a
    call; under a scoring policy each prompt chunk (``calls``), then every generated token."""
    rule = BlockRule(parse(raw, BLOCK))
    segments = rule.segments(seen, total, prompt, calls)
    assert [s for s, _, _ in segments] == [seen] + [e for _, e, _ in segments[:-1]]
    assert segments[-1][1] == total
    for start, end, columns in segments:
        prefix = tuple(b for b in columns if b < start // BLOCK)
        assert columns == prefix + tuple(range(start // BLOCK, (end - 1) // BLOCK + 1))
        for t in range(start, end):
            assert prefix + tuple(range(start // BLOCK, t // BLOCK + 1)) == rule.read_by(t, rule.call_start(t, prompt, calls))
    if total - seen == 1 or total <= rule.cache_length:
        assert len(segments) == 1
    if rule.scoring and total <= prompt and seen in (0, *calls) and total in calls:
        assert len(segments) == 1  # a prompt chunk computed the first time is one call
    if not rule.scoring and total - seen > BLOCK and total > rule.cache_length + BLOCK:
        assert len(segments) > 1  # window and sink drop blocks within a prompt chunk


def test_calls_of_a_scoring_prompt():
    """Under a scoring policy a prompt token's call begins where the last prompt chunk before it
    ended; generated tokens, and every token under window and sink, are calls of their own."""
    h2o = BlockRule(parse({"policy": "h2o", "cache_length": 96}, BLOCK))
    window = BlockRule(parse({"policy": "window", "cache_length": 96}, BLOCK))
    calls = [64, 100, 170]
    assert [h2o.call_start(t, 170, calls) for t in (0, 63, 64, 99, 100, 169, 170, 200)] == [0, 0, 64, 64, 100, 100, 170, 200]
    assert [window.call_start(t, 170, calls) for t in (0, 63, 64, 99)] == [0, 63, 64, 99]
    # The call [100, 170) reads what was kept of 100 tokens (3 blocks of 96 tokens at most,
    # the fourth one being filled), then its own blocks.
    assert h2o.read_by(150, 100) == (1, 2, 3, 4)
    assert h2o.kept_before(150, 170, calls) == (1, 2, 3, 4)
    assert window.kept_before(150, 170, calls) == (2, 3, 4)
