"""kvcache against NVIDIA kvpress: the same compression methods on identical inputs, one process.

Both engines run the same checkpoint in fp32 on the CPU: kvpress through transformers'
``LlamaForCausalLM`` (the press as a context manager around the prefill forward, as kvpress's own
pipeline does), kvcache through ``kvcache.load``. Every press is paired with its kvcache
counterpart and both are given the same token ids:

    kvpress press            kvcache policy (options)
    (no press)               dense                                 sanity: must agree exactly
    StreamingLLMPress        sink      (sinks=4, positions="absolute")
    SnapKVPress              snapkv    (window=64, kernel=5, pooling="avg", fallback="tova")
    TOVAPress                tova
    ObservedAttentionPress   h2o       (recent=0, normalize=True)  kvpress needs eager attention
    KnormPress               knorm     (recent=0, sinks=0)
    ExpectedAttentionPress   expected_attention (future=512, sinks=4, covariance, value_norm)

Tasks (query-agnostic, kvpress's protocol: the context is compressed first, then the rest comes):
    passkey     TaskMaker(stream, tokenizer, seed + length).passkey(length, depth=d) prompts; the
                context is the prompt less its question (" What is the pass key? The pass key is");
                the context is compressed at ratio r, then the question is fed and the answer
                decoded greedily (exactly len(answer) tokens). Accuracy over depths x trials.
    agreement   a held-out window of the texts: ``length`` tokens of context, compressed at ratio r,
                then ``--continuation`` tokens teacher-forced; top-1 agreement and mean
                KL(dense || compressed) of their next-token distributions against the same engine's
                uncompressed forward of context + continuation.
    wall-clock  one passkey prompt (prefill + compression + question + answer decode) per engine,
                press and ratio, engines taking turns, best of ``--repeats``.

Other modes, each instead of the tasks above: ``--ruler TASKS`` (RULER prompts through both
engines: scores, seconds, identical answers), ``--kept-check`` (the positions each press keeps
against its policy's, per layer and K/V head, on the texts or, with ``--ruler``, on RULER
contexts) and ``--kvzip-check`` (KVzipPress's scores against kvcache's kvzip).

Ratios are kvpress's ``compression_ratio`` (the fraction REMOVED). Both engines keep
``int((1 - r) * context)`` context tokens (kvpress's ``compute_n_kept``). kvpress's DynamicCache
then grows by the question and answer (or continuation) tokens; kvcache's scoring policies do the
same through ``reserve`` (cache_length = kept + the tokens that follow, reserve = those tokens),
while its sink policy keeps ``kept`` slots and evicts as tokens arrive (see docs/vs_kvpress.md
for what differs per pair).

Engines on the kvcache side (``--kvcache-engine``):
    native      kvcache's own model (``kvcache.load``) and ``kvcache.generate`` (the default).
    hf          kvcache's policies inside the same transformers ``LlamaForCausalLM`` class kvpress
                runs (a second instance from the same checkpoint), through ``kvcache.hf``: a
                ``kvcache.hf.make_cache`` cache as ``past_key_values`` and
                ``attn_implementation="kvcache"``, driven token for token like the kvpress path.
                Both engines then run the same model code, and each is compared with that model's
                own uncompressed forward.

Set-up (kvpress 0.5.5 pins transformers < 5.3, so it gets its own virtual environment; kvcache
installs into the same one, so both engines run in ONE process):

    python3 -m venv kvpress-venv
    kvpress-venv/bin/pip install torch==2.13.0          # CPU wheel; install torch FIRST
    kvpress-venv/bin/pip install kvpress==0.5.5 transformers==5.2.0
    kvpress-venv/bin/pip install safetensors tokenizers tqdm
    kvpress-venv/bin/pip install -e . --no-deps

Usage:
    kvpress-venv/bin/python benchmarks/vs_kvpress.py --model DIR [--texts DIR]
        [--ratios 0.25,0.5,0.75] [--lengths 1024] [--depths 0,0.25,0.5,0.75,1] [--trials 4]
        [--samples 4] [--continuation 64] [--repeats 3] [--presses NAME,...] [--quick]
        [--out FILE.json] [--markdown FILE.md] [--threads 1] [--kvcache-engine native|hf]
    kvpress-venv/bin/python benchmarks/vs_kvpress.py --make-tiny DIR   # random test model

Prints one JSON object on stdout (also to ``--out``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcache
from kvcache.eval.tasks import PASSKEY_QUESTION as QUESTION
from kvcache.eval.tasks import TaskMaker, read_texts
from kvcache.runtime.threads import set_threads

ROOT = Path(__file__).resolve().parent.parent
N_SINK = 4                   # StreamingLLMPress.n_sink default
SNAP_WINDOW, SNAP_KERNEL = 64, 5  # SnapKVPress.window_size, kernel_size defaults


@dataclass
class Pair:
    press: str                                 # kvpress class name, or "no press"
    press_kwargs: dict = field(default_factory=dict)
    policy: str | None = None                  # kvcache counterpart, None when there is none
    options: dict = field(default_factory=dict)
    eager: bool = False                        # kvpress needs the attention weights


PAIRS = [
    Pair("no press", policy="dense"),
    Pair("StreamingLLMPress", {"n_sink": N_SINK}, "sink", {"sinks": N_SINK, "positions": "absolute"}),
    Pair("SnapKVPress", {"window_size": SNAP_WINDOW, "kernel_size": SNAP_KERNEL}, "snapkv",
         {"window": SNAP_WINDOW, "kernel": SNAP_KERNEL, "pooling": "avg", "fallback": "tova"}),
    Pair("TOVAPress", {}, "tova", {}),
    Pair("ObservedAttentionPress", {}, "h2o", {"recent": 0, "normalize": True}, eager=True),
    Pair("KnormPress", {}, "knorm", {"recent": 0, "sinks": 0}),
    Pair("ExpectedAttentionPress", {"n_future_positions": 512, "n_sink": N_SINK, "use_covariance": True,
                                    "use_vnorm": True, "epsilon": 0.0}, "expected_attention",
         {"future": 512, "sinks": N_SINK, "covariance": True, "value_norm": True, "epsilon": 0.0}),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def kept_tokens(context: int, ratio: float) -> int:
    """kvpress's ``compute_n_kept``: int(k_len * (1 - ratio)), at least 1."""
    return max(1, int(context * (1 - ratio)))


