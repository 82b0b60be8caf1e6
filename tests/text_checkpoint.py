"""A tiny random Llama with a tiny byte-level BPE tokenizer, saved as a checkpoint directory, for
the tests that go through text: the command line, chat templates, stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u2603"]


def build_text_checkpoint(
    path: Path,
    *,
    special_tokens: tuple[str, ...] = (),
    tokenizer_config: dict | None = None,
    generation_config: dict | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> Path:
    """Write tokenizer.json, config.json, model.safetensors (and the optional JSON files) to ``path``."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 10, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    # save_pretrained writes transformers' own generation_config.json; the tests decide what it holds.
    (path / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path
