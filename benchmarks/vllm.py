"""Long prompts in vLLM with the same KV memory: plain vLLM against vLLM with kvcache's plugin.

A random Llama (fp32; hidden 256, 2 layers, 4 query and 2 K/V heads unless ``--hidden``,
``--layers``, ``--heads``, ``--kv-heads`` say otherwise; saved with ``save_pretrained`` to a
temporary directory) serves
``--requests`` requests of ``--prompt`` random tokens each, generating ``--new-tokens`` greedy
tokens, in two engines built one after the other in this process, identical but for the plugin:
the same KV cache memory (``--kv-tokens`` tokens of it, as bytes), block size, batching limits
and chunked prefill. With the plugin (``--policy``, ``--cache-length``) a request frees its evicted
blocks after every step, prompt chunks included, so more requests run at a time in the same
memory, and a prompt longer than the whole memory can be served.

Reported per engine (its fastest of ``--repeats`` runs; the engines take turns): wall time from
the first request added to the last one finished, output
tokens/s and total (prompt + output) tokens/s, the most requests running at once and the mean
over steps, preemptions (requests vLLM had to evict and recompute for lack of blocks), the most
KV blocks any request held after its prompt, and the peak blocks held by one request and by the
whole pool, after steps that computed prompt tokens ("prefill") and steps that only generated
("decode"). The ratio of the two throughputs is the figure of merit. Both engines run in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the scheduler can be read between steps.

Then, per engine, the longest prompt one request is served with the same KV memory
(``longest_prompt``; ``--no-longest`` skips it): each engine is asked for the model's whole
``--positions``; plain vLLM's start-up check refuses what its memory cannot hold and names the
longest model length it can, with which a prompt is then served; with the plugin the check counts
a request's bound, so the model's positions are the limit.

Every run's wall time and the machine's load average between runs are listed too: on a small
shared machine other processes change the times by a factor of two to ten from one run to the next.
The defaults finish in a few minutes on a 2-core CPU: 16 requests of 4k tokens, cache_length 512,
KV memory for three dense requests. The issue's setting (16 x 8k, cache_length 1024) is
``--prompt 8192 --cache-length 1024 --kv-tokens 25000`` and takes proportionally longer here.

Usage (in an environment with kvcache[vllm]):
    python benchmarks/vllm.py [--requests 16] [--prompt 4096] [--new-tokens 128] [--cache-length 512]
                              [--policy sink[,window,snapkv,h2o,...]] [--sinks 64] [--options JSON]
                              [--kv-tokens 12800] [--positions 65536] [--no-longest] [--out FILE]

With several policies, each runs as an engine of its own, in turn with plain vLLM, and its
median decode step (steps in which every running request decoded and none was admitted, at the
batch width most of them had) is compared with the first policy's: the cost of scoring on the
worker (h2o observes every step; snapkv, knorm, keydiff and tova only at the end of a prompt
chunk that evicts and when a block is evicted).

Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's own log handlers write to stdout, which carries the JSON: leave logging to Python's defaults.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
# Run as a script, this file's folder leads sys.path and this file would shadow the vllm package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from kvcache.vllm.config import SUPPORTED  # noqa: E402

BLOCK = 32


def build_model(path: Path, vocab: int, hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                positions: int = 16384) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # K and V, every layer, fp32.
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    return {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "kv_heads": cfg.num_key_value_heads,
            "head_dim": head_dim, "vocab": vocab, "kv_bytes_per_token": kv_bytes_per_token}


def engine_for(path: Path, args, kv_bytes: int, kvcache_config: dict | None, max_model_len: int, max_num_seqs: int):
    from vllm import LLM

    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len,
               block_size=BLOCK, enable_prefix_caching=False, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=args.batched_tokens, kv_cache_memory_bytes=kv_bytes, enforce_eager=True,
               seed=0, additional_config={} if kvcache_config is None else {"kvcache": kvcache_config})


def run(path: Path, args, kv_bytes: int, kvcache_config: dict | None, prompts: list[list[int]], llm=None) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if llm is None:
        llm = engine_for(path, args, kv_bytes, kvcache_config, args.prompt + args.new_tokens, args.requests)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    running, steps, most_blocks, preempted = [], 0, 0, set()
    # The most blocks one request held after a step that computed part of its prompt ("prefill")
    # or a generated token ("decode"), and the most the pool held after a step in which some
    # request prefilled, or in which all decoded.
    peak_request = {"prefill": 0, "decode": 0}
    peak_pool = {"prefill": 0, "decode": 0}
    pool = manager.block_pool
    computed: dict[str, int] = {}
    decode_times: dict[int, list[float]] = {}  # by batch width: steps that only decoded
    outputs = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    while engine.has_unfinished_requests():
        before = {r.request_id for r in scheduler.running}
        decoding = bool(before) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        # A step that only decoded: every request was past its prompt and none was admitted.
        if decoding and {r.request_id for r in scheduler.running} <= before:
            decode_times.setdefault(len(before), []).append(time.perf_counter() - t0)
        steps += 1
        running.append(len(scheduler.running))
        prefilled = False
        for request in scheduler.running:
            rid, n = request.request_id, request.num_computed_tokens
            if request.num_preemptions:
                preempted.add(rid)
            live = sum(not b.is_null for b in manager.req_to_blocks[rid])
            before = computed.get(rid, 0)
            computed[rid] = n
            if n != before:  # scheduled in this step
                phase = "prefill" if min(before, n) < request.num_prompt_tokens else "decode"
                prefilled |= phase == "prefill"
                peak_request[phase] = max(peak_request[phase], live)
            if n > request.num_prompt_tokens:
                most_blocks = max(most_blocks, live)
        if scheduler.running:
            used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # the null block is never free
            phase = "prefill" if prefilled else "decode"
            peak_pool[phase] = max(peak_pool[phase], used)
    wall = time.perf_counter() - start
    pool_blocks = pool.num_gpu_blocks - 1
    engine.engine_core.shutdown()
    del llm, engine, scheduler, manager, pool
    gc.collect()
    n_out = sum(len(t) for t in outputs.values())
    n_in = sum(len(p) for p in prompts)
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(n_out / wall, 1),
        "total_tok_s": round((n_in + n_out) / wall, 1),
        "finished": len(outputs),
        "output_tokens": n_out,
        "steps": steps,
        "max_running": max(running),
        "mean_running": round(sum(running) / len(running), 2),
        "preempted_requests": len(preempted),
        "max_blocks_per_request_after_prompt": most_blocks,
        "peak_blocks_per_request": peak_request,
        "peak_blocks_in_pool": peak_pool,
        "pool_blocks": pool_blocks,
        # Median of the steps that only decoded, at the batch width most of them had.
        **decode_figures(decode_times),
    }


def longest_prompt(path: Path, args, kv_bytes: int, kvcache_config: dict | None, positions: int) -> dict:
    """The longest prompt (plus ``--new-tokens``) one request can be served with this KV memory:
    asked for the model's whole ``positions``, vLLM's start-up check either passes (then a
    prompt that long is served) or refuses, naming the longest model length the memory holds
    (then a prompt of that length is served instead, and one token more would be refused)."""
    limited_by, refused = "the model's max_position_embeddings", None
    try:
        llm = engine_for(path, args, kv_bytes, kvcache_config, positions, 1)
        max_len = positions
    except ValueError as e:
        found = re.search(r"estimated maximum model length is (\d+)", str(e))
        if kvcache_config is not None or found is None:
            raise
        refused = str(e).split(". ")[0]
        max_len = int(found.group(1))
        limited_by = "KV memory (vLLM's start-up check)"
        llm = engine_for(path, args, kv_bytes, kvcache_config, max_len, 1)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (max_len - args.new_tokens,), generator=g).tolist()
    figures = run(path, args, kv_bytes, kvcache_config, [prompt], llm=llm)
    return {"prompt_tokens": len(prompt), "max_model_len": max_len, "limited_by": limited_by,
            "served": figures["finished"] == 1 and figures["output_tokens"] == args.new_tokens,
            "refused_at_start": refused, "wall_s": figures["wall_s"],
            "peak_blocks_per_request": figures["peak_blocks_per_request"],
            "peak_blocks_in_pool": figures["peak_blocks_in_pool"]}


def decode_figures(times: dict[int, list[float]]) -> dict:
    if not times:
        return {"decode_step_ms": None, "decode_width": None, "decode_steps_timed": 0}
    width = max(times, key=lambda w: (len(times[w]), w))
    steps = sorted(times[width])
    return {"decode_step_ms": round(1000 * steps[len(steps) // 2], 2), "decode_width": width,
            "decode_steps_timed": len(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens per request")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--policy", default="sink",
                   help="kvcache policy, or several separated by commas, each run as its own engine "
                        f"(supported: {', '.join(SUPPORTED)})")
    p.add_argument("--cache-length", type=int, default=512)
    p.add_argument("--sinks", type=int, default=64, help="sink policy only")
    p.add_argument("--options", type=json.loads, default={},
                   help="further policy options as JSON, applied to every policy that has them, e.g. '{\"window\": 32}'")
    p.add_argument("--kv-tokens", type=int, default=12800, help="KV cache memory of each engine, in tokens")
    p.add_argument("--batched-tokens", type=int, default=2048, help="vLLM's max_num_batched_tokens (prefill chunk)")
    p.add_argument("--repeats", type=int, default=2, help="runs per engine, taking turns; the fastest is reported")
    p.add_argument("--hidden", type=int, default=256, help="the random Llama's hidden size (MLP: twice that)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="query heads (head size: hidden / heads, at least 32 on CPU)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--positions", type=int, default=65536,
                   help="the random Llama's max_position_embeddings: the longest model length asked for")
    p.add_argument("--no-longest", action="store_true",
                   help="skip the longest prompt each engine serves with the same KV memory")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import vllm

    from kvcache import option_info

    configs = {}
    for policy in args.policy.split(","):
        if policy not in SUPPORTED:
            p.error(f"--policy {policy!r}: the plugin runs {', '.join(SUPPORTED)}")
        names = {o.name for o in option_info(policy)}
        config = {"policy": policy, "cache_length": args.cache_length}
        config.update({k: v for k, v in {"sinks": args.sinks, **args.options}.items()
                       if k in names and (k != "sinks" or policy == "sink")})
        configs[policy] = config
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), vocab=512, hidden=args.hidden, layers=args.layers, heads=args.heads,
                            kv_heads=args.kv_heads, positions=args.positions)
        prompts = [torch.randint(3, 512, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
        kv_bytes = args.kv_tokens * model["kv_bytes_per_token"]
        engines = {"plain_vllm": None, **configs}
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        load = [os.getloadavg()[0]]
        for r in range(args.repeats):
            # The engines take turns, so that a busy spell of the machine does not fall on one alone.
            for name, config in engines.items():
                print(f"{name}, run {r + 1} of {args.repeats} ...", file=sys.stderr)
                runs[name].append(run(Path(tmp), args, kv_bytes, config, prompts))
                load.append(os.getloadavg()[0])
        longest = {}
        if not args.no_longest:
            for name, config in engines.items():
                print(f"{name}, longest prompt ...", file=sys.stderr)
                longest[name] = longest_prompt(Path(tmp), args, kv_bytes, config, args.positions)
                load.append(os.getloadavg()[0])
    best = {name: min(results, key=lambda x: x["wall_s"]) for name, results in runs.items()}
    plain = best["plain_vllm"]
    first = next(iter(configs))
    result = {
        "benchmark": "vllm_long_prompts",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "model": model,
        "workload": {"requests": args.requests, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
                     "kv_memory_tokens": args.kv_tokens, "kv_memory_bytes": kv_bytes, "block": BLOCK,
                     "max_num_batched_tokens": args.batched_tokens},
        "kvcache": configs,
        "plain_vllm": plain,
        "vllm_with_kvcache": {policy: best[policy] for policy in configs},
        # Total tokens/s of each policy's engine over plain vLLM's.
        "throughput_ratio": {policy: round(best[policy]["total_tok_s"] / plain["total_tok_s"], 2) for policy in configs},
        # Each policy's decode step (all requests decoding) over the first policy's, same run.
        # (at the same batch width: policies with one budget run the same schedule)
        "decode_step_ratio_to_" + first: {
            policy: round(best[policy]["decode_step_ms"] / best[first]["decode_step_ms"], 2)
            if best[policy]["decode_step_ms"] and best[first]["decode_step_ms"]
            and best[policy]["decode_width"] == best[first]["decode_width"] else None
            for policy in configs},
        # Peak blocks per request and in the pool, after steps that computed prompt tokens
        # (prefill) and steps that only generated (decode), every engine of this run.
        "peak_blocks": {name: {"per_request": best[name]["peak_blocks_per_request"],
                               "pool": best[name]["peak_blocks_in_pool"], "pool_size": best[name]["pool_blocks"]}
                        for name in engines},
        # The longest prompt one request is served with the same KV memory, per engine.
        "longest_prompt": longest,
        "wall_s_of_every_run": {name: [x["wall_s"] for x in results] for name, results in runs.items()},
        "load_average_1min": [round(x, 2) for x in load],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
