"""``kvcache generate``: continue prompts with a KV cache, streaming the text to stdout (or one
JSON object per prompt with ``--json``); progress and the summary go to stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from .. import load, load_tokenizer, make_cache
from ..cache.registry import sliding_layers, stored_as
from ..checkpoints.load import WEIGHTS, Tokenizer, generation_config
from ..errors import GenerationError, KVCacheError, KVCacheWarning
from ..generation.generate import DEFAULT_PREFILL_CHUNK, generate, truncate_at_stop
from ..prefix.store import DEFAULT_MAX_BYTES, INDEX, PrefixStore
from ..runtime.memory import human
from .args import (
    DTYPES,
    THREADS_HELP,
    add_policy_options,
    apply_threads,
    cache_length_arg,
    device_arg,
    dtype_arg,
    int_at_least,
    number,
)

DEFAULT_MAX_NEW_TOKENS = 128


class TextStream:
    """Prints the text of a growing list of token ids as it grows.

    Decoding each token on its own would break multi-token characters and the tokenizer's spacing
    rules, so the whole list is decoded every time and only the new suffix is printed. A trailing
    U+FFFD means the last tokens end inside a UTF-8 sequence; that text is held back until the
    sequence completes (or ``finish`` is called). With ``stop_strings``, nothing from the first
    stop string on is printed, and text that could be the start of one is held back until it is
    known not to be.
    """

    def __init__(self, tokenizer, out, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.printed = 0

    @property
    def text(self) -> str:
        """The text so far, cut at the first stop string."""
        return truncate_at_stop(self.tokenizer.decode(self.ids), self.stop_strings)

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._emit(self._settled(text))

    def finish(self) -> None:
        self._emit(self.text)

    def _settled(self, text: str) -> str:
        """The part of ``text`` that later tokens cannot turn into (part of) a stop string."""
        cut = truncate_at_stop(text, self.stop_strings)
        if len(cut) < len(text):
            return cut
        held = max((k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - held]

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


def add_parser(commands) -> None:
    gen = commands.add_parser(
        "generate", help="continue a prompt, streaming the text to stdout",
        description="Continue a prompt (or a file of prompts, as one batch) with a KV cache. Text goes to "
                    "stdout, progress and a summary to stderr. Sampling settings a flag does not give come from "
                    "the checkpoint's generation_config.json when it has them, else from the defaults shown.",
    )
    io = gen.add_argument_group("input and output")
    io.add_argument("prompt", nargs="?", help="prompt text, or - to read it from stdin")
    io.add_argument("--prompts-file", metavar="FILE",
                    help="one prompt per line (blank lines skipped; - reads stdin), run as one batch")
    io.add_argument("--chat", action="store_true",
                    help="send each prompt as a user message through the checkpoint's chat template")
    io.add_argument("--system", metavar="TEXT", help="a system message before the prompt (implies --chat)")
    io.add_argument("--json", action="store_true",
                    help="print one JSON object per prompt (prompt, prompt_tokens, tokens, text, prefill_s, "
                         "decode_s, prefill_tok_s, decode_tok_s, compile_s, cache_bytes, storage, weights, threads) instead "
                         "of the text; with --compile, decode_s and decode_tok_s leave out the step that compiled "
                         "(compile_s)")
    io.add_argument("--quiet", action="store_true", help="no progress bar or summary on stderr")

    model = gen.add_argument_group("model")
    model.add_argument("--model", metavar="PATH", help="Hugging Face-format checkpoint directory or GGUF file (default: bundled)")
    model.add_argument("--dtype", choices=DTYPES, help="default: float32 on CPU, the checkpoint's elsewhere")
    model.add_argument("--device", type=device_arg, default="cpu", help="e.g. cpu, cuda, cuda:1 (default: cpu)")
    model.add_argument("--weights", choices=WEIGHTS, default="full",
                       help="int4: hold the attention and MLP projections as 4-bit codes in groups of 32 (a GGUF "
                            "file's Q4_1 codes as they are; CPU only; an approximation, see docs/gguf.md) (default: full)")
    model.add_argument("--threads", type=int_at_least(1), metavar="N", help=THREADS_HELP)

    decoding = gen.add_argument_group("decoding")
    decoding.add_argument("--max-new-tokens", type=int_at_least(0), metavar="N",
                          help=f"the most new tokens per prompt (default: {DEFAULT_MAX_NEW_TOKENS})")
    decoding.add_argument("--temperature", type=number, metavar="T", help="0 is greedy (default: 0)")
    decoding.add_argument("--top-k", type=int_at_least(1), metavar="K",
                          help="sample among the K most likely tokens (needs --temperature > 0)")
    decoding.add_argument("--top-p", type=number, metavar="P",
                          help="sample among the most likely tokens covering probability P (needs --temperature > 0)")
    decoding.add_argument("--repetition-penalty", type=number, metavar="R",
                          help="divide positive logits / multiply negative logits of tokens already in the prompt "
                               "or output by R (CTRL's penalty; 1.1-1.3 curbs loops; default: 1.0, off)")
    decoding.add_argument("--seed", type=int, metavar="S", help="seed for sampling")
    decoding.add_argument("--stop", action="append", default=[], metavar="STRING",
                          help="end a prompt's generation once its text contains STRING, which is not printed "
                               "(repeatable); generation also ends at the model's end-of-text tokens")

    cache = gen.add_argument_group("cache")
    cache.add_argument("--policy", default="dense",
                       help="cache policy, optionally with options and a storage: h2o, h2o:int4, "
                            "h2o(recent=64):int4 (see `kvcache policies`; default: dense)")
    cache.add_argument("--cache-length", type=cache_length_arg, metavar="N|FRACTION",
                       help="cache slots per layer: a token count (300), or a fraction of the longest prompt with a "
                            "decimal point (0.25; 1.0 is the whole prompt). Default: longest prompt + max new tokens")
    cache.add_argument("--allocation", default="uniform", choices=("uniform", "pyramid"),
                       help="how an evicting policy's budget is spread over layers (default: uniform)")
    cache.add_argument("--reserve", type=int_at_least(0), default=0, metavar="N",
                       help="h2o, tova, snapkv: an overflowing cache keeps cache-length - N tokens, then grows by N "
                            "without evicting (e.g. compress the prompt once, then generate N tokens; default: 0)")
    cache.add_argument("--prefill-chunk", type=int_at_least(1), default=DEFAULT_PREFILL_CHUNK, metavar="N",
                       help=f"prompt tokens per forward pass (default: {DEFAULT_PREFILL_CHUNK})")
    cache.add_argument("--compile", action="store_true",
                       help="decode through a captured step (torch.compile; CUDA graphs on CUDA): a one-time "
                            "compilation (tens of seconds on a CPU, reported apart), then replayed steps, faster on "
                            "CUDA; on a CPU slower for dense caches and at best somewhat faster for an evicting "
                            "policy over a small cache: time it (docs/cli.md); not with --reserve")
    reuse = gen.add_argument_group("prompt reuse (docs/prefix.md)")
    reuse.add_argument("--prompt-cache", metavar="DIR",
                       help="reuse the cache of prompt prefixes stored in DIR by earlier runs (same model, policy "
                            "and cache settings), and store this run's there; DIR is created if missing")
    reuse.add_argument("--prompt-cache-bytes", type=int_at_least(1), default=DEFAULT_MAX_BYTES, metavar="N",
                       help=f"the most bytes the prompt cache keeps, least recently used entries dropped first "
                            f"(default: {DEFAULT_MAX_BYTES})")
    reuse.add_argument("--aligned", action="store_true",
                       help="prefill each prompt alone on a fixed grid of --prefill-chunk positions, so a run that "
                            "reuses a stored prefix computes bitwise what a run without it computes")
    add_policy_options(gen)


def _per_second(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def _rate(tokens: int, seconds: float) -> str:
    rate = _per_second(tokens, seconds)
    return "n/a" if rate is None else f"{rate:.1f} tok/s"


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is not None:
        if args.prompt is not None:
            raise ValueError("give a PROMPT or --prompts-file FILE, not both")
        try:
            text = sys.stdin.read() if args.prompts_file == "-" else Path(args.prompts_file).read_text()
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror}") from None
        prompts = [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} has no prompts (one per line; blank lines are skipped)")
        return prompts
    if args.prompt is None:
        raise ValueError("give a PROMPT (- reads it from stdin) or --prompts-file FILE")
    return [sys.stdin.read() if args.prompt == "-" else args.prompt]


def _encode(tokenizer: Tokenizer, prompt: str, args: argparse.Namespace) -> list[int]:
    if not args.chat and args.system is None:
        return tokenizer.encode(prompt)
    if tokenizer.chat_template is None:
        flag = "--system" if args.system is not None else "--chat"
        raise ValueError(f"{args.model or 'the bundled model'} has no chat template (it was not trained for chat): "
                         f"drop {flag} and pass the prompt as plain text")
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _decoding(args: argparse.Namespace, defaults: dict) -> dict:
    """Decoding settings: a flag wins, then the checkpoint's generation_config.json, then the
    built-in defaults. The checkpoint's top_k and top_p go with its sampling only."""
    temperature = args.temperature if args.temperature is not None else defaults.get("temperature", 0.0)
    if temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--top-k and --top-p filter sampling, so they need --temperature > 0 (the default, 0, is greedy)")
    sampling = temperature > 0
    return {
        "temperature": temperature,
        "top_k": args.top_k if args.top_k is not None else defaults.get("top_k") if sampling else None,
        "top_p": args.top_p if args.top_p is not None else defaults.get("top_p") if sampling else None,
        "repetition_penalty": args.repetition_penalty if args.repetition_penalty is not None
        else defaults.get("repetition_penalty", 1.0),
        "max_new_tokens": args.max_new_tokens if args.max_new_tokens is not None
        else defaults.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
    }


