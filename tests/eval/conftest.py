"""Fixtures of the evaluation tests: the bundled tokenizer (a real BPE, so that RULER's lengths
are measured as they would be) and a tiny random Llama that uses it."""

from __future__ import annotations

import shutil

import pytest
import torch

import kvcache
from kvcache.checkpoint import BUNDLED_MODEL


@pytest.fixture(scope="session")
def tokenizer():
    return kvcache.load_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("eval_tiny") / "model"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, path / name)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=kvcache.load_tokenizer().vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return kvcache.load(tiny_dir, dtype=torch.float32)
