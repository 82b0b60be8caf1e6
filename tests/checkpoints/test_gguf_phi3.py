"""Phi-3 GGUF files (kvcache/checkpoints/gguf.py) as llama.cpp writes them: the fused query/key/value and
gate/up projections as single tensors, a SentencePiece vocabulary with a space prefix, and, for
Phi-3-128k and Phi-3.5, longrope's factors as tensors. The file loads to the model its Hugging
Face twin loads to, and to transformers' own reading of it where transformers reads it."""

from __future__ import annotations

import pytest
import torch
from conftest import _COMMON, DEVICE, HF_ATOL, atol, max_diff, random_ids
from gguf_util import sentencepiece_vocab, write_phi3_gguf
from test_gguf_gemma3 import PIECES

import kvcache

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def _file(root, longrope: bool):
    tokens, types = sentencepiece_vocab(PIECES)
    extra = {}
    if longrope:
        gen = torch.Generator().manual_seed(1)
        extra = dict(original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
            "long_factor": (1 + 8 * torch.rand(8, generator=gen)).tolist()})
    config = transformers.Phi3Config(**{**_COMMON, "vocab_size": len(tokens), "max_position_embeddings": 128,
                                        "bos_token_id": 2, "eos_token_id": 1}, tie_word_embeddings=False, **extra)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(root / "hf")
    write_phi3_gguf(root / "model.gguf", model, tokens, types)
    return root / "hf", root / "model.gguf"


def test_the_file_reads_as_its_twin_and_as_transformers_reads_it(tmp_path):
    directory, file = _file(tmp_path, longrope=False)
    ours, twin = kvcache.load(file, device=DEVICE), kvcache.load(directory, device=DEVICE)
    assert ours.config == twin.config
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name,
                                                               dtype=torch.float32).to(DEVICE).eval()
    ids = random_ids(40, batch=2, seed=1)
    with torch.inference_mode():
        got = ours(ids)
        assert max_diff(got, twin(ids)) <= atol("same")
        assert max_diff(got, theirs(ids).logits) <= HF_ATOL[torch.float32]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    assert kvcache.load_tokenizer(file).encode(TEXT) == tokenizer.encode(TEXT)


def test_a_longrope_file_reads_as_its_twin(tmp_path):
    directory, file = _file(tmp_path, longrope=True)
    ours, twin = kvcache.load(file, device=DEVICE), kvcache.load(directory, device=DEVICE)
    assert ours.config.rope.rope_type == "longrope"
    assert ours.config.rope.magnitude == pytest.approx(twin.config.rope.magnitude)
    ids = random_ids(48, seed=2)  # past the original context of 32: the long factors
    with torch.inference_mode():
        assert max_diff(ours(ids), twin(ids)) <= atol("cache")
