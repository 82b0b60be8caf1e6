"""Train the bundled reference model: a small grouped-query Llama on public-domain English mixed
with synthetic long-context retrieval tasks, so that retrieval depends on attention to far tokens.

    python training/train.py --steps 3600 --out data/reference_model

Reproducible: fixed seeds, the corpus and tokenizer from corpus.py and tokenizer.py. Writes a
Hugging Face-format checkpoint (config.json, model.safetensors, tokenizer files), the loss curve
(loss.jsonl: training records every few steps, held-out records every ``--eval-every`` seconds)
and training.json to --out, checkpointing as it goes so a run that is cut short still leaves a
model. ``--resume DIR`` continues from a checkpoint with a fresh schedule (fine-tuning at long
context, say).

On CUDA the forward and backward run under bfloat16 autocast with float32 master weights; on CPU
everything is float32.
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
from kvcache.model.config import ModelConfig, RopeConfig
from kvcache.eval.tasks import TaskMaker, read_texts

ARCH = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=4096, model_type="llama", bos_token_id=0, eos_token_id=1,
)
ROPE_THETA = 10000.0
# Context-length curriculum: (fraction of the steps at which a phase starts, lengths drawn from).
# Short sequences teach the language cheaply, long ones teach retrieval across the whole window;
# every phase keeps some shorter lengths so short contexts are not forgotten.
CURRICULUM = ((0.0, (256, 512)), (0.2, (512, 1024)), (0.45, (1024, 2048)), (0.7, (1024, 2048, 2048)))


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
        state[key] = t.detach().to("cpu", torch.float16).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.config), indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def random_repeats(rows: int, length: int, vocab_size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (rows, length + 1) of random tokens in which a random span occurs twice, at random
    offsets and distances; loss only on the second copy (after its first token), where nothing
    but attention to the first copy predicts the next token. (A fixed distance would be solved
    by position alone, and so, it turned out, is a row that repeats one block periodically: a
    model trained on those copied them and nothing else.)"""
    ids = torch.randint(3, vocab_size, (rows, length + 1))
    ids[:, 0] = 0
    weights = torch.zeros(rows, length + 1)
    for r in range(rows):
        span = rng.randrange(8, max(9, length // 3))
        first = rng.randrange(1, length + 1 - 2 * span)
        second = rng.randrange(first + span, length + 2 - span)
        ids[r, second : second + span] = ids[r, first : first + span]
        weights[r, second + 1 : second + span] = 1.0
    return ids, weights


def row_lengths(text: str) -> tuple[int, ...]:
    """``--lengths``: comma-separated row lengths, each at least 32 (the shortest repeat task)."""
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(lengths) < 32:
        raise argparse.ArgumentTypeError(f"row lengths must be >= 32, got {text!r}")
    return lengths


def lengths_at(frac: float) -> tuple[int, ...]:
    return [lengths for start, lengths in CURRICULUM if frac >= start][-1]


class HeldOut:
    """Fixed evaluation batches: held-out text windows and passkeys at every depth.

    Passkey accuracy is scored teacher-forced: a key counts as retrieved when every answer token
    is the argmax, which is exactly when greedy decoding would produce it.
    """

    def __init__(self, texts: torch.Tensor, filler: torch.Tensor, tokenizer, length: int, n: int,
                 device: torch.device) -> None:
        starts = torch.linspace(0, len(texts) - length - 2, n).long()
        self.text = torch.stack([texts[s : s + length + 1] for s in starts]).to(device)
        tasks = TaskMaker(filler, tokenizer, seed=1234)
        rows, spans = [], []
        for i in range(n):
            prompt, answer = tasks.passkey(length, depth=i / max(1, n - 1))
            seq = prompt + answer
            seq = seq + [0] * (length + 1 - len(seq))
            rows.append(seq[: length + 1])
            spans.append((len(prompt), len(prompt) + len(answer)))
        self.passkey = torch.tensor(rows, device=device)
        self.spans = spans

    @torch.no_grad()
    def __call__(self, model: kvcache.Transformer, autocast) -> dict[str, float]:
        model.eval()
        with autocast():
            logits = model(self.text[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.text[:, 1:].flatten()).item()
            pred = model(self.passkey[:, :-1]).argmax(-1)
        hits = sum(bool((pred[r, a - 1 : b - 1] == self.passkey[r, a:b]).all()) for r, (a, b) in enumerate(self.spans))
        model.train()
        return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 2),
                "passkey": hits / len(self.spans)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--tokenizer", default="data/tokenizer")
    parser.add_argument("--out", default="data/reference_model")
    parser.add_argument("--resume", metavar="DIR", help="start from this checkpoint's weights")
    parser.add_argument("--steps", type=int, default=3600, help="optimizer steps (the schedule's length)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-clock cap: stop (and save) early if the steps take longer")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--retrieval-share", type=float, default=0.45,
                        help="fraction of rows that are passkey or lookup tasks")
    parser.add_argument("--repeat-share", type=float, default=0.25,
                        help="fraction of rows that repeat a span of text (an induction task)")
    parser.add_argument("--random-share", type=float, default=0.0,
                        help="fraction of rows that are random tokens with one span repeated (the rows of "
                             "--induction), mixed with the other rows")
    parser.add_argument("--induction", action="store_true",
                        help="train only on random token rows with one span repeated, of 128 tokens or "
                             "--lengths (forms the copying mechanism retrieval needs; a short stage of its own)")
    parser.add_argument("--induction-vocab", type=int, default=512,
                        help="random tokens of the induction stage are drawn from ids below this")
    fixed = parser.add_mutually_exclusive_group()
    fixed.add_argument("--long-only", action="store_true", help="skip the curriculum: 2048 tokens throughout")
    fixed.add_argument("--lengths", type=row_lengths,
                       help="skip the curriculum: draw each step's length from these (comma-separated, >= 32)")
    parser.add_argument("--eval-length", type=int, default=2048, help="tokens per held-out window and passkey")
    parser.add_argument("--eval-every", type=float, default=600.0, help="seconds between held-out evaluations")
    parser.add_argument("--eval-rows", type=int, default=16, help="held-out text windows and passkeys")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (CPU training only)")
    args = parser.parse_args()
    if not 0 <= args.random_share < 1 or args.retrieval_share + args.repeat_share + args.random_share > 1:
        parser.error("--retrieval-share, --repeat-share and --random-share must be non-negative and sum to at most 1 "
                     f"(--random-share below 1), got {args.retrieval_share}, {args.repeat_share}, {args.random_share}")
    if args.induction_vocab < 4:
        parser.error(f"--induction-vocab must be >= 4 (random ids are drawn from 3 up, past the special tokens), got {args.induction_vocab}")
    if args.eval_length < 64:
        parser.error(f"--eval-length must be >= 64 (a passkey prompt and its answer), got {args.eval_length}")

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    tokenizer = kvcache.load_tokenizer(args.tokenizer)
    filler = read_texts(Path(args.corpus) / "train", tokenizer)
    tasks = TaskMaker(filler, tokenizer, seed=args.seed)
    held_out = HeldOut(read_texts(Path(args.corpus) / "test", tokenizer), filler, tokenizer, args.eval_length,
                       args.eval_rows, device)
    if args.resume:
        model = kvcache.load(args.resume, dtype=torch.float32, device=device)
        cfg = model.config
    else:
        cfg = ModelConfig(rope=RopeConfig(theta=ROPE_THETA), **ARCH)
        model = kvcache.Transformer(cfg)
        for name, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        # Scale the residual-branch outputs down with depth (GPT-2), so the sum of branches keeps
        # unit scale at initialisation.
        for block in model.layers:
            for p in (block.self_attn.o_proj.weight, block.mlp.down_proj.weight):
                torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_layers))
        model.to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters on {device}", file=sys.stderr, flush=True)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=cuda,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "loss.jsonl", "w")

    def record(entry: dict) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        print(entry, file=sys.stderr, flush=True)

    record({"step": 0, "seconds": 0.0, **held_out(model, autocast)})
    budget = math.inf if args.minutes is None else args.minutes * 60
    start = time.time()
    step, tokens_seen = 0, 0
    last_save = last_eval = start
    while step < args.steps and time.time() - start < budget:
        frac = step / args.steps
        if args.lengths:
            length = random.choice(args.lengths)
        elif args.induction:
            length = 128
        else:
            length = 2048 if args.long_only else random.choice(lengths_at(frac))
        rows = max(1, args.batch_tokens // length)
        if args.induction:
            ids, weights = random_repeats(rows, length, min(args.induction_vocab, cfg.vocab_size), tasks.rng)
        else:
            n_random = sum(tasks.rng.random() < args.random_share for _ in range(rows))
            ids, weights = tasks.batch(rows - n_random, length, args.retrieval_share / (1 - args.random_share),
                                       args.repeat_share / (1 - args.random_share))
            if n_random:
                more = random_repeats(n_random, length, min(args.induction_vocab, cfg.vocab_size), tasks.rng)
                ids, weights = torch.cat([ids, more[0]]), torch.cat([weights, more[1]])
        ids = ids.to(device, non_blocking=True)
        weights = weights.to(device, non_blocking=True)
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in optimizer.param_groups:
            g["lr"] = lr
        with autocast():
            logits = model(ids[:, :-1])
        loss_tok = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        w = weights[:, 1:].flatten()
        loss = (loss_tok * w).sum() / w.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += ids[:, :-1].numel()
        elapsed = time.time() - start
        if step % 10 == 0:
            record({"step": step, "seconds": round(elapsed, 1), "tokens": tokens_seen, "length": length,
                    "lr": round(lr, 6), "loss": round(loss.item(), 4), "lm_loss": round(loss_tok.mean().item(), 4)})
        if time.time() - last_eval > args.eval_every:
            record({"step": step, "seconds": round(time.time() - start, 1), **held_out(model, autocast)})
            last_eval = time.time()
        if time.time() - last_save > 120:
            save(model, out, Path(args.tokenizer))
            last_save = time.time()
    final = held_out(model, autocast)
    record({"step": step, "seconds": round(time.time() - start, 1), **final})
    save(model, out, Path(args.tokenizer))
    (out / "training.json").write_text(json.dumps({
        "steps": step, "planned_steps": args.steps, "tokens": tokens_seen, "seconds": round(time.time() - start),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "parameters": n_params,
        "batch_tokens": args.batch_tokens, "lr": args.lr, "warmup": args.warmup,
        "induction": args.induction, "induction_vocab": args.induction_vocab if args.induction or args.random_share else None,
        "retrieval_share": args.retrieval_share, "random_share": args.random_share, "repeat_share": args.repeat_share, "curriculum": None if args.long_only or args.lengths else CURRICULUM, "lengths": args.lengths,
        "resumed_from": args.resume, "seed": args.seed, "config": hf_config(cfg), "final": final,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
