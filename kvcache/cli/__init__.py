"""The ``kvcache`` command line: ``kvcache generate``, ``kvcache eval``, ``kvcache finetune``,
``kvcache drift``, ``kvcache policies``, ``kvcache convert`` and ``kvcache fetch``, one module
each (its ``add_parser`` and ``run``), assembled and dispatched by main.py; args.py has the
argument types and flags they share.

Generated text goes to stdout (or one JSON object per prompt with ``--json``); progress, the
summary and errors go to stderr, so the output can be piped.
"""

from .main import main

__all__ = ["main"]
