"""The ``kvcache`` command line: ``kvcache generate PROMPT`` and ``kvcache policies``."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

from . import generate, load, load_tokenizer, make_cache, policies, policy_options, storages
from .errors import KVCacheError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Small enough that the progress bar moves on a long prompt, large enough that per-chunk overhead
# stays negligible next to the matmuls.
DEFAULT_PREFILL_CHUNK = 512


class TextStream:
    """Prints the text of a growing list of token ids as it grows.

    Decoding each token on its own would break multi-token characters and the tokenizer's spacing
    rules, so the whole list is decoded every time and only the new suffix is printed. A trailing
    U+FFFD means the last tokens end inside a UTF-8 sequence; that text is held back until the
    sequence completes (or ``finish`` is called).
    """

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = 0

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def finish(self) -> None:
        self._emit(self.tokenizer.decode(self.ids))

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


def _device(value: str) -> torch.device:
    try:
        device = torch.device(value)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("CUDA is not available in this PyTorch build or on this machine")
    return device


def _dtype(name: str | None, device: torch.device) -> torch.dtype | None:
    """The --dtype choice; by default float32 on CPU, whose half-precision kernels are slow
    (the bundled model is stored in float16), and the checkpoint's own dtype elsewhere."""
    if name is not None:
        return DTYPES[name]
    return torch.float32 if device.type == "cpu" else None


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _floats(value: str) -> list[float]:
    return [float(v) for v in _names(value)]


def _ints(value: str) -> list[int]:
    return [int(v) for v in _names(value)]


def _eval(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from . import plots
    from .evaluate import Grid, evaluate, markdown
    from .tasks import read_texts

    grid = Grid()
    if args.quick:
        grid = Grid(policies=["dense", "window", "sink", "h2o"], budgets=[0.25], lengths=[256],
                    depths=[0.0, 0.5, 1.0], trials=1, stream_tokens=256)
    overrides = {k: getattr(args, k) for k in ("policies", "budgets", "lengths", "depths", "trials",
                                               "stream_tokens") if getattr(args, k) is not None}
    grid = Grid(**{**grid.__dict__, **overrides})
    tokenizer = load_tokenizer(args.model)
    model = load(args.model, dtype=torch.float32)
    stream = read_texts(args.texts, tokenizer)
    report = evaluate(model, tokenizer, stream, stream, grid, progress=sys.stderr.isatty())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "report.md").write_text(table)
    plots.quality_vs_budget(report, out / "quality_vs_budget.png")
    plots.passkey_heatmaps(report, out / "passkey_heatmap.png", budget=min(grid.budgets))
    print(table, end="")
    print(f"wrote {out}/report.json, report.md, quality_vs_budget.png, passkey_heatmap.png", file=sys.stderr)


def _budget(value: str) -> int | float:
    number = float(value)
    if number.is_integer() and number >= 1:
        return int(number)
    if 0 < number < 1:
        return number
    raise argparse.ArgumentTypeError(f"expected a token count >= 1 or a fraction in (0, 1), got {value}")


