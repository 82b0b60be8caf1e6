"""``python -m kvcache``: the ``kvcache`` command."""

from .cli import main

raise SystemExit(main())