# ---------------------------------------------------------------------------------------------
# kvpress side: transformers model + press, the token-level path of KVPressTextGenerationPipeline


def make_press(pair: Pair, ratio: float):
    """The press of ``pair`` at ``ratio``; None for "no press"."""
    if pair.press == "no press":
        return None
    import kvpress

    if pair.press == "CriticalKVPress":
        return kvpress.CriticalKVPress(getattr(kvpress, pair.press_kwargs["press"])(compression_ratio=ratio))
    return getattr(kvpress, pair.press)(compression_ratio=ratio, **pair.press_kwargs)


def press_name(pair: Pair) -> str:
    return f"{pair.press}({pair.press_kwargs['press']})" if pair.press == "CriticalKVPress" else pair.press


@contextlib.contextmanager
def attention(hf, eager: bool):
    """ObservedAttentionPress reads the attention weights, which only eager attention returns."""
    if not eager:
        yield
        return
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        yield
    finally:
        hf.set_attn_implementation(previous)


def kvpress_prefill(hf, press, context: torch.Tensor):
    """pipeline.py ``_forward``: the press wraps the prefill of the context alone, run without
    the lm head; the press's forward hooks compress each layer's DynamicCache in place."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with press(hf) if press is not None else contextlib.nullcontext():
        hf.model(input_ids=context, past_key_values=cache)
    return cache


@torch.inference_mode()
def kvpress_answer(hf, press, context: torch.Tensor, question: torch.Tensor, n_new: int) -> list[int]:
    """pipeline.py ``generate_answer``: the question at positions context_length.., then greedy
    decode one token at a time at the following positions (no stop token: exactly n_new)."""
    cache = kvpress_prefill(hf, press, context)
    L = context.shape[1]
    pos = torch.arange(L, L + question.shape[1]).unsqueeze(0)
    logits = hf(input_ids=question, past_key_values=cache, position_ids=pos, logits_to_keep=1).logits
    out = [logits[0, -1].argmax()]
    pos = pos[:, -1:] + 1
    for i in range(n_new - 1):
        logits = hf(input_ids=out[-1].view(1, 1), past_key_values=cache, position_ids=pos + i).logits
        out.append(logits[0, -1].argmax())
    return [int(t) for t in out]


@torch.inference_mode()
def kvpress_continuation(hf, press, context: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """(M, vocab) logits of the continuation, teacher-forced after the compressed context."""
    cache = kvpress_prefill(hf, press, context)
    L = context.shape[1]
    pos = torch.arange(L, L + cont.shape[1]).unsqueeze(0)
    return hf(input_ids=cont, past_key_values=cache, position_ids=pos).logits[0].float()


# ---------------------------------------------------------------------------------------------
# kvcache side


def kvcache_cache(model, pair: Pair, kept: int, context: int, total: int, make=kvcache.make_cache):
    """The counterpart of a press that keeps ``kept`` of ``context`` tokens, for ``total`` tokens in all.
    ``make`` is ``kvcache.make_cache`` (kvcache's model) or ``kvcache.hf.make_cache`` (a transformers model).

    Scoring policies get ``reserve`` slots for the tokens after the context: the context is
    compressed to ``kept`` once and the cache then grows, as kvpress's DynamicCache does. (The
    reserve is capped so that the context still overflows; at kvpress's ratios it never binds.)
    Ring policies (sink) have no reserve: they keep ``kept`` slots and evict as tokens arrive.
    """
    if pair.policy == "dense":
        return make(model, "dense", cache_length=total)
    if pair.policy == "sink":
        return make(model, pair.policy, cache_length=kept, **pair.options)
    reserve = max(0, min(total - context, context - kept - 1))
    return make(model, pair.policy, cache_length=kept + reserve, reserve=reserve, **pair.options)


def kvcache_answer(model, pair: Pair, prompt: list[int], context: int, kept: int, n_new: int) -> list[int]:
    """Query-agnostic: the first prefill chunk is the context alone (compressed to ``kept`` as it
    overflows), the second is the question; then greedy decode."""
    cache = kvcache_cache(model, pair, kept, context, len(prompt) + n_new)
    return kvcache.generate(model, prompt, max_new_tokens=n_new, cache=cache, stop_tokens=(),
                            prefill_chunk=context)


@torch.inference_mode()
def kvcache_continuation(model, pair: Pair, context: torch.Tensor, cont: torch.Tensor, kept: int) -> torch.Tensor:
    cache = kvcache_cache(model, pair, kept, context.shape[1], context.shape[1] + cont.shape[1])
    model(context, cache, last_only=True)
    return model(cont, cache)[0].float()


# kvcache through kvcache.hf: a transformers model with a kvcache cache as past_key_values


def hf_cache(hf, pair: Pair, kept: int, context: int, total: int):
    import kvcache.hf

    return kvcache_cache(hf, pair, kept, context, total, make=kvcache.hf.make_cache)


@torch.inference_mode()
def kvcache_hf_answer(hf, pair: Pair, prompt: list[int], context: int, kept: int, n_new: int) -> list[int]:
    """The kvpress path's calls with a kvcache cache: the context alone (no lm head; the cache
    compresses it as it overflows), the question, then greedy decode. Positions come from the
    cache (the tokens it has seen), so none are passed."""
    cache = hf_cache(hf, pair, kept, context, len(prompt) + n_new)
    ids = torch.tensor([prompt])
    hf.model(input_ids=ids[:, :context], past_key_values=cache)
    logits = hf(input_ids=ids[:, context:], past_key_values=cache, logits_to_keep=1).logits
    out = [logits[0, -1].argmax()]
    for _ in range(n_new - 1):
        logits = hf(input_ids=out[-1].view(1, 1), past_key_values=cache).logits
        out.append(logits[0, -1].argmax())
    return [int(t) for t in out]


@torch.inference_mode()
def kvcache_hf_continuation(hf, pair: Pair, context: torch.Tensor, cont: torch.Tensor, kept: int) -> torch.Tensor:
    cache = hf_cache(hf, pair, kept, context.shape[1], context.shape[1] + cont.shape[1])
    hf.model(input_ids=context, past_key_values=cache)
    return hf(input_ids=cont, past_key_values=cache).logits[0].float()


# ---------------------------------------------------------------------------------------------


def compare(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """top-1 agreement and mean KL(reference || logits) over positions; both (M, vocab)."""
    ref, lp = F.log_softmax(reference.float(), -1), F.log_softmax(logits.float(), -1)
    return {"top1_agreement": (ref.argmax(-1) == lp.argmax(-1)).float().mean().item(),
            "kl": (ref.exp() * (ref - lp)).sum(-1).mean().item()}


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def skip_reason(pair: Pair, kept: int, context: int) -> str | None:
    if pair.press == "SnapKVPress" and (kept <= SNAP_WINDOW or context <= SNAP_WINDOW):
        return f"SnapKV's window ({SNAP_WINDOW}) needs more than {SNAP_WINDOW} kept tokens (kept {kept})"
    if pair.press in ("StreamingLLMPress", "ExpectedAttentionPress") and kept <= N_SINK:
        return f"{N_SINK} sinks need more than {N_SINK} kept tokens (kept {kept})"
    return None


def build_tasks(args, stream, tok):
    """Passkey prompts per length (same keys for every press and engine) and agreement windows."""
    q = len(tok.encode(QUESTION, add_special_tokens=False))
    passkey = []
    for n in args.lengths:
        maker = TaskMaker(stream, tok, seed=args.seed + n)
        for d in args.depths:
            for t in range(args.trials):
                prompt, answer = maker.passkey(n, depth=d)
                passkey.append({"length": n, "depth": d, "trial": t, "prompt": prompt, "answer": answer,
                                "context": len(prompt) - q})
    rng = random.Random(args.seed)
    start = [] if tok.bos_token_id is None else [tok.bos_token_id]
    windows = []
    for n in args.lengths:
        for _ in range(args.samples):
            body = n - len(start) + args.continuation
            o = rng.randrange(0, len(stream) - body)
            ids = start + stream[o : o + body].tolist()
            windows.append({"length": n, "context": ids[:n], "continuation": ids[n:]})
    return passkey, windows, q


def run(args) -> dict:
    import kvpress
    import transformers

    set_threads(args.threads)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    tok = kvcache.load_tokenizer(args.model)
    model = kvcache.load(args.model, dtype=torch.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()
    if args.kvcache_engine == "hf":
        # The same model class and weights; kvcache.hf.make_cache switches this instance to
        # attn_implementation="kvcache", while kvpress's keeps SDPA.
        engine = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                               attn_implementation="sdpa").eval()
        answer, continuation = kvcache_hf_answer, kvcache_hf_continuation
    else:
        engine, answer, continuation = model, kvcache_answer, kvcache_continuation
    stream = read_texts(args.texts, tok)
    passkey, windows, q_len = build_tasks(args, stream, tok)
    log(f"{len(passkey)} passkey prompts, {len(windows)} agreement windows, question {q_len} tokens")

    pairs = [p for p in PAIRS if args.presses is None or p.press in args.presses or
             (p.press == "no press" and "dense" in args.presses)]

    # Dense references per engine (the uncompressed model on context + continuation).
    with torch.inference_mode():
        ref_hf, ref_kv = [], []
        for w in windows:
            ids = torch.tensor([w["context"] + w["continuation"]])
            L = len(w["context"])
            ref_hf.append(hf(input_ids=ids).logits[0, L:].float())
            # The hf engine's own uncompressed forward is the transformers model's.
            ref_kv.append(ref_hf[-1] if args.kvcache_engine == "hf" else model(ids)[0, L:].float())

    report: dict = {
        "setup": {
            "model": str(args.model), "one_process": True, "threads": args.threads,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "kvpress": getattr(kvpress, "__version__", "0.5.5"),
            "kvcache": kvcache.__version__, "dtype": "float32", "device": "cpu",
            "kvcache_engine": args.kvcache_engine,
            "kvpress_attention": "sdpa (eager for ObservedAttentionPress)",
            "kept_tokens": "int((1 - ratio) * context), kvpress's compute_n_kept",
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "pairs": [{"press": p.press, "press_kwargs": p.press_kwargs, "policy": p.policy,
                   "policy_options": p.options, "kvpress_eager": p.eager} for p in pairs],
        "results": [],
    }

    timing_task = passkey[len(passkey) // 2]  # a mid-depth prompt of the first length
    for pair in pairs:
        ratios = [0.0] if pair.press == "no press" else args.ratios
        for ratio in ratios:
            press = make_press(pair, ratio)
            row: dict = {"press": pair.press, "policy": pair.policy, "ratio": ratio}
            t_cell = time.perf_counter()
            contexts = [t["context"] for t in passkey] + [len(w["context"]) for w in windows]
            reason = next((r for c in contexts if (r := skip_reason(pair, kept_tokens(c, ratio), c))), None)
            if reason:
                row["skipped"] = reason
                report["results"].append(row)
                log(f"{pair.press} r={ratio}: skipped ({reason})")
                continue
            engines = {"kvpress": {}, "kvcache": {} if pair.policy else None}
            with attention(hf, pair.eager):
                # passkey
                per_task = []
                for t in passkey:
                    ctx, n_new = t["context"], len(t["answer"])
                    kept = kept_tokens(ctx, ratio)
                    prompt = torch.tensor([t["prompt"]])
                    a_press = kvpress_answer(hf, press, prompt[:, :ctx], prompt[:, ctx:], n_new)
                    entry = {"length": t["length"], "depth": t["depth"], "trial": t["trial"], "kept": kept,
                             "kvpress": a_press == t["answer"]}
                    if pair.policy:
                        a_kv = answer(engine, pair, t["prompt"], ctx, kept, n_new)
                        entry["kvcache"] = a_kv == t["answer"]
                        entry["same_answer"] = a_kv == a_press
                    per_task.append(entry)
                # agreement
                per_window = []
                for w, rh, rk in zip(windows, ref_hf, ref_kv):
                    ctx, cont = torch.tensor([w["context"]]), torch.tensor([w["continuation"]])
                    kept = kept_tokens(ctx.shape[1], ratio)
                    lp = kvpress_continuation(hf, press, ctx, cont)
                    entry = {"length": w["length"], "kept": kept, "kvpress": compare(rh, lp)}
                    if pair.policy:
                        lk = continuation(engine, pair, ctx, cont, kept)
                        entry["kvcache"] = compare(rk, lk)
                        entry["cross_engine"] = compare(lp, lk)
                        entry["max_abs_logit_diff"] = (lp - lk).abs().max().item()
                    per_window.append(entry)
                # wall-clock, engines taking turns
                t = timing_task
                ctx, n_new = t["context"], len(t["answer"])
                kept = kept_tokens(ctx, ratio)
                prompt = torch.tensor([t["prompt"]])
                times = {"kvpress": math.inf, "kvcache": math.inf}
                for _ in range(args.repeats):
                    times["kvpress"] = min(times["kvpress"], best_time(partial(
                        kvpress_answer, hf, press, prompt[:, :ctx], prompt[:, ctx:], n_new), 1))
                    if pair.policy:
                        times["kvcache"] = min(times["kvcache"], best_time(partial(
                            answer, engine, pair, t["prompt"], ctx, kept, n_new), 1))
            for name, out in engines.items():
                if out is None:
                    continue
                out["passkey"] = mean([e[name] for e in per_task])
                out["passkey_by_depth"] = {str(d): mean([e[name] for e in per_task if e["depth"] == d])
                                           for d in args.depths}
                out["top1_agreement"] = mean([e[name]["top1_agreement"] for e in per_window])
                out["kl"] = mean([e[name]["kl"] for e in per_window])
                out["seconds"] = times[name]
            row.update(engines)
            row["kept"] = sorted({e["kept"] for e in per_task})
            row["timing_prompt"] = {"length": len(t["prompt"]), "context": ctx, "kept": kept, "new_tokens": n_new}
            if pair.policy:
                row["same_answer"] = mean([e["same_answer"] for e in per_task])
                row["cross_engine_top1"] = mean([e["cross_engine"]["top1_agreement"] for e in per_window])
                row["cross_engine_max_abs_logit_diff"] = max(e["max_abs_logit_diff"] for e in per_window)
            row["passkey_tasks"] = per_task
            row["agreement_windows"] = per_window
            row["cell_seconds"] = time.perf_counter() - t_cell
            report["results"].append(row)
            kv = engines["kvcache"]
            log(f"{pair.press:>22} r={ratio:<4g} passkey {engines['kvpress']['passkey']:.2f}"
                + (f"/{kv['passkey']:.2f}" if kv else "")
                + f"  top1 {engines['kvpress']['top1_agreement']:.3f}" + (f"/{kv['top1_agreement']:.3f}" if kv else "")
                + f"  time {times['kvpress'] * 1e3:.0f}" + (f"/{times['kvcache'] * 1e3:.0f}" if kv else "")
                + f" ms  (cell {row['cell_seconds']:.1f} s)")

    dense = next((r for r in report["results"] if r["press"] == "no press"), None)
    if dense is not None:
        report["sanity"] = {
            "dense_same_greedy_answers": dense["same_answer"],
            "dense_cross_engine_top1": dense["cross_engine_top1"],
            "dense_cross_engine_max_abs_logit_diff": dense["cross_engine_max_abs_logit_diff"],
            "kvpress_dense_top1": dense["kvpress"]["top1_agreement"],
            "kvcache_dense_top1": dense["kvcache"]["top1_agreement"],
            "ok": dense["same_answer"] == 1.0 and dense["cross_engine_top1"] == 1.0
                  and dense["kvpress"]["top1_agreement"] == 1.0 and dense["kvcache"]["top1_agreement"] == 1.0,
        }
    report["pipeline_check"] = pipeline_check(hf, args.model, pairs, passkey[0], args.ratios[0])
    return report


def pipeline_check(hf, model_dir, pairs, task, ratio) -> dict:
    """kvpress's own KVPressTextGenerationPipeline._forward on the same ids must produce the answer
    that the token-level replica above produces (checked for every press at one ratio)."""
    from kvpress import KVPressTextGenerationPipeline
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"),
                                     clean_up_tokenization_spaces=False)
    pipe = KVPressTextGenerationPipeline(model=hf, tokenizer=hf_tok)
    ctx, n_new = task["context"], len(task["answer"])
    prompt = torch.tensor([task["prompt"]])
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    checks = {}
    for pair in pairs:
        press = make_press(pair, 0.0 if pair.press == "no press" else ratio)
        if skip_reason(pair, kept_tokens(ctx, ratio), ctx):
            continue
        with attention(hf, pair.eager), torch.inference_mode():
            theirs = pipe._forward({"context_ids": prompt[:, :ctx], "questions_ids": [prompt[:, ctx:]]},
                                   max_new_tokens=n_new, press=press)[0]
            ours = kvpress_answer(hf, press, prompt[:, :ctx], prompt[:, ctx:], n_new)
        cut = next((i + 1 for i, t in enumerate(ours) if t in eos), len(ours))
        checks[pair.press] = theirs == hf_tok.decode(ours[:cut], skip_special_tokens=True)
    return {"ratio": ratio, "matches": checks, "ok": all(checks.values())}


# ---------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    s = report["setup"]
    a = report["args"]
    lines = [
        (f"kvcache vs kvpress {s['kvpress']} (transformers {s['transformers']}, torch {s['torch']}), "
        f"model `{s['model']}`, fp32 CPU, {s['threads']} thread(s), one process, kvcache engine "
        f"`{s.get('kvcache_engine', 'native')}`"
        + (" (kvcache's policies inside transformers' LlamaForCausalLM through kvcache.hf)"
           if s.get("kvcache_engine") == "hf" else "") + ". Passkey: lengths "
        f"{a['lengths']}, depths {a['depths']}, {a['trials']} trial(s) each, query-agnostic. Agreement: "
        f"{a['samples']} window(s) per length, {a['continuation']} continuation tokens, against each "
        f"engine's own dense forward; 'top-1 kvcache vs kvpress' compares the two compressed engines "
        f"directly. Time: one passkey prompt (prefill + compression + question + answer), best of "
        f"{a['repeats']}; kvpress runs SDPA attention, eager for ObservedAttentionPress (which needs "
        f"the weights). Differences are kvcache - kvpress, in points."),
        "",
        ("| kvpress press | kvcache policy | ratio | passkey kvpress | passkey kvcache | diff | "
        "top-1 kvpress | top-1 kvcache | diff | top-1 kvcache vs kvpress | KL kvpress | KL kvcache | "
        "time kvpress | time kvcache | kvpress / kvcache |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        policy = r["policy"] or "-"
        if r["policy"] and r["policy"] != "dense":
            pair = next(p for p in report["pairs"] if p["press"] == r["press"])
            opts = ", ".join(f"{k}={v}" for k, v in pair["policy_options"].items())
            policy = f"{policy} ({opts})" if opts else policy
        if "skipped" in r:
            lines.append(f"| {r['press']} | {policy} | {r['ratio']:g} | skipped: {r['skipped']} |"
                         + " |" * 11)
            continue
        p, k = r["kvpress"], r.get("kvcache")
        cells = [r["press"], policy, f"{r['ratio']:g}", f"{100 * p['passkey']:.0f}%"]
        if k:
            cells += [f"{100 * k['passkey']:.0f}%", f"{100 * (k['passkey'] - p['passkey']):+.0f}"]
        else:
            cells += ["-", "-"]
        cells.append(f"{100 * p['top1_agreement']:.1f}%")
        if k:
            cells += [f"{100 * k['top1_agreement']:.1f}%",
                      f"{100 * (k['top1_agreement'] - p['top1_agreement']):+.1f}",
                      f"{100 * r['cross_engine_top1']:.1f}%"]
        else:
            cells += ["-", "-", "-"]
        cells += [f"{p['kl']:.4f}", f"{k['kl']:.4f}" if k else "-", f"{1e3 * p['seconds']:.1f} ms"]
        cells += [f"{1e3 * k['seconds']:.1f} ms", f"{p['seconds'] / k['seconds']:.2f}x"] if k else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    san = report.get("sanity")
    if san:
        lines += ["", (f"Sanity (ratio 0, transformers without a press vs kvcache dense): same greedy answers "
                  f"{100 * san['dense_same_greedy_answers']:.0f}%, cross-engine top-1 "
                  f"{100 * san['dense_cross_engine_top1']:.1f}%, max |logit diff| "
                  f"{san['dense_cross_engine_max_abs_logit_diff']:.2e}: {'OK' if san['ok'] else 'FAILED'}.")]
    pc = report.get("pipeline_check")
    if pc:
        lines.append(f"kvpress's own pipeline gives the same answers as this script's kvpress path "
                     f"(ratio {pc['ratio']:g}): {'OK' if pc['ok'] else 'FAILED ' + str(pc['matches'])}.")
    return "\n".join(lines) + "\n"


def make_tiny(out: Path, tokenizer_dir: Path) -> None:
    """A tiny random Llama (save_pretrained) with a real tokenizer copied next to it, for testing
    the mechanics. Weights are scaled up from transformers' init so the logits are not near-ties."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if "embed" not in name else 1.0)
    hf.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)
    log(f"wrote a random {sum(p.numel() for p in hf.parameters()) / 1e6:.2f}M-parameter Llama to {out}")