def _add_policy_options(parser: argparse.ArgumentParser) -> None:
    """One flag per policy option (``--recent 32``); which policy accepts which is checked by make_cache."""
    group = parser.add_argument_group("policy options (see `kvcache policies`)")
    seen: dict[str, list[str]] = {}
    defaults: dict[str, object] = {}
    for name in policies():
        for option, default in policy_options(name).items():
            seen.setdefault(option, []).append(name)
            defaults[option] = default
    for option, owners in sorted(seen.items()):
        default = defaults[option]
        flag = "--" + option.replace("_", "-")
        # default=None marks an option the user did not give, so only given ones reach the policy.
        kwargs = {"dest": f"opt_{option}", "default": None, "help": f"({', '.join(owners)})"}
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            group.add_argument(flag, type=type(default), metavar=type(default).__name__.upper(), **kwargs)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache", description="KV caching for decoder-only language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="continue a prompt, streaming the text to stdout")
    gen.add_argument("prompt", help="prompt text, or - to read it from stdin")
    gen.add_argument("--model", metavar="DIR", help="Hugging Face-format checkpoint directory (default: bundled)")
    gen.add_argument("--policy", default="dense",
                     help="cache policy, optionally with a storage: h2o, h2o:int4 (see `kvcache policies`; default: dense)")
    gen.add_argument(
        "--cache-length", type=_budget, metavar="N",
        help="cache slots per layer, or a fraction of the prompt such as 0.25 (default: prompt + new tokens)",
    )
    gen.add_argument(
        "--allocation", default="uniform", choices=("uniform", "pyramid"),
        help="how the budget is spread over layers (default: uniform)",
    )
    gen.add_argument(
        "--reserve", type=int, default=0, metavar="N",
        help="h2o, tova, snapkv: an overflowing cache keeps cache-length - N tokens, then grows by N "
             "without evicting (e.g. compress the prompt once, then generate N tokens; default: 0)",
    )
    _add_policy_options(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="default: 128")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, metavar="K")
    gen.add_argument("--top-p", type=float, metavar="P")
    gen.add_argument("--seed", type=int, metavar="S")
    gen.add_argument(
        "--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
        help=f"prompt tokens per forward pass (default: {DEFAULT_PREFILL_CHUNK})",
    )
    gen.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, the checkpoint's elsewhere")
    gen.add_argument("--device", type=_device, default="cpu", help="e.g. cpu, cuda, cuda:1 (default: cpu)")

    ev = commands.add_parser("eval", help="quality of policies against dense (perplexity, agreement, passkey)")
    ev.add_argument("--model", metavar="DIR", help="checkpoint directory (default: bundled)")
    ev.add_argument("--texts", metavar="DIR",
                    help="held-out .txt files for streaming and passkey filler (default: the packaged kvcache/data/texts)")
    ev.add_argument("--policies", type=_names, help="comma-separated (default: all)")
    ev.add_argument("--budgets", type=_floats, help="fractions of the context (default: 0.125,0.25,0.5)")
    ev.add_argument("--lengths", type=_ints, help="passkey context lengths (default: 512,1024,2048)")
    ev.add_argument("--depths", type=_floats, help="needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)")
    ev.add_argument("--trials", type=int, help="passkeys per cell (default: 4)")
    ev.add_argument("--stream-tokens", type=int, help="held-out tokens for streaming (default: 2048)")
    ev.add_argument("--out", default="results/eval", metavar="DIR", help="report.json, report.md, PNGs")
    ev.add_argument("--quick", action="store_true", help="a smoke run of well under a minute")

    commands.add_parser("policies", help="list the cache policies and storages")
    return parser


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if tokens > 0 and seconds > 0 else "n/a"


def _generate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    tokenizer = load_tokenizer(args.model)
    model = load(args.model, dtype=_dtype(args.dtype, args.device), device=args.device)
    ids = tokenizer.encode(prompt)
    cache_length = len(ids) + args.max_new_tokens if args.cache_length is None else args.cache_length
    options = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    # Built here rather than inside generate() so its memory can be reported afterwards.
    cache = make_cache(
        model, args.policy, cache_length=cache_length, prompt_length=len(ids),
        allocation=args.allocation, reserve=args.reserve, **options,
    )

    # The tokenizer may name an end-of-text token the model config does not; stop at either.
    eos = model.config.eos_token_id
    stops = set([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)

    stream = TextStream(tokenizer, sys.stdout)
    bar = tqdm(
        total=len(ids), desc="prefill", unit="tok", leave=False, file=sys.stderr,
        disable=len(ids) <= args.prefill_chunk or not sys.stderr.isatty(),
    )
    token_times: list[float] = []

    def on_prefill(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done == total:
            bar.close()  # before the first token is printed, so the text starts on a clean line

    def on_token(row: int, token: int) -> None:
        token_times.append(time.perf_counter())
        stream.push(token)

    start = time.perf_counter()
    try:
        new = generate(
            model, ids, max_new_tokens=args.max_new_tokens, cache=cache, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=sorted(stops),
            prefill_chunk=args.prefill_chunk, on_token=on_token, on_prefill=on_prefill,
        )
    finally:
        bar.close()
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()  # with no new tokens nothing has waited for the prefill kernels
    end = time.perf_counter()
    stream.finish()
    sys.stdout.write("\n")
    sys.stdout.flush()

    # The first token comes out of the prefill pass; each later one costs one decode step (plus
    # detokenising and printing, small next to a real model's forward). Reading a sampled token
    # back to the host waits for the device, so these host timestamps are honest on a GPU too.
    prefill_end = token_times[0] if token_times else end
    decode_time = token_times[-1] - token_times[0] if token_times else 0.0
    print(
        f"prompt tokens: {len(ids)} | new tokens: {len(new)} | "
        f"prefill: {_rate(len(ids), prefill_end - start)} | decode: {_rate(len(new) - 1, decode_time)} | "
        f"cache memory: {_human_bytes(cache.nbytes())} ({cache.policy}, {cache.cache_length} slots)",
        file=sys.stderr,
    )


def _policies() -> None:
    table = policies()
    width = max(map(len, table))
    for name, description in table.items():
        print(f"{name:<{width}}  {description}")
        options = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in policy_options(name).items())
        if options:
            print(f"{'':<{width}}  options: {options}")
    print("\nstorages (name a cache policy:storage, e.g. h2o:int4; default full):")
    for name, description in storages().items():
        print(f"{name:<{width}}  {description}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            _generate(args)
        elif args.command == "eval":
            _eval(args)
        else:
            _policies()
    except (KVCacheError, ValueError) as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; point stdout at nothing so the exit flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
