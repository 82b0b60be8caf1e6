"""gpt-oss GGUF files (kvcache/checkpoints/gguf.py) as llama.cpp writes them: experts stacked with gate and up
apart, MXFP4 expert weights, the sink logits, YaRN as metadata, and the o200k split of its
byte-level BPE tokenizer. The file loads to the model its Hugging Face twin loads to."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import DEVICE, random_ids
from gguf_util import write_gpt_oss_gguf

import kvcache
from kvcache.checkpoints.load import BUNDLED_MODEL

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_gpt_oss")
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128}
    config = transformers.GptOssConfig(
        vocab_size=kvcache.load_tokenizer().vocab_size, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=1024, rope_parameters=rope, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1)
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.3 if p.dim() == 1 else p.shape[-2] ** -0.5) * torch.randn(p.shape, generator=gen)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    model.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, root / "hf" / name)
    write_gpt_oss_gguf(root / "model.gguf", model, BUNDLED_MODEL)
    write_gpt_oss_gguf(root / "mxfp4.gguf", model, BUNDLED_MODEL, expert_type="MXFP4")
    return root


def test_the_file_reads_as_its_twin(twin):
    ours, hf = kvcache.load(twin / "model.gguf", device=DEVICE), kvcache.load(twin / "hf", device=DEVICE)
    # (llama.cpp rounds the ends of YaRN's ramp to whole dimensions: truncate, which the twin's
    # transformers default, True, also is.)
    assert ours.config == hf.config
    assert [layer.window for layer in ours.config.layers] == [8, None]
    for name, p in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[name], p), name


def test_mxfp4_experts_are_the_files_codes(twin):
    """The MXFP4 blocks dequantize to the model's experts, laid back out as the checkpoint's."""
    from gguf import GGUFReader, quants

    ours = kvcache.load(twin / "mxfp4.gguf", device=DEVICE)
    tensors = {t.name: t for t in GGUFReader(str(twin / "mxfp4.gguf")).tensors}
    gate = torch.from_numpy(quants.dequantize(tensors["blk.1.ffn_gate_exps.weight"].data, tensors[
        "blk.1.ffn_gate_exps.weight"].tensor_type).copy())
    gate_up = ours.layers[1].mlp.experts.gate_up_proj
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
    assert torch.equal(gate_up[..., ::2].cpu(), gate.reshape(gate_up.shape[0], -1, gate_up.shape[1]).transpose(1, 2))
    ids = random_ids(20, seed=1)
    with torch.inference_mode():
        assert torch.isfinite(ours(ids)).all()


def test_the_o200k_split_keeps_case_runs_and_three_digits(twin):
    tokenizer = kvcache.load_tokenizer(twin / "model.gguf")
    words = [w for w, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str("HelloWorld 12345 it's\n\n  x")]
    alphabet_space = "\u0120"  # the byte-level alphabet's space
    assert words == ["Hello", "World", f"{alphabet_space}", "123", "45", f"{alphabet_space}it's", "\u010a\u010a",
                     alphabet_space, f"{alphabet_space}x"]

