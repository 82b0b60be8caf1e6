"""Shared fixtures: tiny random Hugging Face checkpoints of every supported family.

Every checkpoint is built from a transformers config, its parameters perturbed so that biases and
norm weights are far from their (zero / one) initial values, saved with ``save_pretrained`` into a
session temporary directory and loaded back with kvcache. Nothing is downloaded.

The device. ``KVCACHE_TEST_DEVICE`` (``cpu``, the default, or ``cuda`` / ``cuda:N``) names the device
every test builds its models, ids and caches on: through the ``device`` fixture, ``DEVICE``,
``random_ids`` and the model fixtures here. A device that is not there fails the run at start-up
(it never falls back to the CPU). Tests that are CPU-only by nature (the command line, gloo
process groups, Ray's workers, vLLM's CPU build, a resident-set measurement) carry
``pytest.mark.cpu_only`` with the reason, and run on the CPU whatever the variable says;
``-m "not cpu_only"`` leaves them out.

CUDA's layouts on the CPU. ``KVCACHE_TEST_LAYOUT`` (``cuda``, the default, or ``native``) says how
the attention kernel's results come back when the suite runs on the CPU. With ``cuda``,
``F.scaled_dot_product_attention`` returns what CUDA's flash and memory-efficient kernels return: a
(B, H, T, D) view of a (B, T, H, D) buffer (a ``.view`` that merges heads with tokens or groups
fails, as it does on a GPU), and, for a query that sees no key, the mean of the values instead of
the CPU kernel's zeros. ``native`` leaves the CPU kernel as it is. On CUDA the kernels are real.

Tolerances. ``TOLERANCES`` is the one per-dtype table of the largest max-abs difference each kind
of comparison accepts; ``atol(kind, dtype)`` reads it.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("KVCACHE_TEST_DEVICE", "cpu").startswith("cpu"):
    # Triton's kernels (the CUDA decode kernel, tests/kernels/test_triton.py) run in its
    # interpreter on CPU tensors. Set before anything imports triton: torch's compiler does, and
    # triton reads the variable once.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import kvcache

# The models are tiny: intra-op threads only add synchronisation, and on a shared 2-core machine
# they make every forward an order of magnitude slower.
torch.set_num_threads(1)

# A run under another CPU instruction set (ATEN_CPU_CAPABILITY=default, as .ci/run does) compiles
# into its own inductor cache: torch 2.13's FX graph cache hands it the code compiled for the
# machine's own vector width, which then fails to build without that width's headers.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}"

VOCAB = 128
HIDDEN = 64

# ---- the test device -------------------------------------------------------------------------------

DEVICE_VARIABLE = "KVCACHE_TEST_DEVICE"


def _device_from_environment() -> tuple[torch.device, str | None]:
    """(the device KVCACHE_TEST_DEVICE names, None) or (cpu, why the value cannot be used).

    The error is raised by ``pytest_configure``, so that a bad value stops the run before
    anything is collected instead of failing inside whichever module imports this one first."""
    value = os.environ.get(DEVICE_VARIABLE, "").strip() or "cpu"
    try:
        device = torch.device(value)
    except RuntimeError:
        return torch.device("cpu"), f"{DEVICE_VARIABLE}={value!r} is not a device: use cpu or cuda (or cuda:N)"
    if device.type == "cpu":
        return torch.device("cpu"), None
    if device.type != "cuda":
        return torch.device("cpu"), f"{DEVICE_VARIABLE}={value!r}: the suite runs on cpu or cuda (or cuda:N) only"
    if not torch.cuda.is_available():
        return torch.device("cpu"), (
            f"{DEVICE_VARIABLE}={value!r} but torch {torch.__version__} sees no CUDA device here "
            f"(torch.version.cuda is {torch.version.cuda}); run on a machine with a GPU and a CUDA build of "
            f"torch, or unset {DEVICE_VARIABLE} to run on the CPU"
        )
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        return torch.device("cpu"), (
            f"{DEVICE_VARIABLE}={value!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return torch.device("cuda", index), None


DEVICE, _DEVICE_ERROR = _device_from_environment()


def pytest_configure(config):
    if _DEVICE_ERROR is not None:
        raise pytest.UsageError(_DEVICE_ERROR)
    config.addinivalue_line(
        "markers", f"cpu_only(reason): runs on the CPU whatever {DEVICE_VARIABLE} says (the reason says why)"
    )


def pytest_report_header(config):
    layout = "native" if DEVICE.type != "cpu" else _layout_from_environment()
    return f"kvcache test device: {DEVICE} ({DEVICE_VARIABLE}); attention layout: {layout} ({LAYOUT_VARIABLE})"


# ---- the order: the longest modules first ----------------------------------------------------------------

# The modules with the longest tests or module fixtures (processes of their own, a Ray cluster, a
# 135M-parameter model read twice, inductor compiles), run before all others, in this order.
# Under pytest-xdist's worksteal scheduling (README's test command) a worker that runs dry takes
# the last tests of another worker's queue: with the long ones first, a run ends on short tests
# instead of one worker waiting for a long test that started last, and a long module runs from its
# start on one worker, so its module fixtures are set up once.
LONGEST_FIRST = ["eval/test_ray_sweep.py", "checkpoints/test_gemma3_270m.py", "checkpoints/test_smollm2.py",
                 "train/test_train_shard.py", "generation/test_compiled.py", "runtime/test_memory.py",
                 "prefix/test_store_crash.py", "cache/test_state_machine.py", "cache/policies/test_h2o.py"]


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def position(item) -> int:
        try:
            return rank.get(item.path.relative_to(root).as_posix(), len(rank))
        except ValueError:  # a test outside this directory
            return len(rank)

    items.sort(key=position)  # stable: the order within a module, and among the rest, is kept


# ---- CUDA's attention layout on the CPU ----------------------------------------------------------------

LAYOUT_VARIABLE = "KVCACHE_TEST_LAYOUT"


def _layout_from_environment() -> str:
    value = os.environ.get(LAYOUT_VARIABLE, "").strip() or "cuda"
    if value not in ("cuda", "native"):
        raise pytest.UsageError(f"{LAYOUT_VARIABLE}={value!r}: use cuda (the default) or native")
    return value


_native_sdpa = torch.nn.functional.scaled_dot_product_attention


def sdpa_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` with its result laid out as CUDA's kernels lay it out.

    query (B, Hq, T, D), key/value (B, Hkv, S, D) -> (B, Hq, T, D) strided as a transposed
    (B, T, Hq, D) buffer. A query whose boolean mask row hides every key gets the mean of the
    values (uniform weights), as CUDA's memory-efficient kernel gives it, where the CPU's gives 0.
    No data-dependent branch: the step stays traceable by torch.compile."""
    out = _native_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=scale, enable_gqa=enable_gqa)
    if out.dim() != 4:
        return out
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        blind = ~attn_mask.any(-1, keepdim=True)  # (B or 1, H or 1, T, 1)
        mean = value.mean(-2, keepdim=True)  # (B, Hkv, 1, D)
        mean = mean.repeat_interleave(out.shape[1] // value.shape[1], dim=1)
        out = torch.where(blind, mean.to(out.dtype), out)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.fixture(scope="session", autouse=True)
def cuda_layout():
    """Installs ``sdpa_as_on_cuda`` for the session when the suite runs on the CPU under
    ``KVCACHE_TEST_LAYOUT=cuda`` (the default); yields the layout in force."""
    layout = "native" if DEVICE.type != "cpu" else _layout_from_environment()
    if layout == "native":
        yield layout
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_as_on_cuda)
        yield layout


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device tests build their models, ids and caches on (``KVCACHE_TEST_DEVICE``)."""
    return DEVICE


# ---- tolerances ---------------------------------------------------------------------------------------

# Largest max-abs difference accepted, per dtype and kind of comparison:
#   same   the same computation arranged differently (a row alone or in a batch, blocked or whole,
#          the last position or all of them);
#   cache  a cached (chunked, blocked) computation against kvcache's own plain one (the forward,
#          an attention reference): only the matmul shapes differ, so this is tighter than hf;
#   hf     kvcache against transformers (same weights, same input): the two implementations order
#          their floating-point operations differently.
#   compiled  a captured decode step (torch.compile) against the eager one: the compiler fuses and
#          reorders the step's operations.
#   precision  a computation in this dtype against the same computation in float32 (the same
#          weights, cast): this dtype's rounding, whichever kernels (eager, compiled, any CPU
#          instruction set) do the rounding.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"cache": 1e-10},
    torch.float32: {"same": 1e-6, "cache": 1e-5, "hf": 1e-4, "compiled": 1e-4},
    torch.bfloat16: {"cache": 1.5e-1, "hf": 1.5e-1, "precision": 1e-1},
    torch.float16: {"cache": 2e-2, "hf": 2e-2, "precision": 1.5e-2},
}


def atol(kind: str, dtype: torch.dtype = torch.float32) -> float:
    """The tolerance of comparison ``kind`` (same, cache, hf) in ``dtype``, from TOLERANCES."""
    try:
        return TOLERANCES[dtype][kind]
    except KeyError:
        raise KeyError(f"TOLERANCES has no {kind!r} tolerance for {dtype}; add one to tests/conftest.py") from None


HF_ATOL = {dtype: row["hf"] for dtype, row in TOLERANCES.items() if "hf" in row}
CACHE_ATOL = {dtype: row["cache"] for dtype, row in TOLERANCES.items() if "cache" in row}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA, two query heads per K/V head
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


# Hybrid families: sliding layers of window 8 among global ones, so that chunks cross the window.
WINDOW = 8


def _config(name: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    if name == "llama":
        return LlamaConfig(**_COMMON, tie_word_embeddings=False)
    if name == "llama_llama3":
        # original_max_position_embeddings=32 puts the head_dim=16 frequencies in all three bands
        # of the llama3 recipe (kept, interpolated, slowed down).
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return LlamaConfig(**_COMMON, rope_parameters=rope, tie_word_embeddings=True)
    if name == "llama_linear":
        rope = {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
        return LlamaConfig(**_COMMON, rope_parameters=rope, attention_bias=True, mlp_bias=True,
                           tie_word_embeddings=False)
    if name == "qwen2":
        return Qwen2Config(**_COMMON, tie_word_embeddings=True)
    if name == "qwen3":
        # head_dim 24 != hidden_size / heads = 16
        return Qwen3Config(**_COMMON, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           tie_word_embeddings=False)
    if name == "mistral":
        return MistralConfig(**_COMMON, sliding_window=None, tie_word_embeddings=False)
    if name == "mistral_window":
        return MistralConfig(**_COMMON, sliding_window=8, tie_word_embeddings=False)
    if name == "gemma3":
        # Sliding, sliding, global; each kind its own rotary (the global one linearly scaled, as on
        # Gemma 3 4B+); query_pre_attn_scalar unlike head_dim, so the attention scale is the model's.
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}
        return Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                                sliding_window=WINDOW, rope_parameters=rope, tie_word_embeddings=True,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if name == "qwen2_window":
        # Layers from max_window_layers on slide.
        return Qwen2Config(**{**_COMMON, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1, tie_word_embeddings=False)
    if name == "qwen3_window":
        return Qwen3Config(**{**_COMMON, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=2, tie_word_embeddings=True)
    if name == "phi3":
        # Fused query/key/value and gate/up projections in the checkpoint.
        return Phi3Config(**_COMMON, tie_word_embeddings=False)
    if name == "gemma2":
        # Soft caps small enough that tanh bends scores and logits of order 1 (Gemma 2's are 50
        # and 30); sliding and global layers alternate, as in Gemma 2.
        return Gemma2Config(**{**_COMMON, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                            sliding_window=WINDOW, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                            tie_word_embeddings=True)
    if name == "gpt_oss":
        # Learned sink logits, YaRN (original_max_position_embeddings=512 with factor 8 puts head_dim=16's
        # frequencies on both sides of the ramp), 4 experts of which 2 per token, window 8.
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 512}
        return GptOssConfig(**{**_COMMON, "num_hidden_layers": 3, "intermediate_size": 48}, head_dim=16,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, rope_parameters=rope,
                            tie_word_embeddings=False)
    if name == "phi3_longrope":
        # Phi-3.5's rotary: short factors within the original context (32 tokens here, so that
        # prompts cross it), long ones past it; factor 4 from max_position_embeddings / 32.
        gen = torch.Generator().manual_seed(3)
        short = (1 + torch.rand(8, generator=gen)).tolist()
        long = (1 + 8 * torch.rand(8, generator=gen)).tolist()
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
        return Phi3Config(**{**_COMMON, "max_position_embeddings": 128}, original_max_position_embeddings=32,
                          rope_parameters=rope, tie_word_embeddings=False)
    if name == "llama_long":
        # One layer, for the 16k-token memory test.
        return LlamaConfig(**{**_COMMON, "num_hidden_layers": 1, "max_position_embeddings": 32768})
    raise KeyError(name)


FAMILIES = ["llama", "llama_llama3", "llama_linear", "qwen2", "qwen3", "mistral", "mistral_window", "phi3",
            "gemma3", "qwen2_window", "qwen3_window"]
# Families whose layers are not all alike: sliding layers among global ones.
HYBRID = ["gemma3", "qwen2_window", "qwen3_window"]
TIED = {"llama_llama3", "qwen2", "gemma3", "qwen3_window", "gemma2"}
# Families whose attention scores are not a plain softmax (model/scores.py): soft-capped (Gemma 2),
# with learned sink logits (gpt-oss, also a mixture of experts with YaRN); hybrid as well.
SCORED = ["gemma2", "gpt_oss"]


def build_hf_model(name: str, seed: int | None = None):
    """A tiny random transformers causal LM of family ``name``, fp32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    if seed is None:
        seed = zlib.crc32(name.encode()) % 10_000
    torch.manual_seed(seed)
    cfg = _config(name)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # Gemma's norms scale by (1 + w): their weights are stored as offsets from one.
        one = 0.0 if cfg.model_type.startswith("gemma") else 1.0
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                # Norm scales around 1 but clearly not 1.
                p.copy_(one + 0.3 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in pname:
                # Tied embeddings double as the head: scale them so logits stay of order 1.
                scale = HIDDEN ** -0.5 if cfg.tie_word_embeddings else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            else:
                # Roughly variance-preserving projections so logits are of order 1.
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@dataclass
class Checkpoint:
    name: str
    path: Path
    hf: object  # the transformers model the checkpoint was saved from


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """``factory(name)`` -> Checkpoint, built once per session per family."""
    built: dict[str, Checkpoint] = {}

    def factory(name: str) -> Checkpoint:
        if name not in built:
            hf = build_hf_model(name)
            path = tmp_path_factory.mktemp(f"ckpt_{name}")
            hf.save_pretrained(path)
            built[name] = Checkpoint(name, path, hf.to(DEVICE))
        return built[name]

    return factory


@pytest.fixture(scope="session")
def model_factory(checkpoint_factory):
    """``factory(name)`` -> kvcache Transformer (fp32) on the test device, loaded once per session per family."""
    loaded: dict[str, kvcache.Transformer] = {}

    def factory(name: str) -> kvcache.Transformer:
        if name not in loaded:
            loaded[name] = kvcache.load(checkpoint_factory(name).path, dtype=torch.float32, device=DEVICE)
        return loaded[name]

    return factory


@pytest.fixture(scope="session")
def llama_ckpt(checkpoint_factory) -> Checkpoint:
    return checkpoint_factory("llama")


@pytest.fixture(scope="session")
def llama(model_factory) -> kvcache.Transformer:
    """The default test model. Tests must not leave a ``layer_hook`` set on it."""
    return model_factory("llama")


@pytest.fixture
def clean_hook(llama):
    yield llama
    llama.layer_hook = None


def random_ids(n: int, batch: int = 1, seed: int = 0, low: int = 3, device: torch.device | str = DEVICE) -> torch.Tensor:
    """(batch, n) random token ids avoiding the special ids 0..2, on ``device`` (the test device).

    Drawn on the CPU, so a seed gives the same ids on every device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, n), generator=g).to(device)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def one_parse_of_each_gguf_file():
    """gguf's reader parses a file's metadata (a vocabulary of 49k to 262k tokens) in Python, seconds
    each time: transformers parses it three times (the model's config, its weights, the
    tokenizer) and kvcache twice (model, tokenizer). In a module that uses this fixture every
    reading of a file shares one read-only parse (a write through it would raise), and gguf's
    tensor-name map, which transformers rebuilds for every module of the model, is built once.
    What each library makes of the parsed fields and tensors is its own, as without the sharing."""
    import functools

    gguf = pytest.importorskip("gguf")
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


# --- evaluation (tests/eval): the bundled tokenizer, a real BPE, so that RULER's lengths are
# measured as they would be, and a tiny random Llama that uses it ------------------------------


@pytest.fixture(scope="session")
def tokenizer():
    return kvcache.load_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    import shutil

    from kvcache.checkpoints.load import BUNDLED_MODEL

    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("eval_tiny") / "model"
    path.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, path / name)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=kvcache.load_tokenizer().vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return kvcache.load(tiny_dir, dtype=torch.float32, device=DEVICE)
