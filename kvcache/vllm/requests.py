"""Per-request options on the worker side, and their check where requests arrive.

A request may carry its own policy and options, ``SamplingParams(extra_args={"kvcache": {...}})``
(config.for_request: over the engine's configuration). vLLM's attention metadata says nothing
of which request a row is; its logits processors are the interface through which vLLM tells a
plugin, on the worker, which request sits at which row of the batch (added, removed, moved).
``KVCacheRequests`` is such a processor (loaded by vLLM from the ``vllm.logits_processors``
entry point that ``kvcache[vllm]`` installs): it leaves the logits alone and keeps, per row,
the request's ``extra_args["kvcache"]``, prompt length and prompt calls, which the metadata builder
(backend.py) reads. Its ``validate_params`` checks a request's options when it arrives.
"""

from __future__ import annotations

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from .config import ROTARY, SUPPORTED, ConfigError, PluginConfig, decoded, for_request
from .state import BATCH, CALLS, ENGINE, Row

# The budget a request's options are checked against where the engine's is unknown: room for any
# option a real budget would allow (the policy's buffers are built, so not unbounded).
UNKNOWN_BUDGET = 1 << 20


def options(params: SamplingParams | None) -> object:
    """A request's ``extra_args["kvcache"]``, or None."""
    extra = params.extra_args if params is not None else None
    return extra.get("kvcache") if isinstance(extra, dict) else None


class KVCacheRequests(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """A request's options, checked as it arrives (vLLM answers a bad one with its message:
        VLLMValidationError from ``LLM.generate``, HTTP 400 from the server). With the engine's
        configuration where this process knows it (the engine runs here), otherwise (an API
        server in a process of its own) as far as possible without it: names, types and values
        against the policy, with blocks of one token (rule.request_rule covers the rest)."""
        raw = decoded(options(sampling_params))
        if raw is None:
            return
        if ENGINE.config is not None:
            config = for_request(ENGINE.config, raw)
            if config.policy in ROTARY and ENGINE.inv_freq is None:
                raise ConfigError(f"kvcache vLLM plugin, SamplingParams.extra_args['kvcache']: the {config.policy} "
                                  "policy needs the model's rotary frequencies, which kvcache cannot read for this model")
        elif ENGINE.known:
            raise ValueError("kvcache vLLM plugin: SamplingParams.extra_args['kvcache'] is given but the engine "
                             "has no kvcache configuration; start it with additional_config={'kvcache': {...}}")
        elif isinstance(raw, dict) and "policy" not in raw:
            # The options belong to the engine's policy, unknown here: they must suit one of the
            # policies the plugin runs (a misspelt option suits none).
            errors = []
            for policy in SUPPORTED:
                try:
                    for_request(PluginConfig(policy, UNKNOWN_BUDGET, (), 1), raw)
                    return
                except ConfigError as e:
                    errors.append(f"as {policy}: {str(e).split(': ', 1)[1]}")
            raise ConfigError("kvcache vLLM plugin, SamplingParams.extra_args['kvcache']: " + "; ".join(errors))
        else:
            for_request(PluginConfig("window", UNKNOWN_BUDGET, (), 1), raw)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, Row] = {}
        BATCH.rows = self.rows

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.rows, batch_update,
            lambda params, prompt_ids, _output_ids: Row(options(params), len(prompt_ids) if prompt_ids is not None else 0,
                                                         calls=CALLS.of(params)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
