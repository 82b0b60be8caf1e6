"""GGUF checkpoints (kvcache/checkpoints/gguf.py): a file written as llama.cpp writes one loads to the model its
Hugging Face twin loads to, for Llama and Qwen2 (bit for bit in float32), and to transformers'
own reading of the file within the kvcache-vs-transformers tolerance for every block type read;
its tokenizer gives the ids the tokenizer it was written from gives; `kvcache convert` writes a
checkpoint both load; broken files are refused with CheckpointError."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import DEVICE, HF_ATOL, max_diff, random_ids
from gguf_util import write_gguf

import kvcache
from kvcache.checkpoints.gguf import TENSOR_TYPES
from kvcache.checkpoints.load import BUNDLED_MODEL
from kvcache.cli import main
from kvcache.errors import CheckpointError

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. 1234 567, naïve café — “quoted” text\n\n  with  spaces\tand tabs.")


def _hf_model(family: str):
    """A tiny random model of the bundled tokenizer's vocabulary, K-quant sized (rows of 256)."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    torch.manual_seed(3)
    config = config_class(vocab_size=kvcache.load_tokenizer().vocab_size, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=family == "qwen2",
                          rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                          bos_token_id=0, eos_token_id=1)  # the bundled tokenizer's
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def twin(request, tmp_path_factory):
    """(Hugging Face directory, GGUF file in float32) of one tiny model, the tokenizer the bundled one."""
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    model = _hf_model(request.param)
    model.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, root / "hf" / name)
    write_gguf(root / "model.gguf", model, BUNDLED_MODEL, arch=request.param, chat_template=TEMPLATE)
    return root / "hf", root / "model.gguf"


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """A Llama GGUF file whose 2-D weights take every type read, in turn, and its directory."""
    root = tmp_path_factory.mktemp("gguf_types")
    model = _hf_model("llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, root / name)
    given = write_gguf(root / "model.gguf", model, BUNDLED_MODEL, types=TENSOR_TYPES[1:])
    assert set(given) == set(TENSOR_TYPES[1:])
    return root / "model.gguf"


def test_a_gguf_file_loads_to_its_hugging_face_twin_bit_for_bit(twin):
    """Names, the Q/K row order (Llama) and biases (Qwen2) are undone exactly: float32 weights
    give the directory's logits bit for bit, cached in chunks as well as in one pass."""
    directory, file = twin
    ours, reference = kvcache.load(file, device=DEVICE), kvcache.load(directory, device=DEVICE)
    assert ours.config == reference.config
    ids = random_ids(40, batch=2, seed=1)
    with torch.inference_mode():
        assert torch.equal(ours(ids), reference(ids))
        cache = kvcache.make_cache(ours, "dense", cache_length=40, batch_size=2)
        chunked = torch.cat([ours(ids[:, :17], cache), ours(ids[:, 17:], cache)], dim=1)
    assert max_diff(chunked, reference(ids)) <= 1e-5


def test_every_block_type_equals_transformers_reading_of_the_file(every_type):
    """F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K weights, read by kvcache and by
    transformers (``from_pretrained(gguf_file=...)``), give the same logits."""
    ours = kvcache.load(every_type, device=DEVICE)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        every_type.parent, gguf_file=every_type.name, dtype=torch.float32).to(DEVICE).eval()
    ids = random_ids(48, seed=2)
    with torch.inference_mode():
        got, want = ours(ids), theirs(ids).logits
    assert max_diff(got, want) <= HF_ATOL[torch.float32] * max(1.0, want.abs().max().item())


def test_the_tokenizer_gives_the_ids_transformers_gives(twin):
    """Of the file (its vocabulary, merges, special tokens and split: GPT-2's for the Llama file,
    Qwen2's for the Qwen2 one), as transformers' GGUF tokenizer; the Llama file's as the
    bundled tokenizer it was written from."""
    directory, file = twin
    ours, bundled = kvcache.load_tokenizer(file), kvcache.load_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    assert ours.encode(TEXT, add_special_tokens=False) == theirs.encode(TEXT, add_special_tokens=False)
    words = [w for w, _ in ours.backend.pre_tokenizer.pre_tokenize_str("1234 abc")]
    if "qwen2" in str(file):
        assert words == ["1", "2", "3", "4", "Ġabc"]  # Qwen2's split keeps digits apart
        return
    assert words == ["1234", "Ġabc"]
    assert ours.encode(TEXT) == bundled.encode(TEXT)
    assert ours.decode(ours.encode(TEXT)) == bundled.decode(bundled.encode(TEXT))
    assert (ours.bos_token_id, ours.eos_token_id) == (bundled.bos_token_id, bundled.eos_token_id)
    chat = [{"role": "user", "content": "Where is the pass key?"}, {"role": "assistant", "content": "Here."}]
    rendered = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == bundled.encode(rendered, add_special_tokens=False)


