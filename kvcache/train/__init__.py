"""Long-context fine-tuning through a bounded KV cache.

``chunked_loss`` (chunked.py, with the layer caches of its two passes in replay.py) is the
differentiable chunked forward; the fine-tuning loop and its pieces live beside it, and shard.py
runs both data-parallel under ``torch.distributed`` (DDP or FSDP2).
"""

from .chunked import chunked_loss

__all__ = ["chunked_loss"]
