"""4-bit weights (kvcache/quant/int4_linear.py): the codes a min-max group of 32 gives back, the
kernel and the dequantizing path against an explicit reference, and a model loaded with
``weights="int4"`` against itself cached and uncached and against its float weights."""

from __future__ import annotations

import pytest
import torch
from conftest import atol, max_diff, random_ids
from torch import nn

import kvcache
from kvcache.quant.int4_linear import GROUP, KERNEL_MAX_ROWS, Int4Linear

pytestmark = pytest.mark.cpu_only("int4 weights run on torch's CPU int4 kernel only")

# One bfloat16 rounding of a number, relative: the kernel rounds its inputs and its result.
BF16_REL = 2.0**-8


def q4_1_weights(out_features: int, in_features: int, seed: int = 0):
    """(W, codes): weights made as GGUF's Q4_1 makes them, W = d q + m per group of 32 input
    channels with fp16 d and m, every group holding codes 0 and 15 (its min and max)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP
    q = torch.randint(0, 16, (out_features, groups, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, groups, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-8 * d - torch.rand(out_features, groups, 1, generator=g) * 0.01).half().float()
    return (d * q + m).reshape(out_features, in_features), q.reshape(out_features, in_features)


def linear_of(w: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(w)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def codes_of(layer: Int4Linear) -> torch.Tensor:
    return torch.stack((layer.codes & 15, layer.codes >> 4), -1).reshape(layer.out_features, -1)


def test_q4_1_groups_come_back_as_their_own_codes():
    w, q = q4_1_weights(48, 96)
    layer = Int4Linear.quantize(linear_of(w))
    assert torch.equal(codes_of(layer), q.to(torch.uint8))
    # The rest of the error is the bfloat16 rounding of each group's scale and zero point:
    # |q - 8| <= 8 scale roundings and one zero rounding, each within 2^-8 relative.
    d = (w.reshape(48, -1, GROUP).amax(-1) - w.reshape(48, -1, GROUP).amin(-1)) / 15
    zero = w.reshape(48, -1, GROUP).amin(-1) + 8 * d
    bound = (8 * d + zero.abs()) * BF16_REL
    err = (layer.dequantize() - w).abs().reshape(48, -1, GROUP).amax(-1)
    assert (err <= bound * 1.01 + 1e-9).all()


def test_any_weights_come_back_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    layer = Int4Linear.quantize(linear_of(w))
    groups = w.reshape(32, -1, GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (layer.dequantize() - w).reshape(32, -1, GROUP).abs().amax(-1)
    rounding = (8 * step + groups.abs().amax(-1)) * 2.0**-8
    assert (err <= step / 2 + rounding).all()


def test_a_constant_group_comes_back_exactly():
    w = torch.full((16, 32), 0.375)
    assert torch.equal(Int4Linear.quantize(linear_of(w)).dequantize(), w)


@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_is_the_product_with_the_dequantized_weights(rows, bias):
    """A decode step's rows (the kernel) in bfloat16: inputs and result rounded once each; a
    prefill's rows in their own dtype, float32 here."""
    g = torch.Generator().manual_seed(rows)
    w, _ = q4_1_weights(64, 128, seed=rows)
    b = torch.randn(64, generator=g) if bias else None
    layer = Int4Linear.quantize(linear_of(w, b))
    x = torch.randn(2, rows, 128, generator=g)
    y = layer(x)
    assert y.shape == (2, rows, 64) and y.dtype == torch.float32
    kernel = rows <= KERNEL_MAX_ROWS
    inputs = (x.to(torch.bfloat16) if kernel else x).double()
    ref = inputs @ layer.dequantize().double().T
    scale = inputs.abs() @ layer.dequantize().double().abs().T
    if b is not None:
        ref = ref + b.double()
    bound = 2 * BF16_REL * scale + 1e-6 if kernel else atol("same") * scale.amax()
    assert ((y.double() - ref).abs() <= bound).all()


def test_a_row_alone_and_in_a_prefill_agree_to_bfloat16s_rounding():
    """The kernel (a decode step's rows) and the dequantizing path (a prefill's) multiply the
    same weights; they differ by the kernel's bfloat16 rounding of the inputs and the result."""
    w, _ = q4_1_weights(64, 128, seed=3)
    layer = Int4Linear.quantize(linear_of(w))
    x = torch.randn(KERNEL_MAX_ROWS * 4, 128, generator=torch.Generator().manual_seed(3))
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert max_diff(together, alone) <= 2 * BF16_REL * together.abs().max().item()


def test_bad_layers_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        Int4Linear.quantize(nn.Linear(48, 32))
    with pytest.raises(ValueError, match="out_features of 16"):
        Int4Linear.quantize(nn.Linear(64, 24))
    with pytest.raises(ValueError, match="on the CPU"):
        Int4Linear.quantize(nn.Linear(64, 32, device="meta"))


def test_a_layer_moved_off_the_cpu_says_so():
    layer = Int4Linear.quantize(nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match="CPU only"):
        layer(torch.randn(1, 64, device="meta"))
    with pytest.raises(RuntimeError, match="CPU only"):
        layer.to("meta")(torch.randn(1, 64))