def test_convert_writes_a_checkpoint_kvcache_and_transformers_load(twin, tmp_path):
    directory, file = twin
    assert main(["convert", str(file), str(tmp_path / "out")]) == 0
    converted = kvcache.load(tmp_path / "out", device=DEVICE)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).to(DEVICE)
    ids = random_ids(24, seed=3)
    with torch.inference_mode():
        want = kvcache.load(directory, device=DEVICE)(ids)
        assert torch.equal(converted(ids), want)
        assert max_diff(theirs(ids).logits, want) <= HF_ATOL[torch.float32]
    tokenizer = kvcache.load_tokenizer(tmp_path / "out")
    assert tokenizer.encode(TEXT) == kvcache.load_tokenizer(file).encode(TEXT)
    # transformers picks its tokenizer class by model_type (Qwen2's split for a Qwen2 directory),
    # and the converted tokenizer.json gives what that class gives.
    assert tokenizer.chat_template == TEMPLATE
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tokenizer.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT, add_special_tokens=False)


def test_a_model_fine_tuned_from_a_gguf_file_saves_as_a_checkpoint(twin, tmp_path):
    """What `kvcache finetune --model FILE.gguf` writes: the file's config and tokenizer beside the weights."""
    from kvcache.train.save import read_config, save_checkpoint

    _, file = twin
    model = kvcache.load(file)
    save_checkpoint(model, tmp_path / "tuned", read_config(file), source=file)
    ids = random_ids(16, seed=5, device="cpu")
    with torch.inference_mode():
        assert torch.equal(kvcache.load(tmp_path / "tuned")(ids), model(ids))
    assert kvcache.load_tokenizer(tmp_path / "tuned").encode(TEXT) == kvcache.load_tokenizer(file).encode(TEXT)


def test_convert_refuses_to_overwrite_and_leaves_nothing_on_failure(twin, tmp_path):
    _, file = twin
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    assert main(["convert", str(file), str(tmp_path / "taken")]) == 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "taken"]


# ----- files that are refused ------------------------------------------------------------------


def test_a_truncated_file_is_refused_without_reading_past_its_end(twin, tmp_path):
    _, file = twin
    data = file.read_bytes()
    for keep in (len(data) - 1000, len(data) // 2, 64):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(CheckpointError, match="truncated|corrupt"):
            kvcache.load(cut)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(CheckpointError, match="neither a directory nor a GGUF file"):
        kvcache.load(other)
    with pytest.raises(CheckpointError, match="does not exist"):
        kvcache.load(tmp_path / "missing.gguf")


def test_an_unsupported_architecture_type_or_tokenizer_is_named(tmp_path):
    import gguf
    import numpy as np

    def write(name: str, arch: str, tensor_type: str, tokenizer: str) -> object:
        writer = gguf.GGUFWriter(str(tmp_path / name), arch)
        writer.add_block_count(1)
        writer.add_embedding_length(32)
        writer.add_feed_forward_length(64)
        writer.add_head_count(2)
        writer.add_tokenizer_model(tokenizer)
        writer.add_token_list(["a", "b"])
        writer.add_token_merges(["a b"])
        qtype = gguf.GGMLQuantizationType[tensor_type]
        data = np.zeros((2, 32 if tensor_type == "F32" else 256), dtype=np.float32)  # (K-quant blocks: 256)
        writer.add_tensor("token_embd.weight", data if tensor_type == "F32" else gguf.quants.quantize(data, qtype),
                          raw_dtype=None if tensor_type == "F32" else qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / name

    with pytest.raises(CheckpointError, match="'falcon' model"):
        kvcache.load(write("a.gguf", "falcon", "F32", "gpt2"))
    with pytest.raises(CheckpointError, match="type TQ1_0"):
        kvcache.load(write("b.gguf", "llama", "TQ1_0", "gpt2"))
    # A merge whose result is no token (tokenizers would abort the process on it).
    with pytest.raises(CheckpointError, match="merge 'a b'"):
        kvcache.load_tokenizer(write("d.gguf", "llama", "F32", "gpt2"))
    with pytest.raises(CheckpointError, match="'llama' tokenizer"):
        kvcache.load_tokenizer(write("c.gguf", "llama", "F32", "llama"))