def _stop_tokens(model, tokenizer: Tokenizer, defaults: dict) -> list[int]:
    """End-of-text tokens from the model config, the tokenizer and generation_config.json: any of
    them ends a row (chat checkpoints often name their end-of-turn token in only one place)."""
    stops = set(model.config.stop_ids())
    for eos in (tokenizer.eos_token_id, defaults.get("eos_token_id")):
        stops.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(stops)


class Clock:
    """Host timestamps of a generation: its start, and each row's first and last new token.

    The first token of every row comes out of the prefill pass; each later one costs one decode
    step (plus detokenising and printing, small next to a real model's forward). Reading a
    sampled token back to the host waits for the device, so these are honest on a GPU too.
    """

    def __init__(self, rows: int) -> None:
        self.start = time.perf_counter()
        self.first: list[float | None] = [None] * rows
        self.last: list[float | None] = [None] * rows

    def token(self, row: int) -> None:
        now = time.perf_counter()
        if self.first[row] is None:
            self.first[row] = now
        self.last[row] = now

    def prefill_s(self, end: float) -> float:
        firsts = [t for t in self.first if t is not None]
        return (min(firsts) if firsts else end) - self.start

    def decode_s(self, row: int) -> float:
        return 0.0 if self.first[row] is None else self.last[row] - self.first[row]