def test_state_dict_round_trip_rebuilds_the_kernel_codes():
    w, _ = q4_1_weights(32, 64, seed=5)
    a = Int4Linear.quantize(linear_of(w))
    b = Int4Linear.quantize(linear_of(torch.zeros(32, 64)))
    assert set(a.state_dict()) == {"codes", "scales_zeros"}
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 64)
    assert torch.equal(a(x), b(x))


# ---- a model with int4 weights -------------------------------------------------------------------


def as_q4_1(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded as GGUF's Q4_1 rounds it: per group of 32 input channels, fp16 d = range / 15
    and m = min, codes round((w - m) / d) in [0, 15]; the weights d q + m."""
    groups = w.reshape(w.shape[0], -1, GROUP)
    m = groups.amin(-1, keepdim=True).half().float()
    d = ((groups.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((groups - m) / d).clamp(0, 15)
    return (d * q + m).reshape(w.shape)


@pytest.fixture(scope="module")
def int4_pair(tmp_path_factory):
    """The llama test model with its projections rounded as a Q4_1 file holds them, loaded with
    float weights and with ``weights="int4"``."""
    from conftest import build_hf_model

    hf = build_hf_model("llama")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("proj.weight"):
                p.copy_(as_q4_1(p))
    path = tmp_path_factory.mktemp("int4_llama")
    hf.save_pretrained(path)
    return kvcache.load(path, device="cpu"), kvcache.load(path, device="cpu", weights="int4")


def test_load_replaces_the_projections_only(int4_pair):
    full, packed = int4_pair
    kinds = {type(m).__name__ for m in packed.modules()}
    assert "Int4Linear" in kinds
    assert all(type(m) is not nn.Linear for m in packed.layers.modules())
    assert type(packed.lm_head) is nn.Linear
    assert torch.equal(packed.embed_tokens.weight, full.embed_tokens.weight)


def test_int4_logits_stay_near_the_float_model(int4_pair):
    full, packed = int4_pair
    ids = random_ids(48, device="cpu")
    with torch.inference_mode():
        a, b = full(ids, None), packed(ids, None)
    # Weights on a Q4_1 grid come back as their own codes: what is left is bfloat16's rounding
    # of the projections' inputs, outputs, scales and zero points.
    assert max_diff(a, b) <= atol("precision", torch.bfloat16)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.9


def test_int4_cached_decode_matches_its_own_forward(int4_pair):
    _, packed = int4_pair
    ids = random_ids(40, device="cpu")
    cache = kvcache.make_cache(packed, "dense", cache_length=64)
    with torch.inference_mode():
        whole = packed(ids, None)
        steps = [packed(ids[:, :24], cache)]
        steps += [packed(ids[:, t : t + 1], cache) for t in range(24, 40)]
    assert max_diff(torch.cat(steps, 1), whole) <= atol("cache", torch.bfloat16)


# Inductor compiles this model's step for the CPU (int4 weights are a CPU path) on every test
# device: past the GPU suite's 60 s a test when 13 other workers share the cores.
@pytest.mark.timeout(300)
def test_int4_generate_eager_and_compiled_agree(int4_pair):
    _, packed = int4_pair
    ids = random_ids(20, device="cpu").tolist()
    eager = kvcache.generate(packed, ids, max_new_tokens=6)
    assert kvcache.generate(packed, ids, max_new_tokens=6, compile=True) == eager


def test_load_refuses_bad_weights_before_reading(tmp_path):
    with pytest.raises(ValueError, match="weights='int3'"):
        kvcache.load(tmp_path / "missing", weights="int3")
    with pytest.raises(ValueError, match="CPU only"):
        kvcache.load(tmp_path / "missing", weights="int4", device="meta")


@pytest.mark.parametrize("shape", [(64, 64), (192, 576), (1536, 576)])
def test_rows_in_whole_kernel_blocks_hold_their_codes_once(shape):
    """Every kernel layout torch has (its vector widths' blocks of 16 to 64 rows) is read back
    from the kernel's copy for row counts that fill whole blocks: 4 bits a weight, not 8."""
    w, q = q4_1_weights(*shape, seed=7)
    layer = Int4Linear.quantize(linear_of(w))
    held = sum(b.numel() for b in layer.buffers() if b.dtype == torch.uint8)
    assert held == shape[0] * shape[1] // 2
    assert torch.equal(codes_of(layer), q.to(torch.uint8))


def test_rows_in_part_of_a_block_keep_a_portable_copy_and_the_same_numbers():
    w, q = q4_1_weights(48, 64, seed=8)
    layer = Int4Linear.quantize(linear_of(w))
    assert torch.equal(codes_of(layer), q.to(torch.uint8))
    x = torch.randn(3, 64)
    ref = x.to(torch.bfloat16).double() @ layer.dequantize().double().T
    assert (layer(x).double() - ref).abs().max() <= 2 * BF16_REL * ref.abs().max()
    many = torch.randn(KERNEL_MAX_ROWS + 1, 64)
    assert max_diff(layer(many), many @ layer.dequantize().T) <= atol("same")


def test_a_model_with_a_projection_the_kernel_cannot_take_is_refused_by_name(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj is 48 -> 48"):
        kvcache.load(tmp_path, weights="int4")
