"""Exceptions raised by kvcache. Each message says what was wrong and what to do about it."""


class KVCacheError(Exception):
    """Base class of every error kvcache raises on purpose."""


class CheckpointError(KVCacheError):
    """A checkpoint directory is missing a file, holds a broken file, or describes an unsupported model."""


class CapacityError(KVCacheError):
    """A chunk would not fit into a cache that cannot evict."""
