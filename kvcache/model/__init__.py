"""The transformer and the parts a model family picks through its config: ModelConfig and each
layer's geometry (config.py), rotary embeddings (rope.py), norms (norm.py), gated MLPs (mlp.py),
gpt-oss's mixture of experts (experts.py), what a family does to attention scores (scores.py),
and the model that assembles them (transformer.py). Each part is tested against transformers' own
module (tests/model); nothing here knows about caches beyond the one attention call a block makes.
This ``__init__`` imports nothing, so that the attention kernels can read ``scores`` without
loading the model."""
