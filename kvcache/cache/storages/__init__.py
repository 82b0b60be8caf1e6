"""Storages: how the bits of the tokens a policy keeps are held, one file each, found by the
registry in ``cache/storage.py`` (nothing else lists them).

A storage class sets ``layout`` (the prefix of its names: ``full``, ``token8``, ``kivi4/32``),
``describe`` (what a name of it means, for ``kvcache.storages()``) and ``build`` (the storage
for a parsed name), and lists its ``buffers()``; ``cache/storage.py`` has the contract every
storage keeps. Adding a storage is one file here, plus its kernel if attention reads it packed.
"""