def run(args: argparse.Namespace) -> None:
    apply_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    defaults = generation_config(args.model)
    decoding = _decoding(args, defaults)
    max_new = decoding.pop("max_new_tokens")
    prompts, ids = _prompt_ids(args, tokenizer)
    model = load(args.model, dtype=dtype_arg(args.dtype, args.device), device=args.device, weights=args.weights)
    cache = _generate_cache(args, model, ids, max_new)
    store = _prompt_cache(args, model, cache)
    reused = None if store is None else [store.reusable(p) for p in ids]
    stop_strings = tuple(args.stop)
    # One prompt as text streams as it is made; a batch's rows are printed one after another at the end.
    stream = TextStream(tokenizer, sys.stdout, stop_strings) if len(ids) == 1 and not args.json else None
    longest = max(map(len, ids))
    bar = tqdm(total=sum(map(len, ids)), desc="prefill", unit="tok", leave=False, file=sys.stderr,
               disable=args.quiet or longest <= args.prefill_chunk or not sys.stderr.isatty())
    clock = Clock(len(ids))
    made: list[list[int]] = [[] for _ in ids]  # what an interrupted run has made (Ctrl-C)

    def on_prefill(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done == total:
            bar.close()  # before the first token is printed, so the text starts on a clean line

    def on_token(row: int, token: int) -> None:
        clock.token(row)
        made[row].append(token)
        if stream is not None:
            stream.push(token)

    failure = None
    if args.compile and not args.quiet and max_new > 1 and cache.captured is None:
        # Said before the first token is printed: the pause after it is the compilation.
        print("kvcache: compiling the decode step after the first token (torch.compile, once per run: tens of "
              "seconds on a CPU); its time is reported apart", file=sys.stderr, flush=True)
    clock.start = time.perf_counter()  # timings start with the prefill, after the set-up above
    try:
        new = generate(
            model, ids, max_new_tokens=max_new, cache=cache, seed=args.seed, stop_tokens=_stop_tokens(model, tokenizer, defaults),
            stop_strings=stop_strings or None, tokenizer=tokenizer, prefill_chunk=args.prefill_chunk,
            on_token=on_token, on_prefill=on_prefill, compile=args.compile, prefix_store=store,
            aligned=args.aligned, **decoding,
        )
    except GenerationError as e:
        new, failure = e.tokens, e  # print what was made, then report the error
    except KeyboardInterrupt:
        # Ctrl-C: what was made is printed and summed up, then the run ends with status 130.
        new, failure = made, KeyboardInterrupt()
    finally:
        bar.close()
    if store is not None:
        _save_prompt_cache(store, args.prompt_cache)
    if model.embed_tokens.weight.is_cuda:
        torch.cuda.synchronize()  # with no new tokens nothing has waited for the prefill kernels
    end = time.perf_counter()
    texts = [truncate_at_stop(tokenizer.decode(row), stop_strings) for row in new]
    if args.json:
        _print_json(prompts, ids, new, texts, clock, end, cache, failure, reused, args.weights)
    else:
        _print_texts(texts, stream)
    _report(args, ids, new, clock, end, cache, store, reused, failure)


def _prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer) -> tuple[list[str], list[list[int]]]:
    """The prompts as given and their ids (chat template, system prompt), with a warning for an
    empty prompt the model would continue from its first token."""
    prompts = _read_prompts(args)
    ids = [_encode(tokenizer, p, args) for p in prompts]
    if not args.chat and args.system is None and not prompts[0].strip() and ids[0]:
        start = "the beginning-of-text token" if ids[0][:1] == [tokenizer.bos_token_id] else "its first token"
        warnings.warn(f"the prompt is empty{' (whitespace only)' if prompts[0] else ''}: the model continues from "
                      f"{start}{' and the whitespace' if prompts[0] else ''}; give a PROMPT (- reads it from stdin)",
                      KVCacheWarning, stacklevel=3)
    return prompts, ids


