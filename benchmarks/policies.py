"""Decode step time and cache bytes of every policy against dense at the same cache_length.

Each policy's cache is filled to ``cache_length`` by one prefill and stays full: every timed
decode step evicts one token. Dense, which cannot evict, is prefilled again before each repeat
with ``cache_length - steps - 1`` tokens, so its last step reads ``cache_length`` keys: it never
reads more keys than the policies (on average ``steps / 2`` fewer), so the comparison does not
flatter them. Policies take turns step by step, so a slow moment of a shared machine lands on
all of them alike; the step time reported is the median over ``steps x repeats`` steps, and the
mean next to it. The ``_reserve64`` variants evict 65 tokens down to ``cache_length - 64`` once
every 65 steps and append in between (so they also hold 32 fewer tokens on average): their mean
is the amortised cost, their median an appending step.

``--prompt N`` prefills every evicting policy with an N-token prompt instead (in chunks of 2048:
the policy evicts down to ``cache_length`` as it goes); dense still holds at most ``cache_length``.
``--compiled`` times the captured decode step (``kvcache.generation.compiled.CompiledDecode``, CUDA graphs on
CUDA) of every policy whose decode step can be captured (not the ``_reserve64`` variants: batched
eviction is decided on the host); the capture is made before the timed steps and its seconds are
reported. ``--device cuda`` runs there, the device synchronised before and after every timed
step; ``--model`` picks a geometry of benchmarks/decode.py (random weights) instead of the default
small one, ``--dtype`` its precision. ``--group-size N`` times the policies N at a time, each group
taking turns with dense steps of its own (its rows' ``vs_dense`` is against those, reported as
``dense_step_ms``): a caller of ``run`` gets the report after every group, so a run cut short keeps
the groups it finished. Prints one JSON object.

    python benchmarks/policies.py [--cache-length 1024 4096] [--steps 64] [--repeats 5]
    python benchmarks/policies.py --device cuda --model 1B --dtype bfloat16 --cache-length 2048 --prompt 8192 --compiled
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from decode import DTYPES, MODELS, allow_recompiles, build_models, free_memory, parse_device, sync  # benchmarks/decode.py
from emit import emit

import kvcache
from kvcache.generation.compiled import CompiledDecode
from kvcache.runtime.threads import set_threads

POLICIES = {
    "dense": {},
    "window": {},
    "sink": {"sinks": 4},
    "sink_absolute": {"sinks": 4, "positions": "absolute"},
    "h2o": {"recent": 32},
    "tova": {},
    "snapkv": {"window": 32},
    # Batched eviction: one eviction (the chunk path) every 65 steps, appends in between.
    "h2o_reserve64": {"recent": 32, "reserve": 64},
    "tova_reserve64": {"reserve": 64},
    "knorm": {},
    "expected_attention": {},
    "knorm_reserve64": {"reserve": 64},
    "expected_attention_reserve64": {"reserve": 64},
}
FLOORS = {"h2o": 1.25, "tova": 1.25, "window": 1.05, "sink": 1.05, "sink_absolute": 1.05}
# Under compile (docs/gpu.md): window and sink <= 1.05x dense; h2o, tova, snapkv <= 1.2x.
COMPILED_FLOORS = {"window": 1.05, "sink": 1.05, "sink_absolute": 1.05, "h2o": 1.2, "tova": 1.2, "snapkv": 1.2}
PREFILL_CHUNK = 2048


def policy_of(name: str) -> str:
    """The registered policy a row of POLICIES runs: its name up to a variant suffix."""
    return name.removesuffix("_reserve64").removesuffix("_absolute")


def build_model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, max_pos: int,
                device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=max_pos,
    )
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(d)
        return kvcache.load(d, dtype=dtype, device=device)


def prefill(model, ids: torch.Tensor, cache) -> None:
    for start in range(0, ids.shape[1], PREFILL_CHUNK):
        model(ids[:, start : start + PREFILL_CHUNK], cache, last_only=True)


@torch.inference_mode()
def time_policies(model, cache_length: int, steps: int, repeats: int, prompt_tokens: int | None = None,
                  compiled: bool = False, policies: dict | None = None) -> dict:
    """Median decode step time per policy (see the module docstring). ``policies``: a subset of POLICIES."""
    policies = POLICIES if policies is None else policies
    if steps + 1 >= cache_length:
        raise ValueError(f"steps ({steps}) must be smaller than cache_length - 1 ({cache_length - 1})")
    prompt_tokens = prompt_tokens or cache_length
    if prompt_tokens < cache_length:
        raise ValueError(f"--prompt ({prompt_tokens}) must be at least cache_length ({cache_length})")
    device = model.embed_tokens.weight.device
    skipped: dict[str, str] = {}
    if compiled:
        for name, options in policies.items():
            if options.get("reserve"):
                skipped[name] = "batched eviction is decided on the host: not captured"
        policies = {name: options for name, options in policies.items() if name not in skipped}
    if compiled:
        allow_recompiles()  # each policy's captured step is a compiled version of its own: more than 8
    caches = {name: kvcache.make_cache(model, policy_of(name), cache_length=cache_length, options=options)
              for name, options in policies.items()}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=gen).to(device)
    token = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen).to(device)
    for name, cache in caches.items():
        if name != "dense":
            prefill(model, prompt, cache)
    steppers = {name: (lambda cache=cache: model(token, cache)) for name, cache in caches.items()}
    compile_s: dict[str, float] = {}
    if compiled:
        for name, cache in caches.items():
            decoder = CompiledDecode(model, cache)
            steppers[name] = lambda decoder=decoder: decoder(token)
    times: dict[str, list[float]] = {name: [] for name in policies}
    # Dense holds at most cache_length: with the untimed step and the timed ones it ends full.
    dense_prompt = cache_length - steps - 1
    for _ in range(repeats):
        dense = caches["dense"]
        dense.reset()
        prefill(model, prompt[:, :dense_prompt], dense)
        for name, step in steppers.items():
            sync(device)
            start = time.perf_counter()
            step()  # one untimed step: first-call effects (compiled: the capture)
            sync(device)
            compile_s.setdefault(name, time.perf_counter() - start)
        for _ in range(steps):
            for name, step in steppers.items():
                sync(device)
                start = time.perf_counter()
                step()
                sync(device)
                times[name].append(time.perf_counter() - start)
    rows = {
        name: {"step_ms": statistics.median(times[name]) * 1e3,
               "step_ms_mean": statistics.mean(times[name]) * 1e3,
               "step_ms_p10_p90": [q * 1e3 for q in statistics.quantiles(times[name], n=10)[::8]],
               "cache_bytes": cache.nbytes(), "slots": cache.cache_length,
               **({"compile_s": compile_s[name]} if compiled else {})}
        for name, cache in caches.items()
    }
    rows.update({name: {"skipped": why} for name, why in skipped.items()})
    del caches, steppers
    free_memory(device)
    return rows


def compare(rows: dict, compiled: bool) -> None:
    """Adds each row's ``vs_dense`` and, where one applies, its floor and whether it is met."""
    floors = COMPILED_FLOORS if compiled else FLOORS
    dense = rows["dense"]["step_ms"]
    for name, row in rows.items():
        if "step_ms" not in row:
            continue
        row["vs_dense"] = row["step_ms"] / dense
        if name in floors:
            row["floor"] = floors[name]
            row["meets_floor"] = row["vs_dense"] <= floors[name]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-length", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=None,
                        help="prompt tokens the evicting policies are prefilled with (default: cache_length)")
    parser.add_argument("--compiled", action="store_true", help="time the captured decode step of each policy")
    parser.add_argument("--policies", default=None,
                        help=f"comma-separated subset of {', '.join(POLICIES)} (default: all; dense is always timed)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--model", choices=["small", *MODELS], default="small",
                        help="small (default: hidden 256, 4 layers) or a geometry of benchmarks/decode.py")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="default: float32 on the CPU, bfloat16 elsewhere")
    parser.add_argument("--group-size", type=int, default=0,
                        help="time the policies this many at a time, each group with its own dense steps "
                             "(default 0: all together)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="also write the JSON here")
    return parser


def run(args, error, on_group=None) -> dict:
    """The benchmark of parsed ``args`` (the options of ``parser()``) as one JSON-ready dict;
    ``on_group(report)``, if given, is called with the report as it stands after every group."""
    if args.threads:
        set_threads(args.threads)
    device = parse_device(args.device, error)
    dtype = DTYPES[args.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    names = [n.strip() for n in (args.policies or ",".join(POLICIES)).split(",") if n.strip() not in ("", "dense")]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    if args.group_size < 0:
        error("--group-size must be >= 0 (0: every policy in one group)")
    size = args.group_size or max(len(names), 1)
    groups = [names[i : i + size] for i in range(0, len(names), size)] or [[]]
    dtype_name = str(dtype).removeprefix("torch.")
    if args.model == "small":
        model = build_model(hidden=256, layers=4, heads=4, kv_heads=2, vocab=4096, max_pos=65536,
                            device=device, dtype=dtype)
        described = f"llama hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 4096, {dtype_name}, batch 1"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            _, model = build_models(args.model, Path(tmp), device, dtype)
        described = f"llama {args.model} geometry of benchmarks/decode.py, random weights, {dtype_name}, batch 1"
    report = {
        "model": described,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt,
        "compiled": args.compiled,
        "results": {},
    }
    for C in args.cache_length:
        merged = report["results"][str(C)] = {}
        for group in groups:
            print(f"cache_length={C}" + (f": {', '.join(group)}" if len(groups) > 1 else ""), file=sys.stderr)
            policies = {n: POLICIES[n] for n in ["dense", *group]}
            rows = time_policies(model, C, args.steps, args.repeats, args.prompt, args.compiled, policies)
            compare(rows, args.compiled)
            if len(groups) > 1:
                for name, row in rows.items():
                    if name != "dense" and "step_ms" in row:
                        row["dense_step_ms"] = rows["dense"]["step_ms"]
            merged.setdefault("dense", rows["dense"])  # the first group's
            merged.update((name, row) for name, row in rows.items() if name != "dense")
            if on_group is not None:
                on_group(report)
    return report


def main() -> None:
    p = parser()
    args = p.parse_args()
    report = run(args, p.error)
    emit(report, args.out, indent=2)


if __name__ == "__main__":
    main()
