"""kvcache's policies inside vLLM, as a plugin (no fork).

Installed with ``kvcache[vllm]``, the package's ``vllm.general_plugins`` entry point calls
``register`` in every vLLM process. Configuration is vLLM's own ``additional_config``:

    LLM(model, additional_config={"kvcache": {"policy": "sink", "cache_length": 1024, "sinks": 64}},
        enable_prefix_caching=False)

How it fits together (docs/vllm.md has more): ``config`` checks the configuration with kvcache's
option machinery; ``rule`` says which blocks a request keeps (kvcache's ``block=N`` rule);
``manager`` frees the others in the scheduler; ``backend`` keeps the attention kernel off them.
An engine without a ``kvcache`` configuration runs exactly as without the plugin.
"""

from __future__ import annotations

import logging


def register() -> None:
    """The ``vllm.general_plugins`` entry point: check the vLLM version, register kvcache's KV
    cache spec with its block manager, and put kvcache's subclass behind the CPU_ATTN backend.
    (vLLM may call this more than once per process; every step is idempotent.)"""
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from . import version

    version.check(vllm.__version__)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # No hook that sees an engine's configuration runs on every platform, so the entry cannot
        # be refused there: say so once per process instead.
        logging.getLogger(__name__).warning(
            "kvcache's vLLM plugin drives vLLM's CPU attention backend only; on %s an engine's "
            "additional_config['kvcache'] is not applied", current_platform.device_name)
        return
    from .manager import KVCacheBlockManager
    from .spec import KVCacheAttentionSpec

    # The registry fills itself with vLLM's own specs only while it is empty: fill it first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVCacheAttentionSpec, KVCacheBlockManager, uniform_type_base_spec=FullAttentionSpec)
    register_backend(AttentionBackendEnum.CPU_ATTN, "kvcache.vllm.backend.KVCacheCPUBackend")