def _generate_cache(args: argparse.Namespace, model, ids: list[list[int]], max_new: int):
    """The run's cache, from --policy, --cache-length (default: the longest prompt and the new
    tokens), --allocation, --reserve and the policy's options; built here rather than inside
    generate() so that its memory can be reported afterwards."""
    longest = max(map(len, ids))
    cache_length = longest + max_new if args.cache_length is None else args.cache_length
    options = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    return make_cache(model, args.policy, cache_length=cache_length, batch_size=len(ids), prompt_length=longest,
                      allocation=args.allocation, reserve=args.reserve, options=options)


def _print_texts(texts: list[str], stream: TextStream | None) -> None:
    """The new text on stdout: the end of a streamed one, or each row's under a header."""
    if stream is not None:
        stream.finish()
        sys.stdout.write("\n")
    else:
        for i, text in enumerate(texts):
            if i:
                sys.stdout.write("\n")
            sys.stdout.write(f"==> prompt {i + 1} of {len(texts)} <==\n{text}\n")
    sys.stdout.flush()


def _report(args, ids, new, clock: Clock, end: float, cache, store, reused, failure) -> None:
    """After the text: a failure raised, else (and after Ctrl-C) the summary and the prompt
    cache's on stderr, then an interruption raised again (status 130)."""
    interrupted = isinstance(failure, KeyboardInterrupt)
    if failure is not None and not interrupted:
        raise failure
    if not args.quiet:
        _print_summary(ids, new, clock, end, cache)
        if store is not None:
            print(f"prompt cache {args.prompt_cache}: reused {sum(reused)} of {sum(map(len, ids))} prompt tokens; "
                  f"{len(store)} entries, {human(store.nbytes)}", file=sys.stderr)
    if interrupted:
        print(f"kvcache: interrupted after {sum(map(len, new))} new tokens", file=sys.stderr)
        raise failure


def _prompt_cache(args: argparse.Namespace, model, cache) -> PrefixStore | None:
    """The prefix store in ``--prompt-cache DIR`` (a new one if DIR has none), checked against
    this run's model and cache before anything runs."""
    if args.prompt_cache is None:
        return None
    path = Path(args.prompt_cache)
    if (path / INDEX).exists():
        store = PrefixStore.load(path, model, args.prompt_cache_bytes)
    elif path.exists() and not path.is_dir():
        raise ValueError(f"--prompt-cache {path} is a file, not a directory")
    else:
        store = PrefixStore(model, args.prompt_cache_bytes)
    try:
        store.bind(model, cache, chunk=args.prefill_chunk, aligned=args.aligned)
    except ValueError as e:
        raise ValueError(f"--prompt-cache {path}: {e}; use another directory for this one") from None
    return store


