"""The bundled reference model: loads with no arguments, matches transformers, is trained.

These are the only tests on trained weights. They pin what the model card claims at a scale a
test can afford: the checkpoint is a valid Hugging Face checkpoint of the size promised, its
weights predict held-out text, the dense cache is exact on them and an evicting one measurably
is not, and the model retrieves a passkey at 2048 tokens where a small window does not.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CACHE_ATOL, DEVICE, HF_ATOL

import kvcache
from kvcache.checkpoints.load import BUNDLED_MODEL
from kvcache.cli import main
from kvcache.eval.tasks import TaskMaker, read_texts

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def reference():
    model = kvcache.load(dtype=torch.float32, device=DEVICE)
    tokenizer = kvcache.load_tokenizer()
    return model, tokenizer


@pytest.fixture(scope="module")
def filler(reference):
    _, tokenizer = reference
    return read_texts(None, tokenizer).to(DEVICE)


def test_bundled_files_and_size():
    names = {p.name for p in BUNDLED_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    total = sum(p.stat().st_size for p in BUNDLED_MODEL.iterdir())
    assert total <= 25e6, f"the bundled model is {total / 1e6:.1f} MB, over the 25 MB budget"


def test_load_with_no_source_is_the_bundled_grouped_query_llama(reference):
    model, tokenizer = reference
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention
    assert tokenizer.vocab_size == cfg.vocab_size
    assert tokenizer.bos_token_id == cfg.bos_token_id and tokenizer.eos_token_id == cfg.eos_token_id
    text = "It is a truth universally acknowledged"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_transformers_loads_the_same_model(reference):
    model, tokenizer = reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval().to(DEVICE)
    ids = torch.tensor([tokenizer.encode("It is a truth universally acknowledged, that a single man")], device=DEVICE)
    with torch.no_grad():
        expected = hf(ids).logits
    assert (model(ids) - expected).abs().max().item() <= HF_ATOL[torch.float32]
    hf_tok = transformers.AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    assert hf_tok("Emma Woodhouse, handsome", add_special_tokens=True)["input_ids"] == tokenizer.encode(
        "Emma Woodhouse, handsome"
    )


def test_the_weights_are_trained(reference, filler):
    model, _ = reference
    ids = filler[None, :512]
    with torch.no_grad():
        logits = model(ids)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    # A random model of this vocabulary scores about exp(9) ~ 8000; the trained one about 60-90.
    assert math.exp(nll) < 200


def test_dense_cache_equals_the_plain_forward_on_trained_weights(reference, filler):
    # In float64, where the different summation orders of the chunked and the whole forward
    # round away (in float32 the trained logits, up to about 15, differ by about 1e-5).
    model = kvcache.load(dtype=torch.float64, device=DEVICE)
    ids = filler[None, :300]
    with torch.no_grad():
        expected = model(ids)
        cache = kvcache.make_cache(model, "dense", cache_length=300)
        got = torch.cat([model(ids[:, i : i + 37], cache) for i in range(0, 300, 37)], dim=1)
    assert got.dtype == torch.float64
    assert (got - expected).abs().max().item() <= CACHE_ATOL[torch.float64]


def test_a_small_sink_cache_drifts_from_dense_and_a_covering_one_does_not(reference, filler):
    model, _ = reference
    ids = filler[None, :256]
    with torch.no_grad():
        dense = model(ids).log_softmax(-1)

        def kl(cache_length: int) -> float:
            cache = kvcache.make_cache(model, "sink", cache_length=cache_length, options={"sinks": 4})
            got = torch.cat([model(ids[:, i : i + 32], cache) for i in range(0, 256, 32)], dim=1).log_softmax(-1)
            return (dense.exp() * (dense - got)).sum(-1).mean().item()

    assert kl(256) < 1e-6
    assert kl(32) > 1e-2


def test_cli_generates_from_the_bundled_model_by_default(capsys):
    assert main(["generate", "It is a truth universally acknowledged", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "tok/s" in err


def test_dense_retrieves_passkeys_at_2048_tokens(reference, filler):
    """The bundled model retrieves a passkey hidden anywhere in 2048 tokens (its card reports 45
    of 48, teacher-forced; here greedy, all 5 of these depths, at least 4 required), and a 256-slot window,
    which holds none of a needle at depth 0-0.75, loses those."""
    model, tokenizer = reference
    tasks = TaskMaker(filler, tokenizer, seed=11)
    prompts = [tasks.passkey(2048, depth=d) for d in (0.0, 0.25, 0.5, 0.75, 1.0)]

    def retrieved(prompts, cache_length: int | None) -> int:
        hits = 0
        for prompt, answer in prompts:
            cache = None if cache_length is None else kvcache.make_cache(model, "window", cache_length=cache_length)
            out = kvcache.generate(model, prompt, max_new_tokens=len(answer), cache=cache, stop_tokens=())
            hits += out == answer
        return hits

    assert retrieved(prompts, None) >= 4
    # Depth 1.0 puts the needle right before the question, inside even a small window.
    assert retrieved(prompts[:4], 256) == 0