# ---------------------------------------------------------------------------------------------
# Kept positions: what each press keeps of a context, against what its kvcache policy keeps


KEPT_PAIRS = [
    Pair("KnormPress", {}, "knorm", {"recent": 0, "sinks": 0}),
    Pair("KeyDiffPress", {}, "keydiff", {"recent": 0, "sinks": 0}),
    Pair("RandomPress", {"seed": 3}, "random", {"score_seed": 3, "recent": 0, "sinks": 0}),
    Pair("LagKVPress", {"n_sink": 4, "lag_size": 64}, "lagkv", {"sinks": 4, "lag": 64}),
    # CriticalKVPress wraps a press (named in press_kwargs["press"]), kvcache's critical a policy.
    Pair("CriticalKVPress", {"press": "KnormPress"}, "critical", {"base": "knorm"}),
    Pair("CriticalKVPress", {"press": "KeyDiffPress"}, "critical", {"base": "keydiff"}),
]


def kept_pairs(presses: list[str] | None) -> list[Pair]:
    """Every pair whose press keeps a subset of the context's positions (all but "no press"; KnormPress
    is in both lists), or those of ``presses``."""
    return [p for p in PAIRS[1:] + KEPT_PAIRS[1:] if presses is None or p.press in presses]


def _row_hashes(keys: torch.Tensor) -> torch.Tensor:
    """(Hkv, n) int64: an exact function of each row's bits of float32 keys (Hkv, n, D). Two
    16-bit halves per element, weighted below 2^20, so the sums cannot overflow."""
    bits = keys.contiguous().view(torch.int32).long()
    g = torch.Generator().manual_seed(0)
    w = torch.randint(1, 1 << 20, (2, keys.shape[-1]), generator=g)
    return ((bits & 0xFFFF) * w[0] + ((bits >> 16) & 0xFFFF) * w[1]).sum(-1)


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> list[set[int]]:
    """Per K/V head, the positions of the rows of ``full`` (1, Hkv, n, D) that the rows of
    ``kept`` (1, Hkv, m, D) are copies of (a press gathers the rows it keeps)."""
    if full.dtype != torch.float32:
        raise ValueError(f"kept positions are matched on float32 keys, got {full.dtype}")
    of_full, of_kept = _row_hashes(full[0]), _row_hashes(kept[0])
    out = []
    for h in range(full.shape[1]):
        order = of_full[h].argsort()
        at = torch.searchsorted(of_full[h][order], of_kept[h]).clamp(max=full.shape[2] - 1)
        idx = order[at]
        if not torch.equal(full[0, h, idx], kept[0, h]):
            raise RuntimeError(f"head {h}: a kept key is not a copy of any key of the uncompressed prefill")
        out.append(set(idx.tolist()))
    return out


