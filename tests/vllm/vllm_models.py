"""Tiny random checkpoints and kvcache's own greedy tokens for the kvcache.vllm tests.

vLLM's CPU attention kernel takes head sizes of 32 and more and blocks that are multiples of 32,
so these models are wider than conftest's. Not a conftest: ``tests/conftest.py`` is imported as
the module ``conftest``.
"""

from __future__ import annotations

from pathlib import Path

import torch

import kvcache

VOCAB = 128
BLOCK = 32  # vLLM's block size in these tests, and kvcache's block= to compare with
# KV memory of one block of these models: 2 layers x keys and values x 2 heads x 32 x 4 bytes.
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 32 * 4
# Prompts of several lengths: shorter than the budget, and several blocks longer than it.
PROMPT_LENGTHS = (40, 100, 150, 230)
NEW_TOKENS = 40
# Each policy with options that evict within the prompts above.
POLICIES = {
    "window": {"policy": "window", "cache_length": 64},
    "sink": {"policy": "sink", "cache_length": 96, "sinks": 32},
    "snapkv": {"policy": "snapkv", "cache_length": 96, "window": 16},
    "snapkv-tova": {"policy": "snapkv", "cache_length": 96, "window": 16, "fallback": "tova"},
    "tova": {"policy": "tova", "cache_length": 96},
    "knorm": {"policy": "knorm", "cache_length": 96},
    "keydiff": {"policy": "keydiff", "cache_length": 96},
    "h2o": {"policy": "h2o", "cache_length": 96, "recent": 32},
    "expected_attention": {"policy": "expected_attention", "cache_length": 96},
}


def build(name: str, path: Path) -> Path:
    """Save a tiny random ``name`` ("llama", "qwen2", "qwen3" or "gemma3") model into ``path``:
    fp32, two layers (Gemma 3: three, the middle one global), 4 query and 2 K/V heads of size 32;
    queries and keys scaled up so that attention is
    peaked and what a policy evicts shows in the tokens."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    # Gemma 3: two sliding layers of window 32 (one vLLM block) around a global one, three layers.
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=32, rope_parameters=rope,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        # Gemma 2: soft-capped scores (a cap that bends them) and logits, sliding and global layers.
        "gemma2": lambda: transformers.Gemma2Config(
            **{**common, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=32, query_pre_attn_scalar=32,
            sliding_window=32, attn_logit_softcapping=5.0, final_logit_softcapping=10.0),
    }
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs[name](), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w): its weights are offsets from one.
                p.copy_((0.0 if name.startswith("gemma") else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in pname:
                # Gemma multiplies them by sqrt(hidden): inputs of order one.
                scale = 128**-0.5 if name.startswith("gemma") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            else:
                scale = 2.0 if pname.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return path


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def prompt_calls(config: dict | None, length: int, chunks: list[int] | None) -> list[int]:
    """Where kvcache's own model ends its calls over a prompt of ``length`` tokens to mean what
    the plugin means in vLLM (kvcache.vllm.rule): window and sink, one token per call; a scoring
    policy, the chunks vLLM computed (``chunks``: where they ended; None, the prompt in one
    call); no policy (dense), the prompt in one call."""
    if config is not None and config["policy"] in ("window", "sink"):
        return list(range(1, length + 1))
    return list(chunks) if chunks else [length]


def kvcache_tokens(path: Path, config: dict | None, prompt_ids: list[list[int]], new_tokens: int,
                   chunks: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy tokens of kvcache's own model for each prompt alone, through ``config``'s policy
    with block=BLOCK (a dense cache for None): the prompt in the calls ``prompt_calls`` gives
    (``chunks[i]``: where vLLM's chunks of prompt i ended), then one token per call."""
    model = kvcache.load(path)
    out = []
    with torch.no_grad():
        for i, ids in enumerate(prompt_ids):
            if config is None:
                cache = kvcache.make_cache(model, "dense", cache_length=len(ids) + new_tokens)
            else:
                options = {k: v for k, v in config.items() if k not in ("policy", "cache_length")}
                if config["policy"] == "sink":
                    options.setdefault("positions", "absolute")
                cache = kvcache.make_cache(model, config["policy"], cache_length=config["cache_length"],
                                           block=BLOCK, options=options)
            start = 0
            for end in prompt_calls(config, len(ids), chunks[i] if chunks else None):
                logits = model(torch.tensor([ids[start:end]]), cache)
                start = end
            tokens = []
            for _ in range(new_tokens):
                tokens.append(int(logits[0, -1].argmax()))
                logits = model(torch.tensor([[tokens[-1]]]), cache)
            out.append(tokens)
    return out
