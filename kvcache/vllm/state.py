"""What the plugin learns about the engine in each vLLM process, where vLLM's hooks do not pass
it along (no vLLM import here)."""

from __future__ import annotations

import collections
import dataclasses

from .config import PluginConfig


@dataclasses.dataclass
class EngineConfig:
    """The configuration of the engine whose model was built last in this process.

    vLLM asks the backend to customize a layer's KV cache spec through a classmethod that is
    given the spec alone, outside any current vLLM config; each attention layer asks the backend
    for its implementation class earlier, while the model is built inside that config, and the
    backend records it then. One process builds one model at a time, and builds it before it
    asks for the model's KV cache specs."""

    config: PluginConfig | None = None
    known: bool = False  # whether this process has built a model (and so knows ``config``)
    # The model's rotary frequencies as kvcache computes them (for expected_attention), or None
    # where kvcache cannot read the model's config.
    inv_freq: object = None
    # vLLM's ``max_in_flight_tokens``: the most tokens one step computes (the KV cache spec's bound).
    in_flight_tokens: int = 0
    # The VllmConfig itself, for the start-up check of the KV cache memory (backend.check_pool).
    vllm_config: object = None
    # The model's rule for attention scores (Gemma 2's soft cap), which the weights a scoring
    # policy reads are computed with (scoring.py); None for plain softmax attention.
    scores: object = None


@dataclasses.dataclass(frozen=True)
class Row:
    """The request at one row of the worker's batch: its ``extra_args["kvcache"]`` (None: the
    engine's configuration) and its prompt length. A request admitted again after a preemption
    gets a new row (and new ``scores``), but the same ``calls``."""

    raw: object
    prompt: int
    # Per layer name, what a scoring policy keeps track of for this request (scoring.LayerState).
    scores: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # Where the prompt's calls ended (rule.py): under a scoring policy, each prompt chunk vLLM
    # computed the first time. Shared by every admission of the request (Calls).
    calls: list = dataclasses.field(default_factory=list, compare=False, repr=False)


class Calls:
    """Each request's ``Row.calls``, found again when vLLM admits the request after a
    preemption. A worker keeps a request's ``SamplingParams`` object (vLLM's engine copies it
    per request) from its first admission to its end and hands the same object back with a
    resumed request; the list is found by that object's identity, which is held here so that
    it cannot be another's. The most recent ``limit`` requests are remembered."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._by_params: collections.OrderedDict[int, tuple[object, list[int]]] = collections.OrderedDict()

    def of(self, params: object) -> list[int]:
        key = id(params)
        entry = self._by_params.get(key)
        if entry is None or entry[0] is not params:
            entry = self._by_params[key] = (params, [])
            if len(self._by_params) > self.limit:
                self._by_params.popitem(last=False)
        else:
            self._by_params.move_to_end(key)
        return entry[1]


@dataclasses.dataclass
class Batch:
    """The rows of the batch of the model runner built last in this process (one runner per
    worker process), kept by requests.KVCacheRequests."""

    rows: dict[int, Row] | None = None


ENGINE = EngineConfig()
BATCH = Batch()
CALLS = Calls()
