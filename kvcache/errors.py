"""Exceptions raised by kvcache. Each message says what was wrong and what to do about it."""


class KVCacheError(Exception):
    """Base class of every error kvcache raises on purpose."""


class CheckpointError(KVCacheError):
    """A checkpoint directory is missing a file, holds a broken file, or describes an unsupported model."""


class CapacityError(KVCacheError):
    """A chunk would not fit into a cache that cannot evict."""


class MemoryBudgetError(KVCacheError, MemoryError):
    """What a call would allocate exceeds the memory its device has available (checked before
    anything is allocated)."""


class KVCacheWarning(UserWarning):
    """A kvcache warning: the call runs, but the result may not be what was meant."""


class GenerationError(KVCacheError):
    """Generation failed after it had produced tokens.

    ``tokens`` holds the new tokens made so far, in the shape ``generate`` returns (one list per
    prompt, or a single list for a single prompt); ``__cause__`` is the error that stopped it.
    """

    def __init__(self, message: str, tokens: list) -> None:
        super().__init__(message)
        self.tokens = tokens
