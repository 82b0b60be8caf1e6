"""``kvcache.hf.make_cache``: a kvcache cache for a transformers model, and the switch of the
model's attention to kvcache's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..cache import make_cache as make_kvcache
from ..cache.names import CacheName
from . import geometry
from .attention import NAME
from .cache import HFCache
from .geometry import UnsupportedModelError


def make_cache(
    model: torch.nn.Module,
    policy: str | CacheName = "dense",
    *,
    cache_length: int | float,
    batch_size: int = 1,
    prompt_length: int | None = None,
    allocation: str | Sequence[int] = "uniform",
    head_budgets: Sequence[Sequence[int]] | None = None,
    reserve: int = 0,
    block: int = 1,
    options: Mapping[str, object] | None = None,
) -> HFCache:
    """A transformers ``Cache`` for ``model`` (a ``PreTrainedModel``) whose layers are kvcache
    layer caches of ``policy`` (``name[:storage]``, any of ``kvcache.policies()``), and the
    model switched to ``attn_implementation="kvcache"``.

    The arguments are ``kvcache.make_cache``'s, with the same meaning and checks: ``cache_length``
    tokens per row and layer (or a fraction of ``prompt_length``), ``batch_size`` rows,
    ``allocation``, ``head_budgets``, ``reserve``, ``block`` and the policy's own ``options`` (a mapping). Pass the result
    as ``past_key_values`` to ``model(...)`` or ``model.generate(...)``; it is one sequence of
    calls' state, like a ``DynamicCache``, and ``reset()`` empties it.

    Raises ``UnsupportedModelError`` (a ValueError) for a model whose attention kvcache cannot
    compute or that does not go through transformers' AttentionInterface, and ``ValueError`` for
    bad options. A failed call leaves the model as it was.
    """
    g = geometry.read(model)
    try:
        kv = make_kvcache(geometry.as_kvcache_model(g, model), policy, cache_length=cache_length, batch_size=batch_size,
                          prompt_length=prompt_length, allocation=allocation, head_budgets=head_budgets,
                          reserve=reserve, block=block, options=options)
    except ValueError as e:
        if g.inv_freqs is None and "inv_freq" in str(e):
            raise UnsupportedModelError(f"{e}; {type(model).__name__} has none kvcache can use: {g.rope_note}") from None
        raise
    use_kvcache_attention(model)
    return HFCache(kv)


def use_kvcache_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to ``attn_implementation="kvcache"``, or raise ``UnsupportedModelError``
    if its attention modules do not call the registered attention function."""
    config = model.config
    if config._attn_implementation != NAME:
        try:
            model.set_attn_implementation(NAME)
        except (ValueError, ImportError) as e:
            raise UnsupportedModelError(f"{type(model).__name__} cannot use attn_implementation={NAME!r}: {e}") from None
    if config._attn_implementation != NAME:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface (it computes "
            f"attention itself), so it cannot use attn_implementation={NAME!r}; kvcache.hf supports models whose "
            "attention modules call the registered attention function, as Llama, Qwen, Mistral, Phi-3 and Gemma do"
        )
