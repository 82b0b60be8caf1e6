"""The prefix store: cached prompt prefixes kept by bytes and saved to a directory (store.py,
docs/prefix.md)."""
