"""Loading checkpoints and tokenizers: what loads, what loads equal, and every way it can fail.

Models whose outputs are compared load on the test device; the failures are of files and need none
(they load on the CPU, the default)."""

from __future__ import annotations

import copy
import json
import shutil
import warnings

import pytest
import torch
from conftest import DEVICE, HF_ATOL, build_hf_model, max_diff, random_ids
from safetensors.torch import load_file, save_file

import kvcache
import kvcache.checkpoints.load


@pytest.fixture
def ckpt_copy(llama_ckpt, tmp_path):
    """A private, writable copy of the untied llama checkpoint."""
    path = tmp_path / "ckpt"
    shutil.copytree(llama_ckpt.path, path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# --- what loads --------------------------------------------------------------------------------


def test_load_gives_eval_fp32_cpu_model(llama_ckpt):
    model = kvcache.load(llama_ckpt.path)
    assert isinstance(model, kvcache.Transformer)
    assert not model.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert not any(p.is_meta for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32 and not model.inv_freq.is_meta
    hf = {name: t.cpu() for name, t in llama_ckpt.hf.state_dict().items()}  # on the test device
    for name, t in model.state_dict().items():
        assert torch.equal(t, hf[name if name.startswith("lm_head") else f"model.{name}"]), name
    assert model.config.model_type == "llama"
    assert model.config.eos_token_id == 2


def test_load_accepts_str_path_and_device(llama_ckpt):
    model = kvcache.load(str(llama_ckpt.path), device="cpu")
    assert model.embed_tokens.weight.device.type == "cpu"


def test_load_expands_a_home_path(llama_ckpt, monkeypatch):
    """"~/..." names the home directory, as the docs write it, even where no shell expanded it."""
    monkeypatch.setenv("HOME", str(llama_ckpt.path.parent))
    model = kvcache.load(f"~/{llama_ckpt.path.name}")
    want = kvcache.load(llama_ckpt.path)
    assert torch.equal(model.embed_tokens.weight, want.embed_tokens.weight)


def test_default_dtype_on_cpu_is_float32(tmp_path, llama_ckpt):
    """A half-precision checkpoint loads in float32 on CPU (the CLI's default too), unless asked."""
    half = tmp_path / "half"
    copy.deepcopy(llama_ckpt.hf).to(torch.float16).save_pretrained(half)  # the shared model stays as it is
    assert kvcache.load(half).embed_tokens.weight.dtype == torch.float32
    assert kvcache.load(half, dtype=torch.float16).embed_tokens.weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_casts_weights(llama_ckpt, dtype):
    ref = kvcache.load(llama_ckpt.path, dtype=torch.float32, device=DEVICE)
    model = kvcache.load(llama_ckpt.path, dtype=dtype, device=DEVICE)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype == dtype, name
        assert torch.equal(p, q.to(dtype)), name
    assert model.inv_freq.dtype == torch.float32  # rotary angles stay in fp32
    ids = random_ids(16, batch=2, seed=1)
    with torch.no_grad():
        out = model(ids)
        assert out.dtype == dtype
        assert max_diff(out, ref(ids)) <= HF_ATOL[dtype]


def test_tied_checkpoint_has_no_lm_head_and_loads_tied(checkpoint_factory):
    ckpt = checkpoint_factory("qwen2")
    assert "lm_head.weight" not in load_file(ckpt.path / "model.safetensors")
    model = kvcache.load(ckpt.path, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_sharded_checkpoint_equals_unsharded(llama_ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    llama_ckpt.hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a, b = kvcache.load(sharded, device=DEVICE), kvcache.load(llama_ckpt.path, device=DEVICE)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = random_ids(10, seed=2)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_transformers4_rope_layout(checkpoint_factory, tmp_path):
    """transformers 4.x wrote ``rope_theta`` and ``rope_scaling`` instead of ``rope_parameters``."""
    ckpt = checkpoint_factory("llama_linear")
    path = tmp_path / "v4"
    shutil.copytree(ckpt.path, path)
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    assert params["rope_type"] == "linear"
    cfg["rope_theta"] = params["rope_theta"]
    cfg["rope_scaling"] = {"type": "linear", "factor": params["factor"]}
    (path / "config.json").write_text(json.dumps(cfg))
    model = kvcache.load(path, device=DEVICE)
    assert model.config.rope.rope_type == "linear" and model.config.rope.factor == params["factor"]
    assert model.config.rope.theta == params["rope_theta"]
    ids = random_ids(20, seed=3)
    with torch.no_grad():
        assert max_diff(model(ids), ckpt.hf(ids).logits) <= HF_ATOL[torch.float32]


def test_unexpected_tensor_warns_but_loads(ckpt_copy):
    _rewrite_weights(ckpt_copy, lambda t: t.__setitem__("model.extra.weight", torch.zeros(3)))
    with pytest.warns(UserWarning, match="extra.weight"):
        kvcache.load(ckpt_copy)


def test_rotary_inv_freq_is_ignored_silently(ckpt_copy):
    _rewrite_weights(ckpt_copy, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvcache.load(ckpt_copy)


# --- what fails --------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    with pytest.raises(kvcache.CheckpointError, match="does not exist"):
        kvcache.load(tmp_path / "nowhere")


def test_file_instead_of_directory(ckpt_copy):
    with pytest.raises(kvcache.CheckpointError, match="neither a directory nor a GGUF file"):
        kvcache.load(ckpt_copy / "config.json")


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(kvcache.CheckpointError, match="config.json"):
        kvcache.load(ckpt_copy)


def test_invalid_config_json(ckpt_copy):
    (ckpt_copy / "config.json").write_text("{not json")
    with pytest.raises(kvcache.CheckpointError, match="not valid JSON"):
        kvcache.load(ckpt_copy)


def test_config_missing_field(ckpt_copy):
    _edit_config(ckpt_copy, hidden_size=None)
    with pytest.raises(kvcache.CheckpointError, match="hidden_size"):
        kvcache.load(ckpt_copy)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ({"num_hidden_layers": 0}, "num_layers"),
    ],
)
def test_config_invalid_values(ckpt_copy, changes, match):
    _edit_config(ckpt_copy, **changes)
    with pytest.raises(kvcache.CheckpointError, match=match):
        kvcache.load(ckpt_copy)


def test_unsupported_model_type_lists_families(ckpt_copy):
    _edit_config(ckpt_copy, model_type="gpt2")
    with pytest.raises(kvcache.CheckpointError, match="gpt2") as err:
        kvcache.load(ckpt_copy)
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert family in str(err.value)


def test_fused_projections_are_split_and_checked(checkpoint_factory, tmp_path):
    """Phi-3's qkv_proj and gate_up_proj load as kvcache's separate projections, no tensor left
    over; a fused tensor of the wrong row count is named."""
    path = tmp_path / "phi3"
    shutil.copytree(checkpoint_factory("phi3").path, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ignoring unexpected tensors"
        kvcache.load(path)
    _rewrite_weights(path, lambda t: t.__setitem__("model.layers.1.self_attn.qkv_proj.weight",
                                                   t["model.layers.1.self_attn.qkv_proj.weight"][:-1]))
    with pytest.raises(kvcache.CheckpointError, match="qkv_proj.weight.* rows, but config.json implies 64 \\+ 32 \\+ 32"):
        kvcache.load(path)


def test_missing_weights(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(kvcache.CheckpointError, match="model.safetensors"):
        kvcache.load(ckpt_copy)


def test_pytorch_bin_only_is_rejected(ckpt_copy):
    (ckpt_copy / "model.safetensors").rename(ckpt_copy / "pytorch_model.bin")
    with pytest.raises(kvcache.CheckpointError, match="safetensors"):
        kvcache.load(ckpt_copy)


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0001])
def test_truncated_weights(ckpt_copy, keep):
    file = ckpt_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: max(1, int(len(data) * keep))])
    with pytest.raises(kvcache.CheckpointError, match="corrupt or truncated"):
        kvcache.load(ckpt_copy)


@pytest.mark.parametrize("where", ["header_size", "header_json"])
def test_corrupt_weights(ckpt_copy, where):
    file = ckpt_copy / "model.safetensors"
    data = bytearray(file.read_bytes())
    if where == "header_size":
        data[:8] = b"\xff" * 8  # an absurd header length
    else:
        data[8:40] = b"\x00\x01garbage\x02" * 3 + b"\xfe\xfd"  # the JSON header is no longer JSON
    file.write_bytes(bytes(data))
    with pytest.raises(kvcache.CheckpointError, match="corrupt or truncated"):
        kvcache.load(ckpt_copy)


def test_missing_tensor(ckpt_copy):
    _rewrite_weights(ckpt_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(kvcache.CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        kvcache.load(ckpt_copy)


def test_missing_untied_lm_head(ckpt_copy):
    _rewrite_weights(ckpt_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(kvcache.CheckpointError, match="'lm_head.weight'"):
        kvcache.load(ckpt_copy)


def test_misshaped_tensor(ckpt_copy):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)  # config implies (32, 64)

    _rewrite_weights(ckpt_copy, edit)
    with pytest.raises(kvcache.CheckpointError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        kvcache.load(ckpt_copy)


def test_sharded_missing_shard_and_bad_index(llama_ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    llama_ckpt.hf.save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    moved = shard.rename(tmp_path / shard.name)
    with pytest.raises(kvcache.CheckpointError, match=shard.name):
        kvcache.load(sharded)
    moved.rename(shard)
    kvcache.load(sharded)  # restored: loads again
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(kvcache.CheckpointError, match="index"):
        kvcache.load(sharded)
    index.write_text("{")
    with pytest.raises(kvcache.CheckpointError, match="index"):
        kvcache.load(sharded)


def test_no_source_without_bundled_model(monkeypatch, tmp_path):
    monkeypatch.setattr(kvcache.checkpoints.load, "BUNDLED_MODEL", tmp_path / "not_installed")
    with pytest.raises(kvcache.CheckpointError, match="bundled"):
        kvcache.load()
    with pytest.raises(kvcache.CheckpointError, match="bundled"):
        kvcache.load_tokenizer()


def test_no_source_uses_bundled_model(monkeypatch, llama_ckpt):
    monkeypatch.setattr(kvcache.checkpoints.load, "BUNDLED_MODEL", llama_ckpt.path)
    model = kvcache.load()
    assert torch.equal(model.embed_tokens.weight, kvcache.load(llama_ckpt.path).embed_tokens.weight)


def test_checkpoint_error_is_a_kvcache_error():
    assert issubclass(kvcache.CheckpointError, kvcache.KVCacheError)


def test_family_seed_independence():
    """Sanity check of the fixtures: distinct families get distinct random weights."""
    a = build_hf_model("llama").model.embed_tokens.weight
    b = build_hf_model("mistral").model.embed_tokens.weight
    assert not torch.equal(a, b)


# --- tokenizers --------------------------------------------------------------------------------

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "it was the best of times, it was the worst of times",
    "a stitch in time saves nine; the early bird catches the worm",
]


def _bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    return tok


def test_tokenizer_round_trip(tmp_path):
    _bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False},
        "chat_template": "{{ messages }}",
    }))
    tok = kvcache.load_tokenizer(tmp_path)
    assert isinstance(tok, kvcache.Tokenizer)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.chat_template == "{{ messages }}"
    assert tok.vocab_size > 256
    for text in TEXT + ["unseen words: zebra, Ünïcödé ✓ 123", " leading space"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
    # merges were learnt: a training sentence takes fewer tokens than bytes
    assert len(tok.encode(TEXT[0])) < len(TEXT[0].encode())


def test_word_level_tokenizer_without_config(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "kv": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = kvcache.load_tokenizer(tmp_path)
    assert tok.bos_token_id is None and tok.eos_token_id is None and tok.chat_template is None
    assert tok.encode("hello kv world") == [1, 3, 2]
    assert tok.encode("hello mars") == [1, 0]
    assert tok.decode([1, 3, 2]) == "hello kv world"
    assert tok.vocab_size == 4


def test_tokenizer_missing_file(ckpt_copy):
    with pytest.raises(kvcache.CheckpointError, match="tokenizer.json"):
        kvcache.load_tokenizer(ckpt_copy)
    with pytest.raises(kvcache.CheckpointError):
        kvcache.load_tokenizer(ckpt_copy / "absent")


def test_tokenizer_corrupt_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(kvcache.CheckpointError, match="tokenizer.json"):
        kvcache.load_tokenizer(tmp_path)
    _bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(kvcache.CheckpointError, match="tokenizer_config.json"):
        kvcache.load_tokenizer(tmp_path)
