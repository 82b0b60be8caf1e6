"""The vLLM versions whose internals the plugin relies on (docs/vllm.md lists them), checked
when vLLM loads the plugin."""

from __future__ import annotations

from packaging.version import Version

MINIMUM = "0.32.0"
BELOW = "0.33"


def check(version: str) -> None:
    """RuntimeError unless ``version`` lies in [MINIMUM, BELOW)."""
    v = Version(version)
    if not Version(MINIMUM) <= Version(v.base_version) < Version(BELOW):
        raise RuntimeError(
            f"kvcache's vLLM plugin supports vLLM >= {MINIMUM}, < {BELOW} (it relies on the block manager, "
            f"KV cache spec registry and CPU attention metadata of those versions); this is vLLM {version}. "
            "Install kvcache[vllm], or leave the plugin out with VLLM_PLUGINS set to the plugins you want"
        )
