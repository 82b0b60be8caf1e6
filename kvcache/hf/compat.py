"""The transformers releases kvcache.hf supports, and what differs between them; nothing else
in kvcache looks at the installed version.

kvcache.hf relies on transformers' 5.x extension points: ``Cache`` objects built from per-layer
``CacheLayerMixin`` layers, the ``AttentionInterface`` and ``AttentionMaskInterface`` registries,
and attention modules that hand ``(module, query, key, value, attention_mask, scaling=...)`` to the
registered function after calling the cache's ``update``. 4.x predates several of these and a 6.x
may change them, so both are refused (``check``) rather than run unchecked.

Differences that matter to a Cache that computes attention itself (docs/transformers.md has the
release-by-release test results):

- the keyword a model and ``generate`` take the cache by: ``past_key_values`` up to the release
  that renamed it, ``cache`` after it (the old name still works there, with a FutureWarning,
  until the release named in that warning); ``CACHE_ARG`` and ``cache_kwargs``;
- the field of a model's output that holds the cache, named the same way (``output_cache``);
- what ``Cache.update`` receives besides keys, values and the layer: a positional dict of rotary
  tensors (5.0) or the attention keywords as ``kwargs=`` (later); kvcache reads neither, so its
  overrides take the base class's ``*args, **kwargs``;
- what ``get_mask_sizes`` is given: the chunk's cache positions (T,) (5.0) or its length
  (later); ``query_length``.

Features are detected from the installed transformers (a signature), not from its version
number, so a release between two tested ones gets the behaviour it really has. A release newer
than ``NEWEST_TESTED`` is used as it is, with one warning.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import transformers
from packaging.version import InvalidVersion, Version
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import KVCacheWarning

# Keep in step with the `hf` extra in pyproject.toml. .ci/run tests the oldest (a second virtual
# environment) and the newest release; .ci/hf-versions tests every 5.x minor release.
MINIMUM = "5.0.0"
BELOW = "6"
SUPPORTED = f">={MINIMUM},<{BELOW}"
# The newest transformers release whose tests/hf results are in docs/transformers.md. Raise it
# after running `bash .ci/hf-versions` on a newer release.
NEWEST_TESTED = "5.25.0"

# The keyword models and generate take the cache by.
# (Llama's forward stands for every model: the rename was made across models in one release.)
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"

# The output field that holds the cache, detected on its own: the output classes need not have
# been renamed in the same release as the keyword.
_OUTPUT_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class UntestedTransformersWarning(KVCacheWarning):
    """transformers is newer than any release kvcache.hf was tested on."""


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """``{name: cache}``, the keyword argument passing ``cache`` to a model's forward or to
    ``generate`` under the name the installed transformers expects:
    ``model.generate(ids, **kvcache.hf.cache_kwargs(cache))``."""
    return {CACHE_ARG: cache}


def output_cache(outputs: Any) -> Any:
    """The cache a model's output carries (``outputs.cache`` or ``outputs.past_key_values``)."""
    return getattr(outputs, _OUTPUT_FIELD)


def query_length(query: int | torch.Tensor) -> int:
    """The chunk length from what ``get_mask_sizes`` is given: the length itself, or the
    chunk's cache positions (T,)."""
    return query if isinstance(query, int) else int(query.shape[0])


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


_warned = False


def warn_if_untested(version: str = transformers.__version__) -> None:
    """Warn once per process when ``version`` is a release newer than ``NEWEST_TESTED``."""
    global _warned
    if _warned or Version(Version(version).base_version) <= Version(NEWEST_TESTED):
        return
    _warned = True
    warnings.warn(
        f"kvcache.hf was tested with transformers up to {NEWEST_TESTED}; {version} is installed. It is used as it "
        "is: if a model call fails, install transformers=="
        f"{NEWEST_TESTED} and report the release that broke it",
        UntestedTransformersWarning,
        stacklevel=3,
    )
