"""kvcache's policies inside transformers models: a ``Cache`` and a registered attention function.

    import kvcache.hf
    cache = kvcache.hf.make_cache(model, "h2o", cache_length=256, batch_size=2)  # model: a PreTrainedModel
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, **kvcache.hf.cache_kwargs(cache))

``make_cache`` builds a transformers ``Cache`` (``HFCache``) whose layers are kvcache layer caches
and switches the model to ``attn_implementation="kvcache"``: each attention module's rotated
queries, keys and values then go to its layer cache, which stores them and computes attention,
exactly as in kvcache's own model. Importing this module registers the implementation with
transformers' ``AttentionInterface`` and ``AttentionMaskInterface``; nothing in transformers is
replaced.

``cache_kwargs`` passes the cache under the keyword the installed transformers takes it by
(``cache`` or, in older 5.x releases, ``past_key_values``).

Files: compat.py (the supported transformers range, checked here, and every difference between
releases), geometry.py (what a cache needs from a model, and what is refused), cache.py (the
Cache), layer.py (its per-layer view), padding.py (left padding to kvcache's layout),
positions.py (transformers' positions against kvcache's), attention.py (the registered
functions), make.py (``make_cache``). See docs/transformers.md.
"""

from __future__ import annotations

try:
    import transformers
except ImportError:
    raise ImportError("kvcache.hf needs transformers: pip install 'transformers>=5.0.0,<6' (or the hf extra)") from None

from .compat import SUPPORTED, cache_kwargs, check, output_cache, warn_if_untested

check(transformers.__version__)
warn_if_untested()

from .attention import NAME, register  # noqa: E402 (after the version check)
from .cache import HFCache  # noqa: E402
from .geometry import UnsupportedModelError  # noqa: E402
from .make import make_cache, use_kvcache_attention  # noqa: E402

register()

__all__ = ["HFCache", "NAME", "SUPPORTED", "UnsupportedModelError", "cache_kwargs", "make_cache", "output_cache",
           "register", "use_kvcache_attention"]
