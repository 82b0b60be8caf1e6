"""What the plugin learns about the engine in each vLLM process, where vLLM's hooks do not pass
it along (no vLLM import here)."""

from __future__ import annotations

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


@dataclasses.dataclass(frozen=True)
class Row:
    """The request at one row of the worker's batch: its ``extra_args["kvcache"]`` (None: the
    engine's configuration) and its prompt length (tokens attended whole). A request admitted
    again after a preemption gets a new row."""

    raw: object
    prompt: int
    # Per layer name, what a scoring policy keeps track of for this request (scoring.LayerState).
    scores: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


@dataclasses.dataclass
class Batch:
    """The rows of the batch of the model runner built last in this process (one runner per
    worker process), kept by requests.KVCacheRequests."""

    rows: dict[int, Row] | None = None


ENGINE = EngineConfig()
BATCH = Batch()