@torch.inference_mode()
def press_kept(hf, presses: dict, ids: list[int], eager: bool) -> dict:
    """{key: [per layer: per K/V head: set of positions]}: what each press of ``presses`` ({key:
    press}) keeps of ``ids`` in kvpress's pipeline, from ONE uncompressed prefill. Each press's
    own ``forward_hook`` (the hook ``with press(model)`` registers) runs after every layer on the
    layer's full keys and values, its compressed cache is read back and the full one restored:
    within a prefill a press changes no hidden state (the layer's output is computed before it
    compresses), so every press sees what its own pipeline run would. ``eager``: run the
    prefill with eager attention, whose weights ObservedAttentionPress reads."""
    from transformers import DynamicCache

    lm = hf.model
    for press in presses.values():
        press.post_init_from_model(hf)
    kept = {key: [] for key in presses}

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        full_k, full_v = layer.keys, layer.values
        for key, press in presses.items():
            press.forward_hook(module, args, kwargs, output)
            kept[key].append(kept_positions(full_k, layer.keys))
            layer.keys, layer.values = full_k, full_v
        return output

    handles = []
    try:
        for block in lm.layers:
            block.self_attn.rotary_emb = lm.rotary_emb  # as ``with press(model)`` sets it
            handles.append(block.self_attn.register_forward_hook(hook, with_kwargs=True))
        with attention(hf, eager):
            lm(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    finally:
        for handle in handles:
            handle.remove()
    return kept


@torch.inference_mode()
def policy_kept(model, pair: Pair, ratio: float, ids: list[int], shared) -> list[list[set[int]]]:
    """Per layer, per K/V head: the positions kvcache's policy of ``pair`` keeps after
    compressing ``ids`` in one chunk to ``int((1 - ratio) * n)`` tokens. ``shared``: a
    ``kvcache.eval.shared.SharedPrefill``, so the policies that prefill as dense does share one."""
    kept = kept_tokens(len(ids), ratio)

    def fresh():
        return kvcache.make_cache(model, pair.policy, cache_length=kept, options=pair.options)

    cache, _ = shared.prefill(model, fresh(), ids, f"{press_name(pair)} {ratio:g}", fresh)
    out = []
    for layer in cache.layers:
        pos = layer.storage.pos[0, :, :kept]  # (Hp, kept): one row for all heads, or one a head
        heads = pos.expand(layer.spec.num_kv_heads, -1)
        out.append([set(p[p >= 0].tolist()) for p in heads])
    return out


def kept_check(model_dir: Path, contexts: list[tuple[str, list[int]]], ratios: list[float],
               pairs: list[Pair]) -> list[dict]:
    """Per context, press and ratio: the positions kvpress's press keeps in its pipeline
    (``press_kept``) against those kvcache's policy keeps after compressing the same ids in one
    chunk. ``contexts``: (label, ids). ``identical_heads`` is the share of (layer, K/V head)
    whose kept sets are equal; ``position_overlap`` the share of kvpress's kept positions
    kvcache keeps too."""
    from transformers import AutoModelForCausalLM

    from kvcache.eval.shared import SharedPrefill

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    model = kvcache.load(model_dir, dtype=torch.float32)
    rows = []
    for label, ids in contexts:
        shared = SharedPrefill()
        theirs = {}
        for eager in (False, True):
            presses = {(i, r): make_press(p, r) for i, p in enumerate(pairs) if p.eager == eager for r in ratios}
            if presses:
                start = time.perf_counter()
                theirs.update(press_kept(hf, presses, ids, eager))
                log(f"kept {label}: {len(presses)} kvpress compressions from one "
                    f"{'eager ' if eager else ''}prefill in {time.perf_counter() - start:.1f}s")
        for i, pair in enumerate(pairs):
            for ratio in ratios:
                start = time.perf_counter()
                ours = policy_kept(model, pair, ratio, ids, shared)
                seconds = time.perf_counter() - start
                same = total = overlap = kept = 0
                for a_layer, b_layer in zip(theirs[i, ratio], ours, strict=True):
                    for a, b in zip(a_layer, b_layer, strict=True):
                        same += a == b
                        overlap += len(a & b)
                        kept += len(a)
                        total += 1
                rows.append({"context": label, "press": press_name(pair), "policy": pair.policy,
                             "options": pair.options, "ratio": ratio, "tokens": len(ids),
                             "kept": kept_tokens(len(ids), ratio), "identical_heads": same / total,
                             "position_overlap": overlap / kept, "kvcache_s": seconds})
                log(f"kept {label} {press_name(pair):<30} {ratio:<5} identical heads {same}/{total}, "
                    f"positions in common {100 * overlap / kept:.2f}%")
    return rows


def kept_markdown(rows: list[dict]) -> str:
    """One line per press and ratio over every context: heads identical, positions in common."""
    lines = ["| kvpress press | kvcache policy (options) | ratio | contexts | identical (layer, head) | "
             "positions in common | lowest context |", "|---|---|---:|---:|---:|---:|---:|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["press"], r["policy"], json.dumps(r["options"]), r["ratio"]), []).append(r)
    for (press, policy, options, ratio), rs in groups.items():
        opts = ", ".join(f"{k}={v}" for k, v in json.loads(options).items())
        lines.append(f"| `{press}` | `{policy}({opts})` | {ratio:g} | {len(rs)} | "
                     f"{100 * mean([r['identical_heads'] for r in rs]):.1f}% | "
                     f"{100 * mean([r['position_overlap'] for r in rs]):.2f}% | "
                     f"{100 * min(r['position_overlap'] for r in rs):.2f}% |")
    return "\n".join(lines) + "\n"


@torch.inference_mode()
def kvzip_check(model_dir: Path, ids: list[int], ratios: list[float]) -> list[dict]:
    """KVzipPress's reconstruction scores against kvcache's kvzip on the same ids (one chunk, no
    chat template, the same repeat prompt). kvpress spreads its budget over heads, kvcache keeps
    the same count per head, so the kept sets are compared per head against the top
    ``int((1 - ratio) * n)`` of kvpress's scores. Without a chat template the press's sinks are
    scored like every other token (its first chunk's scores overwrite the 1.0 it gives them), so
    kvcache runs with ``sinks=0``. ``max_score_diff`` is the largest difference between the two
    engines' scores of the tokens kvcache keeps.

    The press reads the tokenizer from the model's ``name_or_path``; with a chat template it
    would take the ids' first tokens for the template's prefix and reconstruct the rest after the
    template's closing. These ids are plain text, so it is given the tokenizer without one."""
    import kvpress
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvcache.generation import reconstruction as kvzip

    class Recorded(kvpress.KVzipPress):
        def compress_post(self, model):
            self.recorded = self.score_val.float().clone()  # (layers, 1, Hkv, n), reset on exit
            super().compress_post(model)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    model = kvcache.load(model_dir, dtype=torch.float32)
    tok = kvcache.load_tokenizer(model_dir)
    x = torch.tensor([ids])
    rows = []
    with tempfile.TemporaryDirectory() as plain:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(model_dir) / name).exists():
                shutil.copy(Path(model_dir) / name, plain)
        config = json.loads((Path(plain) / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (Path(plain) / "tokenizer_config.json").write_text(json.dumps(config))
        hf.config.name_or_path = plain
        for ratio in ratios:
            press = Recorded(compression_ratio=ratio, layerwise=True)
            with press(hf):
                hf(input_ids=x, past_key_values=DynamicCache())
            theirs = press.recorded[:, 0]  # (layers, Hkv, n)
            kept = max(1, int(len(ids) * (1 - ratio)))
            cache = kvcache.make_cache(model, "kvzip", cache_length=kept, options={"sinks": 0})
            kvzip.prefill(model, cache, x, repeat=kvzip.repeat_ids(tok), chunk=None)
            same = total = 0
            worst = 0.0
            for i, layer in enumerate(cache.layers):
                for h in range(theirs.shape[1]):
                    pos = layer.storage.pos[0, h, :kept]
                    mine = set(pos.tolist())
                    top = set(theirs[i, h].topk(kept).indices.tolist())
                    same += mine == top
                    total += 1
                    diff = (layer.stats["score"][0, h, :kept] - theirs[i, h][pos]).abs().max()
                    worst = max(worst, float(diff))
            rows.append({"press": "KVzipPress(layerwise=True)", "policy": "kvzip", "options": {"sinks": 0},
                         "ratio": ratio, "tokens": len(ids), "kept": kept, "identical_heads": same / total,
                         "max_score_diff": worst})
            log(f"kvzip {ratio:<5} identical heads {same}/{total}, largest score difference {worst:.2e}")
    return rows


# ---------------------------------------------------------------------------------------------
# RULER side by side: the same RULER prompts (kvcache.eval.ruler), query-agnostic


def ruler_side_by_side(args) -> dict:
    """Per RULER task, press and ratio: each engine's score (RULER's string_match_all, exactly
    ``max_new_tokens`` greedy tokens, no stop token, on both sides) and seconds, and the share of
    samples on which the two engines answer with the same tokens."""
    import transformers

    from kvcache.eval import ruler
    from kvcache.eval.metrics import score
    from kvcache.eval.sample import encode

    set_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    tok = kvcache.load_tokenizer(args.model)
    model = kvcache.load(args.model, dtype=torch.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()
    length = args.lengths[0]
    samples = {t: ruler.samples(t, tok, length, args.samples, args.seed) for t in args.ruler}
    pairs = [p for p in PAIRS + KEPT_PAIRS[1:] if args.presses is None or p.press in args.presses
             or (p.press == "no press" and "dense" in args.presses)]
    rows = []
    for pair in pairs:
        for ratio in ([0.0] if pair.policy == "dense" else args.ratios):
            for task, found in samples.items():
                out = {"kvpress": [0.0, 0.0], "kvcache": [0.0, 0.0]}
                same = 0
                for sample in found:
                    enc = encode(tok, sample)
                    prompt, context, n_new = enc.ids, len(enc.context), sample.max_new_tokens
                    kept = context if pair.policy == "dense" else kept_tokens(context, ratio)
                    x = torch.tensor([prompt])
                    press = make_press(pair, ratio)
                    start = time.perf_counter()
                    with attention(hf, pair.eager):
                        theirs = kvpress_answer(hf, press, x[:, :context], x[:, context:], n_new)
                    out["kvpress"][1] += time.perf_counter() - start
                    start = time.perf_counter()
                    ours = kvcache_answer(model, pair, prompt, context, kept, n_new)
                    out["kvcache"][1] += time.perf_counter() - start
                    for engine, answer in (("kvpress", theirs), ("kvcache", ours)):
                        out[engine][0] += score("string_match_all", tok.decode(answer), sample.answers)
                    same += theirs == ours
                n = len(found)
                name = press_name(pair)
                rows.append({"press": name, "policy": pair.policy, "ratio": ratio, "task": task, "samples": n,
                             "kvpress_score": out["kvpress"][0] / n, "kvcache_score": out["kvcache"][0] / n,
                             "kvpress_s": out["kvpress"][1], "kvcache_s": out["kvcache"][1],
                             "same_answer": same / n})
                log(f"ruler {name:<28} {ratio:<5} {task:<16} kvpress {rows[-1]['kvpress_score']:5.1f} "
                    f"({rows[-1]['kvpress_s']:.1f}s)  kvcache {rows[-1]['kvcache_score']:5.1f} "
                    f"({rows[-1]['kvcache_s']:.1f}s)  same answer {same}/{n}")
    return {"ruler": rows, "length": length, "samples": args.samples, "seed": args.seed, "threads": args.threads,
            "torch": torch.__version__, "transformers": transformers.__version__}


def ruler_markdown(report: dict) -> str:
    lines = [f"RULER at {report['length']} tokens, {report['samples']} sample(s) per task, query-agnostic, "
             f"{report['threads']} thread(s); score 0-100 (string_match_all), seconds summed over samples", "",
             "| press | kvcache policy | ratio | task | kvpress score | kvcache score | same answer | kvpress s | kvcache s |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["ruler"]:
        lines.append(f"| {r['press']} | {r['policy']} | {r['ratio']:g} | {r['task']} | {r['kvpress_score']:.1f} | "
                     f"{r['kvcache_score']:.1f} | {100 * r['same_answer']:.0f}% | {r['kvpress_s']:.2f} | "
                     f"{r['kvcache_s']:.2f} |")
    return "\n".join(lines) + "\n"


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "kvcache" / "reference_model",
                    help="Hugging Face-format checkpoint directory (default: kvcache/reference_model)")
    ap.add_argument("--texts", type=Path, default=None, help="held-out .txt files (default: the packaged kvcache/data/texts)")
    ap.add_argument("--ratios", type=floats, default=[0.25, 0.5, 0.75], help="kvpress compression_ratio values")
    ap.add_argument("--lengths", type=ints, default=[1024])
    ap.add_argument("--depths", type=floats, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="agreement windows per length")
    ap.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens after the context")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (best is reported)")
    ap.add_argument("--presses", type=lambda s: s.split(","), default=None,
                    help="subset of: dense," + ",".join(p.press for p in PAIRS[1:]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kvcache-engine", choices=("native", "hf"), default="native",
                    help="kvcache's own model (native), or kvcache's policies inside the transformers "
                         "LlamaForCausalLM through kvcache.hf (hf)")
    ap.add_argument("--quick", action="store_true",
                    help="lengths 512, depth 0.5, 1 trial, 1 window of 32 continuation tokens, 1 repeat")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--markdown", type=Path, default=None, help="write the Markdown table here")
    ap.add_argument("--make-tiny", type=Path, default=None, metavar="DIR",
                    help="write a tiny random Llama checkpoint to DIR and exit")
    ap.add_argument("--tokenizer-from", type=Path, default=ROOT / "kvcache" / "reference_model",
                    help="tokenizer.json + tokenizer_config.json to copy for --make-tiny")
    ap.add_argument("--ruler", type=lambda v: v.split(","), default=None, metavar="TASK,TASK",
                    help="only run these RULER tasks (kvcache.eval.ruler, at the first --lengths, --samples each) "
                         "through both engines, query-agnostic: per-task scores and seconds")
    ap.add_argument("--kept-check", action="store_true",
                    help="only compare the positions each press keeps (all but KVzipPress, or --presses) with those "
                         "its kvcache policy keeps, on the first --lengths tokens of the texts, or with --ruler on "
                         "the contexts of --samples RULER prompts a task")
    ap.add_argument("--kvzip-check", action="store_true",
                    help="only compare KVzipPress's reconstruction scores and per-head top positions with kvcache's "
                         "kvzip on the first --lengths tokens of the texts (one chunk: at most 2048)")
    args = ap.parse_args(argv)
    if args.make_tiny:
        make_tiny(args.make_tiny, args.tokenizer_from)
        return
    if args.quick:
        args.lengths, args.depths, args.trials = [512], [0.5], 1
        args.samples, args.continuation, args.repeats = 1, 32, 1
    if not all(0 <= r < 1 for r in args.ratios):
        ap.error("ratios are kvpress compression ratios in [0, 1)")
    if not (args.model / "config.json").exists():
        ap.error(f"{args.model} is not a checkpoint directory (no config.json)")
    known = {"dense"} | {p.press for p in PAIRS[1:] + KEPT_PAIRS}
    if args.presses and set(args.presses) - known:
        ap.error(f"unknown presses {sorted(set(args.presses) - known)}; choose from {sorted(known)}")
    if args.kept_check:
        set_threads(args.threads)
        tok = kvcache.load_tokenizer(args.model)
        if args.ruler:
            from kvcache.eval import ruler
            from kvcache.eval.sample import encode

            contexts = [(f"{task}#{s.index}", encode(tok, s).context) for task in args.ruler
                        for s in ruler.samples(task, tok, args.lengths[0], args.samples, args.seed)]
        else:
            contexts = [("texts", read_texts(args.texts, tok)[: args.lengths[0]].tolist())]
        rows = kept_check(args.model, contexts, args.ratios, kept_pairs(args.presses))
        report = {"kept_check": rows, "ruler": args.ruler, "length": args.lengths[0], "seed": args.seed,
                  "torch": torch.__version__}
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(kept_markdown(rows))
            args.markdown = None
    elif args.ruler:
        report = ruler_side_by_side(args)
        if args.markdown:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(ruler_markdown(report))
            args.markdown = None
    elif args.kvzip_check:
        tok = kvcache.load_tokenizer(args.model)
        ids = read_texts(args.texts, tok)[: args.lengths[0]].tolist()
        report = {"kvzip_check": kvzip_check(args.model, ids, args.ratios), "torch": torch.__version__}
    else:
        report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report))
        log(markdown(report))


if __name__ == "__main__":
    main()
