"""The transformers versions kvcache.hf supports, and the check made when it is imported.

kvcache.hf relies on transformers' 5.x extension points: ``Cache`` objects built from per-layer
``CacheLayerMixin`` layers, ``AttentionInterface`` and ``AttentionMaskInterface`` registries, and
attention modules that hand ``(module, query, key, value, attention_mask, scaling=...)`` to the
registered function after calling ``past_key_values.update``. 4.x predates several of these, and
a 6.x may change them, so both are refused with an error rather than run unchecked.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

# Keep in step with the `hf` extra in pyproject.toml and the README. CI tests the oldest
# (a second virtual environment in .ci/run) and the newest release.
MINIMUM = "5.0.0"
BELOW = "6"
SUPPORTED = f">={MINIMUM},<{BELOW}"


def check(version: str) -> None:
    """Raise ImportError unless transformers ``version`` lies in ``SUPPORTED``."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise ImportError(f"kvcache.hf cannot read the transformers version {version!r}") from None
    # A pre-release of 6.0 is outside the range too; a 5.x pre-release or dev build is inside.
    if Version(MINIMUM) <= Version(parsed.base_version) < Version(BELOW):
        return
    raise ImportError(
        f"kvcache.hf supports transformers{SUPPORTED} (its 5.x Cache, AttentionInterface and "
        f"AttentionMaskInterface), but transformers {version} is installed. Install a supported "
        f"version: pip install 'transformers{SUPPORTED}' (kvcache's hf extra)."
    )
