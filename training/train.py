"""Train the bundled reference model: a small grouped-query Llama on public-domain English mixed
with synthetic long-context retrieval tasks, so that retrieval depends on attention to far tokens.

    python training/train.py --minutes 60 --out data/reference_model

Reproducible: fixed seeds, the corpus and tokenizer from corpus.py and tokenizer.py. Writes a
Hugging Face-format checkpoint (config.json, model.safetensors, tokenizer files) and the loss
curve (loss.jsonl) to --out, checkpointing every few minutes so a run that is cut short still
leaves a model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import kvcache
from kvcache.config import ModelConfig, RopeConfig

from kvcache.tasks import TaskMaker, read_texts

ARCH = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=4096, model_type="llama", bos_token_id=0, eos_token_id=1,
)


def hf_config(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope.theta,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "torch_dtype": "float16",
    }


def save(model: kvcache.Transformer, out: Path, tokenizer_dir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        key = name if name.startswith("lm_head") else f"model.{name}"
        state[key] = t.detach().to(torch.float16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.config), indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)


def lr_at(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--tokenizer", default="data/tokenizer")
    parser.add_argument("--out", default="data/reference_model")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock training budget")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--retrieval-share", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    tokenizer = kvcache.load_tokenizer(args.tokenizer)
    tasks = TaskMaker(read_texts(Path(args.corpus) / "train", tokenizer), tokenizer, seed=args.seed)
    cfg = ModelConfig(rope=RopeConfig(theta=10000.0), **ARCH)
    model = kvcache.Transformer(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "loss.jsonl", "w")
    budget = args.minutes * 60
    start = time.time()
    # Step count is unknown in advance (a time budget); plan the schedule for an estimate and
    # stretch it once the step time is known.
    planned = 10_000
    step = 0
    last_save = start
    while time.time() - start < budget:
        # Context length grows over training: short sequences teach the language cheaply, long
        # ones teach retrieval across the whole 2k window.
        frac = (time.time() - start) / budget
        length = random.choice([256, 512] if frac < 0.3 else [512, 1024] if frac < 0.6 else [1024, 2048])
        rows = max(1, args.batch_tokens // length)
        ids, weights = tasks.batch(rows, length, args.retrieval_share)
        lr = lr_at(step, planned, args.lr)
        for g in optimizer.param_groups:
            g["lr"] = lr
        logits = model(ids[:, :-1])
        loss_tok = F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), ids[:, 1:].reshape(-1), reduction="none")
        w = weights[:, 1:].reshape(-1)
        loss = (loss_tok * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        elapsed = time.time() - start
        if step == 20:
            planned = int(budget / (elapsed / step) * 0.95)
        if step % 10 == 0:
            record = {"step": step, "seconds": round(elapsed, 1), "length": length, "lr": lr,
                      "loss": round(loss.item(), 4), "lm_loss": round(loss_tok.mean().item(), 4)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(record, file=sys.stderr, flush=True)
        if time.time() - last_save > 300:
            save(model, out, Path(args.tokenizer))
            last_save = time.time()
    save(model, out, Path(args.tokenizer))
    (out / "training.json").write_text(json.dumps({
        "steps": step, "seconds": round(time.time() - start), "batch_tokens": args.batch_tokens,
        "lr": args.lr, "retrieval_share": args.retrieval_share, "seed": args.seed, "arch": ARCH,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
