"""The small parts a model family picks through its config (``ModelConfig.norm``, ``block``,
``activation``): norms, gated MLPs, decoder blocks. Each is tested against transformers' own module
(tests/parts). ``model.py`` assembles them; nothing here knows about caches beyond the one
attention call a block makes."""
