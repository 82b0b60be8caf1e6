"""The plugin's configuration, ``additional_config={"kvcache": {...}}``, checked by kvcache itself.

The object under ``"kvcache"`` names a policy, a ``cache_length`` (tokens per request) and the
policy's options, with the names and types ``make_cache`` takes; they are checked by kvcache's own
option machinery and by building the policy's layer cache, so a bad one fails at engine start
with the message ``make_cache`` would give. ``block`` is vLLM's block size (the unit vLLM frees).
This module does not import vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..cache.base import CacheSpec, LayerCache
from ..cache.blocks import check_block
from ..cache.names import CacheName
from ..cache.registry import layer_cache, policy_class

# Policies whose kept blocks depend on positions alone, so that vLLM's scheduler (which frees
# blocks) and its attention metadata (which skips them) decide alike from token counts.
POSITIONAL = ("window", "sink")
# Policies that score tokens on the worker: blocks are freed as window frees them, and each
# layer moves the blocks its policy keeps into the ones window keeps (scoring.py).
SCORING = ("snapkv", "tova", "knorm", "keydiff", "h2o", "expected_attention")
SUPPORTED = POSITIONAL + SCORING
# Policies that rotate queries themselves and so need the model's rotary frequencies.
ROTARY = ("expected_attention",)
# make_cache arguments that are not the plugin's to take: vLLM decides batching and layouts.
NOT_OPTIONS = ("batch_size", "prompt_length", "allocation", "head_budgets", "reserve")


class ConfigError(ValueError):
    """additional_config["kvcache"] is not a configuration kvcache accepts."""


@dataclass(frozen=True)
class PluginConfig:
    """A checked configuration: the policy, its budget, its options as given (a hashable tuple,
    since vLLM hashes the KV cache spec that carries it) and the block size."""

    policy: str
    cache_length: int
    options: tuple[tuple[str, object], ...]
    block: int

    @property
    def scoring(self) -> bool:
        """Whether the policy scores tokens on the worker (``SCORING``)."""
        return self.policy in SCORING

    def layer(self, inv_freq: torch.Tensor | None = None) -> LayerCache:
        """kvcache's layer cache of this policy (one row, one head), with options left out set as
        ``make_cache`` sets them for this budget: its ``priority``, ``observe`` and
        ``blocks.keep_whole_blocks`` are the rule the plugin applies (rule.py, scoring.py).
        Its slot buffers go unused. ``inv_freq``: the model's rotary frequencies, for a policy
        that rotates queries itself (expected_attention); without them (checking options) a
        placeholder stands in, which no check reads."""
        spec = CacheSpec(batch_size=1, num_kv_heads=1, head_dim=2, cache_length=self.cache_length,
                         dtype=torch.float32, device=torch.device("cpu"), block=self.block,
                         inv_freq=torch.ones(1) if inv_freq is None else inv_freq)
        return layer_cache(policy_class(self.policy), spec, dict(self.options))


def parse(raw: object, block: int) -> PluginConfig:
    """Check ``raw`` (additional_config["kvcache"]) for vLLM's ``block`` size; ConfigError with
    what is wrong and what to pass instead."""
    try:
        return _parse(raw, block)
    except ValueError as e:
        raise ConfigError(f"kvcache vLLM plugin, additional_config['kvcache']: {e}") from None


def for_request(engine: PluginConfig, raw: object) -> PluginConfig:
    """The configuration of one request: ``raw`` (``SamplingParams.extra_args["kvcache"]``, an
    object or its JSON text) over the engine's. A request that names another policy starts from that policy's defaults and the
    engine's ``cache_length``; one that names none (or the engine's) overrides the engine's
    options one by one. ConfigError (prefixed with where the object came from) when the result
    is not a configuration ``parse`` accepts."""
    try:
        raw = decoded(raw)
        if not isinstance(raw, dict):
            raise ValueError(f'expected an object such as {{"cache_length": 512}} or '
                             f'{{"policy": "window", "cache_length": 256}} (or its JSON text), got {raw!r}')
        base: dict = {"policy": engine.policy, "cache_length": engine.cache_length}
        if raw.get("policy", engine.policy) == engine.policy:
            base.update(engine.options)
        return _parse({**base, **raw}, engine.block)
    except ValueError as e:
        raise ConfigError(f"kvcache vLLM plugin, SamplingParams.extra_args['kvcache']: {e}") from None


def decoded(raw: object) -> object:
    """A request's ``extra_args["kvcache"]``, its JSON text read (the OpenAI-compatible server's
    vllm_xargs takes flat values only); anything else as given."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
    return raw


def request_key(raw: object) -> object:
    """A hashable stand-in for a request's ``extra_args["kvcache"]`` (a dict of plain values), so
    that the configurations of requests alike are checked and built once."""
    if isinstance(raw, dict):
        return tuple(sorted((str(k), request_key(v)) for k, v in raw.items()))
    if isinstance(raw, list):
        return ("list", tuple(request_key(v) for v in raw))
    return raw


def _parse(raw: object, block: int) -> PluginConfig:
    if not isinstance(raw, dict):
        raise ValueError(f'expected an object such as {{"policy": "sink", "cache_length": 1024, "sinks": 64}}, got {raw!r}')
    given = dict(raw)
    policy = given.pop("policy", None)
    if not isinstance(policy, str):
        raise ValueError(f"'policy' (a string, one of {', '.join(SUPPORTED)}) is required, got {policy!r}")
    parsed = CacheName.parse(policy)
    name = parsed.policy
    cls = policy_class(parsed)  # an unknown policy: kvcache's message, with the available ones
    if parsed.storage != "full":
        raise ValueError(f"{policy!r}: vLLM keeps keys and values in its own format; name the policy alone ({name!r})")
    if name not in SUPPORTED:
        raise ValueError(f"policy {name!r} is not supported in vLLM yet (supported: {', '.join(SUPPORTED)}); "
                         "it runs in kvcache's own model (kvcache.make_cache)")
    cache_length = given.pop("cache_length", None)
    if isinstance(cache_length, bool) or not isinstance(cache_length, int) or cache_length <= 0:
        raise ValueError(f"'cache_length' (a positive token count per request) is required, got {cache_length!r}")
    for key in NOT_OPTIONS:
        if key in given:
            raise ValueError(f"{key!r} is not set through the plugin: vLLM schedules requests and lays out their blocks")
    if given.pop("block", block) != block:
        raise ValueError(f"block is vLLM's block size here ({block}): set it with vLLM's block_size, or leave block out")
    # "sink(sinks=64)" is {"policy": "sink", "sinks": 64}; merged after the keys above are taken,
    # so that a name sets the policy's options only.
    given = dict(parsed.with_options(given).options)
    if name == "sink":
        # vLLM stores keys rotated at their true positions: sinks keep them.
        given.setdefault("positions", "absolute")
    config = PluginConfig(name, cache_length, tuple(sorted(given.items())), block)
    check_block(block, name, cls.evicts, cache_length)
    config.layer()  # the policy's own checks (room for the sinks, positions with blocks, ...)
    return config