def _save_prompt_cache(store: PrefixStore, directory: str) -> None:
    try:
        store.save(directory)
    except OSError as e:
        raise KVCacheError(f"cannot save the prompt cache to {directory}: {e.strerror or e}") from None


def _compile_s(cache) -> float | None:
    """Seconds the first decode step took to capture the step (``--compile``), or None."""
    return None if cache.captured is None else cache.captured.compile_s


def _print_json(prompts, ids, new, texts, clock: Clock, end: float, cache, failure,
                reused: list[int] | None = None, weights: str = "full") -> None:
    prefill_s = clock.prefill_s(end)
    prefill_rate = _per_second(sum(map(len, ids)), prefill_s)
    compile_s = _compile_s(cache)
    for i, prompt in enumerate(prompts):
        decode_s, decoded = clock.decode_s(i), len(new[i]) - 1
        if compile_s is not None and decoded > 0:
            # The first decode step captured the step: reported apart, as the summary does.
            decode_s, decoded = decode_s - compile_s, decoded - 1
        record = {
            "prompt": prompt,
            "prompt_tokens": len(ids[i]),
            "tokens": new[i],
            "text": texts[i],
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": prefill_rate,
            "decode_tok_s": _per_second(decoded, decode_s),
            "compile_s": compile_s,
            "cache_bytes": cache.nbytes(),
            "storage": cache.spec.storage,
            "weights": weights,
            "threads": torch.get_num_threads(),
        }
        if reused is not None:
            record["reused_tokens"] = reused[i]
        if failure is not None:
            record["error"] = str(failure)
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")


def _print_summary(ids, new, clock: Clock, end: float, cache) -> None:
    # Decode steps produce each row's tokens after its first; rows that stopped early stop counting.
    decoded = sum(max(len(row) - 1, 0) for row in new)
    decode_s = max((clock.last[i] for i in range(len(new)) if clock.last[i] is not None), default=end) - (
        min((t for t in clock.first if t is not None), default=end))
    compiled = ""
    compile_s = _compile_s(cache)
    if compile_s is not None:
        # The first decode step captured the step: its time is reported apart, not as decoding.
        decode_s -= compile_s
        decoded -= sum(len(row) > 1 for row in new)
        compiled = f"compile: {compile_s:.1f} s | "
    batch = f"prompts: {len(ids)} | " if len(ids) > 1 else ""
    threads = torch.get_num_threads()
    on_cpu = f" ({threads} thread{'s' if threads != 1 else ''})" if cache.spec.device.type == "cpu" else ""
    held = f"{cache.policy}, {cache.cache_length} slots"
    allocated = cache.allocated_tokens
    if allocated is not None and allocated < cache.cache_length:
        # A dense cache allocates as it fills: its memory is that of the slots the run reached.
        held = f"{cache.policy}, {allocated} of {cache.cache_length} slots allocated"
    rings = sliding_layers(cache)
    if rings:
        # A model with sliding-window layers: those hold their window, the policy the others.
        windows = sorted({cache.layers[i].spec.cache_length for i in rings})
        rest = len(cache.layers) - len(rings)
        ring_bytes = sum(cache.layers[i].nbytes() for i in rings)
        held = (f"{held} on {rest} global layer{'s' if rest != 1 else ''}; {len(rings)} sliding layers hold their "
                f"window of {'/'.join(map(str, windows))} in {human(ring_bytes)}")
    if stored_as(cache) == "full":
        held = (f"{cache.policy} held at full precision: fewer bytes than its codes at {cache.cache_length} slots, "
                "see kvcache policies")
    print(
        f"{batch}prompt tokens: {sum(map(len, ids))} | new tokens: {sum(map(len, new))} | "
        f"prefill: {_rate(sum(map(len, ids)), clock.prefill_s(end))}, first token after {_duration(clock.prefill_s(end))} | "
        f"{compiled}decode: {_rate(decoded, decode_s)}"
        f"{on_cpu} | cache memory: {human(cache.nbytes())} ({held})",
        file=sys.stderr,
    )
